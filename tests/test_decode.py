"""jax_mla.decode against the torch reference, for every backend this machine can run."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (backend_params, check_accuracy, make_problem, request_head_error,
                      tolerances)
from oracles import per_token_decode

import jax_mla
from jax_mla import xla_backend
from jax_mla.reference import reference_from_jax

BACKENDS = backend_params()
SHAPES = list(itertools.product([1, 3, 8], [1, 2, 4], [16, 128], [1, 16, 32, 64]))


def dtype_for(backend):
    return jnp.float32 if backend == "xla" else jnp.bfloat16


def rejection(backend, problem, kv_lora_rank=None) -> str | None:
    """The ValueError message with which ``backend`` must refuse this problem, or None if it runs it."""
    if backend != "sm90":
        return None
    _, q_len, _, head_dim = problem.query.shape
    page_size = problem.kv_cache.shape[1]
    if (kv_lora_rank or head_dim - 64) != 512:
        return r"sm90 supports \(kv_lora_rank, rope_dim\) = \(512, 64\), got \(256, 64\)"
    if page_size not in (32, 64):
        return rf"sm90 needs kv_cache page_size in \(32, 64\), got {page_size}"
    if q_len > 4:
        return rf"sm90 supports query q_len \(dim 1\) in \[1, 4\], got {q_len}"
    return None


def rejected(problem, backend, **kwargs) -> bool:
    """Whether ``backend`` must refuse the problem; if so, check that it does, at trace time."""
    message = rejection(backend, problem, kwargs.get("kv_lora_rank"))
    if message is not None:
        with pytest.raises(ValueError, match=message):
            jax.jit(lambda *a: jax_mla.decode(*a, backend=backend, **kwargs)).trace(*problem.arrays)
    return message is not None


def check_against_reference(problem, backend, *, output_scale=1.0, kv_lora_rank=None, jit=True):
    kwargs = dict(softmax_scale=problem.softmax_scale, output_scale=output_scale,
                  kv_lora_rank=kv_lora_rank)
    if rejected(problem, backend, **kwargs):
        return None
    fn = lambda q, kv, bt, sl: jax_mla.decode(q, kv, bt, sl, return_lse=True, backend=backend, **kwargs)
    out, lse = (jax.jit(fn) if jit else fn)(*problem.arrays)
    ref_out, ref_lse = reference_from_jax(*problem.arrays, **kwargs)
    assert out.dtype == problem.query.dtype and lse.dtype == jnp.float32
    assert not np.isnan(np.asarray(out, np.float32)).any(), "NaN leaked from masked cache memory"
    return check_accuracy(out, lse, ref_out.numpy(), ref_lse.numpy(), backend=backend)[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch,q_len,num_heads,page_size", SHAPES)
def test_matches_reference(backend, batch, q_len, num_heads, page_size):
    seed = hash((batch, q_len, num_heads, page_size)) % 2**31
    problem = make_problem(seed, batch=batch, q_len=q_len, num_heads=num_heads, page_size=page_size,
                           dtype=dtype_for(backend))
    check_against_reference(problem, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_eager_equals_jit(backend):
    problem = make_problem(1, batch=3, q_len=2, num_heads=16, page_size=32, dtype=dtype_for(backend))
    kwargs = dict(softmax_scale=problem.softmax_scale, backend=backend)
    eager = jax_mla.decode(*problem.arrays, **kwargs)
    jitted = jax.jit(lambda *a: jax_mla.decode(*a, **kwargs))(*problem.arrays)
    np.testing.assert_array_equal(np.asarray(eager, np.float32), np.asarray(jitted, np.float32))
    check_against_reference(problem, backend, jit=False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_small_latent_rank(backend):
    problem = make_problem(2, batch=3, q_len=2, num_heads=16, page_size=32, kv_lora_rank=256,
                           dtype=dtype_for(backend))
    if check_against_reference(problem, backend, kv_lora_rank=256) is None:
        return
    out = jax_mla.decode(*problem.arrays, softmax_scale=problem.softmax_scale, backend=backend)
    assert out.shape == (3, 2, 16, 256)


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_scale_and_long_sequences(backend):
    problem = make_problem(3, batch=3, q_len=1, num_heads=16, page_size=64, max_len=3000,
                           dtype=dtype_for(backend))
    check_against_reference(problem, backend, output_scale=0.37)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_len,num_heads", [(1, 16), (2, 16), (1, 128)])
def test_values_growing_along_each_request(backend, q_len, num_heads):
    """Scores that keep rising along each request (make_problem's growth), so that the running
    maximum moves every few blocks, between blocks that leave it where it is. bf16 data for every
    backend, and for xla slower growth: xla's float32 scores differ from the reference's by their
    rounding, which grows with the scores, and its lse tolerance is float32's."""
    growth = 1 / 2048 if backend == "xla" else 1 / 512
    problem = make_problem(5, batch=4, q_len=q_len, num_heads=num_heads, page_size=64,
                           seq_lens=[2500, 1900, 3000, 777], growth=growth, dtype=jnp.bfloat16)
    check_against_reference(problem, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_lengths_all_one_and_all_page_multiples(backend):
    for seq_lens in ([1, 1, 1, 1], [32, 64, 96, 128]):
        problem = make_problem(4, batch=4, q_len=1, num_heads=16, page_size=32, seq_lens=seq_lens,
                               dtype=dtype_for(backend))
        check_against_reference(problem, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_tables_and_lengths_are_traced(backend):
    """One compiled program serves different lengths and tables of the same shape."""
    first = make_problem(5, batch=3, q_len=1, num_heads=16, page_size=32, seq_lens=[5, 40, 70],
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
        assert request_head_error(out, ref.numpy()) < tolerances(backend, first.query.dtype)[0]
    assert len(traces) == 1


@pytest.mark.parametrize("seed,q_len,page_size", [(6, 2, 16), (8, 1, 64), (9, 4, 1)])
def test_xla_backend_bfloat16(seed, q_len, page_size):
    problem = make_problem(seed, batch=4, q_len=q_len, num_heads=16, page_size=page_size,
                           max_len=700, dtype=jnp.bfloat16)
    check_against_reference(problem, "xla")


def check_against_per_token_loop(problem, backend, *, kv_lora_rank=512, output_scale=1.0):
    """decode and the torch reference both against ``oracles.per_token_decode``."""
    kwargs = dict(softmax_scale=problem.softmax_scale, output_scale=output_scale,
                  kv_lora_rank=kv_lora_rank)
    if rejected(problem, backend, **kwargs):
        return
    out, lse = jax.jit(lambda *a: jax_mla.decode(*a, backend=backend, return_lse=True, **kwargs))(
        *problem.arrays)
    want_out, want_lse = per_token_decode(*problem.arrays, **kwargs)
    check_accuracy(out, lse, want_out, want_lse, backend=backend)
    ref_out, ref_lse = reference_from_jax(*problem.arrays, **kwargs)  # what the GPU tests trust
    check_accuracy(ref_out.numpy(), ref_lse.numpy(), want_out, want_lse, backend="reference")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_len,page_size,seq_lens", [
    (2, 16, [2, 3, 16, 17, 40]),
    (3, 1, [3, 4, 9]),
    (5, 8, [5, 8, 9, 13, 64]),
    (8, 64, [8, 63, 64, 65, 200]),
])
def test_multi_token_queries_against_a_per_token_loop(backend, q_len, page_size, seq_lens):
    """q_len > 1: each new token sees the cache up to its own position, checked one token at a time."""
    problem = make_problem(q_len, batch=len(seq_lens), q_len=q_len, num_heads=16, page_size=page_size,
                           seq_lens=seq_lens, dtype=dtype_for(backend))
    check_against_per_token_loop(problem, backend, output_scale=0.75)


def chunk_tokens(page_size: int) -> int:
    """Tokens per step of the xla backend's loop: whole pages, CHUNK_TOKENS of them at most unless
    one page is larger."""
    return page_size * max(1, xla_backend.CHUNK_TOKENS // page_size)


@pytest.mark.parametrize("page_size", [1, 16, 48, 200, 1024])
def test_online_softmax_across_chunk_boundaries(page_size):
    """Lengths on both sides of one, two and three chunks (with several pages per chunk where the
    page size allows), a new token on each side of a boundary, and a short request beside them."""
    chunk = chunk_tokens(page_size)
    lengths = [chunk - 1, chunk, chunk + 1, 2 * chunk, 2 * chunk + 1, 3 * chunk - 1, 3]
    problem = make_problem(page_size, batch=len(lengths), q_len=3, num_heads=16, page_size=page_size,
                           seq_lens=lengths)
    check_against_per_token_loop(problem, "xla")


def test_output_scale_multiplies_the_output_exactly():
    """xla: output_scale s gives s times the output of s = 1, and leaves the lse alone."""
    problem = make_problem(10, batch=3, q_len=2, num_heads=16, page_size=16)
    run = lambda s: jax_mla.decode(*problem.arrays, softmax_scale=problem.softmax_scale,  # noqa: E731
                                   output_scale=s, backend="xla", return_lse=True)
    unscaled, unscaled_lse = run(1.0)
    for scale in (0.5, -2.0, 0.37, 1e-3):
        out, lse = run(scale)
        np.testing.assert_allclose(np.asarray(out), scale * np.asarray(unscaled), rtol=3e-7, atol=0)
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(unscaled_lse))


def xla_temp_bytes(cache: jax.ShapeDtypeStruct, query_dtype, *, batch: int, num_heads: int) -> int:
    """Temporary bytes of the compiled xla decode of one new token per request over ``cache``, every
    request owning cache.shape[0] / batch pages."""
    max_pages = cache.shape[0] // batch
    args = (
        jax.ShapeDtypeStruct((batch, 1, num_heads, 576), query_dtype),
        cache,
        jax.ShapeDtypeStruct((batch, max_pages), jnp.int32),
        jax.ShapeDtypeStruct((batch,), jnp.int32),
    )
    compiled = jax.jit(lambda *a: jax_mla.decode(*a, softmax_scale=0.1, backend="xla")).lower(
        *args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("cache_dtype,row,query_dtype", [
    (jnp.float32, 576, jnp.float32),
    (jnp.bfloat16, 576, jnp.bfloat16),  # on the CPU gathered through float32, chunk by chunk
    (jnp.uint8, 656, jnp.bfloat16),  # the fp8 cache, dequantised chunk by chunk
], ids=["float32", "bf16", "fp8"])
def test_xla_backend_memory_is_bounded_by_the_chunk(cache_dtype, row, query_dtype):
    """Temporaries scale with the chunk, not with max_len: no full gather, no full logits."""
    batch, num_heads, page_size, max_pages = 4, 16, 16, 1024  # 16k tokens per request

    def temp_bytes(pages):
        cache = jax.ShapeDtypeStruct((batch * pages, page_size, row), cache_dtype)
        return xla_temp_bytes(cache, query_dtype, batch=batch, num_heads=num_heads)

    temp = temp_bytes(max_pages)
    full_gather = batch * max_pages * page_size * 576 * 4
    chunk_gather = batch * xla_backend.CHUNK_TOKENS * 576 * 4
    assert temp < 4 * chunk_gather, (temp, chunk_gather)
    assert temp < full_gather / 8, (temp, full_gather)
    assert temp_bytes(4 * max_pages) == temp


def test_auto_on_cpu_is_xla():
    assert jax_mla.available_backends("cpu") == ["xla"]
    problem = make_problem(7, batch=1, q_len=1, num_heads=16, page_size=16)
    auto = jax_mla.decode(*problem.arrays, softmax_scale=0.1)
    xla = jax_mla.decode(*problem.arrays, softmax_scale=0.1, backend="xla")
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(xla))
