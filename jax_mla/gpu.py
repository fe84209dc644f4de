"""The GPU bridge: jax_mla's XLA FFI library, FlashInfer's compiled entry points, the custom calls.

Every GPU backend is an XLA custom call into ``libjax_mla_ffi.so`` (built from ``ffi/``). The fa3,
fa2 and trtllm-gen handlers call FlashInfer's kernels: this module loads FlashInfer's modules once,
publishes their entry points in TVM-FFI's global registry, and passes the names as custom-call
attributes, so the handlers find them at execute time and no Python runs inside a decode call.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import importlib.util
import math
import os
import sysconfig
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla import e4m3_cache, fp8_cache, planning, validation

LIBRARY_NAME = "libjax_mla_ffi.so"
# XLA custom-call target name -> exported handler symbol of each stage.
TARGETS = {
    "jax_mla_fa_decode": {"execute": "JaxMlaFaDecode"},
    "jax_mla_fa_decode_self_plan": {"instantiate": "JaxMlaFaDecodeSelfPlanInstantiate",
                                    "execute": "JaxMlaFaDecodeSelfPlan"},
    "jax_mla_trtllm_decode": {"execute": "JaxMlaTrtllmDecode"},
    "jax_mla_trtllm_decode_fp8": {"execute": "JaxMlaTrtllmDecodeFp8"},
    "jax_mla_device_plan": {"execute": "JaxMlaDevicePlan"},
    "jax_mla_sm90_schedule": {"execute": "JaxMlaSm90Schedule"},
    "jax_mla_sm90_decode": {"execute": "JaxMlaSm90Decode"},
    "jax_mla_sm90_decode_fp8": {"execute": "JaxMlaSm90DecodeFp8"},
}
# Targets a library may have been built without (ffi/CMakeLists.txt skips the sm90 handler without
# CUTLASS headers, with nvcc < 12.5 or JAX_MLA_BUILD_SM90=OFF): register_targets skips them,
# sm90_missing() says why.
OPTIONAL_TARGETS = ("jax_mla_sm90_schedule", "jax_mla_sm90_decode", "jax_mla_sm90_decode_fp8")
# ffi::State types of the handlers: name -> symbols returning its type id and type info.
STATE_TYPES = {
    "jax_mla_plan_staging": ("JaxMlaPlanStagingTypeId", "JaxMlaPlanStagingTypeInfo"),
}
FLASHINFER_VERSION = "0.7.2.post1"
TRTLLM_WORKSPACE_BYTES = 128 * 1024 * 1024  # what FlashInfer and vLLM give trtllm-gen
TRTLLM_PAGE_SIZES = (32, 64)
TRTLLM_DIMS = ((512, 64), (256, 64))  # (kv_lora_rank, rope_dim)


# ---- the machine ---------------------------------------------------------------------------------

def capability(device=None) -> tuple[int, int]:
    """Compute capability (major, minor) of ``device`` (default: the first CUDA device)."""
    device = device or jax.devices("gpu")[0]
    major, minor = str(device.compute_capability).split(".")
    return int(major), int(minor)


def sm_count(device=None) -> int:
    """Streaming multiprocessors of ``device`` (default: the first CUDA device)."""
    if device is None:
        device = jax.devices("gpu")[0]
    elif not isinstance(device, jax.Device) or device.platform != "gpu":
        raise ValueError(f"device must be a CUDA jax.Device (e.g. jax.devices('gpu')[0]), got "
                         f"{device!r}")
    return int(device.core_count)


def library_path() -> Path | None:
    """The FFI library: $JAX_MLA_FFI_LIB, else next to this package (regular or editable install)."""
    override = os.environ.get("JAX_MLA_FFI_LIB")
    if override:
        return Path(override) if Path(override).is_file() else None
    candidates = [Path(__file__).with_name(LIBRARY_NAME)]
    for scheme_path in ("platlib", "purelib"):
        candidates.append(Path(sysconfig.get_paths()[scheme_path]) / "jax_mla" / LIBRARY_NAME)
    return next((path for path in candidates if path.is_file()), None)


def runtime_missing() -> str | None:
    """Why the GPU backends cannot run in this environment, or None when they can."""
    if library_path() is None:
        return ("jax_mla's FFI library was not built (reinstall jax_mla on a machine with nvcc and "
                "the CUDA toolkit, or set JAX_MLA_FFI_LIB)")
    for module, package in (("flashinfer", "flashinfer-python"), ("tvm_ffi", "apache-tvm-ffi")):
        if importlib.util.find_spec(module) is None:
            return f"{package} is not installed (pip install 'jax_mla[cuda]')"
    found = _installed_version("flashinfer-python")
    if found is not None and found != FLASHINFER_VERSION:
        return (f"flashinfer-python {found} is installed but jax_mla is built against "
                f"{FLASHINFER_VERSION} (pip install 'jax_mla[cuda]')")
    return None


def _installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:  # importable without metadata (a source tree)
        return None


@functools.cache
def register_targets() -> None:
    """Load the library (after TVM-FFI, whose runtime it links to) and register every target."""
    import tvm_ffi  # noqa: F401  loads libtvm_ffi.so globally, which the library resolves by soname

    path = library_path()
    if path is None:
        raise RuntimeError("jax_mla's FFI library is not built: reinstall jax_mla where nvcc and the "
                           "CUDA toolkit are available (pip install 'jax_mla[cuda]'), or set "
                           "JAX_MLA_FFI_LIB to a built libjax_mla_ffi.so")
    library = ctypes.CDLL(str(path))
    for name, symbols in STATE_TYPES.items():  # before the handlers that keep such state
        type_id, type_info = (getattr(library, symbol) for symbol in symbols)
        type_id.restype = type_info.restype = ctypes.c_void_p
        jax.ffi.register_ffi_type(name, {"type_id": jax.ffi.pycapsule(type_id()),
                                         "type_info": jax.ffi.pycapsule(type_info())},
                                  platform="CUDA")
    for target, stages in TARGETS.items():
        if target in OPTIONAL_TARGETS and not all(hasattr(library, s) for s in stages.values()):
            continue
        handlers = {stage: jax.ffi.pycapsule(getattr(library, symbol))
                    for stage, symbol in stages.items()}
        jax.ffi.register_ffi_target(target, handlers, platform="CUDA")


# ---- FlashInfer's entry points -------------------------------------------------------------------

def _import_flashinfer():
    try:
        import flashinfer
    except ImportError as error:
        raise RuntimeError(f"the GPU backends need flashinfer-python=={FLASHINFER_VERSION} and "
                           "apache-tvm-ffi: pip install 'jax_mla[cuda]'") from error
    if flashinfer.__version__ != FLASHINFER_VERSION:
        raise RuntimeError(f"jax_mla is built against flashinfer-python=={FLASHINFER_VERSION}, found "
                           f"{flashinfer.__version__}: its C++ entry points change between releases")
    return flashinfer


def _publish(name: str, function) -> str:
    import tvm_ffi

    tvm_ffi.register_global_func(name, function, override=True)
    return name


@functools.cache
def fa_entry_points(backend: str, kv_lora_rank: int, rope_dim: int,
                    kv_dtype: str = "bfloat16") -> tuple[str, str]:
    """Global names of the (run, plan) functions of FlashInfer's ``backend`` batch-MLA module for
    a bf16 query and a cache of ``kv_dtype`` ("bfloat16", or "float8_e4m3fn" for the e4m3
    cache).

    FlashInfer JIT-compiles the module with nvcc on first use and caches it under
    ``~/.cache/flashinfer``.
    """
    import torch

    _import_flashinfer()
    from flashinfer.mla._batch_mla._backends._fa_common import get_batch_mla_module

    try:
        module = get_batch_mla_module(backend, torch.bfloat16, getattr(torch, kv_dtype),
                                      torch.bfloat16, torch.int32, kv_lora_rank, rope_dim, False)
    except Exception as error:  # nvcc missing, wrong arch, compile failure
        raise RuntimeError(f"building FlashInfer's {backend} MLA module failed (it needs nvcc from the "
                           f"CUDA toolkit and a GPU that supports {backend}): {error}") from error
    raw = getattr(module, "_module", module)  # past FlashInfer's torch staging proxy
    prefix = f"jax_mla.{backend}.mla_{kv_lora_rank}_{rope_dim}_{kv_dtype}"
    return _publish(f"{prefix}.run", raw.run), _publish(f"{prefix}.plan", raw.plan)


@functools.cache
def fa_plan_function(backend: str, kv_lora_rank: int, rope_dim: int):
    """FlashInfer's host planner for ``backend`` as a callable (used by ``jax_mla.plan``)."""
    import tvm_ffi

    return tvm_ffi.get_global_func(fa_entry_points(backend, kv_lora_rank, rope_dim)[1])


