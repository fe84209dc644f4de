"""The decode problem of one point: its paged layout, its cost, its random caches, and the error
measure outputs are checked with.

Host-side parts are numpy only (cheap and deterministic; the grid's cost estimates use them), and
``relative_error`` and ``shuffled_block_tables`` are shared with the tests. JAX is imported only
by ``random_cache``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import warnings

import numpy as np

from benchmarks.grid import Point


@dataclasses.dataclass(frozen=True)
class FloorModel:
    """The floor's two rates on one GPU, as ``python -m benchmarks.floor_rates`` measures them:
    dense bf16 matmul (FLOP/s) and device copy (bytes read plus bytes written per second)."""

    gpu: str
    flops_per_s: float
    bytes_per_s: float


# The GPUs this project measured (docs/performance.md, "The floor"); the first is the default.
FLOOR_MODELS = (FloorModel("NVIDIA H200", 790e12, 4.3e12),
                FloorModel("NVIDIA H100 80GB HBM3", 796e12, 3.03e12))
L2_BYTES = 60e6  # the H200's L2 (the H100's 50 MB is smaller, so its rotation suffices there too)
KV_LORA_RANK = 512
ROPE_DIM = 64
HEAD_DIM = KV_LORA_RANK + ROPE_DIM
FP8_ROW_BYTES = KV_LORA_RANK + 4 * KV_LORA_RANK // 128 + 2 * ROPE_DIM  # the fp8 cache (656)
SOFTMAX_SCALE = 0.135234  # DeepSeek-V3: 192**-0.5 * mscale**2
GIB = 1 << 30


def relative_error(actual, expected) -> float:
    """max |actual - expected| / max |expected|, in float64; inf when ``actual`` is not finite."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    if not np.isfinite(actual).all():
        return float("inf")
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-6))


def fp8_errors(actual, expected) -> tuple[float, float]:
    """An fp8 cache's output against the bf16 cache's reference: (relative_error, the relative L2
    error ||actual - expected|| / ||expected||), both in float64."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    l2 = np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30)
    return relative_error(actual, expected), float(l2) if np.isfinite(l2) else float("inf")


def shuffled_block_tables(rng: np.random.Generator, pages_per_request, num_pages: int | None = None,
                          max_pages: int | None = None, fill: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Block tables over a pool of ``num_pages`` pages (default: just enough), pages in random order.

    One permutation of the pool is dealt out in turn: request b gets the next
    ``pages_per_request[b]`` pages. Returns (int32 tables [B, max_pages] with ``fill`` past each
    request's pages, the pool's pages no request got, in their random order)."""
    pages = np.asarray(pages_per_request)
    used = int(pages.sum())
    num_pages = used if num_pages is None else num_pages
    max_pages = int(pages.max()) if max_pages is None else max_pages
    order = rng.permutation(num_pages).astype(np.int32)
    tables = np.full((len(pages), max_pages), fill, np.int32)
    start = 0
    for b, n in enumerate(pages):
        tables[b, :n] = order[start:start + n]
        start += n
    return tables, order[used:]


@dataclasses.dataclass
class Layout:
    """A point's requests: lengths and shuffled pages of one bf16 cache."""

    point: Point
    seed: int
    lengths: np.ndarray  # int32 [B]
    pages_per_request: np.ndarray
    tables: np.ndarray  # int32 [B, max_pages], pages shuffled, padding 0
    num_pages: int

    @property
    def max_pages(self) -> int:
        return self.tables.shape[1]

    @property
    def cache_bytes(self) -> int:
        return self.num_pages * self.point.page_size * HEAD_DIM * 2

    @property
    def kv_indptr(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.pages_per_request)]).astype(np.int32)

    @property
    def kv_indices(self) -> np.ndarray:
        return np.concatenate([self.tables[b, :n] for b, n in enumerate(self.pages_per_request)]
                              ).astype(np.int32)


