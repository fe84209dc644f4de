"""jax_mla.decode against the torch reference, for every backend this machine can run."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import backend_params, make_problem, relative_error, tolerance

import jax_mla
from jax_mla import xla_backend
from jax_mla.reference import reference_from_jax

BACKENDS = backend_params()
SHAPES = list(itertools.product([1, 3, 8], [1, 2, 4], [16, 128], [1, 16, 32, 64]))


def dtype_for(backend):
    return jnp.float32 if backend == "xla" else jnp.bfloat16


def check_against_reference(problem, backend, *, output_scale=1.0, kv_lora_rank=None, jit=True):
    kwargs = dict(softmax_scale=problem.softmax_scale, output_scale=output_scale,
                  kv_lora_rank=kv_lora_rank)
    fn = lambda q, kv, bt, sl: jax_mla.decode(q, kv, bt, sl, return_lse=True, backend=backend, **kwargs)
    out, lse = (jax.jit(fn) if jit else fn)(*problem.arrays)
    ref_out, ref_lse = reference_from_jax(*problem.arrays, **kwargs)
    assert out.dtype == problem.query.dtype and lse.dtype == jnp.float32
    assert not np.isnan(np.asarray(out, np.float32)).any(), "NaN leaked from masked cache memory"
    err = relative_error(out, ref_out.numpy())
    lse_err = float(np.abs(np.asarray(lse) - ref_lse.numpy()).max())
    tol = tolerance(problem.query.dtype)
    assert err < tol, f"output relative error {err:.2e} >= {tol}"
    assert lse_err < tol * 10, f"lse abs error {lse_err:.2e}"
    return err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch,q_len,num_heads,page_size", SHAPES)
def test_matches_reference(backend, batch, q_len, num_heads, page_size):
    seed = hash((batch, q_len, num_heads, page_size)) % 2**31
    problem = make_problem(seed, batch=batch, q_len=q_len, num_heads=num_heads, page_size=page_size,
                           dtype=dtype_for(backend))
    check_against_reference(problem, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_eager_equals_jit(backend):
    problem = make_problem(1, batch=3, q_len=2, num_heads=16, page_size=16, dtype=dtype_for(backend))
    kwargs = dict(softmax_scale=problem.softmax_scale, backend=backend)
    eager = jax_mla.decode(*problem.arrays, **kwargs)
    jitted = jax.jit(lambda *a: jax_mla.decode(*a, **kwargs))(*problem.arrays)
    np.testing.assert_array_equal(np.asarray(eager, np.float32), np.asarray(jitted, np.float32))
    check_against_reference(problem, backend, jit=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_latent_rank(backend):
    problem = make_problem(2, batch=3, q_len=2, num_heads=16, page_size=32, kv_lora_rank=256,
                           dtype=dtype_for(backend))
    check_against_reference(problem, backend, kv_lora_rank=256)
    out = jax_mla.decode(*problem.arrays, softmax_scale=problem.softmax_scale, backend=backend)
    assert out.shape == (3, 2, 16, 256)


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_scale_and_long_sequences(backend):
    problem = make_problem(3, batch=3, q_len=1, num_heads=16, page_size=64, max_len=3000,
                           dtype=dtype_for(backend))
    check_against_reference(problem, backend, output_scale=0.37)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lengths_all_one_and_all_page_multiples(backend):
    for seq_lens in ([1, 1, 1, 1], [32, 64, 96, 128]):
        problem = make_problem(4, batch=4, q_len=1, num_heads=16, page_size=32, seq_lens=seq_lens,
                               dtype=dtype_for(backend))
        check_against_reference(problem, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tables_and_lengths_are_traced(backend):
    """One compiled program serves different lengths and tables of the same shape."""
    first = make_problem(5, batch=3, q_len=1, num_heads=16, page_size=16, seq_lens=[5, 40, 70],
                         dtype=dtype_for(backend))
    traces = []

    @jax.jit
    def step(q, kv, bt, sl):
        traces.append(1)
        return jax_mla.decode(q, kv, bt, sl, softmax_scale=0.1, backend=backend)

    step(*first.arrays)
    shorter = jnp.asarray([3, 17, 33], jnp.int32)
    # Each request's pages in another order (the ids past a request's last page stay garbage).
    rng = np.random.default_rng(0)
    tables = np.asarray(first.block_tables).copy()
    for row, length in zip(tables, np.asarray(shorter)):
        used = -(-int(length) // first.kv_cache.shape[1])
        row[:used] = rng.permutation(row[:used])
    shuffled = jnp.asarray(tables)
    for bt in (first.block_tables, shuffled):
        out = step(first.query, first.kv_cache, bt, shorter)
        ref, _ = reference_from_jax(first.query, first.kv_cache, bt, shorter, softmax_scale=0.1)
        assert relative_error(out, ref.numpy()) < tolerance(first.query.dtype)
    assert len(traces) == 1


def test_xla_backend_bfloat16():
    problem = make_problem(6, batch=3, q_len=2, num_heads=16, page_size=16, dtype=jnp.bfloat16)
    err = check_against_reference(problem, "xla")
    assert err < 1e-2


def test_xla_backend_memory_is_bounded_by_the_chunk():
    """Temporaries scale with the chunk, not with max_len: no full gather, no full logits."""
    batch, num_heads, page_size, max_pages = 4, 16, 16, 1024  # 16k tokens per request
    args = (
        jax.ShapeDtypeStruct((batch, 1, num_heads, 576), jnp.float32),
        jax.ShapeDtypeStruct((batch * max_pages, page_size, 576), jnp.float32),
        jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )
    compiled = jax.jit(lambda *a: jax_mla.decode(*a, softmax_scale=0.1, backend="xla")).lower(
        *args).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    full_gather = batch * max_pages * page_size * 576 * 4
    chunk_gather = batch * xla_backend.CHUNK_TOKENS * 576 * 4
    assert temp < 4 * chunk_gather, (temp, chunk_gather)
    assert temp < full_gather / 8, (temp, full_gather)


def test_auto_on_cpu_is_xla():
    assert jax_mla.available_backends("cpu") == ["xla"]
    problem = make_problem(7, batch=1, q_len=1, num_heads=16, page_size=16)
    auto = jax_mla.decode(*problem.arrays, softmax_scale=0.1)
    xla = jax_mla.decode(*problem.arrays, softmax_scale=0.1, backend="xla")
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(xla))
