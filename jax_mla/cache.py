"""The paged MLA cache: allocation, token writes, and zero-copy torch views.

Layout: ``kv_cache[num_pages, page_size, kv_lora_rank + rope_dim]``. A token's row holds its latent
``c_kv`` (first ``kv_lora_rank`` channels, both key part and value) followed by its RoPE key ``k_pe``.
Token ``t`` of a request lives at slot ``block_table[t // page_size] * page_size + t % page_size``.

JAX owns the cache. ``torch_view`` gives torch a zero-copy, read-only-by-convention view through
DLPack; drop it before the cache is donated to a jitted step (PJRT refuses to donate a buffer with a
live DLPack export).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mla import validation


def allocate_cache(num_pages: int, page_size: int, *, kv_lora_rank: int = 512, rope_dim: int = 64,
                   dtype=jnp.bfloat16, device=None) -> jax.Array:
    """A zeroed cache ``[num_pages, page_size, kv_lora_rank + rope_dim]`` of ``dtype``."""
    for name, value in (("num_pages", num_pages), ("page_size", page_size),
                        ("kv_lora_rank", kv_lora_rank), ("rope_dim", rope_dim)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"dtype must be a floating dtype, got {jnp.dtype(dtype)}")
    cache = jnp.zeros((num_pages, page_size, kv_lora_rank + rope_dim), dtype)
    return jax.device_put(cache, device) if device is not None else cache


def write_kv(kv_cache: jax.Array, latent: jax.Array, k_rope: jax.Array,
             slot_mapping: jax.Array) -> jax.Array:
    """Write ``T`` tokens into the paged cache and return the updated cache.

    Args:
      kv_cache: [num_pages, page_size, kv_lora_rank + rope_dim].
      latent: [T, kv_lora_rank], the normalised latent ``c_kv``.
      k_rope: [T, rope_dim], the rotated RoPE key.
      slot_mapping: int32 [T], ``page * page_size + offset``; negative slots are padding and are
        skipped (so are slots past the cache). No other row of the cache changes. A slot named
        more than once holds, channel by channel, one of the tokens written to it; which one is
        unspecified (docs/bad-values.md).

    Under ``jax.jit(..., donate_argnums=0)`` the update happens in place: XLA aliases the donated
    cache to the result and copies nothing but the written rows.
    """
    validation.check_write_args(kv_cache, latent, k_rope, slot_mapping)
    num_pages, page_size, head_dim = kv_cache.shape
    num_slots = num_pages * page_size
    rows = jnp.concatenate([latent, k_rope], axis=-1).astype(kv_cache.dtype)
    # Padding slots point past the end, where mode="drop" discards them.
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)
    flat = kv_cache.reshape(num_slots, head_dim)
    return flat.at[slots].set(rows, mode="drop").reshape(num_pages, page_size, head_dim)


def torch_view(array: jax.Array):
    """A zero-copy torch tensor over a JAX array's buffer (DLPack). Drop it before donating."""
    import torch

    return torch.from_dlpack(array)
