"""The fp8 cache format: one uint8 row per token, e4m3 latent with per-group scales, bf16 rope.

A token's row (docs/fp8-cache.md has the byte table), for ``kv_lora_rank`` R and ``rope_dim`` r:

    bytes [0, R)                 the latent, float8_e4m3fn, one byte per channel
    bytes [R, R + 4 * R / 128)   float32 scales, one per 128 latent channels
    bytes [.., .. + 2 * r)       the rope key, bfloat16, unquantised

A latent channel's value is its e4m3 value times its group's scale. Multi-byte values are in the
machine's byte order (little-endian on x86, ARM and NVIDIA GPUs). The cache is a uint8 array
``[num_pages, page_size, row_bytes]``: one JAX array, so it is donated and viewed through DLPack like
a bf16 cache. Row bytes are 656 for (R, r) = (512, 64) and 392 for (256, 64).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

FP8 = "fp8"  # allocate_cache(..., dtype="fp8")
STORAGE_DTYPE = jnp.dtype(jnp.uint8)
GROUP_SIZE = 128  # latent channels per scale
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BYTES = 4  # float32
ROPE_BYTES = 2  # bfloat16


def is_fp8_cache(kv_cache) -> bool:
    """Whether an array (or shape-dtype struct) is an fp8 cache: its dtype is uint8."""
    return jnp.dtype(kv_cache.dtype) == STORAGE_DTYPE


@dataclasses.dataclass(frozen=True)
class RowLayout:
    """Byte offsets and sizes of one token's row for ``kv_lora_rank`` latent and ``rope_dim`` rope
    channels. Build it with ``layout``, which checks that the latent splits into whole groups."""

    kv_lora_rank: int
    rope_dim: int

    @property
    def num_groups(self) -> int:
        return self.kv_lora_rank // GROUP_SIZE

    @property
    def scales_offset(self) -> int:
        return self.kv_lora_rank

    @property
    def rope_offset(self) -> int:
        return self.scales_offset + SCALE_BYTES * self.num_groups

    @property
    def row_bytes(self) -> int:
        return self.rope_offset + ROPE_BYTES * self.rope_dim

    @property
    def head_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim


def layout(kv_lora_rank: int, rope_dim: int = 64) -> RowLayout:
    """The row layout for these widths; ValueError unless ``kv_lora_rank`` is a positive multiple
    of ``GROUP_SIZE``."""
    if kv_lora_rank < GROUP_SIZE or kv_lora_rank % GROUP_SIZE:
        raise ValueError(f"an fp8 cache needs kv_lora_rank to be a multiple of {GROUP_SIZE} (one "
                         f"scale per {GROUP_SIZE} latent channels), got {kv_lora_rank}")
    return RowLayout(kv_lora_rank, rope_dim)


def layout_of_rows(row_bytes: int, rope_dim: int = 64) -> RowLayout:
    """The layout whose rows are ``row_bytes`` long with ``rope_dim`` rope channels; ValueError if
    no kv_lora_rank gives that size."""
    latent_and_scales = row_bytes - ROPE_BYTES * rope_dim
    per_group = GROUP_SIZE + SCALE_BYTES
    if latent_and_scales < per_group or latent_and_scales % per_group:
        raise ValueError(f"{row_bytes} bytes is not an fp8 cache row with rope_dim {rope_dim}: rows "
                         f"are kv_lora_rank * {per_group} / {GROUP_SIZE} + {ROPE_BYTES * rope_dim} "
                         "bytes (656 for kv_lora_rank 512)")
    return layout(latent_and_scales // per_group * GROUP_SIZE, rope_dim)


def group_scales(amax: jax.Array) -> jax.Array:
    """The scale of groups whose largest magnitude is ``amax`` (float32 [...]): the smallest power
    of two ``s`` with ``amax <= 448 * s``, at least 2^-126 (the smallest normal float32); 1 for an
    all-zero group. A power of two, so ``e4m3 * scale`` is exact in bfloat16 and float32 and a
    kernel can dequantise into either without rounding. Exact integer arithmetic on the exponent:
    every implementation gets the same bits. A group holding inf or NaN gets a scale of inf or
    NaN (``amax`` itself), so that its values dequantise to NaN rather than to finite values."""
    mantissa, exponent = jnp.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    # 448 = 0.875 * 2^9: amax <= 448 * 2^k for k >= exponent - 9, or - 8 if mantissa > 0.875.
    power = exponent - 9 + (mantissa > 0.875).astype(exponent.dtype)
    scales = jnp.ldexp(jnp.ones_like(amax), jnp.maximum(power, -126))
    scales = jnp.where(amax > 0, scales, 1.0)
    return jnp.where(jnp.isfinite(amax), scales, amax).astype(jnp.float32)


def to_e4m3(values: jax.Array, scale) -> jax.Array:
    """float8_e4m3fn of ``values / scale`` in float32 (``scale``: a float32 array broadcasting
    against ``values``, or a float), clipped to e4m3's finite range and rounded to the nearest
    e4m3 (ties to even)."""
    scaled = values.astype(jnp.float32) / scale
    return jnp.clip(scaled, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


def quantize_rows(latent: jax.Array, rope: jax.Array) -> jax.Array:
    """Cache rows for ``T`` tokens.

    Args:
      latent: float [T, R], R a multiple of 128. Each group of 128 channels gets the float32 scale
        ``group_scales(max |x|)``, a power of two, and stores ``x / scale`` (exact) rounded to the
        nearest float8_e4m3fn.
      rope: float [T, r], stored as bfloat16.
    Returns:
      uint8 [T, row_bytes].
    """
    num_tokens, kv_lora_rank = latent.shape
    row = layout(kv_lora_rank, rope.shape[-1])
    groups = latent.astype(jnp.float32).reshape(num_tokens, row.num_groups, GROUP_SIZE)
    scales = group_scales(jnp.max(jnp.abs(groups), axis=-1))  # [T, G]
    values = to_e4m3(groups, scales[..., None])
    parts = (values.reshape(num_tokens, kv_lora_rank), scales, rope.astype(jnp.bfloat16))
    return jnp.concatenate([_bytes_of(part) for part in parts], axis=-1)


def dequantize(rows: jax.Array, rope_dim: int = 64) -> tuple[jax.Array, jax.Array]:
    """(latent float32 [..., R], rope float32 [..., rope_dim]) of uint8 cache rows [..., row_bytes]."""
    row = layout_of_rows(rows.shape[-1], rope_dim)
    latent = _from_bytes(rows[..., :row.scales_offset], jnp.float8_e4m3fn).astype(jnp.float32)
    scales = _from_bytes(rows[..., row.scales_offset:row.rope_offset], jnp.float32)  # [..., G]
    groups = latent.reshape(*latent.shape[:-1], row.num_groups, GROUP_SIZE) * scales[..., None]
    rope = _from_bytes(rows[..., row.rope_offset:], jnp.bfloat16).astype(jnp.float32)
    return groups.reshape(latent.shape), rope


def dequantize_rows(rows: jax.Array, rope_dim: int = 64) -> jax.Array:
    """float32 [..., R + rope_dim] (latent then rope, a float cache's row) of uint8 cache rows
    [..., row_bytes]."""
    return jnp.concatenate(dequantize(rows, rope_dim), axis=-1)


def _bytes_of(values: jax.Array) -> jax.Array:
    """uint8 [T, n * itemsize] of values [T, n] (T may be 0)."""
    raw = jax.lax.bitcast_convert_type(values, jnp.uint8)
    return raw.reshape(values.shape[0], values.shape[1] * values.dtype.itemsize)


def _from_bytes(raw: jax.Array, dtype) -> jax.Array:
    """Values [..., n / itemsize] of ``dtype`` of bytes uint8 [..., n]."""
    itemsize = jnp.dtype(dtype).itemsize
    if itemsize > 1:
        raw = raw.reshape(*raw.shape[:-1], raw.shape[-1] // itemsize, itemsize)
    return jax.lax.bitcast_convert_type(raw, dtype)
