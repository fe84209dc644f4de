"""Trace-time argument checks shared by every public entry point.

Each check raises ``TypeError`` (wrong kind or dtype) or ``ValueError`` (wrong shape or value) with a
message that names the argument, what was expected and what was given.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator

import jax
import jax.numpy as jnp
import numpy as np

from jax_mla import e4m3_cache, fp8_cache

DEFAULT_ROPE_DIM = 64
STATIC = ("it is compiled into the call, so pass a static value (under jax.jit close over it, or "
          "mark it static)")


class ShardLimitError(ValueError):
    """A kernel's limit on a dim that the devices may split (the heads, the batch, the page pool),
    broken by the shapes it was given. Under sharding only each device's shard must keep it: the
    sharding wrapper's trace on the global shapes defers it (``jax_mla.sharding``)."""


_SHARD_LIMITS_DEFERRED = contextvars.ContextVar("jax_mla_shard_limits_deferred", default=False)


@contextlib.contextmanager
def shard_limits_deferred():
    """Within it ``check_shard_limit`` raises nothing: for a trace on the global shapes of a call
    whose kernel runs per shard."""
    token = _SHARD_LIMITS_DEFERRED.set(True)
    try:
        yield
    finally:
        _SHARD_LIMITS_DEFERRED.reset(token)


def check_shard_limit(holds: bool, message: str) -> None:
    """Raise ``ShardLimitError(message)`` unless the limit ``holds`` or is deferred."""
    if not holds and not _SHARD_LIMITS_DEFERRED.get():
        raise ShardLimitError(message)


def shape_of(name: str, x) -> tuple[int, ...]:
    """The shape of an array-like, or a TypeError naming ``name`` when it has none."""
    shape = getattr(x, "shape", None)
    if shape is None or getattr(x, "dtype", None) is None:
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(shape)


def check_rank(name: str, x, rank: int, layout: str) -> tuple[int, ...]:
    shape = shape_of(name, x)
    if len(shape) != rank:
        raise ValueError(f"{name} must have rank {rank} ({layout}), got shape {shape}")
    return shape


def is_value_float(dtype) -> bool:
    """Whether ``dtype`` is floating of at least 16 bits: what values and plain caches hold (8-bit
    floats are cache formats: the e4m3 cache's float8_e4m3fn, and no other)."""
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize >= 2


def check_floating(name: str, x) -> None:
    if not is_value_float(x.dtype):
        raise TypeError(f"{name} must have a floating dtype of at least 16 bits (bfloat16, float16, "
                        f"float32), got {x.dtype}")


def check_bool(name: str, value) -> bool:
    """``value``, a Python or NumPy bool, as a bool."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return bool(value)


def check_int32(name: str, x) -> None:
    if x.dtype != jnp.int32:
        raise TypeError(f"{name} must have dtype int32, got {x.dtype}")


def check_int(name: str, value, minimum: int | None = 1) -> int:
    """``value`` (a Python or NumPy integer known at trace time, not a bool) as an int, at least
    ``minimum`` unless that is None."""
    if isinstance(value, (jax.Array, jax.core.Tracer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}: {STATIC}")
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_sizes(**sizes) -> tuple[int, ...]:
    """Each keyword's value (``check_int``) as an int >= 1, in the order given."""
    return tuple(check_int(name, value) for name, value in sizes.items())


def static_float(name: str, value) -> float:
    """``value``, a Python or NumPy real number known at trace time, as a float."""
    if isinstance(value, (jax.Array, jax.core.Tracer)):
        raise TypeError(f"{name} must be a Python float, got {type(value).__name__}: {STATIC}")
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.floating,
                                                                     np.integer)):
        raise TypeError(f"{name} must be a Python float, got {type(value).__name__}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite in float64, got an int of "
                         f"{len(str(abs(int(value))))} digits") from None


def as_float32(value: float) -> np.float32:
    """``value`` in float32, the kernels' precision (inf where it is out of range)."""
    with np.errstate(over="ignore"):
        return np.float32(value)


def check_finite_scale(name: str, value) -> float:
    """``value`` (static_float) as a float, finite also in float32."""
    value = static_float(name, value)
    if not np.isfinite(as_float32(value)):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_positive_scale(name: str, value) -> float:
    """``value`` (static_float) as a float, finite and > 0 also in float32."""
    value = static_float(name, value)
    in_float32 = as_float32(value)
    if not (np.isfinite(in_float32) and in_float32 > 0):
        raise ValueError(f"{name} must be finite and > 0, got {value}")
    return value


# The largest softmax scale whose base-2 form (scale * log2(e), what the GPU kernels multiply the
# scores by) is finite in float32.
MAX_SOFTMAX_SCALE = float(np.finfo(np.float32).max / np.float32(np.log2(np.e)))


def check_softmax_scale(name: str, value) -> float:
    """``value`` as check_positive_scale reads it, and at most MAX_SOFTMAX_SCALE."""
    value = check_positive_scale(name, value)
    if as_float32(value) > MAX_SOFTMAX_SCALE:
        raise ValueError(f"{name} must be at most {MAX_SOFTMAX_SCALE:.4g} (times log2(e) it must stay "
                         f"finite in float32), got {value}")
    return value


