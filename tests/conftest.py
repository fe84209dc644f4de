"""Shared fixtures: random paged-cache problems with shuffled pages and NaN-poisoned unused memory."""

from __future__ import annotations

import importlib.util
import os

# Four host devices for tests/test_sharding.py, set before jax is imported; not where a GPU is expected.
if ("xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", "")
        and not any(p in os.environ.get("JAX_PLATFORMS", "") for p in ("cuda", "gpu"))
        and not any(importlib.util.find_spec(m) for m in ("jax_cuda12_plugin", "jax_cuda13_plugin"))):
    os.environ["XLA_FLAGS"] = " ".join(
        filter(None, [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4"]))

import dataclasses
import functools
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_mla
from jax_mla import backends, gpu

jax.config.update("jax_enable_x64", False)

BENCH_DECODE = Path(__file__).parent.parent / "benchmarks" / "decode.py"


@functools.cache
def load_bench_decode():
    """benchmarks/decode.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("bench_decode", BENCH_DECODE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@dataclasses.dataclass
class Problem:
    query: jax.Array
    kv_cache: jax.Array
    block_tables: jax.Array
    seq_lens: jax.Array
    softmax_scale: float

    @property
    def arrays(self):
        return self.query, self.kv_cache, self.block_tables, self.seq_lens


def make_problem(seed, *, batch, q_len, num_heads, page_size, seq_lens=None, max_len=300,
                 kv_lora_rank=512, rope_dim=64, dtype=jnp.float32, spare_pages=3,
                 garbage_tables=True) -> Problem:
    """A decode problem whose unused pages, page tails and table padding are all poisoned."""
    rng = np.random.default_rng(seed)
    head_dim = kv_lora_rank + rope_dim
    if seq_lens is None:
        lengths = rng.integers(q_len, max_len + 1, size=batch)
        lengths[0] = q_len  # the shortest possible request
        if batch > 1:
            lengths[1] = page_size * max(1, max_len // (2 * page_size))  # an exact multiple
    else:
        lengths = np.asarray(seq_lens)
    pages_per_request = -(-lengths // page_size)
    max_pages = int(pages_per_request.max()) + 1  # one padding column at least
    num_pages = int(pages_per_request.sum()) + spare_pages
    order = rng.permutation(num_pages)
    tables = np.full((batch, max_pages), -7, np.int64)
    start = 0
    for b, n in enumerate(pages_per_request):
        tables[b, :n] = order[start:start + n]
        start += n
        if garbage_tables:
            # Padding entries may hold anything, out-of-range ids included.
            tables[b, n:] = rng.choice([-1, num_pages + 5, 10**6, int(order[-1])], size=max_pages - n)
    cache = rng.standard_normal((num_pages, page_size, head_dim)).astype(np.float32)
    written = np.zeros((num_pages, page_size), bool)
    for b, n in enumerate(pages_per_request):
        flat = np.zeros(n * page_size, bool)
        flat[:lengths[b]] = True
        written[tables[b, :n]] = flat.reshape(n, page_size)
    cache[~written] = np.nan
    query = rng.standard_normal((batch, q_len, num_heads, head_dim)).astype(np.float32)
    return Problem(
        query=jnp.asarray(query, dtype),
        kv_cache=jnp.asarray(cache, dtype),
        block_tables=jnp.asarray(tables.astype(np.int32)),
        seq_lens=jnp.asarray(lengths.astype(np.int32)),
        softmax_scale=float(rng.uniform(0.05, 0.2)),
    )


HAS_TVM_FFI = importlib.util.find_spec("tvm_ffi") is not None


@pytest.fixture(scope="session")
def ffi_library_path(tmp_path_factory):
    """The installed FFI library, else one built here from ffi/ (needs nvcc and apache-tvm-ffi)."""
    path = gpu.library_path()
    if path is not None:
        return path
    if shutil.which("nvcc") is None or not HAS_TVM_FFI:
        pytest.skip("needs nvcc and apache-tvm-ffi to build ffi/")
    build = tmp_path_factory.mktemp("ffi-build")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run(["cmake", "-S", root, "-B", str(build), "-DCMAKE_CUDA_ARCHITECTURES=90a"],
                   check=True, capture_output=True)
    subprocess.run(["cmake", "--build", str(build)], check=True, capture_output=True)
    return build / "ffi" / gpu.LIBRARY_NAME


def gpu_backends_here() -> list[str]:
    return [b for b in backends.available_backends() if b != backends.XLA]


def backend_params():
    """Every backend, GPU ones marked ``gpu`` and skipped where this machine cannot run them."""
    params = [pytest.param(backends.XLA, id="xla")]
    runnable = gpu_backends_here()
    for name in (backends.FA3, backends.FA2):
        marks = [pytest.mark.gpu]
        if name not in runnable:
            marks.append(pytest.mark.skip(reason=f"{name} needs a GPU that supports it ({runnable=})"))
        params.append(pytest.param(name, id=name, marks=marks))
    return params


def relative_error(actual, expected) -> float:
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.abs(actual - expected).max() / max(np.abs(expected).max(), 1e-6))


def tolerance(dtype) -> float:
    return 2e-2 if jnp.dtype(dtype) == jnp.bfloat16 else 1e-5


@pytest.fixture
def problem_factory():
    return make_problem


__all__ = ["Problem", "backend_params", "jax_mla", "make_problem", "relative_error", "tolerance"]
