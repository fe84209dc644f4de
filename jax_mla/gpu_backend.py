"""The GPU backends: FlashInfer's MLA kernels as XLA FFI custom calls (see ffi/mla_decode.cc).

fa3 (SM90) and fa2 (SM80+) read a work schedule: from a ``jax_mla.Plan`` (graph-safe, no host work
in the call) or, without one, built inside the call from ``seq_lens`` read back to the host.
trtllm-gen (SM100/SM103) schedules on the GPU itself.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla import backends, ffi, flashinfer_modules, planning

MASK_NON_CAUSAL, MASK_CAUSAL = 0, 1
DEVICE_PLAN = "device"  # decode(..., plan="device"): schedule built on the GPU inside the call
TRTLLM_WORKSPACE_BYTES = 128 * 1024 * 1024  # what FlashInfer and vLLM give trtllm-gen
TRTLLM_PAGE_SIZES = (32, 64)
TRTLLM_DIMS = ((512, 64), (256, 64))


def decode(backend, query, kv_cache, block_tables, seq_lens, *, softmax_scale, output_scale,
           kv_lora_rank, return_lse, plan=None):
    """Run ``backend``'s kernel; shapes as in ``jax_mla.decode`` (already validated there)."""
    if query.dtype != jnp.bfloat16:
        raise TypeError(f"backend {backend!r} needs bfloat16 query and kv_cache, got {query.dtype}; "
                        "use backend='xla' for other dtypes")
    ffi.register_targets()
    if backend == backends.TRTLLM_GEN:
        if plan is not None:
            raise ValueError("plan is only used by the fa3/fa2 backends; trtllm-gen schedules on the GPU")
        out, lse = trtllm_decode(query, kv_cache, block_tables, seq_lens, softmax_scale=softmax_scale,
                                 output_scale=output_scale, kv_lora_rank=kv_lora_rank)
    else:
        out, lse = fa_decode(backend, query, kv_cache, block_tables, seq_lens,
                             softmax_scale=softmax_scale, kv_lora_rank=kv_lora_rank, plan=plan)
        if output_scale != 1.0:
            out = (out.astype(jnp.float32) * output_scale).astype(out.dtype)
    return (out, lse) if return_lse else out


def check_plan(plan, batch, q_len, num_heads, max_pages, kv_lora_rank, layout):
    if not isinstance(plan, planning.Plan):
        raise TypeError("plan must be None, 'device' or a jax_mla.Plan from jax_mla.plan(...) or "
                        f"jax_mla.device_plan(...), got {plan!r}")
    expected = dict(batch=batch, q_len=q_len, num_heads=num_heads, max_pages=max_pages,
                    kv_lora_rank=kv_lora_rank)
    actual = {name: getattr(plan, name) for name in expected}
    if actual != expected or plan.layout != layout:
        raise planning.PlanMismatchError(
            f"plan was built for {actual} but decode got {expected}; build the plan with "
            "the step's seq_lens, local head count and block-table width")


