"""The sm90 backend (jax_mla's own Hopper kernel, ffi/sm90): how it lowers, what it refuses, and on an
SM90 GPU its results against the float32 torch reference, on bad inputs, under jit/scan and inside
XLA command buffers."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (HAS_TVM_FFI, Problem, assert_custom_calls_in_command_buffers, check_accuracy,
                      custom_calls_in_loops, fp8_problem, lse_error, make_problem,
                      record_kernel_runs, request_head_error, skip_or_fail, tolerances)

import jax_mla
from jax_mla import api, backends, gpu, xla_backend

HERE = Path(__file__).parent
SM90 = backends.SM90


# ---- lowering, checks and availability: no GPU needed -------------------------------------------

@pytest.fixture
def lowering_stubs(monkeypatch):
    """The SM count a GPU would supply and no library loading, so lowering runs on any machine."""
    monkeypatch.setattr(gpu, "sm_count", lambda device=None: 132)
    monkeypatch.setattr(gpu, "register_targets", lambda: None)


def shapes(batch=4, q_len=2, num_heads=128, num_pages=64, page_size=64, max_pages=8, head_dim=576):
    return (jax.ShapeDtypeStruct((batch, q_len, num_heads, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((num_pages, page_size, head_dim), jnp.bfloat16),
            jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
            jax.ShapeDtypeStruct((batch,), jnp.int32))


def lower(*arrays, softmax_scale=0.135, output_scale=0.5, kv_lora_rank=512):
    """The StableHLO text of one device's sm90 decode, lowered for CUDA."""
    def fn(*a):
        return api.run_backend(backends.BY_NAME[SM90], *a, softmax_scale=softmax_scale,
                               output_scale=output_scale, kv_lora_rank=kv_lora_rank,
                               device_plan=False)
    return jax.jit(fn).trace(*arrays).lower(lowering_platforms=("cuda",)).as_text()


def custom_call_line(text):
    return next(line for line in text.splitlines() if "@jax_mla_sm90_decode(" in line)


@pytest.mark.parametrize("batch,q_len,num_heads,page_size", [(4, 2, 128, 64), (1, 1, 8, 32),
                                                             (33, 4, 16, 64)])
def test_lowering_is_a_schedule_call_and_a_decode_call(lowering_stubs, batch, q_len, num_heads,
                                                       page_size):
    """The schedule (from the lengths alone, so a step's layers share it) feeds the decode call,
    which also takes the lengths it was built from and fails closed itself: the layer is the two
    calls and nothing else."""
    text = lower(*shapes(batch, q_len, num_heads, page_size=page_size))
    assert text.count(" = stablehlo.") == 2 and text.count("stablehlo.custom_call") == 2
    schedule = next(line for line in text.splitlines() if "@jax_mla_sm90_schedule(" in line)
    for attribute in ("max_pages = 8 : i64", f"page_size = {page_size} : i64", "enable_pdl = true"):
        assert attribute in schedule, schedule
    schedule_in, schedule_out = schedule.rsplit(" : ", 1)[1].split(" -> ")
    assert re.findall(r"tensor<[^>]+>", schedule_in) == [f"tensor<{batch}xi32>"]
    assert re.findall(r"tensor<[^>]+>", schedule_out) == [f"tensor<{batch + 1}xi32>"]
    call = custom_call_line(text)
    for attribute in ("softmax_scale = 1.350000e-01 : f64", "output_scale = 5.000000e-01 : f64",
                      "sm_count = 132 : i64", "enable_pdl = true", "fail_closed = true"):
        assert attribute in call, call
    operands = [f"tensor<{batch}x{q_len}x{num_heads}x576xbf16>", f"tensor<64x{page_size}x576xbf16>",
                f"tensor<{batch}x8xi32>", f"tensor<{batch}xi32>", f"tensor<{batch}xi32>",
                f"tensor<{batch + 1}xi32>"]
    workspace = gpu.sm90_workspace_bytes(batch, q_len, num_heads, 132)
    results = [f"tensor<{batch}x{q_len}x{num_heads}x512xbf16>", f"tensor<{batch}x{q_len}x{num_heads}xf32>",
               f"tensor<{workspace}xui8>"]
    signature = call.rsplit(" : ", 1)[1]
    inputs, outputs = signature.split(" -> ")
    assert re.findall(r"tensor<[^>]+>", inputs) == operands
    assert re.findall(r"tensor<[^>]+>", outputs) == results
    schedule_result = schedule.split("=", 1)[0].strip()
    decode_operands = re.findall(r"%[\w#]+", call.split("(", 1)[1].split(")", 1)[0])
    assert decode_operands[5] == schedule_result and decode_operands[3] in schedule
    assert decode_operands[3] == decode_operands[4] == "%arg3"
    assert "stablehlo.multiply" not in text  # the kernel applies output_scale itself


def plan_struct(batch=4, max_pages=8, page_size=64):
    """An Sm90Plan of shape-dtype structs, to trace with."""
    return jax_mla.Sm90Plan(jax.ShapeDtypeStruct((batch + 1,), jnp.int32),
                            jax.ShapeDtypeStruct((batch,), jnp.int32), batch, max_pages, page_size)


@pytest.mark.parametrize("fail_closed", [True, False])
def test_a_plan_gives_the_decode_call_its_schedule(lowering_stubs, fail_closed):
    """With an Sm90Plan the call builds no schedule: the decode call reads the plan's schedule
    and lengths (it compares them with the call's itself) and is the layer's only op, failing
    closed or not."""
    def fn(*arrays, plan):
        return api.run_backend(backends.BY_NAME[SM90], *arrays, softmax_scale=0.1,
                               output_scale=1.0, kv_lora_rank=512, device_plan=False,
                               fail_closed=fail_closed, plan=plan)

    text = jax.jit(fn).trace(*shapes(), plan=plan_struct()).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "@jax_mla_sm90_schedule(" not in text and text.count(" = stablehlo.") == 1
    call = custom_call_line(text)
    operands = re.findall(r"%[\w#]+", call.split("(", 1)[1].split(")", 1)[0])
    # %arg4, %arg5: the plan's schedule and lengths
    assert operands == ["%arg0", "%arg1", "%arg2", "%arg3", "%arg5", "%arg4"]
    assert f"fail_closed = {str(fail_closed).lower()}" in call