@functools.cache
def trtllm_entry_point() -> str:
    """Global name of FlashInfer's trtllm-gen paged-attention decode (SM100/SM103)."""
    _import_flashinfer()
    from flashinfer.mla._batch_mla._backends.trtllm_gen_backend import get_trtllm_gen_fmha_module

    try:
        module = get_trtllm_gen_fmha_module()
    except Exception as error:
        raise RuntimeError("loading FlashInfer's trtllm-gen module failed: it needs its cubins "
                           "(flashinfer-cubin matching flashinfer-python, or FLASHINFER_CUBIN_DIR): "
                           f"{error}") from error
    return _publish("jax_mla.trtllm_gen.decode", module.trtllm_paged_attention_decode)


# ---- the custom calls ----------------------------------------------------------------------------

def check_plan(plan: planning.Plan, batch, q_len, num_heads, max_pages, kv_lora_rank, layout) -> None:
    """Raise ``PlanMismatchError`` unless ``plan`` was built for this call's shapes."""
    expected = dict(batch=batch, q_len=q_len, num_heads=num_heads, max_pages=max_pages,
                    kv_lora_rank=kv_lora_rank)
    actual = {name: getattr(plan, name) for name in expected}
    if actual != expected or plan.layout != layout:
        raise planning.PlanMismatchError(
            f"plan was built for {actual} but decode got {expected}; build the plan with "
            "the step's seq_lens, local head count and block-table width")
    plan.check_arrays()


