"""The FFI bridge where no GPU is needed: the library builds and exports its handlers, and each
GPU backend lowers to its custom call with the attributes FlashInfer's entry points expect."""

from __future__ import annotations

import ctypes
import math
import re
import sys
import types

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
    symbols = [symbol for stages in gpu.TARGETS.values() for symbol in stages.values()]
    symbols += [symbol for pair in gpu.STATE_TYPES.values() for symbol in pair]
    for symbol in symbols:
        assert hasattr(library, symbol), symbol
    with pytest.raises(AttributeError):
        library.JaxMlaDevicePlanOnHost  # the planner's host twin lives in the tests' own library


def test_schedule_layout_matches_flashinfer_mlaplan():
    """MLAPlanInfo for 132 SMs as FlashInfer 0.7.2.post1's MLAPlan lays it out.

    On a GPU, jax_mla.plan compares this layout with the one FlashInfer's planner returns and
    raises on any difference.
    """
    narrow = planning.schedule_layout(132, 1, 16, 512)
    assert narrow.plan_info[:2] == (1, 132)
    assert narrow.plan_info[2:] == (0, 65536, 131072, 196608, 197136, 197664, 198192, 198720, 199248,
                                    264784, 330320, 395856, 461392, 526928, 0, 17301504)
    assert narrow.int_workspace_bytes == 592464
    wide = planning.schedule_layout(132, 2, 128, 512)
    assert wide.plan_info[:2] == (2, 66)  # clusters of two CTAs once q_len * H > 64
    assert wide.float_workspace_bytes == 2 * 132 * 64 * (2 * 512 + 4)


