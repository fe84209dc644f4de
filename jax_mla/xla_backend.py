"""Pure-XLA MLA decode: walks the block table in chunks of pages with an online softmax.

Runs on any JAX platform. Temporary memory is O(B * q_len * H * chunk_tokens): neither the whole
gathered cache nor all logits are ever materialised. Math is float32 throughout; an fp8 cache is
dequantised chunk by chunk as it is gathered (docs/fp8-cache.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jax_mla import fp8_cache

# Tokens gathered per step of the loop; the page count per chunk is derived from the page size.
CHUNK_TOKENS = 512


def pages_per_chunk(page_size: int, max_pages: int) -> int:
    return max(1, min(max_pages, CHUNK_TOKENS // page_size))


def clamp_lengths(seq_lens, capacity: int):
    """int32 [B]: each length clamped to [0, capacity], the tokens a block-table row can address."""
    return jnp.clip(seq_lens, 0, capacity)


def gather_rows(kv_cache, pages, rope_dim: int):
    """float32 [B, chunk_pages * page_size, D]: the rows of ``pages`` (int32 [B, chunk_pages], valid
    ids), dequantised when ``kv_cache`` is an fp8 cache."""
    batch, chunk_pages = pages.shape
    rows = kv_cache[pages].reshape(batch, chunk_pages * kv_cache.shape[1], kv_cache.shape[2])
    if fp8_cache.is_fp8_cache(kv_cache):
        return fp8_cache.dequantize_rows(rows, rope_dim)
    return rows.astype(jnp.float32)


def cpu_gather_in_loop(kv_cache, pages):
    """(kv_cache, pages), tied together inside the chunk loop on the CPU for a bf16 cache: XLA's
    CPU backend gathers bf16 through float32 and would hoist that float32 copy of the whole cache
    out of the loop, where gathering each chunk's rows converts only those. A no-op for other
    caches and platforms."""
    if kv_cache.dtype != jnp.bfloat16:
        return kv_cache, pages
    return lax.platform_dependent(kv_cache, pages, cpu=lambda *a: lax.optimization_barrier(a),
                                  default=lambda *a: a)


@functools.partial(
    jax.jit, static_argnames=("softmax_scale", "output_scale", "kv_lora_rank", "return_lse")
)
def decode(query, kv_cache, block_tables, seq_lens, *, softmax_scale, output_scale, kv_lora_rank,
           return_lse):
    """MLA decode.

    Args:
      query: [B, q_len, H, D] with D = kv_lora_rank + rope_dim.
      kv_cache: [num_pages, page_size, D], same dtype as query, or the fp8 cache: uint8
        [num_pages, page_size, row_bytes] (``jax_mla.fp8_cache``).
      block_tables: int32 [B, max_pages]; entries past a request's pages are never read.
      seq_lens: int32 [B], kv length of each request including its q_len new tokens.
    Returns:
      out [B, q_len, H, kv_lora_rank] in query.dtype, and lse float32 [B, q_len, H] (natural log)
      when ``return_lse``; rows that see no kv get out 0 and lse -inf.

    Bad values never read another request's pages (docs/bad-values.md): a length is clamped to
    [0, max_pages * page_size] before anything else uses it, and a token whose page id lies outside
    [0, num_pages) is treated like a token past the length (never read, masked out).
    """
    batch, q_len, num_heads, _ = query.shape
    num_pages, page_size, _ = kv_cache.shape
    head_dim = query.shape[-1]
    max_pages = block_tables.shape[1]
    chunk_pages = pages_per_chunk(page_size, max_pages)
    num_chunks = -(-max_pages // chunk_pages)
    chunk_tokens = chunk_pages * page_size

    padded_tables = jnp.pad(block_tables, ((0, 0), (0, num_chunks * chunk_pages - max_pages)))
    q = query.astype(jnp.float32) * softmax_scale
    seq_lens = clamp_lengths(seq_lens, max_pages * page_size)
    # Last kv position (exclusive) that query token i may see: bottom-right causal.
    visible_end = seq_lens[:, None] - q_len + 1 + jnp.arange(q_len)[None, :]  # [B, q_len]

    def step(chunk, carry):
        running_max, running_sum, acc = carry
        pages = lax.dynamic_slice_in_dim(padded_tables, chunk * chunk_pages, chunk_pages, axis=1)
        positions = chunk * chunk_tokens + jnp.arange(chunk_tokens)  # [T]
        # Never index with a page id past the request's pages, nor with an out-of-range one.
        page_starts = (chunk * chunk_pages + jnp.arange(chunk_pages)) * page_size
        page_in_request = page_starts[None, :] < seq_lens[:, None]  # [B, chunk_pages]
        page_valid = page_in_request & (pages >= 0) & (pages < num_pages)
        safe_pages = jnp.where(page_valid, pages, 0)
        token_present = ((positions[None, :] < seq_lens[:, None])
                         & jnp.repeat(page_valid, page_size, axis=1))  # [B, T]
        kv = gather_rows(*cpu_gather_in_loop(kv_cache, safe_pages),
                         head_dim - kv_lora_rank)  # [B, T, D]
        kv = jnp.where(token_present[..., None], kv, 0.0)  # hide NaN tails before the matmul

        logits = jnp.einsum("bshd,btd->bsht", q, kv, precision=lax.Precision.HIGHEST)
        visible = (positions[None, None, :] < visible_end[:, :, None]) & token_present[:, None, :]
        logits = jnp.where(visible[:, :, None, :], logits, -jnp.inf)  # visible: [B, q_len, T]

        new_max = jnp.maximum(running_max, logits.max(axis=-1))
        safe_max = jnp.where(jnp.isfinite(new_max), new_max, 0.0)
        probs = jnp.exp(logits - safe_max[..., None])
        rescale = jnp.exp(running_max - safe_max)
        running_sum = running_sum * rescale + probs.sum(axis=-1)
        acc = acc * rescale[..., None] + jnp.einsum(
            "bsht,btd->bshd", probs, kv[..., :kv_lora_rank], precision=lax.Precision.HIGHEST
        )
        return new_max, running_sum, acc

    init = (
        jnp.full((batch, q_len, num_heads), -jnp.inf, jnp.float32),
        jnp.zeros((batch, q_len, num_heads), jnp.float32),
        jnp.zeros((batch, q_len, num_heads, kv_lora_rank), jnp.float32),
    )
    # Chunks past the longest request hold nothing visible: stop before them.
    chunks_needed = jnp.clip(-(-jnp.max(seq_lens, initial=0) // chunk_tokens), 0, num_chunks)
    # The first chunk runs before the loop (with every length 0 it adds nothing to init): its
    # carries vary over the mesh axes the inputs vary over inside shard_map, as the loop's do.
    running_max, running_sum, acc = lax.fori_loop(1, chunks_needed, step, step(0, init))
    nonempty = running_sum > 0
    out = acc / jnp.where(nonempty, running_sum, 1.0)[..., None] * output_scale
    out = out.astype(query.dtype)
    if not return_lse:
        return out
    lse = jnp.where(nonempty, running_max + jnp.log(jnp.where(nonempty, running_sum, 1.0)), -jnp.inf)
    return out, lse