def fa_decode(backend: str, query, kv_cache, block_tables, seq_lens, *, softmax_scale: float,
              kv_lora_rank: int, plan: planning.Plan | None):
    """FlashInfer's fa3 or fa2 kernel.

    Args:
      backend: "fa3" or "fa2".
      query: bf16 [B, q_len, H, D]; kv_cache: bf16 or float8_e4m3fn (the e4m3 cache, its scale
        already folded into ``softmax_scale`` and the output scale) [num_pages, page_size, D];
        block_tables: int32 [B, max_pages]; seq_lens: int32 [B] (D = kv_lora_rank + rope_dim).
      plan: the step's schedule, or None to plan inside the call (reads ``seq_lens`` back to the
        host, so the call cannot join a CUDA graph).
    Returns:
      out bf16 [B, q_len, H, kv_lora_rank] and lse float32 [B, q_len, H].
    """
    register_targets()
    batch, q_len, num_heads, head_dim = query.shape
    rope_dim = head_dim - kv_lora_rank
    max_pages = block_tables.shape[1]
    run_fn, plan_fn = fa_entry_points(backend, kv_lora_rank, rope_dim,
                                      jnp.dtype(kv_cache.dtype).name)
    layout = planning.schedule_layout(sm_count(), q_len, num_heads, kv_lora_rank)
    tokens = batch * q_len
    results = [
        jax.ShapeDtypeStruct((tokens, num_heads, kv_lora_rank), query.dtype),
        jax.ShapeDtypeStruct((tokens, num_heads), jnp.float32),
        jax.ShapeDtypeStruct((layout.float_workspace_bytes,), jnp.uint8),
    ]
    attrs = dict(run_fn=run_fn, kv_lora_rank=np.int64(kv_lora_rank), causal=q_len > 1,
                 softmax_scale=np.float64(softmax_scale),
                 plan_info=np.asarray(layout.plan_info, np.int64))
    flat_query = query.reshape(tokens, num_heads, head_dim)
    if plan is not None:
        check_plan(plan, batch, q_len, num_heads, max_pages, kv_lora_rank, layout)
        out, lse, _ = jax.ffi.ffi_call("jax_mla_fa_decode", results)(
            flat_query, kv_cache, block_tables, plan.int_workspace, **attrs)
    else:
        planning.check_works_fit(batch, q_len, num_heads, layout)
        results.append(jax.ShapeDtypeStruct((layout.int_workspace_bytes,), jnp.uint8))
        out, lse, _, _ = jax.ffi.ffi_call("jax_mla_fa_decode_self_plan", results)(
            flat_query, kv_cache, block_tables, seq_lens, plan_fn=plan_fn, q_len=np.int64(q_len),
            **attrs)
    return (out.reshape(batch, q_len, num_heads, kv_lora_rank),
            lse.reshape(batch, q_len, num_heads))


