"""The e4m3 cache: a float cache of float8_e4m3fn values with one scale for the whole cache.

``kv_cache[num_pages, page_size, kv_lora_rank + rope_dim]`` of dtype float8_e4m3fn, laid out as a
bf16 cache; a value is its e4m3 value times ``kv_scale``, one positive float for the latent and
the rope alike, which the caller keeps (a per-layer constant, as a calibrated checkpoint gives it)
and passes to ``write_kv`` and ``decode``. This is the layout FlashInfer's fa3/fa2 fp8 MLA kernels
read and vLLM-style engines keep (docs/fp8-cache.md, "The e4m3 cache"). Half the bytes of bf16;
finite values beyond 448 times the scale saturate; inf and NaN are stored as NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_mla import validation
from jax_mla.fp8_cache import to_e4m3

E4M3 = "e4m3"  # the cache format's name in jax_mla.backends
DTYPE = jnp.dtype(jnp.float8_e4m3fn)


def is_e4m3_cache(kv_cache) -> bool:
    """Whether an array (or shape-dtype struct) is an e4m3 cache: its dtype is float8_e4m3fn."""
    return jnp.dtype(kv_cache.dtype) == DTYPE


def check_kv_scale(kv_cache, kv_scale) -> float | None:
    """``kv_scale`` as a float for an e4m3 cache, where it is required (finite and > 0), and None
    for any other cache, which takes none; TypeError or ValueError naming ``kv_scale`` otherwise."""
    if not is_e4m3_cache(kv_cache):
        if kv_scale is not None:
            raise TypeError(f"kv_scale is for an e4m3 cache (float8_e4m3fn) only; kv_cache has "
                            f"dtype {kv_cache.dtype}, so pass kv_scale=None, got {kv_scale!r}")
        return None
    if kv_scale is None:
        raise TypeError("kv_cache is an e4m3 cache (float8_e4m3fn): pass kv_scale, the float its "
                        "values are multiplied by (docs/fp8-cache.md)")
    kv_scale = validation.check_positive_scale("kv_scale", kv_scale)
    return kv_scale


def quantize(rows: jax.Array, kv_scale) -> jax.Array:
    """float8_e4m3fn [..., D] of float rows [..., D]: ``rows / kv_scale`` (a float, or a float32
    scalar array) in float32, clipped to [-448, 448] and rounded to the nearest e4m3 (ties to
    even); inf and NaN become NaN (e4m3 has no inf), so they never read back as finite."""
    e4m3 = to_e4m3(rows, jnp.float32(kv_scale))
    return jnp.where(jnp.isfinite(rows), e4m3, jnp.asarray(jnp.nan, e4m3.dtype))
