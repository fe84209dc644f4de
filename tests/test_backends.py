"""The backend table: what "auto" picks on each architecture, and the rules every backend shares."""

from __future__ import annotations

import re
import warnings

import jax
import jax.numpy as jnp
import pytest
from conftest import lse_error, make_problem, record_kernel_runs, request_head_error, tolerances

import jax_mla
from jax_mla import api, backends, gpu, xla_backend
from jax_mla.reference import reference_from_jax


@pytest.mark.parametrize("capability,expected", [
    ((8, 0), ["fa2", "xla"]),
    ((8, 9), ["fa2", "xla"]),
    ((9, 0), ["fa3", "fa2", "sm90", "xla"]),
    ((10, 0), ["trtllm-gen", "fa2", "xla"]),
    ((10, 3), ["trtllm-gen", "fa2", "xla"]),
    ((12, 0), ["fa2", "xla"]),
    ((7, 5), ["xla"]),
    (None, ["xla"]),
])
def test_preference_order_per_architecture(capability, expected):
    assert backends.runnable_on(capability) == expected


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA platform whose GPU has the capability the test sets, with the runtime installed."""
    state = {"capability": (9, 0)}
    monkeypatch.setattr(gpu, "runtime_missing", lambda: None)
    monkeypatch.setattr(gpu, "capability", lambda device=None: state["capability"])
    return state


@pytest.mark.parametrize("capability,auto", [
    ((8, 0), "fa2"), ((9, 0), "fa3"), ((10, 0), "trtllm-gen"), ((10, 3), "trtllm-gen"), ((12, 0), "fa2"),
])
def test_auto_on_each_gpu(fake_gpu, capability, auto):
    fake_gpu["capability"] = capability
    assert backends.resolve("auto", "gpu", jnp.bfloat16) == auto
    assert backends.available_backends("gpu")[0] == auto
    assert backends.resolve("auto", "gpu", jnp.float32) == "xla"  # the GPU kernels take bf16 only


@pytest.mark.parametrize("capability,auto", [
    ((8, 0), "fa2"), ((9, 0), "fa3"), ((10, 0), "fa2"), ((10, 3), "fa2"), ((12, 0), "fa2"),
])
def test_auto_with_a_plan_takes_a_backend_that_reads_it(monkeypatch, fake_gpu, capability, auto):
    fake_gpu["capability"] = capability
    monkeypatch.setattr(gpu, "sm90_missing", lambda: None)
    assert backends.resolve("auto", "gpu", jnp.bfloat16, plan_kind=backends.FA_PLAN) == auto
    with pytest.raises(ValueError, match=r"^plan is only read by the fa3/fa2 backends, and "
                                         r"backend='auto' cannot take either here: backend "
                                         r"'fa3' needs an NVIDIA GPU .* on 'cpu'; .*available here: "
                                         r"\['xla'\]$"):
        backends.resolve("auto", "cpu", jnp.bfloat16, plan_kind=backends.FA_PLAN)
    # An Sm90Plan: sm90 on Hopper on either cache, even where "auto" without a plan would not
    # take it; elsewhere an error that says why.
    for cache_format in (backends.FLOAT_CACHE, backends.FP8_CACHE):
        if capability == (9, 0):
            assert backends.resolve("auto", "gpu", jnp.bfloat16, cache_format,
                                    plan_kind=backends.SM90_PLAN) == "sm90"
            continue
        with pytest.raises(ValueError, match=r"^a jax_mla.Sm90Plan is only read by the sm90 "
                                             r"backend, and .*: backend 'sm90' runs on SM90 "):
            backends.resolve("auto", "gpu", jnp.bfloat16, cache_format,
                             plan_kind=backends.SM90_PLAN)


def test_auto_with_a_plan_says_which_format_a_reader_does_not_take_on_this_gpu(fake_gpu):
    """On SM80, fa2 takes the e4m3 cache only on SM90 (and fa3 does not run): "auto" with a Plan
    names both reasons."""
    fake_gpu["capability"] = (8, 0)
    with pytest.raises(ValueError, match=r"^plan is only read by the fa3/fa2 backends, and "
                                         r"backend='auto' cannot take either here: backend 'fa3' "
                                         r"runs on SM90 .*; backend 'fa2' does not take the e4m3 "
                                         r"cache \(float8_e4m3fn\) on this GPU; available here"):
        backends.resolve("auto", "gpu", jnp.bfloat16, backends.E4M3_CACHE,
                         plan_kind=backends.FA_PLAN)


def test_auto_with_an_sm90_plan_says_why_sm90_cannot_take_the_arguments(fake_gpu, monkeypatch):
    monkeypatch.setattr(gpu, "sm90_missing", lambda: None)
    takes = "backend 'sm90' takes bfloat16 queries with caches of the query's dtype or the fp8 cache"
    for dtype, cache_format, given in [
        (jnp.float32, backends.FLOAT_CACHE, "a float32 query with a float32 cache"),
        (jnp.bfloat16, backends.E4M3_CACHE, "a bfloat16 query with the e4m3 cache"),
    ]:
        with pytest.raises(ValueError, match=rf"{re.escape(takes)} \(uint8\), not "
                                             rf"{re.escape(given)}"):
            backends.resolve("auto", "gpu", dtype, cache_format, plan_kind=backends.SM90_PLAN)


BLACKWELL_BACKENDS = ("trtllm-gen", "fa2", "xla")


@pytest.mark.parametrize("page_size,num_heads,expected", [
    (64, 16, "trtllm-gen"), (32, 128, "trtllm-gen"), (16, 16, "fa2"), (64, 96, "fa2"),
])
def test_auto_on_blackwell_takes_fa2_where_trtllm_gen_does_not_run_the_shapes(
        monkeypatch, page_size, num_heads, expected):
    """trtllm-gen runs pages of 32 or 64 and up to 64 or exactly 128 heads; "auto" gives a device
    whose shard it does not run to fa2, the next row, instead of refusing the call."""
    ran = record_kernel_runs(monkeypatch, BLACKWELL_BACKENDS, available=BLACKWELL_BACKENDS)
    problem = make_problem(4, batch=2, q_len=1, num_heads=num_heads, page_size=page_size,
                           dtype=jnp.bfloat16)
    monkeypatch.setattr(backends, "platform_of", lambda *arrays: "gpu")
    assert jax_mla.backend_for(*problem.arrays[:3]) == expected
    jax_mla.decode(*problem.arrays, softmax_scale=problem.softmax_scale)
    assert ran == [expected]
    if expected == "fa2":  # named, trtllm-gen still refuses the shapes
        with pytest.raises(ValueError, match="trtllm-gen (needs|supports)"):
            jax_mla.backend_for(*problem.arrays[:3], backend="trtllm-gen")


def test_auto_on_cpu():
    assert backends.resolve("auto", "cpu", jnp.bfloat16) == "xla"
    assert backends.available_backends("cpu") == ["xla"]


def test_available_backends_names_a_platform_jax_knows():
    assert backends.available_backends("CPU") == ["xla"]
    with pytest.raises(TypeError, match="platform must be a str, one of .*got int"):
        backends.available_backends(3)
    with pytest.raises(ValueError, match="platform must be one of .*got 'gpuu'"):
        backends.available_backends("gpuu")


def test_available_backends_reads_the_platform_in_any_case(monkeypatch):
    monkeypatch.setattr(gpu, "runtime_missing", lambda: None)
    monkeypatch.setattr(gpu, "sm90_missing", lambda: None)
    monkeypatch.setattr(gpu, "capability", lambda device=None: (9, 0))
    hopper = ["fa3", "fa2", "sm90", "xla"]
    assert backends.available_backends("gpu") == backends.available_backends("GPU") == hopper
    assert backends.available_backends("CUDA") == hopper


def test_gpu_without_the_runtime_offers_only_xla(monkeypatch):
    monkeypatch.setattr(gpu, "runtime_missing", lambda: "flashinfer-python is not installed")
    monkeypatch.setattr(gpu, "capability", lambda device=None: (9, 0))
    assert backends.available_backends("gpu") == ["xla"]
    with pytest.warns(RuntimeWarning, match=r"'auto' runs the xla backend on this GPU, many times "
                                            r"slower .* because flashinfer-python is not installed"):
        assert backends.resolve("auto", "gpu") == "xla"
    with pytest.warns(RuntimeWarning, match="because flashinfer-python"):  # sm90 takes it on Hopper
        assert backends.resolve("auto", "gpu", jnp.bfloat16, backends.FP8_CACHE) == "xla"
    with warnings.catch_warnings():  # no GPU kernel takes float32: xla is the choice, not a fallback
        warnings.simplefilter("error")
        assert backends.resolve("auto", "gpu", jnp.float32) == "xla"
        monkeypatch.setattr(gpu, "capability", lambda device=None: (8, 0))
        assert backends.resolve("auto", "gpu", jnp.bfloat16, backends.FP8_CACHE) == "xla"
    with pytest.raises(ValueError, match=r"backend 'fa3' is unavailable: flashinfer-python is not "
                                         r"installed; available here: \['xla'\]"):
        backends.resolve("fa3", "gpu")


def test_a_backend_the_gpu_cannot_run_names_the_capability(fake_gpu):
    fake_gpu["capability"] = (8, 0)
    with pytest.raises(ValueError, match=r"backend 'fa3' runs on SM90 \(H100, H200\) and cannot run "
                                         r"on this GPU \(compute capability 8.0\); available here: "
                                         r"\['fa2', 'xla'\]"):
        backends.resolve("fa3", "gpu")


@pytest.mark.parametrize("backend", [None, 3, ("fa3",)])
def test_backend_must_be_a_string(backend):
    with pytest.raises(TypeError, match=r"backend must be a str .* got "
                                        + type(backend).__name__):
        backends.resolve(backend, "cpu")


def test_plans_compare_and_hash_by_identity():
    """A plan holds arrays, whose == is elementwise: plans are equal only to themselves."""
    make = lambda: jax_mla.Sm90Plan(jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32), 2, 4, 64)
    plan, twin = make(), make()
    assert plan == plan and plan != twin and plan in [twin, plan] and len({plan, twin}) == 2
    assert jax.tree_util.tree_map(lambda x: x, plan) != plan
    assert jax_mla.Plan.__eq__ is object.__eq__ and jax_mla.Plan.__hash__ is object.__hash__


def test_every_backend_shares_one_plan_rule():
    """fa3 and fa2 read the fa3/fa2 schedule ("device" or a Plan), sm90 its own (an Sm90Plan), the
    others none; every other pairing is refused, naming what the backend takes."""
    readers = {kind: sorted(b.name for b in backends.TABLE if b.reads_plan == kind)
               for kind in (backends.FA_PLAN, backends.SM90_PLAN)}
    assert readers == {backends.FA_PLAN: ["fa2", "fa3"], backends.SM90_PLAN: ["sm90"]}
    sm90_plan = jax_mla.Sm90Plan(jnp.zeros((3,), jnp.int32), jnp.zeros((2,), jnp.int32), 2, 4, 64)
    for backend in backends.TABLE:
        for plan, kind in (("device", backends.FA_PLAN), (sm90_plan, backends.SM90_PLAN)):
            if backend.reads_plan == kind:
                api.check_plan_argument(plan, backend)
                continue
            other = f" or a {backend.reads_plan}" if backend.reads_plan else ""
            with pytest.raises(ValueError, match=rf"backend '{backend.name}' takes plan=None"
                                                 rf"{re.escape(other)}, got {type(plan).__name__}"):
                api.check_plan_argument(plan, backend)
    with pytest.raises(ValueError, match=r"^a jax_mla.Sm90Plan is only read by the sm90 backend; "
                                         r"backend 'fa3' takes plan=None or a jax_mla.Plan, got "
                                         r"Sm90Plan$"):
        api.check_plan_argument(sm90_plan, backends.BY_NAME["fa3"])


@pytest.fixture
def stand_in_kernels(monkeypatch):
    """fa3, fa2 and trtllm-gen runnable here, their kernels replaced by the xla backend: unscaled
    for fa3/fa2 (whose kernels leave output_scale to jax_mla.decode), scaled for trtllm-gen (whose
    kernel applies it)."""
    monkeypatch.setattr(backends, "available_backends",
                        lambda platform=None: ["trtllm-gen", "fa3", "fa2", "xla"])

    def fa_decode(name, *arrays, softmax_scale, kv_lora_rank, plan):
        return xla_backend.decode(*arrays, softmax_scale=softmax_scale, output_scale=1.0,
                                  kv_lora_rank=kv_lora_rank, return_lse=True)

    def trtllm_decode(*arrays, softmax_scale, output_scale, kv_lora_rank):
        return xla_backend.decode(*arrays, softmax_scale=softmax_scale, output_scale=output_scale,
                                  kv_lora_rank=kv_lora_rank, return_lse=True)

    monkeypatch.setattr(gpu, "fa_decode", fa_decode)
    monkeypatch.setattr(gpu, "trtllm_decode", trtllm_decode)


@pytest.mark.parametrize("backend", ["fa3", "fa2", "trtllm-gen"])
@pytest.mark.parametrize("output_scale", [0.5, 0.37, -2.0])
def test_every_backend_scales_the_output_once(stand_in_kernels, backend, output_scale):
    """jax_mla.decode's output is output_scale times the attention, whether the kernel or the
    wrapper applies the scale."""
    problem = make_problem(3, batch=2, q_len=2, num_heads=16, page_size=32, dtype=jnp.bfloat16)
    out, lse = jax_mla.decode(*problem.arrays, softmax_scale=problem.softmax_scale,
                              output_scale=output_scale, backend=backend, return_lse=True)
    ref_out, ref_lse = reference_from_jax(*problem.arrays, softmax_scale=problem.softmax_scale,
                                          output_scale=output_scale)
    out_tol, lse_tol = tolerances(backends.XLA, jnp.bfloat16)
    assert request_head_error(out, ref_out.numpy()) < out_tol
    assert lse_error(lse, ref_lse.numpy()) < lse_tol