def expected_layout(num_sm, q_len, num_heads, head_dim_o):
    """MLAPlan's layout written out in closed form: works arrays of 16384 int32 (64 KiB), five
    per-SM arrays rounded up to 16 bytes, then six more works arrays; float partials for two CTA
    tiles of 64 rows on each SM of every cluster (CTAs of 2 once q_len * H > 64)."""
    cluster_size = 1 if q_len * num_heads <= 64 else 2
    clusters = num_sm // cluster_size
    works = 16384 * 4
    per_sm = -(-num_sm * 4 // 16) * 16
    merge = [3 * works + k * per_sm for k in range(5)]
    per_work = [3 * works + 5 * per_sm + k * works for k in range(6)]
    rows = 2 * clusters * cluster_size * 64
    partial_o_bytes = rows * head_dim_o * 2
    plan_info = (cluster_size, clusters, 0, works, 2 * works, *merge, *per_work, 0, partial_o_bytes)
    return plan_info, 9 * works + 5 * per_sm, partial_o_bytes + rows * 4


# (q_len, num_heads) pairs on both sides of q_len * H = 64, where MLAPlan's clusters go from one
# CTA to two.
CLUSTER_BOUNDARY = [((1, 64), (1, 65)), ((2, 32), (2, 33)), ((4, 16), (5, 13)), ((8, 8), (3, 22))]


@pytest.mark.parametrize("num_sm", [132, 114, 78, 133])
@pytest.mark.parametrize("below,above", CLUSTER_BOUNDARY, ids=lambda pair: "x".join(map(str, pair)))
def test_schedule_layout_on_both_sides_of_the_cluster_boundary(num_sm, below, above):
    for (q_len, num_heads), cluster_size in ((below, 1), (above, 2)):
        for head_dim_o in (512, 256):
            layout = planning.schedule_layout(num_sm, q_len, num_heads, head_dim_o)
            plan_info, int_bytes, float_bytes = expected_layout(num_sm, q_len, num_heads, head_dim_o)
            assert layout.plan_info[0] == cluster_size, (q_len, num_heads)
            assert layout.plan_info == plan_info
            assert (layout.int_workspace_bytes, layout.float_workspace_bytes) == (int_bytes, float_bytes)


@pytest.fixture
def lowering_stubs(monkeypatch):
    """Entry-point names and SM count that a GPU would supply, so lowering runs on any machine."""
    monkeypatch.setattr(gpu, "fa_entry_points",
                        lambda b, r, p, kv="bfloat16": (f"t.{b}.{kv}.run", f"t.{b}.{kv}.plan"))
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


def run_backend(name, *arrays, plan=None, fail_closed=False, **scales):
    """One device's decode through backend ``name``, as jax_mla.decode runs it once resolved
    (without the guard of bad values unless asked: these tests read the kernel's own dataflow)."""
    return api.run_backend(backends.BY_NAME[name], *arrays, kv_lora_rank=512, device_plan=False,
                           fail_closed=fail_closed, plan=plan, **scales)


def attributes(text, target):
    line = next(line for line in text.splitlines() if f"@{target}(" in line)
    return line


def test_fa_lowering_without_a_plan(lowering_stubs):
    text = lower_for_cuda(lambda *a: run_backend("fa3", *a, softmax_scale=0.135, output_scale=1.0),
                          *SHAPES)
    call = attributes(text, "jax_mla_fa_decode_self_plan")
    layout = planning.schedule_layout(132, 2, 128, 512)
    assert 'run_fn = "t.fa3.bfloat16.run"' in call and 'plan_fn = "t.fa3.bfloat16.plan"' in call
    assert "causal = true" in call and "q_len = 2" in call and "softmax_scale = 1.350000e-01" in call
    assert "tensor<8x128x576xbf16>" in call  # [B * q_len, H, D]: the flattened token axis
    assert f"tensor<{layout.int_workspace_bytes}xui8>" in call
    assert f"tensor<{layout.float_workspace_bytes}xui8>" in call


def test_fa_lowering_with_a_plan_is_a_pure_device_call(lowering_stubs):
    layout = planning.schedule_layout(132, 2, 128, 512)
    plan = planning.Plan(jnp.zeros((layout.int_workspace_bytes,), jnp.uint8), jnp.ones((4,), jnp.int32),
                         4, 2, 128, 8, 512, layout)
    text = lower_for_cuda(lambda *a: run_backend("fa2", *a, softmax_scale=0.1, output_scale=0.5,
                                                 plan=plan), *SHAPES)
    call = attributes(text, "jax_mla_fa_decode")
    assert "plan_fn" not in call and 'run_fn = "t.fa2.bfloat16.run"' in call
    assert "stablehlo.multiply" in text  # output_scale applied after the kernel
    wrong = planning.Plan(plan.int_workspace, plan.seq_lens, 4, 2, 64, 8, 512, layout)
    with pytest.raises(ValueError, match="plan was built for .*'num_heads': 64"):
        lower_for_cuda(lambda *a: run_backend("fa3", *a, softmax_scale=0.1, output_scale=1.0,
                                              plan=wrong), *SHAPES)


@pytest.mark.parametrize("workspace", [jnp.zeros((1024,), jnp.uint8), jnp.zeros((592464,), jnp.int8)])
def test_a_plan_with_a_wrong_workspace_fails_at_trace_time(lowering_stubs, workspace):
    layout = planning.schedule_layout(132, 2, 128, 512)
    plan = planning.Plan(workspace, jnp.ones((4,), jnp.int32), 4, 2, 128, 8, 512, layout)
    message = (rf"plan.int_workspace must be uint8 \[{layout.int_workspace_bytes}\] for this schedule "
               rf"layout, got {workspace.dtype} \[{workspace.shape[0]}\]")
    with pytest.raises(planning.PlanMismatchError, match=message):
        lower_for_cuda(lambda *a: run_backend("fa3", *a, softmax_scale=0.1, output_scale=1.0,
                                              plan=plan), *SHAPES)


def dataflow(text):
    """The main function's values: {name: (op, operand names)} and the returned names."""
    values, returned = {}, []
    for line in text.splitlines():
        definition = re.match(r"\s*(%\w+)(?::\d+)? = (\S+)(.*)", line)
        if definition:
            values[definition.group(1)] = (definition.group(2), re.findall(r"%[\w#]+", definition.group(3)),
                                           definition.group(3))
        elif line.strip().startswith("return"):
            returned = re.findall(r"%[\w#]+", line)
    return values, returned


def through_casts(values, name):
    """The value ``name`` holds before reshapes and dtype converts."""
    while values[name.split("#")[0]][0] in ("stablehlo.reshape", "stablehlo.convert"):
        name = values[name.split("#")[0]][1][0]
    return name


def kernel_result_and_scale(text):
    """(which custom-call result the output comes from, the constant it is multiplied by or None)."""
    values, returned = dataflow(text)
    out = through_casts(values, returned[0])
    op, operands, _ = values[out.split("#")[0]]
    if op != "stablehlo.multiply":
        return out, None
    sources = [through_casts(values, operand) for operand in operands]
    (kernel,) = [s for s in sources if values[s.split("#")[0]][0] == "stablehlo.custom_call"]
    (factor,) = [s for s in sources if s != kernel]
    while values[factor][0] == "stablehlo.broadcast_in_dim":
        factor = values[factor][1][0]
    op, _, rest = values[factor]
    assert op == "stablehlo.constant", op
    return kernel, float(re.search(r"dense<([^>]+)>", rest).group(1))


@pytest.mark.parametrize("backend", ["fa3", "fa2"])
@pytest.mark.parametrize("output_scale", [0.5, 0.37, -3.0, 1.0])
def test_fa_output_is_the_kernels_times_output_scale(lowering_stubs, backend, output_scale):
    """fa3/fa2 kernels do not scale: the lowered program multiplies the kernel's output by exactly
    output_scale (once, not its inverse), and passes the lse through."""
    text = lower_for_cuda(lambda *a: run_backend(backend, *a, softmax_scale=0.1,
                                                 output_scale=output_scale), *SHAPES)
    values, returned = dataflow(text)
    kernel, factor = kernel_result_and_scale(text)
    assert "@jax_mla_fa_decode_self_plan" in values[kernel.split("#")[0]][2] and kernel.endswith("#0")
    assert factor == (None if output_scale == 1.0 else np.float32(output_scale))
    assert text.count("stablehlo.multiply") == (output_scale != 1.0)
    assert through_casts(values, returned[1]) == kernel.replace("#0", "#1")


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
    monkeypatch.setattr(gpu, "runtime_missing", lambda: None)
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


def fake_flashinfer(monkeypatch, version=gpu.FLASHINFER_VERSION, **backend_modules):
    """A stand-in ``flashinfer`` package in sys.modules, with the backend modules given
    (``name=module attributes``) under flashinfer.mla._batch_mla._backends."""
    package = "flashinfer.mla._batch_mla._backends"
    parts = package.split(".")
    for depth in range(1, len(parts) + 1):
        monkeypatch.setitem(sys.modules, ".".join(parts[:depth]),
                            types.ModuleType(".".join(parts[:depth])))
    sys.modules["flashinfer"].__version__ = version
    for name, attributes in backend_modules.items():
        module = types.ModuleType(f"{package}.{name}")
        module.__dict__.update(attributes)
        monkeypatch.setitem(sys.modules, module.__name__, module)


def failing(message):
    def build(*args):
        raise RuntimeError(message)
    return build


def test_a_flashinfer_of_another_version_is_refused(monkeypatch):
    fake_flashinfer(monkeypatch, version="0.6.1")
    with pytest.raises(RuntimeError, match=r"built against flashinfer-python==0.7.2.post1, found 0.6.1: "
                                           r"its C\+\+ entry points change"):
        gpu._import_flashinfer()


def test_a_failed_flashinfer_build_says_what_it_needs(monkeypatch):
    pytest.importorskip("torch")
    fake_flashinfer(monkeypatch, _fa_common=dict(get_batch_mla_module=failing("nvcc: not found")))
    with pytest.raises(RuntimeError, match=r"building FlashInfer's fa3 MLA module failed \(it needs "
                                           r"nvcc .* supports fa3\): nvcc: not found"):
        gpu.fa_entry_points.__wrapped__("fa3", 512, 64)


def test_missing_trtllm_gen_cubins_are_named(monkeypatch):
    fake_flashinfer(monkeypatch, trtllm_gen_backend=dict(
        get_trtllm_gen_fmha_module=failing("no cubin for sm_100a")))
    with pytest.raises(RuntimeError, match=r"loading FlashInfer's trtllm-gen module failed: it needs "
                                           r"its cubins .*: no cubin for sm_100a"):
        gpu.trtllm_entry_point.__wrapped__()


@pytest.mark.parametrize("flashinfer_agrees", [True, False])
def test_host_plan_checks_flashinfers_layout(monkeypatch, flashinfer_agrees):
    """jax_mla.plan uploads FlashInfer's schedule only if its layout is the one jax_mla computed."""
    monkeypatch.setattr(backends, "available_backends", lambda platform=None: ["fa3", "fa2", "xla"])
    monkeypatch.setattr(gpu, "sm_count", lambda device=None: 132)
    layout = planning.schedule_layout(132, 1, 16, 512)
    calls = []

    def planner(float_ws, int_ws, staging, qo_indptr, kv_indptr, lengths, num_heads, rank, causal):
        calls.append((list(qo_indptr), list(kv_indptr), list(lengths), num_heads, rank, causal))
        staging[:4] = 7
        info = layout.plan_info if flashinfer_agrees else (1, 66, *layout.plan_info[2:])
        return info, layout.int_workspace_bytes

    monkeypatch.setattr(gpu, "fa_plan_function", lambda backend, rank, rope: planner)
    cpu = jax.devices("cpu")[0]
    if not flashinfer_agrees:
        with pytest.raises(RuntimeError, match=r"FlashInfer's plan layout \(1, 66, .* differs from "
                                               r"jax_mla's \(1, 132, .*FlashInfer version mismatch"):
            planning.plan(np.array([5, 9]), num_heads=16, max_pages=4, device=cpu)
        return
    plan = planning.plan(np.array([5, 9]), num_heads=16, max_pages=4, device=cpu)
    assert calls == [([0, 1, 2], [0, 4, 8], [5, 9], 16, 512, False)]
    assert (plan.batch, plan.q_len, plan.num_heads, plan.max_pages, plan.layout) == (2, 1, 16, 4, layout)
    assert np.asarray(plan.int_workspace)[:5].tolist() == [7, 7, 7, 7, 0]


def test_a_plan_of_the_wrong_type_is_rejected():
    with pytest.raises(TypeError, match=r"plan must be None, 'device' or a jax_mla.Plan.*'host'"):
        api.check_plan_argument("host", backends.BY_NAME["fa3"])


@pytest.mark.parametrize("seq_lens,kwargs,error,message", [
    (jnp.ones((4,), jnp.int32), {}, None, None),
    (np.ones((2, 2), np.int32), {}, ValueError, r"seq_lens must be a non-empty 1-D integer array"),
    (np.ones((4,), np.float32), {}, ValueError, r"non-empty 1-D integer array, got shape \(4,\) dtype float32"),
    (np.ones((4,), np.int32), dict(num_heads=0), ValueError, r"num_heads must be >= 1, got 0"),
    (np.ones((4,), np.int32), dict(q_len=True), TypeError, r"q_len must be an int, got bool"),
    (np.ones((4,), np.int32), dict(max_pages=4.0), TypeError, r"max_pages must be an int, got float"),
    (np.array([1, 5]), dict(q_len=2), ValueError, r"every seq_lens entry must be >= q_len=2"),
    (np.array([3, 5]), {}, ValueError, r"jax_mla.plan builds the fa3/fa2 schedule on a CUDA GPU; this "
                                       r"process has none \(platform cpu\)"),
])
def test_plan_rejects(seq_lens, kwargs, error, message):
    args = dict(num_heads=16, max_pages=4, q_len=1)
    args.update(kwargs)
    if error is None:  # a traced array: the host plan must be built outside jit
        with pytest.raises(TypeError, match="seq_lens must be host values"):
            jax.jit(lambda sl: planning.plan(sl, **args)).trace(seq_lens)
        return
    if "CUDA GPU" in message and jax.default_backend() != "cpu":
        pytest.skip("only meaningful on a CPU-only machine")
    with pytest.raises(error, match=message):
        planning.plan(seq_lens, **args)


def test_another_flashinfer_version_makes_the_gpu_backends_unavailable(monkeypatch, tmp_path):
    library = tmp_path / gpu.LIBRARY_NAME
    library.touch()
    monkeypatch.setenv("JAX_MLA_FFI_LIB", str(library))
    monkeypatch.setattr(gpu.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(gpu.importlib.metadata, "version", lambda name: "0.6.0")
    assert gpu.runtime_missing() == ("flashinfer-python 0.6.0 is installed but jax_mla is built "
                                     "against 0.7.2.post1 (pip install 'jax_mla[cuda]')")
    monkeypatch.setattr(gpu.importlib.metadata, "version", lambda name: gpu.FLASHINFER_VERSION)
    assert gpu.runtime_missing() is None