def point_seed(pt: Point, base: int) -> int:
    digest = hashlib.sha256(f"{base}:{pt.key}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def make_layout(pt: Point, base_seed: int) -> Layout:
    """Lengths uniform in [L/2, 3L/2], shifted so that their mean is L (B=1 gets exactly L)."""
    seed = point_seed(pt, base_seed)
    rng = np.random.default_rng(seed)
    low, high = pt.L // 2, (3 * pt.L) // 2
    lengths = rng.integers(low, high + 1, size=pt.B)
    lengths = np.clip(lengths + int(round(pt.L - lengths.mean())), low, high)
    lengths = np.maximum(lengths, pt.q_len).astype(np.int32)
    pages = -(-lengths // pt.page_size)
    tables, _ = shuffled_block_tables(rng, pages)
    return Layout(pt, seed, lengths, pages.astype(np.int32), tables, int(pages.sum()))


def floor_model(gpu: str | None) -> FloorModel:
    """The measured floor model of the GPU named ``gpu`` (nvidia-smi's name), else the default's."""
    return next((m for m in FLOOR_MODELS if m.gpu == gpu), FLOOR_MODELS[0])


def work(layout: Layout, cache_row_bytes: int = HEAD_DIM * 2,
         model: FloorModel = FLOOR_MODELS[0]) -> dict:
    """FLOPs, bytes and the floor of one decode call (one layer) on a cache of ``cache_row_bytes``
    a token (bf16 by default; FP8_ROW_BYTES for the fp8 cache), by ``model``'s rates (a run's:
    ``args.floor_model``, its GPU's)."""
    pt = layout.point
    tokens = int(layout.lengths.astype(np.int64).sum())
    flops = 2 * (HEAD_DIM + KV_LORA_RANK) * pt.H * pt.q_len * tokens
    nbytes = tokens * cache_row_bytes + pt.B * pt.q_len * pt.H * (HEAD_DIM + KV_LORA_RANK) * 2
    compute_s = flops / model.flops_per_s
    memory_s = nbytes / model.bytes_per_s
    return {"sum_len": tokens, "mean_len": tokens / pt.B, "max_len": int(layout.lengths.max()),
            "flops": flops, "bytes": nbytes, "intensity": flops / nbytes,
            "floor_us": max(compute_s, memory_s) * 1e6,
            "floor_bound": "compute" if compute_s >= memory_s else "memory"}


def cache_count(layout: Layout, budget_bytes: float, l2_bytes: float = L2_BYTES) -> int:
    """Caches to rotate: enough that the other caches read between two reads of one exceed 2x L2.

    0 when even one cache exceeds the budget (the point is skipped)."""
    size = layout.cache_bytes
    wanted = max(2, 1 + math.ceil(2 * l2_bytes / size))
    return min(wanted, int(budget_bytes // size))


def naive_temp_bytes(layout: Layout) -> int:
    """What plain XLA materialises: the gathered cache plus ~3 float32 copies of the logits."""
    pt = layout.point
    tokens = layout.max_pages * pt.page_size
    return pt.B * tokens * HEAD_DIM * 2 + 3 * pt.B * pt.q_len * pt.H * tokens * 4


_WRITE_CHUNK = None


def _write_chunk_fn():
    import jax
    import jax.numpy as jnp
    from jax import lax

    def write_chunk(cache, key, start, n):
        chunk = jax.random.normal(key, (n,) + cache.shape[1:], jnp.float32).astype(cache.dtype)
        return lax.dynamic_update_slice(cache, chunk, (start, 0, 0))

    return jax.jit(write_chunk, static_argnums=(3,), donate_argnums=(0,))


def random_cache(seed: int, num_pages: int, page_size: int):
    """A [num_pages, page_size, 576] bf16 cache of N(0, 1) values, filled in chunks of ~256 MiB."""
    global _WRITE_CHUNK
    import jax
    import jax.numpy as jnp

    if _WRITE_CHUNK is None:
        _WRITE_CHUNK = _write_chunk_fn()
    cache = jnp.zeros((num_pages, page_size, HEAD_DIM), jnp.bfloat16)
    chunk = max(1, (256 << 20) // (page_size * HEAD_DIM * 4))
    key = jax.random.PRNGKey(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "donated buffers were not usable" on CPU
        for start in range(0, num_pages, chunk):
            key, sub = jax.random.split(key)
            n = min(chunk, num_pages - start)
            cache = _WRITE_CHUNK(cache, sub, np.int32(start), n)
    return cache
