"""The FFI bridge where no GPU is needed: the library builds and exports its handlers, and each
GPU backend lowers to its custom call with the attributes FlashInfer's entry points expect."""

from __future__ import annotations

import ctypes
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import HAS_TVM_FFI

from jax_mla import api, backends, gpu, planning


@pytest.mark.skipif(not HAS_TVM_FFI, reason="apache-tvm-ffi provides the runtime the library links to")
def test_library_exports_every_handler(ffi_library_path):
    import tvm_ffi  # noqa: F401  (loads libtvm_ffi.so, which the library resolves by soname)

    library = ctypes.CDLL(str(ffi_library_path))
    for symbol in gpu.TARGETS.values():
        assert getattr(library, symbol) is not None


def test_schedule_layout_matches_flashinfer_mlaplan():
    """MLAPlanInfo for 132 SMs as FlashInfer 0.7.2.post1's MLAPlan lays it out.

    On a GPU, jax_mla.plan compares this layout with the one FlashInfer's planner returns and
    raises on any difference (it matched on the H200 for H in {16, 128}, q_len in {1, 2}).
    """
    narrow = planning.schedule_layout(132, 1, 16, 512)
    assert narrow.plan_info[:2] == (1, 132)
    assert narrow.plan_info[2:] == (0, 65536, 131072, 196608, 197136, 197664, 198192, 198720, 199248,
                                    264784, 330320, 395856, 461392, 526928, 0, 17301504)
    assert narrow.int_workspace_bytes == 592464
    wide = planning.schedule_layout(132, 2, 128, 512)
    assert wide.plan_info[:2] == (2, 66)  # clusters of two CTAs once q_len * H > 64
    assert wide.float_workspace_bytes == 2 * 132 * 64 * (2 * 512 + 4)


@pytest.fixture
def lowering_stubs(monkeypatch):
    """Entry-point names and SM count that a GPU would supply, so lowering runs on any machine."""
    monkeypatch.setattr(gpu, "fa_entry_points", lambda b, r, p: (f"t.{b}.run", f"t.{b}.plan"))
    monkeypatch.setattr(gpu, "trtllm_entry_point", lambda: "t.trtllm")
    monkeypatch.setattr(gpu, "sm_count", lambda device=None: 132)
    monkeypatch.setattr(gpu, "register_targets", lambda: None)


def lower_for_cuda(fn, *shapes):
    return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


SHAPES = (
    jax.ShapeDtypeStruct((4, 2, 128, 576), jnp.bfloat16),
    jax.ShapeDtypeStruct((64, 64, 576), jnp.bfloat16),
    jax.ShapeDtypeStruct((4, 8), jnp.int32),
    jax.ShapeDtypeStruct((4,), jnp.int32),
)


def run_backend(name, *arrays, plan=None, **scales):
    """One device's decode through backend ``name``, as jax_mla.decode runs it once resolved."""
    return api.run_backend(backends.BY_NAME[name], *arrays, kv_lora_rank=512, device_plan=False,
                           plan=plan, **scales)


def attributes(text, target):
    line = next(line for line in text.splitlines() if f"@{target}(" in line)
    return line


def test_fa_lowering_without_a_plan(lowering_stubs):
    text = lower_for_cuda(lambda *a: run_backend("fa3", *a, softmax_scale=0.135, output_scale=1.0),
                          *SHAPES)
    call = attributes(text, "jax_mla_fa_decode_self_plan")
    layout = planning.schedule_layout(132, 2, 128, 512)
    assert 'run_fn = "t.fa3.run"' in call and 'plan_fn = "t.fa3.plan"' in call
    assert "causal = true" in call and "q_len = 2" in call and "softmax_scale = 1.350000e-01" in call
    assert "tensor<8x128x576xbf16>" in call  # [B * q_len, H, D]: the flattened token axis
    assert f"tensor<{layout.int_workspace_bytes}xui8>" in call
    assert f"tensor<{layout.float_workspace_bytes}xui8>" in call


def test_fa_lowering_with_a_plan_is_a_pure_device_call(lowering_stubs):
    layout = planning.schedule_layout(132, 2, 128, 512)
    plan = planning.Plan(jnp.zeros((layout.int_workspace_bytes,), jnp.uint8), 4, 2, 128, 8, 512, layout)
    text = lower_for_cuda(lambda *a: run_backend("fa2", *a, softmax_scale=0.1, output_scale=0.5,
                                                 plan=plan), *SHAPES)
    call = attributes(text, "jax_mla_fa_decode")
    assert "plan_fn" not in call and 'run_fn = "t.fa2.run"' in call
    assert "stablehlo.multiply" in text  # output_scale applied after the kernel
    wrong = planning.Plan(plan.int_workspace, 4, 2, 64, 8, 512, layout)
    with pytest.raises(ValueError, match="plan was built for .*'num_heads': 64"):
        lower_for_cuda(lambda *a: run_backend("fa3", *a, softmax_scale=0.1, output_scale=1.0,
                                              plan=wrong), *SHAPES)


