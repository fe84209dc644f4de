"""The public decode entry point: validation, backend choice, dispatch."""

from __future__ import annotations

import functools

import jax

from jax_mla import _validate, backends, sharding, xla_backend


def decode(query: jax.Array, kv_cache: jax.Array, block_tables: jax.Array, seq_lens: jax.Array, *,
           softmax_scale: float, output_scale: float = 1.0, return_lse: bool = False,
           backend: str = "auto", kv_lora_rank: int | None = None, plan=None):
    """Multi-head Latent Attention decode over a paged cache. Callable inside ``jax.jit``.

    Args:
      query: [B, q_len, H, kv_lora_rank + rope_dim]; the absorbed query (``q_nope @ W_UK`` then
        ``q_pe``).
      kv_cache: [num_pages, page_size, kv_lora_rank + rope_dim], same dtype as ``query``. The first
        ``kv_lora_rank`` channels of a token are both its latent key part and its value.
      block_tables: int32 [B, max_pages]; entries past a request's pages may hold anything.
      seq_lens: int32 [B], each request's kv length, counting its q_len new tokens. Cached values past
        it may be NaN.
      softmax_scale: the pre-absorption scale, e.g. ``192**-0.5 * mscale**2`` for DeepSeek.
      output_scale: multiplies the output.
      return_lse: also return the log-sum-exp (natural log) of the scaled logits.
      backend: "auto", "xla", "fa3", "fa2" or "trtllm-gen". "auto" picks the best available one for
        the platform and dtype (see ``jax_mla.available_backends``): fa3 on Hopper, fa2 on other
        CUDA GPUs, trtllm-gen on Blackwell, xla on CPU and for non-bfloat16.
      kv_lora_rank: channels of the latent; default ``head_dim - 64``.
      plan: for the fa3/fa2 backends, the work schedule. A ``jax_mla.Plan`` from ``jax_mla.plan``
        (host, once per step) or ``jax_mla.device_plan`` (GPU, inside jit), shared by every layer;
        ``"device"`` builds one on the GPU inside this call; None
        plans inside the call on the host, which reads ``seq_lens`` back (a device sync) and
        cannot be captured in a CUDA graph.

    With q_len > 1 the mask is bottom-right causal: query token i of a request sees kv positions
    ``[0, seq_len - q_len + i]``.

    Returns:
      out [B, q_len, H, kv_lora_rank] in ``query.dtype``; with ``return_lse`` a tuple
      ``(out, lse)`` with lse float32 [B, q_len, H].
    """
    _, _, _, kv_lora_rank, _, _ = _validate.check_decode_args(
        query, kv_cache, block_tables, seq_lens, kv_lora_rank)
    softmax_scale = _validate.check_finite_scale("softmax_scale", softmax_scale)
    output_scale = _validate.check_finite_scale("output_scale", output_scale)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
    platform = backends.platform_of(query, kv_cache)
    chosen = backends.resolve(backend, platform, query.dtype)
    # The kernel runs once per device on its shard when the arrays are sharded (jax_mla.sharding).
    if chosen == backends.XLA:
        if plan is not None:
            raise ValueError("plan is only used by the fa3/fa2 backends; the xla backend takes plan=None")
        kernel = functools.partial(xla_backend.decode, softmax_scale=softmax_scale,
                                   output_scale=output_scale, kv_lora_rank=kv_lora_rank,
                                   return_lse=return_lse)
        return sharding.call(kernel, query, kv_cache, block_tables, seq_lens)
    from jax_mla import gpu_backend

    kernel = functools.partial(gpu_backend.decode, chosen, softmax_scale=softmax_scale,
                               output_scale=output_scale, kv_lora_rank=kv_lora_rank,
                               return_lse=return_lse)
    return sharding.call(kernel, query, kv_cache, block_tables, seq_lens, plan=plan)
