"""The paged MLA cache: allocation, token writes, and zero-copy torch views.

Layout: ``kv_cache[num_pages, page_size, kv_lora_rank + rope_dim]``. A token's row holds its latent
``c_kv`` (first ``kv_lora_rank`` channels, both key part and value) followed by its RoPE key ``k_pe``.
Token ``t`` of a request lives at slot ``block_table[t // page_size] * page_size + t % page_size``.
The fp8 cache (``dtype="fp8"``) is uint8 ``[num_pages, page_size, row_bytes]`` with rows in
``jax_mla.fp8_cache``'s layout (docs/fp8-cache.md), slotted the same way. The e4m3 cache
(``dtype=jnp.float8_e4m3fn``) has a float cache's layout, with one ``kv_scale`` for all its values
(``jax_mla.e4m3_cache``).

JAX owns the cache. ``torch_view`` gives torch a zero-copy, read-only view (``jax_mla.cache_view``):
torch ops that would write to it raise, and it holds no reference to the buffer between ops, so a
jitted step donates the cache even while a view is alive. A view of a donated or deleted cache
raises when used; take a new view of the cache the step returned.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_mla import e4m3_cache, fp8_cache, sharding, validation


def allocate_cache(num_pages: int, page_size: int, *, kv_lora_rank: int = 512, rope_dim: int = 64,
                   dtype=jnp.bfloat16, device=None) -> jax.Array:
    """A zeroed paged cache.

    Args:
      num_pages: pages in the cache (every request's pages come from this one pool).
      page_size: tokens a page holds.
      kv_lora_rank, rope_dim: channels of a token's latent and of its rope key.
      device: where it is made (a ``jax.Device`` or a sharding, each device zeroing only its own
        shard); None: JAX's default device.
      dtype: a floating dtype (bf16, f16, f32) for a cache ``[num_pages, page_size, kv_lora_rank +
        rope_dim]`` of that dtype; ``jnp.float8_e4m3fn`` for the e4m3 cache of that shape, whose
        values are multiplied by one ``kv_scale``; or the string ``"fp8"`` for the fp8 cache: uint8
        ``[num_pages, page_size, row_bytes]``, 656 bytes a token for (512, 64), with a scale per
        128 latent channels (docs/fp8-cache.md).
    Returns:
      The cache: ``[num_pages, page_size, kv_lora_rank + rope_dim]`` of ``dtype``, or for "fp8"
      uint8 ``[num_pages, page_size, row_bytes]``. Integer sizes may be Python or NumPy ints.
    """
    num_pages, page_size, kv_lora_rank, rope_dim = validation.check_sizes(
        num_pages=num_pages, page_size=page_size, kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)
    validation.check_slot_count("", num_pages, page_size, f"{num_pages} * {page_size}")
    if device is not None and not isinstance(device, (jax.Device, jax.sharding.Sharding)):
        raise TypeError(f"device must be None, a jax.Device or a jax.sharding.Sharding, got "
                        f"{device!r}; e.g. jax.devices('gpu')[0]")
    if isinstance(dtype, str) and dtype == fp8_cache.FP8:
        row_bytes = fp8_cache.layout(kv_lora_rank, rope_dim).row_bytes
        shape, dtype = (num_pages, page_size, row_bytes), fp8_cache.STORAGE_DTYPE
    else:
        shape, dtype = (num_pages, page_size, kv_lora_rank + rope_dim), _float_dtype(dtype)
    if device is None:
        return jnp.zeros(shape, dtype)
    if isinstance(device, jax.Device):
        device = jax.sharding.SingleDeviceSharding(device)
    return _zeros_program(shape, dtype, device)()


@functools.lru_cache(maxsize=64)
def _zeros_program(shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding):
    """A compiled program whose output is zeros of ``shape`` with ``sharding``: each device writes
    its own shard, with no whole copy on one device first. Kept per (shape, dtype, sharding), so a
    cache per layer compiles it once."""
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


def _float_dtype(dtype) -> jnp.dtype:
    """``dtype`` as a floating jnp dtype of 16 bits or more, or float8_e4m3fn; TypeError
    otherwise, naming "fp8"."""
    try:
        name = jnp.dtype(dtype)
    except TypeError:
        name = repr(dtype)
    if isinstance(name, str) or not (name == e4m3_cache.DTYPE or validation.is_value_float(name)):
        raise TypeError(f"dtype must be a floating dtype of 16 bits or more (bfloat16, float16, "
                        f"float32), float8_e4m3fn for the e4m3 cache with one scale, or "
                        f"{fp8_cache.FP8!r} for the fp8 cache with per-group scales "
                        f"(docs/fp8-cache.md), got {name}")
    return name


def write_kv(kv_cache: jax.Array, latent: jax.Array, k_rope: jax.Array,
             slot_mapping: jax.Array, *, kv_lora_rank: int | None = None,
             kv_scale: float | None = None) -> jax.Array:
    """Write ``T`` tokens into the paged cache and return the updated cache.

    Args:
      kv_cache: [num_pages, page_size, kv_lora_rank + rope_dim] of a floating dtype of 16 bits or
        more, where the rows are cast to its dtype (for the e4m3 cache, float8_e4m3fn: divided by
        ``kv_scale`` first, ``e4m3_cache.quantize``), or the fp8 cache (uint8 [num_pages,
        page_size, row_bytes]), where they are quantised (``fp8_cache.quantize_rows``).
      latent: [T, kv_lora_rank], the normalised latent ``c_kv``.
      k_rope: [T, rope_dim], the rotated RoPE key.
      slot_mapping: int32 [T], ``page * page_size + offset``; negative slots are padding and are
        skipped (so are slots past the cache). No other row of the cache changes. A slot named
        more than once holds, channel by channel, one of the tokens written to it; which one is
        unspecified (docs/bad-values.md). On the fp8 cache the channels are bytes, so such a
        slot may hold values of neither token.
      kv_lora_rank: channels of the latent, as ``decode`` takes it: by default the cache's row
        less 64 rope channels (for the fp8 cache, latent's last dim); latent and k_rope must
        have exactly these widths.
      kv_scale: for the e4m3 cache only, and required there: a finite float > 0, the scale its
        values are stored in (the one ``decode`` is given).

    Under ``jax.jit(..., donate_argnums=0)`` the update happens in place: XLA aliases the donated
    cache to the result and copies nothing but the written rows.
    """
    validation.check_write_args(kv_cache, latent, k_rope, slot_mapping, kv_lora_rank)
    kv_scale = e4m3_cache.check_kv_scale(kv_cache, kv_scale)
    explicit = sharding.explicit_mesh_axes(kv_cache, latent, k_rope, slot_mapping)
    if explicit is not None:
        # Explicit mesh axes would have the scatter below resolve its output's sharding itself,
        # which it cannot for a sharded cache: the write runs with them Auto, the cache keeping its
        # sharding (slots still address the whole cache).
        return sharding.with_auto_axes(
            _WriteKv(kv_lora_rank, kv_scale), explicit, sharding.spec_of(kv_cache), kv_cache,
            latent, k_rope, slot_mapping)
    kv_cache = jnp.asarray(kv_cache)  # a NumPy cache too (decode takes one)
    num_pages, page_size, row_size = kv_cache.shape
    num_slots = num_pages * page_size
    if fp8_cache.is_fp8_cache(kv_cache):
        rows = fp8_cache.quantize_rows(latent, k_rope)
    elif kv_scale is not None:
        rows = e4m3_cache.quantize(jnp.concatenate([latent, k_rope], axis=-1), kv_scale)
    else:
        rows = jnp.concatenate([latent, k_rope], axis=-1).astype(kv_cache.dtype)
    # Padding slots point past the end, where mode="drop" discards them.
    slots = jnp.where(slot_mapping < 0, num_slots, slot_mapping)
    flat = kv_cache.reshape(num_slots, row_size)
    return flat.at[slots].set(rows, mode="drop").reshape(num_pages, page_size, row_size)


@dataclasses.dataclass(frozen=True)
class _WriteKv:
    """``write_kv`` with its static arguments, equal for equal ones (a static argument JAX caches
    compilations on)."""

    kv_lora_rank: int | None
    kv_scale: float | None

    def __call__(self, kv_cache, latent, k_rope, slot_mapping):
        return write_kv(kv_cache, latent, k_rope, slot_mapping, kv_lora_rank=self.kv_lora_rank,
                        kv_scale=self.kv_scale)


def torch_view(array: jax.Array):
    """A zero-copy, read-only torch view (``jax_mla.cache_view.CacheView``) of ``array``.

    Args:
      array: a single-device JAX array, e.g. the cache ([num_pages, page_size, kv_lora_rank +
        rope_dim] bf16, or the uint8 fp8 cache); the view has its shape and the matching torch
        dtype (``torch.bfloat16``, ``torch.uint8``, ...), and ``view.data_ptr()`` is
        ``array.unsafe_buffer_pointer()``.

    Each torch op exports the buffer through DLPack only while it runs, so donating ``array`` to a
    jitted step with the view alive donates it (no copy); the view then raises ``RuntimeError``.
    In-place and ``out=`` ops on the view or on views of it raise ``RuntimeError``.
    """
    from jax_mla.cache_view import CacheView

    if isinstance(array, jax.core.Tracer) or not isinstance(array, jax.Array):
        raise TypeError(f"array must be a concrete jax.Array (outside jax.jit), got "
                        f"{type(array).__name__}")
    if _bit_width(array.dtype) < 8:
        raise TypeError(f"array's dtype must have 8 bits or more (DLPack has no sub-byte "
                        f"elements), got {array.dtype}")
    if len(array.devices()) != 1:
        raise ValueError(f"array must live on one device (DLPack exports a single buffer), got an "
                         f"array on {len(array.devices())} devices: take the view of one shard, "
                         f"array.addressable_shards[i].data")
    return CacheView(array)


def _bit_width(dtype) -> int:
    """Bits of one element of ``dtype`` (4 for int4 and float4_e2m1fn, of NumPy itemsize 1)."""
    if jnp.issubdtype(dtype, jnp.integer):
        return jnp.iinfo(dtype).bits
    if jnp.issubdtype(dtype, jnp.floating):
        return jnp.finfo(dtype).bits
    return 8 * jnp.dtype(dtype).itemsize
