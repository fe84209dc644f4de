"""sm90 on the fp8 cache (docs/fp8-cache.md, docs/sm90-kernel.md), every query row count: against the torch reference on the same (dequantised) cache with the bf16 kernel tolerances, and
against the bf16 cache it was quantised from; bad values; "auto"; a jitted step. GPU only."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import (Problem, check_accuracy, fp8_problem, lse_error, make_problem,
                      record_accuracy, request_head_error, scaled_up)
from test_fp8_cache import AGAINST_BF16
from test_sm90 import (SM90, assert_identical, defined_reference, make_step, on_gpu, reference, sm90,
                       sm90_gpu,  # noqa: F401  (the fixture on_gpu names)
                       with_garbage_columns)

import jax_mla
from jax_mla.reference import dequantize_fp8


def sm90_fp8_problem(seed, **shape):
    """(the problem on an fp8 cache, the problem on the bf16 cache it came from); bf16 query."""
    return fp8_problem(make_problem(seed, dtype=jnp.bfloat16, **shape), seed)


def check_both(problem, source, out, lse, output_scale=1.0):
    """Against the reference on the same cache (the bf16 kernel tolerances), and against the
    reference on the bf16 cache it came from (AGAINST_BF16, the quantisation's error)."""
    check_accuracy(out, lse, *reference(problem, output_scale), backend="sm90-fp8")
    bf16_out, bf16_lse = reference(source, output_scale)
    out = np.asarray(out, np.float64)
    errors = (request_head_error(out, bf16_out), lse_error(lse, bf16_lse),
              float(np.linalg.norm(out - bf16_out) / np.linalg.norm(bf16_out)))
    record_accuracy("sm90-fp8-vs-bf16", jnp.bfloat16, **dict(zip(("output", "lse", "l2"), errors)))
    assert all(e < bound for e, bound in zip(errors, AGAINST_BF16)), (errors, AGAINST_BF16)


@pytest.mark.parametrize("page_size", [32, 64])
@pytest.mark.parametrize("q_len,num_heads", [(1, 8), (1, 16), (1, 32), (2, 16), (3, 8), (4, 8),
                                             (2, 3), (1, 64), (1, 128), (3, 16), (2, 128)])
@pytest.mark.parametrize("batch", [1, 3, 32])
@on_gpu
def test_matches_the_reference_on_the_fp8_cache(batch, q_len, num_heads, page_size):
    """Shuffled pages, garbage table padding, unused rows of NaN bytes (fp8_problem); run twice:
    bit-identical. 6, 8 and 16 query rows run QK^T from registers, 24 and 32 from the tile, 48 and
    more in 64-row tiles."""
    problem, source = sm90_fp8_problem(200 + batch, batch=batch, q_len=q_len, num_heads=num_heads,
                                       page_size=page_size, max_len=700,
                                       seq_lens=[555] if batch == 1 else None)
    first = sm90(problem)
    check_both(problem, source, *first)
    assert_identical(first, sm90(problem))


@pytest.mark.parametrize("num_heads,q_len", [(16, 1), (16, 2), (8, 4), (1, 1), (128, 1), (64, 2)])
@on_gpu
def test_skewed_lengths_and_output_scale_on_the_fp8_cache(num_heads, q_len):
    """One long request among short ones: split over many parts and merged by the combine kernel."""
    lengths = [q_len, 40_000, 1 + q_len, 64, 65, 4097, 128, 3000]
    problem, source = sm90_fp8_problem(8, batch=len(lengths), q_len=q_len, num_heads=num_heads,
                                       page_size=64, seq_lens=lengths)
    first = sm90(problem, output_scale=0.37)
    check_both(problem, source, *first, output_scale=0.37)
    assert_identical(first, sm90(problem, output_scale=0.37))


@pytest.mark.parametrize("num_heads", [128, 64])
@pytest.mark.parametrize("extra_columns", [0, 400])
@on_gpu
def test_both_sides_of_the_column_halves_rule_on_the_fp8_cache(num_heads, extra_columns):
    """One request's parts of the 64-row tiles on two CTAs each, one a half of the output's
    columns, where its block table is narrow (64 pages: UseColumnHalves in ffi/sm90/launch.cuh),
    and whole where garbage columns widen it: both match the reference, each run twice
    bit-identical."""
    problem, source = sm90_fp8_problem(24, batch=1, q_len=1, num_heads=num_heads, page_size=64,
                                       seq_lens=[4000])
    assert problem.block_tables.shape == (1, 64)
    problem = with_garbage_columns(problem, extra_columns, seed=7)
    first = sm90(problem)
    check_both(problem, source, *first)
    assert_identical(first, sm90(problem))


@pytest.mark.parametrize("num_heads,q_len", [(16, 1), (16, 2), (128, 1)])
@on_gpu
def test_values_growing_along_each_request_on_the_fp8_cache(num_heads, q_len):
    """Rows growing along each request (make_problem's growth): the rows' running maxima move
    every few blocks, between blocks that leave them, and the groups' power-of-two running
    maximum scales step up along the request."""
    problem, _ = sm90_fp8_problem(9, batch=4, q_len=q_len, num_heads=num_heads, page_size=64,
                                  seq_lens=[2500, 1900, 3000, 777], growth=1 / 512)
    first = sm90(problem)
    # Against the reference on the same cache only: scores this large magnify the quantisation's
    # error beyond AGAINST_BF16, whose bounds are those of N(0, 1) rows.
    check_accuracy(*first, *reference(problem), backend="sm90-fp8")
    assert_identical(first, sm90(problem))


@pytest.mark.parametrize("num_heads,q_len", [(16, 1), (16, 2), (128, 1)])
@on_gpu
def test_large_group_scales_on_the_fp8_cache(num_heads, q_len):
    """Rows 2^14 times larger, softmax_scale over it (scaled_up): the same scores, group scales of
    2^7 and 2^8 (write_kv's reach 2^119) through each kernel kind's conversion."""
    base = make_problem(10, batch=3, q_len=q_len, num_heads=num_heads, page_size=64,
                        dtype=jnp.bfloat16, seq_lens=[700, 65, 1300])
    problem, source = fp8_problem(scaled_up(base), 10)
    first = sm90(problem)
    check_both(problem, source, *first)
    assert_identical(first, sm90(problem))


@pytest.mark.parametrize("num_heads", [16, 64])
@pytest.mark.parametrize("page_size", [32, 64])
@on_gpu
def test_bad_inputs_give_the_defined_result_on_the_fp8_cache(page_size, num_heads):
    """Out-of-range page ids inside the lengths, lengths over the table's capacity, below q_len,
    zero and negative, beneath decode's guard: the documented result on the dequantised cache, and
    nothing from the rows of NaN bytes that no table names."""
    rng = np.random.default_rng(6)
    q_len, max_pages, num_pages = 2, 4, 40
    lengths = np.array([0, -5, 1, 1000, 70, 2**31 - 1, 2, 100, -(2**31)], np.int32)
    tables = rng.integers(0, 30, size=(len(lengths), max_pages)).astype(np.int32)  # pages 30.. unnamed
    tables[3, 1] = -1
    tables[4, 0] = num_pages
    tables[5, 2] = 10**6
    tables[7, :] = -(2**31)
    cache = rng.standard_normal((num_pages, page_size, 576)).astype(np.float32)
    cache[30:] = np.nan
    query = rng.standard_normal((len(lengths), q_len, num_heads, 576))
    quantised, _ = fp8_problem(Problem(jnp.asarray(query, jnp.bfloat16), jnp.asarray(cache),
                                       jnp.asarray(tables), jnp.asarray(lengths), 0.1), 6)
    kernel_only = dict(softmax_scale=0.1, backend=SM90, return_lse=True, fail_closed=False)
    first = jax_mla.decode(*quantised.arrays, **kernel_only)
    jax.block_until_ready(first)
    rows = torch.from_numpy(np.asarray(quantised.kv_cache).reshape(num_pages * page_size, -1))
    dequantised = jnp.asarray(dequantize_fp8(rows, 512).numpy().reshape(num_pages, page_size, 576))
    check_accuracy(*first, *defined_reference(quantised.query, dequantised, tables, lengths, 0.1),
                   backend="sm90-fp8")
    assert_identical(first, jax_mla.decode(*quantised.arrays, **kernel_only))


@pytest.mark.parametrize("q_len,num_heads", [(1, 16), (2, 16), (1, 64), (1, 128)])
@on_gpu
def test_auto_on_the_fp8_cache_is_sm90(q_len, num_heads):
    """Bit for bit the named backend's result, under jit."""
    problem, _ = sm90_fp8_problem(42, batch=4, q_len=q_len, num_heads=num_heads, page_size=64,
                                  max_len=1500)

    def run(backend):
        return jax.jit(lambda *a: jax_mla.decode(*a, softmax_scale=problem.softmax_scale,
                                                 backend=backend, return_lse=True))(*problem.arrays)

    assert_identical(run("auto"), run(SM90))


@on_gpu
def test_inside_jit_and_scan_over_fp8_layers():
    """Four layers' fp8 caches under lax.scan: each layer's result is a lone call's."""
    base = make_problem(44, batch=6, q_len=2, num_heads=16, page_size=64, max_len=2000,
                        dtype=jnp.bfloat16)
    problem = fp8_problem(base, 44)[0]
    caches = jnp.stack([
        fp8_problem(dataclasses.replace(base, kv_cache=base.kv_cache * (1 + 0.05 * i)), 44)[0].kv_cache
        for i in range(4)])
    outs, lses = make_step(problem.softmax_scale, chain=False)(problem.query, caches,
                                                               problem.block_tables, problem.seq_lens)
    for i in range(caches.shape[0]):
        lone = jax_mla.decode(problem.query, caches[i], problem.block_tables, problem.seq_lens,
                              softmax_scale=problem.softmax_scale, backend=SM90, return_lse=True)
        assert_identical((outs[i], lses[i]), lone)


def sanitize_program() -> None:
    """The fp8 cache's bad-value cases and a skewed problem through jax_mla.decode, for
    ``compute-sanitizer`` (docs/testing.md): the kernel may touch no memory outside the cache, the
    tables, its workspace and its outputs."""
    for page_size in (32, 64):
        for num_heads in (16, 64):
            test_bad_inputs_give_the_defined_result_on_the_fp8_cache(page_size, num_heads)
            print(f"ok bad values page_size={page_size} num_heads={num_heads}", flush=True)
    for num_heads, q_len in ((16, 2), (128, 1)):
        test_skewed_lengths_and_output_scale_on_the_fp8_cache(num_heads, q_len)
        print(f"ok skewed lengths num_heads={num_heads} q_len={q_len}", flush=True)