def check_cache_dtype(kv_cache) -> None:
    """A cache is floating of at least 16 bits (a plain cache), uint8 (the fp8 cache) or
    float8_e4m3fn (the e4m3 cache; docs/fp8-cache.md)."""
    if not (is_value_float(kv_cache.dtype) or fp8_cache.is_fp8_cache(kv_cache)
            or e4m3_cache.is_e4m3_cache(kv_cache)):
        raise TypeError(f"kv_cache must have a floating dtype of at least 16 bits, uint8 for an fp8 "
                        f"cache or float8_e4m3fn for an e4m3 cache (docs/fp8-cache.md), got "
                        f"{kv_cache.dtype}")


def check_fp8_row_size(kv_cache, kv_lora_rank: int, rope_dim: int, widths: str) -> None:
    """ValueError unless an fp8 cache's rows are the bytes of ``fp8_cache.layout(kv_lora_rank,
    rope_dim)``; ``widths`` says where the widths came from."""
    expected = fp8_cache.layout(kv_lora_rank, rope_dim).row_bytes
    if kv_cache.shape[-1] != expected:
        raise ValueError(f"kv_cache is an fp8 cache (uint8), so its last dim must be {expected} bytes "
                         f"per token for {widths} (docs/fp8-cache.md), got kv_cache shape "
                         f"{tuple(kv_cache.shape)}")


def split_head_dim(head_dim: int, kv_lora_rank: int | None,
                   source: str = "the head dim") -> tuple[int, int]:
    """(kv_lora_rank, rope_dim) for a cached row of ``head_dim`` channels, read from ``source``
    (e.g. "query's last dim")."""
    if kv_lora_rank is None:
        if head_dim <= DEFAULT_ROPE_DIM:
            raise ValueError(
                f"{source} must exceed the default rope_dim {DEFAULT_ROPE_DIM} (kv_lora_rank "
                f"defaults to it less {DEFAULT_ROPE_DIM}; pass kv_lora_rank= for another split), "
                f"got {head_dim}")
        kv_lora_rank = head_dim - DEFAULT_ROPE_DIM
    kv_lora_rank = check_int("kv_lora_rank", kv_lora_rank, minimum=None)
    if not 0 < kv_lora_rank < head_dim:
        raise ValueError(
            f"kv_lora_rank must be in (0, {head_dim}) for {source} {head_dim} "
            f"(kv_lora_rank + rope_dim), got {kv_lora_rank}"
        )
    return kv_lora_rank, head_dim - kv_lora_rank


def check_plan_lengths(seq_lens) -> int:
    """A planner's ``seq_lens``, int32 [B] with B >= 1; returns B."""
    check_rank("seq_lens", seq_lens, 1, "[batch]")
    check_int32("seq_lens", seq_lens)
    if seq_lens.shape[0] < 1:
        raise ValueError(f"seq_lens must hold at least one request, got shape "
                         f"{tuple(seq_lens.shape)}")
    return seq_lens.shape[0]


def check_cache_sizes(kv_cache) -> None:
    """A cache has at least one page of at least one token."""
    for dim, name in ((0, "num_pages"), (1, "page_size")):
        if kv_cache.shape[dim] < 1:
            raise ValueError(f"kv_cache's {name} (dim {dim}) must be >= 1, got kv_cache shape "
                             f"{tuple(kv_cache.shape)}")