def test_a_plan_built_outside_a_scan_lowers_outside_its_loop(monkeypatch, lowering_stubs):
    """The step builds the schedule once, before the scan; "auto" with an Sm90Plan takes sm90, and
    the loop holds only the decode call."""
    monkeypatch.setattr(backends, "available_backends", lambda platform=None: ["fa3", "fa2", SM90, "xla"])
    query, cache, tables, lens = shapes(q_len=1, num_heads=16)
    caches = jax.ShapeDtypeStruct((3, *cache.shape), cache.dtype)

    def step(query, caches, tables, lens):
        plan = jax_mla.sm90_plan(lens, max_pages=tables.shape[1], page_size=caches.shape[2])
        assert jax_mla.backend_for(query, caches[0], tables, plan=plan) == SM90

        def layer(q, cache):
            return q, jax_mla.decode(q, cache, tables, lens, softmax_scale=0.1, plan=plan)
        return jax.lax.scan(layer, query, caches)[1]

    lines = jax.jit(step).trace(query, caches, tables, lens).lower(
        lowering_platforms=("cuda",)).as_text().splitlines()
    where = {target: [i for i, line in enumerate(lines) if f"@{target}(" in line]
             for target in ("jax_mla_sm90_schedule", "jax_mla_sm90_decode")}
    loop = [i for i, line in enumerate(lines) if "stablehlo.while" in line]
    assert len(loop) == 1 and len(where["jax_mla_sm90_decode"]) == 1
    assert where["jax_mla_sm90_schedule"] and max(where["jax_mla_sm90_schedule"]) < loop[0]
    assert where["jax_mla_sm90_decode"][0] > loop[0]


def test_an_sm90_plan_must_fit_its_call():
    plan = jax_mla.Sm90Plan(jnp.zeros((5,), jnp.int32), jnp.ones((4,), jnp.int32), 4, 8, 64)
    lens, tables = jnp.ones((4,), jnp.int32), jnp.zeros((4, 8), jnp.int32)
    plan.check_for(lens, tables, 64)
    for args, message in [
        ((lens, tables, 32), r"built for \{'batch': 4, 'max_pages': 8, 'page_size': 64\} but decode "
                             r"got \{'batch': 4, 'max_pages': 8, 'page_size': 32\}"),
        ((lens, tables[:, :7], 64), r"got \{'batch': 4, 'max_pages': 7, 'page_size': 64\}"),
        ((lens[:3], tables[:3], 64), r"got \{'batch': 3, 'max_pages': 8, 'page_size': 64\}"),
    ]:
        with pytest.raises(jax_mla.planning.PlanMismatchError, match=message):
            plan.check_for(*args)
    for change, message in [
        (dict(schedule=jnp.zeros((4,), jnp.int32)), r"plan.schedule must be int32 \[5\], got int32 \[4\]"),
        (dict(seq_lens=jnp.ones((4,), jnp.float32)), r"plan.seq_lens must be int32 \[4\], got float32"),
    ]:
        with pytest.raises(jax_mla.planning.PlanMismatchError, match=message):
            dataclasses.replace(plan, **change).check_for(lens, tables, 64)


@pytest.mark.parametrize("args,error,message", [
    (dict(seq_lens=jnp.ones((3,), jnp.float32)), TypeError, r"seq_lens must have dtype int32, got float32"),
    (dict(seq_lens=jnp.ones((3, 1), jnp.int32)), ValueError, r"seq_lens must have rank 1"),
    (dict(seq_lens=jnp.ones((0,), jnp.int32)), ValueError, r"seq_lens must hold at least one request"),
    (dict(page_size=16), ValueError, r"sm90 needs page_size in \(32, 64\), got 16"),
    (dict(max_pages=0), ValueError, r"max_pages must be >= 1, got 0"),
    (dict(max_pages=2**24), ValueError, r"max_pages \* page_size < 2\*\*30 tokens"),
])
def test_sm90_plan_names_a_bad_argument(args, error, message):
    with pytest.raises(error, match=message):
        jax_mla.sm90_plan(**{**dict(seq_lens=jnp.ones((3,), jnp.int32), max_pages=8, page_size=64),
                             **args})


def test_sm90_plan_says_where_sm90_does_not_run():
    if jax.default_backend() != "cpu":
        pytest.skip("only meaningful on a CPU-only machine")
    with pytest.raises(ValueError, match=r"jax_mla.sm90_plan builds the sm90 kernel's schedule: "
                                         r"backend 'sm90' needs an NVIDIA GPU"):
        jax_mla.sm90_plan(jnp.ones((3,), jnp.int32), max_pages=8, page_size=64)