def fa_decode(backend, query, kv_cache, block_tables, seq_lens, *, softmax_scale, kv_lora_rank, plan):
    """fa3/fa2: returns out [B, q_len, H, kv_lora_rank] and lse f32 [B, q_len, H]."""
    batch, q_len, num_heads, head_dim = query.shape
    rope_dim = head_dim - kv_lora_rank
    max_pages = block_tables.shape[1]
    run_fn, plan_fn = flashinfer_modules.fa_entry_points(backend, kv_lora_rank, rope_dim)
    layout = planning.schedule_layout(planning.gpu_sm_count(), q_len, num_heads, kv_lora_rank)
    tokens = batch * q_len
    results = [
        jax.ShapeDtypeStruct((tokens, num_heads, kv_lora_rank), query.dtype),
        jax.ShapeDtypeStruct((tokens, num_heads), jnp.float32),
        jax.ShapeDtypeStruct((layout.float_workspace_bytes,), jnp.uint8),
    ]
    attrs = dict(run_fn=run_fn, kv_lora_rank=np.int64(kv_lora_rank),
                 mask_mode=np.int64(MASK_CAUSAL if q_len > 1 else MASK_NON_CAUSAL),
                 sm_scale=np.float64(softmax_scale), plan_info=np.asarray(layout.plan_info, np.int64))
    flat_query = query.reshape(tokens, num_heads, head_dim)
    if isinstance(plan, str) and plan == DEVICE_PLAN:
        plan = planning.device_plan(seq_lens, num_heads=num_heads, max_pages=max_pages, q_len=q_len,
                                    kv_lora_rank=kv_lora_rank)
    if plan is not None:
        check_plan(plan, batch, q_len, num_heads, max_pages, kv_lora_rank, layout)
        out, lse, _ = jax.ffi.ffi_call("jax_mla_fa_decode", results)(
            flat_query, kv_cache, block_tables, plan.int_workspace, **attrs)
    else:
        results.append(jax.ShapeDtypeStruct((layout.int_workspace_bytes,), jnp.uint8))
        out, lse, _, _ = jax.ffi.ffi_call("jax_mla_fa_decode_self_plan", results)(
            flat_query, kv_cache, block_tables, seq_lens, plan_fn=plan_fn, q_len=np.int64(q_len),
            **attrs)
    return (out.reshape(batch, q_len, num_heads, kv_lora_rank),
            lse.reshape(batch, q_len, num_heads))


def check_trtllm_shapes(query, kv_cache, kv_lora_rank):
    _, _, num_heads, head_dim = query.shape
    page_size = kv_cache.shape[1]
    if (kv_lora_rank, head_dim - kv_lora_rank) not in TRTLLM_DIMS:
        raise ValueError(f"trtllm-gen supports (kv_lora_rank, rope_dim) in {TRTLLM_DIMS}, got "
                         f"({kv_lora_rank}, {head_dim - kv_lora_rank})")
    if page_size not in TRTLLM_PAGE_SIZES:
        raise ValueError(f"trtllm-gen needs kv_cache page_size in {TRTLLM_PAGE_SIZES}, got {page_size}")
    if num_heads > 128 or 64 < num_heads < 128:
        raise ValueError(f"trtllm-gen supports num_heads <= 64 or exactly 128, got {num_heads}")


def trtllm_counter_bytes(batch: int, num_heads: int, sm_count: int) -> int:
    """Size of the multi-CTA counter buffer, as FlashInfer computes it."""
    return -(-max(batch * num_heads, sm_count) // 8) * 8 * 4


def trtllm_decode(query, kv_cache, block_tables, seq_lens, *, softmax_scale, output_scale,
                  kv_lora_rank):
    """trtllm-gen: returns out [B, q_len, H, kv_lora_rank] and lse f32 [B, q_len, H]."""
    check_trtllm_shapes(query, kv_cache, kv_lora_rank)
    batch, q_len, num_heads, _ = query.shape
    sm_count = planning.gpu_sm_count()
    # The kernel leaves the counters zeroed; XLA zero-fills this operand (graph-safe, no memset here).
    counter = jnp.zeros((trtllm_counter_bytes(batch, num_heads, sm_count),), jnp.uint8)
    results = (
        jax.ShapeDtypeStruct((batch, q_len, num_heads, kv_lora_rank), query.dtype),
        jax.ShapeDtypeStruct((batch, q_len, num_heads), jnp.float32),
        jax.ShapeDtypeStruct((TRTLLM_WORKSPACE_BYTES,), jnp.uint8),
    )
    out, lse, _ = jax.ffi.ffi_call("jax_mla_trtllm_decode", results)(
        query, kv_cache, block_tables, seq_lens, counter,
        decode_fn=flashinfer_modules.trtllm_entry_point(), kv_lora_rank=np.int64(kv_lora_rank),
        max_seq_len=np.int64(block_tables.shape[1] * kv_cache.shape[1]),
        bmm1_scale=np.float64(softmax_scale), bmm2_scale=np.float64(output_scale),
        lse_scale=np.float64(math.log(2.0)), sm_count=np.int64(sm_count),
        enable_pdl=True)
    return out, lse
