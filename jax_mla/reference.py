"""A torch reference for MLA decode: float32 math, pages gathered per request.

Independent of every backend: it takes torch tensors (JAX arrays are shared through DLPack by
``reference_from_jax``) and loops over requests the plain way. An fp8 cache (uint8 rows) is read
with its own torch decoding of the byte layout in docs/fp8-cache.md, not jax_mla.fp8_cache's; an
e4m3 cache (float8_e4m3fn) as its values times ``kv_scale``.
"""

from __future__ import annotations


def mla_decode_reference(query, kv_cache, block_tables, seq_lens, *, softmax_scale: float,
                         output_scale: float = 1.0, kv_lora_rank: int | None = None,
                         kv_scale: float | None = None):
    """MLA decode in float32 torch.

    Args:
      query: [B, q_len, H, D]; kv_cache: [num_pages, page_size, D], or an fp8 cache (uint8
        [num_pages, page_size, row_bytes], docs/fp8-cache.md), or an e4m3 cache (float8_e4m3fn,
        read as its values times ``kv_scale``, which it needs and other caches refuse);
        block_tables: int [B, max_pages]; seq_lens: int [B].
    Returns:
      (out float32 [B, q_len, H, kv_lora_rank], lse float32 [B, q_len, H], natural log). A request
      that ``decode`` fails closed on every backend (a length outside [q_len, max_pages *
      page_size], or a page id it reads outside [0, num_pages): docs/bad-values.md) gets out 0
      and lse -inf, as there; fa3/fa2's 2^22 cap and a plan's lengths are not modelled.
    """
    import torch

    if (kv_cache.dtype == torch.float8_e4m3fn) != (kv_scale is not None):
        raise TypeError(f"kv_scale is for an e4m3 cache (float8_e4m3fn) and needed there; got "
                        f"kv_scale={kv_scale!r} with a {kv_cache.dtype} cache")
    batch, q_len, num_heads, head_dim = query.shape
    page_size = kv_cache.shape[1]
    kv_lora_rank = head_dim - 64 if kv_lora_rank is None else kv_lora_rank
    out = torch.zeros(batch, q_len, num_heads, kv_lora_rank, dtype=torch.float32, device=query.device)
    lse = torch.full((batch, q_len, num_heads), float("-inf"), dtype=torch.float32, device=query.device)
    tables = block_tables.long().cpu()
    lengths = seq_lens.long().cpu()
    for b in range(batch):
        seq_len = int(lengths[b])
        num_pages = -(-seq_len // page_size)
        pages = tables[b, :num_pages]
        if (not q_len <= seq_len <= tables.shape[1] * page_size
                or bool(((pages < 0) | (pages >= kv_cache.shape[0])).any())):
            continue
        pages = pages.to(kv_cache.device)
        rows = kv_cache[pages].reshape(-1, kv_cache.shape[-1])[:seq_len]
        keys = dequantize_fp8(rows, kv_lora_rank) if rows.dtype == torch.uint8 else rows.float()
        if rows.dtype == torch.float8_e4m3fn:
            keys = keys * kv_scale
        values = keys[:, :kv_lora_rank]
        logits = torch.einsum("shd,ld->shl", query[b].float(), keys) * softmax_scale
        positions = torch.arange(seq_len, device=query.device)
        visible_end = seq_len - q_len + 1 + torch.arange(q_len, device=query.device)
        mask = positions[None, :] < visible_end[:, None]  # [q_len, L]
        logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
        row_lse = torch.logsumexp(logits, dim=-1)
        seen = torch.isfinite(row_lse)
        probs = torch.where(seen[..., None], torch.exp(logits - row_lse[..., None]),
                            torch.zeros_like(logits))
        out[b] = torch.einsum("shl,ld->shd", probs, values) * output_scale
        lse[b] = row_lse
    return out, lse


def dequantize_fp8(rows, kv_lora_rank: int):
    """float32 [..., kv_lora_rank + rope_dim] of fp8 cache rows uint8 [..., row_bytes] (the cache
    itself, a page, or rows): e4m3 latent bytes, then one float32 scale per 128 latent channels,
    then bfloat16 rope values."""
    import torch

    if rows.dim() != 2:
        flat = dequantize_fp8(rows.reshape(-1, rows.shape[-1]), kv_lora_rank)
        return flat.reshape(*rows.shape[:-1], flat.shape[-1])
    groups = kv_lora_rank // 128
    rope_start = kv_lora_rank + 4 * groups
    latent = rows[:, :kv_lora_rank].contiguous().view(torch.float8_e4m3fn).float()
    scales = rows[:, kv_lora_rank:rope_start].contiguous().view(torch.float32)  # [L, groups]
    rope = rows[:, rope_start:].contiguous().view(torch.bfloat16).float()
    latent = (latent.reshape(-1, groups, 128) * scales[:, :, None]).reshape(-1, kv_lora_rank)
    return torch.cat([latent, rope], dim=-1)


def reference_from_jax(query, kv_cache, block_tables, seq_lens, **kwargs):
    """``mla_decode_reference`` on JAX arrays (each on one device: DLPack exports no sharded
    array), read zero-copy through DLPack; results on the CPU."""
    import torch

    views = [torch.from_dlpack(x) for x in (query, kv_cache, block_tables, seq_lens)]
    return tuple(t.cpu() for t in mla_decode_reference(*views, **kwargs))