def test_trtllm_lowering_carries_flashinfer_scales(lowering_stubs):
    text = lower_for_cuda(lambda *a: run_backend("trtllm-gen", *a, softmax_scale=0.135,
                                                 output_scale=0.5), *SHAPES)
    call = attributes(text, "jax_mla_trtllm_decode")
    assert "softmax_scale = 1.350000e-01" in call and "output_scale = 5.000000e-01" in call
    assert "stablehlo.multiply" not in text  # the kernel applies output_scale itself
    assert "max_seq_len = 512" in call and "sm_count = 132" in call and "enable_pdl = true" in call
    counter = gpu.trtllm_counter_bytes(4, 128, 132)
    assert counter == math.ceil(512 / 8) * 8 * 4 and f"tensor<{counter}xui8>" in call
    assert f"tensor<{gpu.TRTLLM_WORKSPACE_BYTES}xui8>" in call
    assert "tensor<4x2x128x512xbf16>" in call


@pytest.mark.parametrize("shapes,message", [
    (((4, 1, 128, 576), (8, 16, 576)), r"page_size in \(32, 64\), got 16"),
    (((4, 1, 96, 576), (8, 64, 576)), r"num_heads <= 64 or exactly 128, got 96"),
    (((4, 1, 16, 448), (8, 64, 448)), r"\(kv_lora_rank, rope_dim\) in .*got \(384, 64\)"),
])
def test_trtllm_rejects_unsupported_shapes(shapes, message):
    query = jax.ShapeDtypeStruct(shapes[0], jnp.bfloat16)
    cache = jax.ShapeDtypeStruct(shapes[1], jnp.bfloat16)
    with pytest.raises(ValueError, match=message):
        gpu.check_trtllm_shapes(query, cache, shapes[0][-1] - 64)


def test_gpu_backends_need_bfloat16(monkeypatch):
    monkeypatch.setattr(backends, "available_backends", lambda platform=None: ["fa3", "fa2", "xla"])
    with pytest.raises(TypeError, match="backend 'fa3' needs query and kv_cache of dtype bfloat16, "
                                        "got float32"):
        backends.resolve("fa3", "gpu", jnp.float32)
    assert backends.resolve("auto", "gpu", jnp.float32) == "xla"


def test_missing_library_names_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("JAX_MLA_FFI_LIB", str(tmp_path / "absent.so"))
    assert gpu.library_path() is None
    with pytest.raises(RuntimeError, match=r"FFI library is not built.*JAX_MLA_FFI_LIB"):
        gpu.register_targets.__wrapped__()


def test_missing_flashinfer_names_the_package(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import fails as if not installed
    with pytest.raises(RuntimeError, match=r"flashinfer-python==0.7.2.post1.*jax_mla\[cuda\]"):
        gpu._import_flashinfer()


def test_a_plan_of_the_wrong_type_is_rejected():
    with pytest.raises(TypeError, match=r"plan must be None, 'device' or a jax_mla.Plan.*'host'"):
        api.check_plan_argument("host", backends.BY_NAME["fa3"])


@pytest.mark.parametrize("seq_lens,kwargs,error,message", [
    (jnp.ones((4,), jnp.int32), {}, None, None),
    (np.ones((2, 2), np.int32), {}, ValueError, r"seq_lens must be a non-empty 1-D integer array"),
    (np.ones((4,), np.float32), {}, ValueError, r"non-empty 1-D integer array, got shape \(4,\) dtype float32"),
    (np.ones((4,), np.int32), dict(num_heads=0), ValueError, r"num_heads must be a positive int, got 0"),
    (np.array([1, 5]), dict(q_len=2), ValueError, r"every seq_lens entry must be >= q_len=2"),
    (np.array([3, 5]), {}, ValueError, r"jax_mla.plan needs a GPU that runs fa3 or fa2; available here"),
])
def test_plan_rejects(seq_lens, kwargs, error, message):
    args = dict(num_heads=16, max_pages=4, q_len=1)
    args.update(kwargs)
    if error is None:  # a traced array: the host plan must be built outside jit
        with pytest.raises(TypeError, match="seq_lens must be host values"):
            jax.jit(lambda sl: planning.plan(sl, **args)).trace(seq_lens)
        return
    if "needs a GPU" in message and jax.default_backend() != "cpu":
        pytest.skip("only meaningful on a CPU-only machine")
    with pytest.raises(error, match=message):
        planning.plan(seq_lens, **args)