def check_trtllm_shapes(query, kv_cache, kv_lora_rank: int) -> None:
    """Raise ``ValueError`` for the dims, page sizes and head counts trtllm-gen does not run."""
    _, _, num_heads, head_dim = query.shape
    page_size = kv_cache.shape[1]
    if (kv_lora_rank, head_dim - kv_lora_rank) not in TRTLLM_DIMS:
        raise ValueError(f"trtllm-gen supports (kv_lora_rank, rope_dim) in {TRTLLM_DIMS}, got "
                         f"({kv_lora_rank}, {head_dim - kv_lora_rank})")
    if page_size not in TRTLLM_PAGE_SIZES:
        raise ValueError(f"trtllm-gen needs kv_cache page_size in {TRTLLM_PAGE_SIZES}, got {page_size}")
    validation.check_shard_limit(
        num_heads <= 64 or num_heads == 128,
        f"trtllm-gen supports num_heads <= 64 or exactly 128, got {num_heads}")


def trtllm_counter_bytes(batch: int, num_heads: int, num_sms: int) -> int:
    """Size of the multi-CTA counter buffer, as FlashInfer computes it."""
    return -(-max(batch * num_heads, num_sms) // 8) * 8 * 4


def trtllm_decode(query, kv_cache, block_tables, seq_lens, *, softmax_scale: float,
                  output_scale: float, kv_lora_rank: int):
    """FlashInfer's trtllm-gen kernel (SM100/SM103); shapes as in ``fa_decode``. On the e4m3 cache
    (its scale already folded into ``softmax_scale`` and ``output_scale``) the query goes in as
    e4m3 too (``e4m3_query``), as trtllm-gen's fp8 MLA takes it.

    Returns out bf16 [B, q_len, H, kv_lora_rank] (scaled by ``output_scale``) and lse float32
    [B, q_len, H].
    """
    check_trtllm_shapes(query, kv_cache, kv_lora_rank)
    register_targets()
    batch, q_len, num_heads, _ = query.shape
    num_sms = sm_count()
    # The kernel leaves the counters zeroed; XLA zero-fills this operand (graph-safe, no memset here).
    counter = jnp.zeros((trtllm_counter_bytes(batch, num_heads, num_sms),), jnp.uint8)
    results = (
        jax.ShapeDtypeStruct((batch, q_len, num_heads, kv_lora_rank), query.dtype),
        jax.ShapeDtypeStruct((batch, q_len, num_heads), jnp.float32),
        jax.ShapeDtypeStruct((TRTLLM_WORKSPACE_BYTES,), jnp.uint8),
    )
    attrs = dict(decode_fn=trtllm_entry_point(), kv_lora_rank=np.int64(kv_lora_rank),
                 max_seq_len=np.int64(block_tables.shape[1] * kv_cache.shape[1]),
                 output_scale=np.float64(output_scale), sm_count=np.int64(num_sms),
                 enable_pdl=True)
    if e4m3_cache.is_e4m3_cache(kv_cache):
        query, softmax_scale_log2 = e4m3_query(query, softmax_scale)
        out, lse, _ = jax.ffi.ffi_call("jax_mla_trtllm_decode_fp8", results)(
            query, kv_cache, block_tables, seq_lens, counter, softmax_scale_log2, **attrs)
    else:
        out, lse, _ = jax.ffi.ffi_call("jax_mla_trtllm_decode", results)(
            query, kv_cache, block_tables, seq_lens, counter,
            softmax_scale=np.float64(softmax_scale), **attrs)
    return out, lse


def e4m3_query(query, softmax_scale: float):
    """(the query as float8_e4m3fn over one scale, max |query| / 448 of its finite values computed
    on the device (1 for an all-zero query), and trtllm-gen's softmax scale for it:
    ``softmax_scale`` times that scale times log2(e), float32 [1]). query: float [B, q_len, H, D].
    A non-finite value becomes NaN and leaves the scale, and so the other requests, alone."""
    magnitudes = jnp.abs(query.astype(jnp.float32))
    amax = jnp.max(jnp.where(jnp.isfinite(magnitudes), magnitudes, 0))
    scale = jnp.where(amax > 0, amax / fp8_cache.E4M3_MAX, jnp.float32(1.0))
    values = e4m3_cache.quantize(query, scale)
    return values, (scale * np.float32(softmax_scale * math.log2(math.e))).reshape(1)


def device_plan_call(seq_lens, *, q_len: int, num_heads: int, max_pages: int, num_sms: int,
                     layout: planning.ScheduleLayout):
    """The GPU planner's custom call: uint8 [layout.int_workspace_bytes], the schedule."""
    register_targets()
    return jax.ffi.ffi_call(
        "jax_mla_device_plan", jax.ShapeDtypeStruct((layout.int_workspace_bytes,), np.uint8))(
        seq_lens, q_len=np.int64(q_len), num_heads=np.int64(num_heads),
        max_pages=np.int64(max_pages), sm_count=np.int64(num_sms), causal=q_len > 1,
        plan_info=np.asarray(layout.plan_info, np.int64))


# ---- the sm90 kernel (ffi/sm90: jax_mla's own Hopper MLA decode) --------------------------------

SM90_PAGE_SIZES = (32, 64)
SM90_DIMS = (512, 64)  # (kv_lora_rank, rope_dim)
SM90_MAX_Q_LEN = 4
SM90_MAX_HEADS = 128
SM90_SYMBOL = "JaxMlaSm90Decode"


@functools.cache
def sm90_missing() -> str | None:
    """Why the sm90 backend cannot run here beyond what ``runtime_missing`` covers, or None: the
    FFI library must have been built with its handler (which needs CUTLASS headers at build time)."""
    path = library_path()
    if path is None:
        return runtime_missing() or "jax_mla's FFI library was not built"
    try:
        import tvm_ffi  # noqa: F401  the library resolves libtvm_ffi.so by soname

        library = ctypes.CDLL(str(path))
    except (ImportError, OSError) as error:
        return f"jax_mla's FFI library {path} cannot be loaded: {error}"
    if not hasattr(library, SM90_SYMBOL):
        return (f"jax_mla's FFI library {path} was built without the sm90 handler (the build "
                "skips it without CUTLASS headers, with nvcc older than 12.5 or with "
                "JAX_MLA_BUILD_SM90=OFF, and says which in its CMake warning: pip install "
                "nvidia-cutlass or set CUTLASS_INCLUDE_DIR, then reinstall jax_mla)")
    return None


def sm90_workspace_bytes(batch: int, q_len: int, num_heads: int, num_sms: int) -> int:
    """Scratch bytes of one sm90 decode: ``WorkspaceBytes`` of ffi/sm90/decode_params.h.

    fp32 partial LSEs [slots, rows_pad] and room for fp32 partial outputs [slots, rows_pad, 512]
    (the 64-row tiles store them in bf16), each region 256-byte aligned; slots = batch + parts,
    rows_pad = the query rows (q_len * num_heads) rounded up to 64-row tiles, parts = num_sms // M
    tiles (>= 1).
    """
    def align(x: int) -> int:
        return -(-x // 256) * 256

    m_tiles = -(-(q_len * num_heads) // 64)
    parts = max(num_sms // m_tiles, 1)
    slots, rows_pad = batch + parts, m_tiles * 64
    partial_out = align(4 * slots * rows_pad)
    return align(partial_out + 4 * slots * rows_pad * SM90_DIMS[0])


def check_sm90_shapes(query, kv_cache, block_tables, kv_lora_rank: int,
                      softmax_scale: float | None = None) -> None:
    """Raise ``ValueError`` for what the sm90 kernel does not run (names the argument, the
    expectation and what was given); the scale is checked when given. Limits on the heads, the
    batch and the page pool raise ``validation.ShardLimitError``: under sharding they hold per
    device."""
    batch, q_len, num_heads, head_dim = query.shape
    num_pages, page_size, _ = kv_cache.shape
    max_pages = block_tables.shape[1]
    if (kv_lora_rank, head_dim - kv_lora_rank) != SM90_DIMS:
        raise ValueError(f"sm90 supports (kv_lora_rank, rope_dim) = {SM90_DIMS}, got "
                         f"({kv_lora_rank}, {head_dim - kv_lora_rank})")
    check_sm90_table(batch, max_pages, page_size)
    if not 1 <= q_len <= SM90_MAX_Q_LEN:
        raise ValueError(f"sm90 supports query q_len (dim 1) in [1, {SM90_MAX_Q_LEN}], got {q_len}")
    validation.check_shard_limit(
        1 <= num_heads <= SM90_MAX_HEADS,
        f"sm90 supports query num_heads (dim 2) in [1, {SM90_MAX_HEADS}], got {num_heads}")
    if num_pages < 1:
        raise ValueError(f"sm90 needs kv_cache with at least one page, got shape {tuple(kv_cache.shape)}")
    validation.check_shard_limit(
        num_pages * page_size < 2**31,
        f"sm90 supports kv_cache num_pages * page_size < 2**31 tokens, got {num_pages} * "
        f"{page_size}")
    if softmax_scale is not None and not np.float32(softmax_scale) > 0:
        raise ValueError(f"sm90 needs softmax_scale > 0 (in float32), got {softmax_scale}")


def check_sm90_table(batch: int, max_pages: int, page_size: int, page_size_of: str = "kv_cache "
                     ) -> None:
    """Raise ``ValueError`` for a page size or block-table capacity that the sm90 kernel and its
    int32 schedule do not take (``CheckTableCapacity`` in ffi/sm90_decode.cu); ``page_size_of``
    names where the page size came from ("" for an argument of that name)."""
    if page_size not in SM90_PAGE_SIZES:
        raise ValueError(f"sm90 needs {page_size_of}page_size in {SM90_PAGE_SIZES}, got {page_size}")
    if max_pages * page_size >= 2**30:
        raise ValueError(f"sm90 supports block_tables max_pages * page_size < 2**30 tokens, got "
                         f"{max_pages} * {page_size}")
    validation.check_shard_limit(
        batch * (max_pages * page_size // 64 + 3) < 2**31,
        f"sm90 supports batch * (max_pages * page_size / 64 + 3) < 2**31, got batch {batch}, "
        f"max_pages {max_pages}, page_size {page_size}")


def sm90_schedule(seq_lens, *, max_pages: int, page_size: int):
    """The sm90 kernel's split-KV schedule, int32 [B + 1], built on the GPU from ``seq_lens``
    (ffi/sm90/schedule.cuh). It depends only on the lengths and the table's shape, so XLA keeps
    one of the identical calls that a step's layers make."""
    register_targets()
    return jax.ffi.ffi_call(
        "jax_mla_sm90_schedule", jax.ShapeDtypeStruct((seq_lens.shape[0] + 1,), jnp.int32))(
        seq_lens, max_pages=np.int64(max_pages), page_size=np.int64(page_size), enable_pdl=True)


def sm90_decode(query, kv_cache, block_tables, seq_lens, *, softmax_scale: float,
                output_scale: float, kv_lora_rank: int, plan=None, fail_closed: bool = False):
    """jax_mla's own SM90 kernel (ffi/sm90); shapes as in ``fa_decode``, or the fp8 cache (uint8
    [num_pages, page_size, 656], docs/fp8-cache.md).

    Decodes over ``plan`` = (schedule int32 [B + 1], the lengths int32 [B] it was built from;
    ``sm90_schedule``'s result for them, this table width and page size), or without one builds
    the schedule from ``seq_lens`` on the GPU first (once per step after XLA merges the layers'
    identical calls); no host work. A request whose length is not the plan's reads nothing. With
    ``fail_closed`` a request whose length lies outside [q_len, max_pages * page_size] or which
    reads a block-table entry outside [0, num_pages) gets out 0 and lse -inf (the kernel's own
    check, docs/bad-values.md); without it lengths are clamped to the table's capacity and such
    pages' tokens left out. Needs B >= 1 (``jax_mla.decode`` refuses an empty batch).
    Returns out bf16 [B, q_len, H, 512] (scaled by ``output_scale``) and lse float32 [B, q_len, H].
    """
    check_sm90_shapes(query, kv_cache, block_tables, kv_lora_rank, softmax_scale)
    batch, q_len, num_heads, _ = query.shape
    register_targets()
    num_sms = sm_count()
    if plan is None:
        plan = (sm90_schedule(seq_lens, max_pages=block_tables.shape[1],
                              page_size=kv_cache.shape[1]), seq_lens)
    schedule, plan_lens = plan
    results = (
        jax.ShapeDtypeStruct((batch, q_len, num_heads, kv_lora_rank), query.dtype),
        jax.ShapeDtypeStruct((batch, q_len, num_heads), jnp.float32),
        jax.ShapeDtypeStruct((sm90_workspace_bytes(batch, q_len, num_heads, num_sms),), jnp.uint8),
    )
    target = "jax_mla_sm90_decode_fp8" if fp8_cache.is_fp8_cache(kv_cache) else "jax_mla_sm90_decode"
    out, lse, _ = jax.ffi.ffi_call(target, results)(
        query, kv_cache, block_tables, seq_lens, plan_lens, schedule,
        softmax_scale=np.float64(softmax_scale), output_scale=np.float64(output_scale),
        sm_count=np.int64(num_sms), enable_pdl=True, fail_closed=bool(fail_closed))
    return out, lse