def check_decode_args(query, kv_cache, block_tables, seq_lens, kv_lora_rank):
    """Validate ``decode``'s arrays; returns (B, q_len, H, kv_lora_rank, rope_dim, page_size)."""
    batch, q_len, num_heads, head_dim = check_rank(
        "query", query, 4, "[batch, q_len, num_heads, kv_lora_rank + rope_dim]"
    )
    _, page_size, cache_dim = check_rank(
        "kv_cache", kv_cache, 3, "[num_pages, page_size, kv_lora_rank + rope_dim]"
    )
    check_rank("block_tables", block_tables, 2, "[batch, max_pages]")
    check_rank("seq_lens", seq_lens, 1, "[batch]")
    check_floating("query", query)
    check_cache_dtype(kv_cache)
    fp8 = fp8_cache.is_fp8_cache(kv_cache)
    if not (fp8 or e4m3_cache.is_e4m3_cache(kv_cache)) and query.dtype != kv_cache.dtype:
        raise TypeError(
            f"query and kv_cache must have the same dtype (or kv_cache an fp8 cache, uint8, or an "
            f"e4m3 cache, float8_e4m3fn), got query {query.dtype} and kv_cache {kv_cache.dtype}"
        )
    check_int32("block_tables", block_tables)
    check_int32("seq_lens", seq_lens)
    if not fp8 and cache_dim != head_dim:
        raise ValueError(
            f"kv_cache's last dim must equal query's last dim {head_dim} "
            f"(kv_lora_rank + rope_dim), got kv_cache shape {tuple(kv_cache.shape)}"
        )
    if batch < 1:
        raise ValueError(f"query's batch (dim 0) must be >= 1 (an empty batch has nothing to decode), "
                         f"got query shape {tuple(query.shape)}")
    if q_len < 1:
        raise ValueError(f"query's q_len (dim 1) must be >= 1, got query shape {tuple(query.shape)}")
    if num_heads < 1:
        raise ValueError(f"query's num_heads (dim 2) must be >= 1, got query shape {tuple(query.shape)}")
    check_cache_sizes(kv_cache)
    if block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must have shape [batch={batch}, max_pages], got {tuple(block_tables.shape)}"
        )
    if block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must have at least one page column, got {tuple(block_tables.shape)}")
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens must have shape [batch={batch}], got {tuple(seq_lens.shape)}")
    capacity = block_tables.shape[1] * page_size
    if capacity >= 2**31:
        raise ValueError(f"block_tables' capacity max_pages * page_size must be < 2**31 tokens (the "
                         f"lengths are int32), got {block_tables.shape[1]} * {page_size} = {capacity}")
    kv_lora_rank, rope_dim = split_head_dim(head_dim, kv_lora_rank, "query's last dim")
    if fp8:
        check_fp8_row_size(kv_cache, kv_lora_rank, rope_dim,
                           f"query's head dim {head_dim} (kv_lora_rank {kv_lora_rank} + rope_dim "
                           f"{rope_dim})")
    return batch, q_len, num_heads, kv_lora_rank, rope_dim, page_size


def check_slot_count(owner: str, num_pages: int, page_size: int, got: str) -> None:
    """ValueError unless a cache of ``num_pages`` pages of ``page_size`` tokens has fewer than
    2**31 token slots, which write_kv's int32 slot_mapping can address; ``owner`` prefixes the
    sizes' names and ``got`` says what was given."""
    if num_pages * page_size >= 2**31:
        raise ValueError(f"{owner}num_pages * page_size must be < 2**31 token slots (slot_mapping "
                         f"is int32), got {got}")


def check_write_args(kv_cache, latent, k_rope, slot_mapping, kv_lora_rank=None):
    """Validate ``write_kv``'s arrays; returns (kv_lora_rank, rope_dim)."""
    _, _, head_dim = check_rank("kv_cache", kv_cache, 3, "[num_pages, page_size, kv_lora_rank + rope_dim]")
    num_tokens, latent_dim = check_rank("latent", latent, 2, "[num_tokens, kv_lora_rank]")
    _, rope_dim = check_rank("k_rope", k_rope, 2, "[num_tokens, rope_dim]")
    check_rank("slot_mapping", slot_mapping, 1, "[num_tokens]")
    check_cache_dtype(kv_cache)
    check_floating("latent", latent)
    check_floating("k_rope", k_rope)
    check_int32("slot_mapping", slot_mapping)
    check_cache_sizes(kv_cache)
    check_slot_count("kv_cache's ", kv_cache.shape[0], kv_cache.shape[1],
                     f"kv_cache shape {tuple(kv_cache.shape)}")
    if k_rope.shape[0] != num_tokens:
        raise ValueError(f"k_rope must have shape [num_tokens={num_tokens}, rope_dim], got {tuple(k_rope.shape)}")
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"slot_mapping must have shape [num_tokens={num_tokens}], got {tuple(slot_mapping.shape)}")
    widths = f"latent {tuple(latent.shape)}, k_rope {tuple(k_rope.shape)}"
    if fp8_cache.is_fp8_cache(kv_cache):
        if latent_dim < 1 or rope_dim < 1:
            raise ValueError(f"latent and k_rope must each have a last dim >= 1 (kv_lora_rank and "
                             f"rope_dim), got {widths}")
        if kv_lora_rank is not None and check_int("kv_lora_rank", kv_lora_rank) != latent_dim:
            raise ValueError(f"latent's last dim must be kv_lora_rank={kv_lora_rank}, got {widths}")
        check_fp8_row_size(kv_cache, latent_dim, rope_dim,
                           f"kv_lora_rank {latent_dim} (latent's last dim) and rope_dim {rope_dim} "
                           "(k_rope's last dim)")
        return latent_dim, rope_dim
    expected_rank, expected_rope = split_head_dim(head_dim, kv_lora_rank, "kv_cache's last dim")
    if (latent_dim, rope_dim) != (expected_rank, expected_rope):
        swapped = (rope_dim, latent_dim) == (expected_rank, expected_rope)
        raise ValueError(
            f"latent must be [num_tokens, kv_lora_rank={expected_rank}] and k_rope [num_tokens, "
            f"rope_dim={expected_rope}] for kv_cache's last dim {head_dim} (kv_lora_rank "
            f"defaults to it less {DEFAULT_ROPE_DIM}; pass kv_lora_rank= for another split), got "
            f"{widths}" + ("; latent and k_rope look swapped" if swapped else ""))
    return latent_dim, rope_dim