def test_workspace_formula_by_hand():
    # 132 SMs, q_len * H = 256 rows: 4 M tiles, 33 parts, slots = 4 + 33, rows_pad = 256.
    slots, rows_pad = 4 + 33, 256
    out_at = -(-(4 * slots * rows_pad) // 256) * 256  # after the partial LSEs
    total = -(-(out_at + 4 * slots * rows_pad * 512) // 256) * 256
    assert gpu.sm90_workspace_bytes(4, 2, 128, 132) == total
    assert gpu.sm90_workspace_bytes(1, 1, 8, 132) == 256 * -(-(4 * 133 * 64) // 256) + 4 * 133 * 64 * 512


WORKSPACE_CASES = [(b, q, h, sms) for b in (1, 3, 32, 129, 1000) for q in (1, 2, 3, 4)
                   for h in (1, 8, 16, 33, 64, 128) for sms in (1, 78, 132, 133)]


@pytest.mark.skipif(not HAS_TVM_FFI, reason="apache-tvm-ffi provides the runtime the library links to")
def test_workspace_formula_equals_the_kernels(ffi_library_path):
    import tvm_ffi  # noqa: F401  (loads libtvm_ffi.so, which the library resolves by soname)

    library = ctypes.CDLL(str(ffi_library_path))
    if not hasattr(library, "JaxMlaSm90WorkspaceBytes"):
        skip_or_fail(f"{ffi_library_path} was built without the sm90 handler")
    assert hasattr(library, gpu.SM90_SYMBOL)
    for target in ("jax_mla_sm90_schedule", "jax_mla_sm90_decode", "jax_mla_sm90_decode_fp8"):
        assert hasattr(library, gpu.TARGETS[target]["execute"]), target
    kernel = library.JaxMlaSm90WorkspaceBytes
    kernel.restype = ctypes.c_size_t
    kernel.argtypes = [ctypes.c_int64] * 4
    for case in WORKSPACE_CASES:
        assert gpu.sm90_workspace_bytes(*case) == kernel(*case), case


# DecodeKernel<kEarlyRelease, kSkip, kCluster, kScoreN, kFp8, kSplitRelease, kColumnHalves>
# instantiations the default LaunchOptions select (ffi/sm90/launch.cuh, SelectKernel and
# ColumnHalvesKernel): the transposed kernels up to 16 and 32 rows, the 64-row tiles without
# clusters and in M-tile pairs (clusters of two), each stage released whole, with and without
# column halves, and the fp8 cache's 64-row tiles with and without them.
DEFAULT_DECODE_KERNELS = {(1, 0, 1, 16, 0, 0, 0), (1, 0, 1, 32, 0, 0, 0), (1, 0, 1, 0, 0, 0, 0),
                          (1, 0, 2, 0, 0, 0, 0), (1, 0, 1, 0, 1, 0, 0), (1, 0, 1, 0, 0, 0, 1),
                          (1, 0, 2, 0, 0, 0, 1), (1, 0, 1, 0, 1, 0, 1)}


def test_the_library_holds_only_the_kernels_of_the_default_options(ffi_library_path):
    """The FFI library is built without the launcher's experiment kernels (no
    JAX_MLA_SM90_EXPERIMENTS): the DecodeKernel instantiations it registers by name are those the
    default options select, beside the fp8 cache's register-operand kernels."""
    library = Path(ffi_library_path).read_bytes()
    found = {tuple(int(v) for v in args) for args in re.findall(
        rb"DecodeKernelILb(\d)ELi(\d+)ELi(\d+)ELi(\d+)ELb(\d)ELb(\d)ELb(\d)E", library)}
    if not found:
        skip_or_fail(f"{ffi_library_path} was built without the sm90 handler")
    assert found == DEFAULT_DECODE_KERNELS
    assert b"DecodeFp8RegsKernel" in library and b"DecodeFp8SplitKernel" in library


@pytest.mark.parametrize("change,message", [
    (dict(page_size=16), r"sm90 needs kv_cache page_size in \(32, 64\), got 16"),
    (dict(page_size=128), r"sm90 needs kv_cache page_size in \(32, 64\), got 128"),
    (dict(head_dim=448), r"sm90 supports \(kv_lora_rank, rope_dim\) = \(512, 64\), got \(384, 64\)"),
    (dict(q_len=5), r"sm90 supports query q_len \(dim 1\) in \[1, 4\], got 5"),
    (dict(num_heads=129), r"sm90 supports query num_heads \(dim 2\) in \[1, 128\], got 129"),
    (dict(num_heads=0), r"sm90 supports query num_heads \(dim 2\) in \[1, 128\], got 0"),
    (dict(num_pages=0), r"sm90 needs kv_cache with at least one page, got shape \(0, 64, 576\)"),
    (dict(num_pages=2**25), r"sm90 supports kv_cache num_pages \* page_size < 2\*\*31 tokens, got "
                            r"33554432 \* 64"),
    (dict(max_pages=2**24), r"sm90 supports block_tables max_pages \* page_size < 2\*\*30 tokens, got "
                            r"16777216 \* 64"),
    (dict(max_pages=2**23, batch=2**10), r"sm90 supports batch \* \(max_pages \* page_size / 64 \+ 3\) "
                                         r"< 2\*\*31, got batch 1024, max_pages 8388608, page_size 64"),
])
def test_unsupported_shapes_are_named(lowering_stubs, change, message):
    with pytest.raises(ValueError, match=message):
        lower(*shapes(**change), kv_lora_rank=change.get("head_dim", 576) - 64)


def fp8_shapes(batch=4, q_len=2, num_heads=16, num_pages=64, page_size=64, max_pages=8):
    query, _, tables, lens = shapes(batch, q_len, num_heads, num_pages, page_size, max_pages)
    return query, jax.ShapeDtypeStruct((num_pages, page_size, 656), jnp.uint8), tables, lens


@pytest.mark.parametrize("q_len,num_heads", [(1, 16), (2, 16), (4, 8), (1, 32), (1, 64), (3, 11),
                                             (4, 128)])
def test_the_fp8_cache_lowers_to_its_own_target(lowering_stubs, q_len, num_heads):
    text = lower(*fp8_shapes(q_len=q_len, num_heads=num_heads))
    call = next(line for line in text.splitlines() if "@jax_mla_sm90_decode_fp8(" in line)
    inputs = call.rsplit(" : ", 1)[1].split(" -> ")[0]
    assert re.findall(r"tensor<[^>]+>", inputs)[1] == "tensor<64x64x656xui8>"
    assert "@jax_mla_sm90_decode(" not in text


def test_kv_lora_rank_other_than_512_is_refused(lowering_stubs):
    with pytest.raises(ValueError, match=r"\(kv_lora_rank, rope_dim\) = \(512, 64\), got \(448, 128\)"):
        lower(*shapes(), kv_lora_rank=448)


@pytest.mark.parametrize("scale", [0.0, -0.1, 1e-50])
def test_softmax_scale_must_be_positive_in_float32(lowering_stubs, scale):
    with pytest.raises(ValueError, match=rf"sm90 needs softmax_scale > 0 \(in float32\), got {scale}"):
        lower(*shapes(), softmax_scale=scale)


def test_unsupported_shapes_are_named_through_decode(monkeypatch, lowering_stubs):
    monkeypatch.setattr(backends, "available_backends", lambda platform=None: ["fa3", "fa2", SM90, "xla"])
    query, cache, tables, lens = shapes(page_size=16)
    with pytest.raises(ValueError, match=r"page_size in \(32, 64\), got 16"):
        jax.jit(lambda *a: jax_mla.decode(*a, softmax_scale=0.1, backend=SM90)).trace(
            query, cache, tables, lens)
    with pytest.raises(ValueError, match=r"backend 'sm90' takes plan=None"):
        jax_mla.decode(*shapes(), softmax_scale=0.1, backend=SM90, plan="device")


def test_sm90_is_listed_after_fa3_and_fa2_and_never_the_first_pick():
    names = [b.name for b in backends.TABLE]
    assert names.index(SM90) > names.index(backends.FA2) > names.index(backends.FA3)
    sm90 = backends.BY_NAME[SM90]
    assert not sm90.first_pick and all(b.first_pick for b in backends.TABLE if b is not sm90)
    assert sm90.cache_formats == (backends.FLOAT_CACHE, backends.FP8_CACHE)
    assert sm90.runs_on_gpu((9, 0)) and not sm90.runs_on_gpu((10, 0)) and not sm90.runs_on_gpu((8, 0))
    assert sm90.reads_plan == backends.SM90_PLAN and sm90.applies_output_scale


@pytest.fixture
def fake_hopper(monkeypatch):
    monkeypatch.setattr(gpu, "runtime_missing", lambda: None)
    monkeypatch.setattr(gpu, "capability", lambda device=None: (9, 0))


def test_available_on_hopper_when_the_library_has_it(monkeypatch, fake_hopper):
    monkeypatch.setattr(gpu, "sm90_missing", lambda: None)
    assert backends.available_backends("gpu") == ["fa3", "fa2", SM90, "xla"]
    assert backends.resolve("auto", "gpu", jnp.bfloat16) == "fa3"
    assert backends.resolve(SM90, "gpu", jnp.bfloat16) == SM90


def test_unavailable_when_the_library_lacks_it(monkeypatch, fake_hopper):
    monkeypatch.setattr(gpu, "sm90_missing", lambda: "built without the sm90 handler")
    assert backends.available_backends("gpu") == ["fa3", "fa2", "xla"]
    with pytest.raises(ValueError, match=r"backend 'sm90' is unavailable: built without the sm90 "
                                         r"handler; available here: \['fa3', 'fa2', 'xla'\]"):
        backends.resolve(SM90, "gpu")


def test_other_gpus_are_told_the_architecture(monkeypatch):
    monkeypatch.setattr(gpu, "runtime_missing", lambda: None)
    monkeypatch.setattr(gpu, "capability", lambda device=None: (10, 0))
    monkeypatch.setattr(gpu, "sm90_missing", lambda: None)
    with pytest.raises(ValueError, match=r"backend 'sm90' runs on SM90 \(H100, H200\) and cannot run "
                                         r"on this GPU \(compute capability 10.0\)"):
        backends.resolve(SM90, "gpu")


@pytest.mark.skipif(not HAS_TVM_FFI, reason="loading a library needs apache-tvm-ffi's runtime")
def test_a_library_without_the_handler_is_reported(monkeypatch):
    import tvm_ffi.libinfo

    monkeypatch.setenv("JAX_MLA_FFI_LIB", tvm_ffi.libinfo.find_libtvm_ffi())  # a library without it
    assert "was built without the sm90 handler" in gpu.sm90_missing.__wrapped__()
    assert "CUTLASS" in gpu.sm90_missing.__wrapped__()


def test_output_scale_is_applied_once(monkeypatch):
    """The kernel scales (applies_output_scale=True): jax_mla.decode must not scale again."""
    monkeypatch.setattr(backends, "available_backends", lambda platform=None: [SM90, "xla"])

    def stand_in(*arrays, softmax_scale, output_scale, kv_lora_rank, plan, fail_closed):
        assert plan is None and fail_closed
        return xla_backend.decode(*arrays, softmax_scale=softmax_scale, output_scale=output_scale,
                                  kv_lora_rank=kv_lora_rank, return_lse=True)

    monkeypatch.setattr(gpu, "sm90_decode", stand_in)
    problem = make_problem(3, batch=2, q_len=2, num_heads=8, page_size=32, dtype=jnp.bfloat16)
    out = jax_mla.decode(*problem.arrays, softmax_scale=problem.softmax_scale, output_scale=-0.5,
                         backend=SM90)
    unscaled = jax_mla.decode(*problem.arrays, softmax_scale=problem.softmax_scale, backend="xla")
    np.testing.assert_allclose(np.asarray(out, np.float32), -0.5 * np.asarray(unscaled, np.float32),
                               rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("batch,q_len,num_heads,prefers", [
    (32, 1, 64, True), (32, 1, 8, True), (512, 1, 16, True), (31, 1, 16, True), (32, 1, 128, True),
    (64, 1, 128, True), (32, 2, 128, True), (128, 1, 128, True), (129, 1, 128, True),
    (256, 1, 128, True), (512, 1, 128, True), (33, 2, 128, True), (128, 2, 128, True),
    (512, 2, 128, True), (31, 1, 128, True), (128, 2, 16, True), (511, 2, 16, True),
    (512, 2, 16, False), (128, 2, 32, True), (32, 2, 64, True), (511, 2, 64, True),
    (512, 2, 64, False), (512, 2, 32, False), (1, 1, 16, True), (2, 1, 8, True), (4, 1, 64, True),
    (8, 1, 32, False), (17, 1, 32, False), (8, 1, 128, True), (7, 1, 128, False), (1, 1, 128, True),
    (2, 1, 128, True), (3, 1, 128, True), (4, 1, 128, True), (5, 1, 128, True), (6, 1, 128, True),
    (4, 1, 32, True), (5, 1, 32, False), (1, 1, 32, True), (1, 2, 128, True), (8, 2, 128, True),
    (7, 2, 128, True), (31, 2, 128, True), (1, 2, 64, True), (31, 2, 64, True), (4, 2, 32, True),
    (16, 2, 32, True), (1, 2, 16, True), (4, 2, 16, True), (8, 2, 16, True), (9, 2, 16, False),
    (16, 2, 16, False), (1, 2, 8, True), (8, 2, 8, True), (9, 2, 8, False), (31, 2, 8, False),
    (8, 3, 128, True), (33, 3, 128, True), (511, 3, 128, True), (512, 3, 128, False),
    (8, 3, 16, False), (8, 3, 32, False), (31, 3, 64, True), (32, 3, 64, True), (32, 3, 8, True),
    (1, 3, 64, True), (512, 3, 64, True), (512, 3, 32, False), (2, 3, 32, True), (3, 3, 32, False),
    (15, 3, 32, False), (16, 3, 32, True), (511, 3, 32, True), (4, 3, 16, True), (5, 3, 16, False),
    (23, 3, 16, False), (24, 3, 16, True), (32, 3, 16, True), (512, 3, 16, False), (1, 3, 8, False),
    (31, 3, 8, False), (1, 4, 16, True), (8, 4, 32, True), (31, 4, 64, True), (32, 4, 128, True),
    (511, 4, 16, True), (512, 4, 128, False), (1, 4, 8, True), (8, 4, 8, True), (9, 4, 8, False),
    (31, 4, 8, False), (32, 4, 8, True), (512, 4, 8, False)])
def test_the_rule_follows_the_benchmark(batch, q_len, num_heads, prefers):
    assert backends.prefers_sm90(batch, q_len, num_heads) is prefers
    assert backends.prefers_sm90(batch, q_len, num_heads, instead_of="xla")


def test_auto_offers_sm90_only_without_a_plan(monkeypatch, fake_hopper):
    monkeypatch.setattr(gpu, "sm90_missing", lambda: None)
    fa3, xla, sm90 = (backends.BY_NAME[name] for name in ("fa3", "xla", SM90))
    fp8 = backends.FP8_CACHE
    assert backends.auto_alternative("auto", fa3, None, "gpu") is sm90
    assert backends.auto_alternative("auto", xla, None, "gpu") is sm90  # Hopper without FlashInfer
    assert backends.auto_alternative("auto", xla, None, "gpu", jnp.bfloat16, fp8) is sm90
    assert backends.auto_alternative("auto", fa3, "device", "gpu") is None
    assert backends.auto_alternative("fa3", fa3, None, "gpu") is None
    assert backends.auto_alternative("xla", xla, None, "gpu", jnp.bfloat16, fp8) is None
    assert backends.auto_alternative("auto", fa3, None, "gpu", jnp.float32) is None
    assert backends.auto_alternative("auto", xla, None, "gpu", jnp.float32, fp8) is None
    monkeypatch.setattr(gpu, "sm90_missing", lambda: "built without the sm90 handler")
    assert backends.auto_alternative("auto", fa3, None, "gpu") is None


def test_auto_takes_sm90_per_device_where_the_benchmark_has_it_faster(monkeypatch):
    """With "auto" resolving to fa3 and no plan, the kernel that runs follows the shard's shape:
    sm90 for 32 and 256 requests of 128 heads and for 32 and 8 of 16, fa3 for 7 requests of 128
    heads, for 8 of 32 and for a page size sm90 does not take; at q_len 3 sm90 for 4 requests of
    16 heads and fa3 for 8, at q_len 4 sm90 for 8 requests of 8 heads and fa3 for 9 (stand-in
    kernels record which one ran), and ``backend_for`` names it."""
    ran = record_kernel_runs(monkeypatch, ("fa3", SM90, "xla"))
    for batch, q_len, num_heads, page_size, expected in (
            (32, 1, 16, 64, SM90), (32, 1, 128, 64, SM90), (256, 1, 128, 64, SM90),
            (7, 1, 128, 64, "fa3"), (8, 1, 16, 64, SM90), (8, 1, 32, 64, "fa3"),
            (4, 3, 16, 64, SM90), (8, 3, 16, 64, "fa3"), (8, 4, 8, 32, SM90), (9, 4, 8, 32, "fa3"),
            (32, 1, 16, 16, "fa3")):
        problem = make_problem(5, batch=batch, q_len=q_len, num_heads=num_heads,
                               page_size=page_size, max_len=100, dtype=jnp.bfloat16)
        ran.clear()
        jax_mla.decode(*problem.arrays, softmax_scale=problem.softmax_scale)
        assert ran == [expected], (batch, q_len, num_heads, page_size)
        assert jax_mla.backend_for(*problem.arrays[:3]) == expected
        assert jax_mla.backend_for(*problem.arrays[:3], plan="device") == "fa3"
    with pytest.raises(ValueError, match=r"sm90 needs kv_cache page_size in \(32, 64\), got 16"):
        jax_mla.backend_for(*problem.arrays[:3], backend=SM90)  # the last problem: pages of 16
    # The fp8 cache: "auto" resolves to xla; sm90 where it runs the shard (pages of 32 or 64).
    for batch, q_len, num_heads, page_size, expected in ((1, 1, 16, 64, SM90), (3, 2, 16, 32, SM90),
                                                         (3, 1, 64, 64, SM90), (2, 4, 128, 32, SM90),
                                                         (3, 1, 16, 16, "xla")):
        problem, _ = fp8_problem(make_problem(6, batch=batch, q_len=q_len, num_heads=num_heads,
                                              page_size=page_size, max_len=100,
                                              dtype=jnp.bfloat16), 6)
        ran.clear()
        jax_mla.decode(*problem.arrays, softmax_scale=problem.softmax_scale)
        assert ran == [expected], (batch, q_len, num_heads, page_size)
        assert jax_mla.backend_for(*problem.arrays[:3]) == expected


# ---- on an SM90 GPU -----------------------------------------------------------------------------

def sm90_blocker() -> str | None:
    if SM90 in jax_mla.available_backends():
        return None
    if jax.default_backend() != "gpu":
        return f"no CUDA GPU (default backend {jax.default_backend()!r})"
    return gpu.runtime_missing() or gpu.sm90_missing() or "this GPU is not SM90"


@pytest.fixture
def sm90_gpu():
    blocker = sm90_blocker()
    if blocker:
        if os.environ.get("JAX_MLA_REQUIRE_GPU", "0").strip() not in ("", "0"):
            pytest.fail(f"JAX_MLA_REQUIRE_GPU requires the sm90 GPU tests, but {blocker}", pytrace=False)
        pytest.skip(f"sm90: {blocker}")


def on_gpu(test):
    """Marks a test ``gpu`` and runs it only where the sm90 backend is available."""
    return pytest.mark.gpu(pytest.mark.usefixtures("sm90_gpu")(test))


OUT_TOL, LSE_TOL = tolerances(SM90, jnp.bfloat16)  # per request/head; nats


def sm90(problem, output_scale=1.0):
    return jax_mla.decode(*problem.arrays, softmax_scale=problem.softmax_scale,
                          output_scale=output_scale, backend=SM90, return_lse=True)


def reference(problem, output_scale=1.0):
    from jax_mla.reference import reference_from_jax

    out, lse = reference_from_jax(*problem.arrays, softmax_scale=problem.softmax_scale,
                                  output_scale=output_scale)
    return out.numpy(), lse.numpy()


def assert_close(out, lse, ref_out, ref_lse):
    check_accuracy(out, lse, ref_out, ref_lse, backend=SM90)


def assert_identical(first, second):
    for a, b in zip(first, second):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize("page_size", [32, 64])
@pytest.mark.parametrize("num_heads", [8, 16, 64, 128])
@pytest.mark.parametrize("q_len", [1, 2, 4])
@pytest.mark.parametrize("batch", [1, 3, 32])
@on_gpu
def test_matches_the_reference(batch, q_len, num_heads, page_size):
    """NaN-poisoned unused pages and page tails, garbage table padding (make_problem); run twice:
    bit-identical."""
    problem = make_problem(100 + batch, batch=batch, q_len=q_len, num_heads=num_heads,
                           page_size=page_size, max_len=700, dtype=jnp.bfloat16,
                           seq_lens=[555] if batch == 1 else None)  # not just q_len tokens
    first = sm90(problem)
    assert_close(*first, *reference(problem))
    assert_identical(first, sm90(problem))


def with_garbage_columns(problem: Problem, extra_columns: int, seed: int) -> Problem:
    """``problem`` with ``extra_columns`` more block-table columns of garbage page ids (-1, 10**6,
    7): a wider table, the same requests (for the launch rules that read the table's width)."""
    padding = np.random.default_rng(seed).choice(
        [-1, 10**6, 7], size=(problem.block_tables.shape[0], extra_columns))
    tables = np.concatenate([np.asarray(problem.block_tables), padding], axis=1).astype(np.int32)
    return dataclasses.replace(problem, block_tables=jnp.asarray(tables))


@pytest.mark.parametrize("num_heads,q_len", [(128, 1), (64, 2), (128, 2)])
@pytest.mark.parametrize("extra_columns", [0, 400])
@on_gpu
def test_both_sides_of_the_cluster_rule(num_heads, q_len, extra_columns):
    """The 64-row tiles run without clusters up to 24,576 block-table tokens and in clusters of two
    beyond (ClusterSize, ffi/sm90/launch.cuh): the same requests, their tables widened by garbage
    columns to take the clusters, match the reference either way."""
    problem = with_garbage_columns(
        make_problem(17, batch=3, q_len=q_len, num_heads=num_heads, page_size=64, max_len=3000,
                     dtype=jnp.bfloat16), extra_columns, seed=5)
    batch, width = problem.block_tables.shape
    assert (batch * width * 64 > 24576) == (extra_columns > 0)
    first = sm90(problem)
    assert_close(*first, *reference(problem))
    assert_identical(first, sm90(problem))


@pytest.mark.parametrize("num_heads,q_len", [(128, 1), (64, 1), (64, 2)])
@pytest.mark.parametrize("extra_columns", [0, 400])
@on_gpu
def test_both_sides_of_the_column_halves_rule(num_heads, q_len, extra_columns):
    """One request's parts of the 64-row tiles run on two CTAs each, one a half of the output's
    columns, where its block table is narrow (64 pages: UseColumnHalves in ffi/sm90/launch.cuh),
    and whole where garbage columns widen it: both match the reference, each run twice
    bit-identical."""
    problem = make_problem(23, batch=1, q_len=q_len, num_heads=num_heads, page_size=64,
                           seq_lens=[4000], dtype=jnp.bfloat16)
    assert problem.block_tables.shape == (1, 64)
    problem = with_garbage_columns(problem, extra_columns, seed=6)
    first = sm90(problem)
    assert_close(*first, *reference(problem))
    assert_identical(first, sm90(problem))


@pytest.mark.parametrize("num_heads,q_len", [(128, 1), (16, 2), (32, 4), (1, 1), (3, 3)])
@on_gpu
def test_skewed_lengths_and_output_scale(num_heads, q_len):
    """One long request among short ones: split over many parts and merged by the combine kernel."""
    lengths = [q_len, 40_000, 1 + q_len, 64, 65, 4097, 128, 3000]
    problem = make_problem(7, batch=len(lengths), q_len=q_len, num_heads=num_heads, page_size=64,
                           seq_lens=lengths, dtype=jnp.bfloat16)
    first = sm90(problem, output_scale=0.37)
    assert_close(*first, *reference(problem, output_scale=0.37))
    assert_identical(first, sm90(problem, output_scale=0.37))


def defined_reference(query, cache, tables, lengths, softmax_scale):
    """What docs/sm90-kernel.md defines for any input, in float64: lengths clamped to [0, max_pages
    * page_size]; tokens on pages whose id is outside [0, num_pages) masked; a row that sees no
    token gives 0 and lse -inf."""
    query, cache = (np.asarray(x.astype(jnp.float32), np.float64) for x in (query, cache))
    tables, lengths = np.asarray(tables), np.asarray(lengths)
    batch, q_len, num_heads, _ = query.shape
    num_pages, page_size, _ = cache.shape
    out = np.zeros((batch, q_len, num_heads, 512))
    lse = np.full((batch, q_len, num_heads), -np.inf)
    for b in range(batch):
        length = int(np.clip(lengths[b], 0, tables.shape[1] * page_size))
        pages = tables[b, np.arange(length) // page_size]
        valid = (pages >= 0) & (pages < num_pages)
        keys = np.zeros((length, 576))
        keys[valid] = cache[pages[valid], np.arange(length)[valid] % page_size]
        for i in range(q_len):
            seen = valid & (np.arange(length) <= length - q_len + i)
            if not seen.any():
                continue
            logits = query[b, i] @ keys[seen].T * softmax_scale  # [H, n]
            top = logits.max(axis=1, keepdims=True)
            weights = np.exp(logits - top)
            total = weights.sum(axis=1, keepdims=True)
            out[b, i] = weights @ keys[seen, :512] / total
            lse[b, i] = (top + np.log(total))[:, 0]
    return out, lse


@pytest.mark.parametrize("page_size", [32, 64])
@on_gpu
def test_bad_inputs_give_the_defined_result(page_size):
    """Out-of-range page ids inside the lengths, lengths over the table's capacity, below q_len,
    zero and negative: no fault, the documented result, nothing from the NaN pages no table names."""
    rng = np.random.default_rng(5)
    q_len, num_heads, max_pages, num_pages = 2, 16, 4, 40
    lengths = np.array([0, -5, 1, 1000, 70, 2**31 - 1, 2, 100, -(2**31)], np.int32)
    batch = len(lengths)
    tables = rng.integers(0, 30, size=(batch, max_pages)).astype(np.int32)  # pages 30.. unnamed
    tables[3, 1] = -1
    tables[4, 0] = num_pages
    tables[5, 2] = 10**6
    tables[7, :] = -(2**31)  # no valid page at all
    cache = rng.standard_normal((num_pages, page_size, 576)).astype(np.float32)
    cache[30:] = np.nan
    query = rng.standard_normal((batch, q_len, num_heads, 576)).astype(np.float32)
    arrays = (jnp.asarray(query, jnp.bfloat16), jnp.asarray(cache, jnp.bfloat16),
              jnp.asarray(tables), jnp.asarray(lengths))
    # The kernel's own handling, beneath decode's guard (fail_closed=False).
    kernel_only = dict(softmax_scale=0.1, backend=SM90, return_lse=True, fail_closed=False)
    first = jax_mla.decode(*arrays, **kernel_only)
    jax.block_until_ready(first)
    assert_close(*first, *defined_reference(*arrays, 0.1))
    assert_identical(first, jax_mla.decode(*arrays, **kernel_only))
    # The device is still healthy: a normal problem afterwards is right.
    problem = make_problem(9, batch=4, q_len=1, num_heads=16, page_size=page_size, dtype=jnp.bfloat16)
    assert_close(*sm90(problem), *reference(problem))


@on_gpu
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
@pytest.mark.parametrize("num_heads,q_len", [(16, 1), (16, 2), (64, 1), (64, 3), (128, 1)])
def test_the_kernels_fail_closed_on_split_requests(cache, num_heads, q_len):
    """Failing closed is the kernels' own (no guard runs before sm90), in each kernel: the bf16
    cache's transposed tiles of 16 and 32 rows and its 64-row tiles (one M tile, three, and pairs
    in clusters), the fp8 cache's register-operand, split and 64-row kernels. A request that reads a page id outside the cache
    gets out 0 and lse -inf also when it is split over many parts and only one of them reads that
    page, as does one whose length lies outside [q_len, capacity]. The others get their results,
    bit for bit those of fail_closed=False (the schedule is the same)."""
    problem = make_problem(31, batch=6, q_len=q_len, num_heads=num_heads, page_size=64,
                           seq_lens=[4000, 3000, 3500, 5000, 2500, 200], dtype=jnp.bfloat16)
    if cache == "fp8":
        problem, _ = fp8_problem(problem, 31)
    tables, lengths = np.array(problem.block_tables), np.array(problem.seq_lens)
    tables[1, 20] = problem.kv_cache.shape[0]  # a page in the middle of a split request
    tables[2, (lengths[2] - 1) // 64] = -1     # its last page
    lengths[3] = tables.shape[1] * 64 + 1      # past the table's capacity
    lengths[4] = q_len - 6                     # below q_len
    bad, good = np.array([1, 2, 3, 4]), np.array([0, 5])
    arrays = (problem.query, problem.kv_cache, jnp.asarray(tables), jnp.asarray(lengths))

    def run(fail_closed):
        return jax.jit(lambda *a: jax_mla.decode(
            *a, softmax_scale=problem.softmax_scale, backend=SM90, return_lse=True,
            fail_closed=fail_closed))(*arrays)

    out, lse = run(True)
    assert np.all(np.asarray(out, np.float32)[bad] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[bad]))
    assert_close(out[good], lse[good], *reference(dataclasses.replace(
        problem, query=problem.query[good], block_tables=problem.block_tables[good],
        seq_lens=problem.seq_lens[good])))
    open_out, open_lse = run(False)
    assert_identical((out[good], lse[good]), (open_out[good], open_lse[good]))


def make_step(softmax_scale, output_scale=1.0, chain=True, planned=False):
    """A jitted decode step: lax.scan over stacked per-layer caches; with ``chain`` each layer's
    query adds the previous layer's output (as a model's residual stream would); with
    ``planned`` the schedule is built once by ``jax_mla.sm90_plan``, before the scan, and passed
    to every layer."""
    @jax.jit
    def step(query, caches, tables, lens):
        plan = (jax_mla.sm90_plan(lens, max_pages=tables.shape[1], page_size=caches.shape[2])
                if planned else None)

        def layer(q, cache):
            out, lse = jax_mla.decode(q, cache, tables, lens, softmax_scale=softmax_scale,
                                      output_scale=output_scale, backend=SM90, return_lse=True,
                                      plan=plan)
            return (q.at[..., :512].add(out * 0.1) if chain else q), (out, lse)
        _, (outs, lses) = jax.lax.scan(layer, query, caches)
        return outs, lses

    return step


@on_gpu
def test_inside_jit_and_scan_over_layers():
    problem = make_problem(21, batch=6, q_len=2, num_heads=64, page_size=64, max_len=2000,
                           dtype=jnp.bfloat16)
    layers = 4
    caches = jnp.stack([problem.kv_cache * (1 + 0.05 * i) for i in range(layers)])
    step = make_step(problem.softmax_scale, chain=False)
    outs, lses = step(problem.query, caches, problem.block_tables, problem.seq_lens)
    for i in range(layers):
        direct = jax_mla.decode(problem.query, caches[i], problem.block_tables, problem.seq_lens,
                                softmax_scale=problem.softmax_scale, backend=SM90, return_lse=True)
        assert_identical((outs[i], lses[i]), direct)
        assert_close(outs[i], lses[i], *reference(dataclasses.replace(problem, kv_cache=caches[i])))
    assert_identical((outs, lses), step(problem.query, caches, problem.block_tables, problem.seq_lens))
    chained = make_step(problem.softmax_scale)(problem.query, caches, problem.block_tables,
                                               problem.seq_lens)
    assert np.isfinite(np.asarray(chained[0], np.float32)).all()
    assert_identical((chained[0][0], chained[1][0]), (outs[0], lses[0]))  # same layer-0 inputs


@on_gpu
def test_a_plan_built_before_a_scan_over_layers_is_built_once():
    """The scan runs only the decode call; each layer's result is bit for bit the one of the step
    that builds the schedule in every layer (the same schedule)."""
    problem = make_problem(24, batch=3, q_len=1, num_heads=16, page_size=64, max_len=2000,
                           dtype=jnp.bfloat16)
    caches = jnp.stack([problem.kv_cache * (1 + 0.05 * i) for i in range(4)])
    arrays = (problem.query, caches, problem.block_tables, problem.seq_lens)
    step = make_step(problem.softmax_scale, planned=True)
    hlo = step.lower(*arrays).compile().as_text()
    assert custom_call_counts(hlo)["jax_mla_sm90_schedule"] == 1  # (XLA may unroll the loop)
    assert custom_calls_in_loops(hlo) == ["jax_mla_sm90_decode"]
    unchained = make_step(problem.softmax_scale, chain=False, planned=True)(*arrays)
    assert_identical(unchained, make_step(problem.softmax_scale, chain=False)(*arrays))
    chained = step(*arrays)
    assert np.isfinite(np.asarray(chained[0], np.float32)).all()
    assert_identical((chained[0][0], chained[1][0]), (unchained[0][0], unchained[1][0]))


@on_gpu
def test_a_plan_used_with_other_lengths_on_the_boundary_combine():
    """300 requests at 128 heads: more requests than four per part boundary, so the combine runs
    by boundary, where a request whose length is not its plan's may still be named split (from
    its planned cost). Without the guard, those requests get 0 and -inf, the others their
    results."""
    problem = make_problem(27, batch=300, q_len=1, num_heads=128, page_size=64, max_len=700,
                           dtype=jnp.bfloat16)
    planned = np.asarray(problem.seq_lens)
    changed = np.arange(0, 300, 7)
    lengths = planned.copy()
    lengths[changed] = np.where(planned[changed] > 65, planned[changed] - 65, planned[changed] + 1)
    plan = jax_mla.sm90_plan(jnp.asarray(planned), max_pages=problem.block_tables.shape[1],
                             page_size=64)
    arrays = (problem.query, problem.kv_cache, problem.block_tables, jnp.asarray(lengths))
    out, lse = jax.jit(lambda *a: jax_mla.decode(
        *a, softmax_scale=problem.softmax_scale, backend=SM90, return_lse=True, plan=plan,
        fail_closed=False))(*arrays)
    assert np.all(np.asarray(out, np.float32)[changed] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[changed]))
    kept = np.setdiff1d(np.arange(300), changed)
    assert_close(out[kept], lse[kept], *reference(dataclasses.replace(
        problem, query=problem.query[kept], block_tables=problem.block_tables[kept],
        seq_lens=problem.seq_lens[kept])))


@on_gpu
@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_auto_with_an_sm90_plan_runs_sm90(cache):
    """"auto" takes sm90 for an Sm90Plan (with the bf16 cache at a shape where without a plan it
    takes fa3) and gives what sm90 gives without one (the same schedule)."""
    problem = make_problem(26, batch=16, q_len=2, num_heads=16, page_size=32, max_len=3000,
                           dtype=jnp.bfloat16)
    if cache == "fp8":
        problem, _ = fp8_problem(problem, 26)
    assert not backends.prefers_sm90(16, 2, 16)
    plan = jax_mla.sm90_plan(problem.seq_lens, max_pages=problem.block_tables.shape[1],
                             page_size=32)
    assert jax_mla.backend_for(*problem.arrays[:3], plan=plan) == SM90
    planned = jax.jit(lambda *a, plan: jax_mla.decode(
        *a, softmax_scale=problem.softmax_scale, return_lse=True, plan=plan))(*problem.arrays,
                                                                             plan=plan)
    assert_identical(planned, sm90(problem))


def custom_call_counts(hlo: str) -> dict[str, int]:
    """How many custom calls of each jax_mla sm90 target a compiled program holds."""
    return {target: len(re.findall(rf'custom_call_target="{target}"', hlo))
            for target in ("jax_mla_sm90_schedule", "jax_mla_sm90_decode")}


def test_custom_calls_in_loops_are_told_from_those_before_them():
    """The helper below on a CPU program: LAPACK's custom call inside a scan's body, and before it."""
    def program(matrix, xs):
        def layer(carry, x):
            values, _ = jnp.linalg.eigh(matrix + carry[0])
            return carry + x * values.sum(), carry
        return jax.lax.scan(layer, jnp.linalg.eigh(matrix)[0], xs)

    hlo = jax.jit(program).lower(jnp.eye(4), jnp.ones((3, 4))).compile().as_text()
    targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
    assert len(targets) == 2 and targets[0] == targets[1]
    assert custom_calls_in_loops(hlo) == [targets[0]]
    hlo = jax.jit(lambda m: jnp.linalg.eigh(m)[0]).lower(jnp.eye(4)).compile().as_text()
    assert custom_calls_in_loops(hlo) == []


@on_gpu
@pytest.mark.xfail(strict=True, reason="XLA 0.11.2 keeps the schedule call inside the scanned loop "
                   "(H100, 2026-12-05; docs/sm90-kernel.md, 'How it is wired'): each layer "
                   "rebuilds it. Passing when XLA hoists it, this test then fails: update the docs.")
def test_a_scan_over_layers_builds_the_schedule_once_before_the_loop():
    """The schedule call's operands are the same in every layer of a lax.scan, so XLA could run it
    once, outside the loop, and only the decode call once a layer."""
    problem = make_problem(24, batch=3, q_len=1, num_heads=16, page_size=64, max_len=2000,
                           dtype=jnp.bfloat16)
    caches = jnp.stack([problem.kv_cache * (1 + 0.05 * i) for i in range(4)])
    hlo = make_step(problem.softmax_scale).lower(
        problem.query, caches, problem.block_tables, problem.seq_lens).compile().as_text()
    assert custom_call_counts(hlo)["jax_mla_sm90_schedule"] == 1
    assert custom_calls_in_loops(hlo) == ["jax_mla_sm90_decode"]


@on_gpu
def test_the_schedule_is_built_once_per_step():
    """Every layer's schedule call reads the same lengths, so XLA keeps one for the step; each
    layer's result is the one a lone call gives."""
    problem = make_problem(23, batch=5, q_len=1, num_heads=128, page_size=64, max_len=3000,
                           dtype=jnp.bfloat16)
    caches = [problem.kv_cache * (1 + 0.05 * i) for i in range(4)]

    def step(query, caches, tables, lengths):
        return [jax_mla.decode(query, cache, tables, lengths, softmax_scale=problem.softmax_scale,
                               backend=SM90, return_lse=True) for cache in caches]

    arrays = (problem.query, caches, problem.block_tables, problem.seq_lens)
    hlo = jax.jit(step).lower(*arrays).compile().as_text()
    assert custom_call_counts(hlo) == {"jax_mla_sm90_schedule": 1, "jax_mla_sm90_decode": 4}
    for cache, got in zip(caches, jax.jit(step)(*arrays)):
        lone = jax_mla.decode(problem.query, cache, problem.block_tables, problem.seq_lens,
                              softmax_scale=problem.softmax_scale, backend=SM90, return_lse=True)
        assert_identical(got, lone)


def step_program(out_dir: str) -> None:
    """Run as a subprocess by the command-buffer test: an 8-layer jitted step, saved to out_dir."""
    problem = make_problem(21, batch=16, q_len=2, num_heads=128, page_size=64, max_len=2000,
                           dtype=jnp.bfloat16)
    caches = jnp.stack([problem.kv_cache * (1 + 0.01 * i) for i in range(8)])
    step = make_step(problem.softmax_scale, output_scale=0.5)
    arrays = (problem.query, caches, problem.block_tables, problem.seq_lens)
    step(*arrays)
    outs, lses = step(*arrays)
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    np.save(path / "out.npy", np.asarray(outs, np.float32))
    np.save(path / "lse.npy", np.asarray(lses))
    ref_out, ref_lse = reference(problem, output_scale=0.5)
    print(json.dumps({"output_error": request_head_error(outs[0], ref_out),
                      "lse_error": lse_error(lses[0], ref_lse)}))


def run_step_program(out_dir: Path, xla_flags: str) -> dict:
    env = dict(os.environ, XLA_FLAGS=xla_flags,
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), str(HERE.parent),
                                                        os.environ.get("PYTHONPATH")])))
    code = "import sys, test_sm90; test_sm90.step_program(sys.argv[1])"
    result = subprocess.run([sys.executable, "-c", code, str(out_dir)], env=env, cwd=HERE.parent,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@on_gpu
def test_inside_an_xla_command_buffer(tmp_path):
    """The jitted step under XLA command buffers (CUDA graphs) equals the plain run bit for bit,
    and the decode's custom call sits inside a command buffer."""
    flags = ("--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE,CONDITIONAL "
             "--xla_gpu_graph_min_graph_size=1")
    dump = tmp_path / "dump"
    graphs = run_step_program(tmp_path / "graphs", f"{flags} --xla_dump_to={dump}")
    run_step_program(tmp_path / "plain", "--xla_gpu_enable_command_buffer=")
    for key in ("out", "lse"):
        np.testing.assert_array_equal(np.load(tmp_path / "graphs" / f"{key}.npy"),
                                      np.load(tmp_path / "plain" / f"{key}.npy"))
    assert graphs["output_error"] < OUT_TOL and graphs["lse_error"] < LSE_TOL, graphs
    assert_custom_calls_in_command_buffers(dump)


def sanitize_program() -> None:
    """One small sm90 decode and its check, then the kernels failing closed on split requests
    with foreign pages on both caches, for compute-sanitizer (.ci/sm90-check.sh)."""
    problem = make_problem(4, batch=3, q_len=2, num_heads=16, page_size=32, dtype=jnp.bfloat16)
    out, lse = sm90(problem)
    error = request_head_error(out, reference(problem)[0])
    print(json.dumps({"output_error": error}))
    assert error < OUT_TOL
    for cache in ("bf16", "fp8"):
        for num_heads, q_len in ((16, 1), (16, 2), (64, 3), (128, 1)):
            test_the_kernels_fail_closed_on_split_requests(cache, num_heads, q_len)
            print(f"ok failing closed: {cache} cache, {num_heads} heads, q_len {q_len}", flush=True)


@on_gpu
@pytest.mark.parametrize("batch,q_len,num_heads,expected", [
    (32, 1, 16, SM90), (32, 1, 128, SM90), (128, 1, 128, SM90), (256, 1, 128, SM90),
    (7, 1, 128, "fa3"), (8, 1, 16, SM90), (8, 1, 32, "fa3"), (4, 3, 16, SM90), (8, 3, 16, "fa3"),
    (8, 4, 8, SM90), (9, 4, 8, "fa3")])
def test_auto_without_a_plan_is_the_kernel_the_rule_names(batch, q_len, num_heads, expected):
    """Bit for bit the named backend's result (plan=None), under jit."""
    problem = make_problem(41, batch=batch, q_len=q_len, num_heads=num_heads, page_size=64,
                           max_len=2000, dtype=jnp.bfloat16)

    def run(backend):
        return jax.jit(lambda *a: jax_mla.decode(*a, softmax_scale=problem.softmax_scale,
                                                 backend=backend, return_lse=True))(*problem.arrays)

    assert_identical(run("auto"), run(expected))
