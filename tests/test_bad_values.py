"""Bad values (docs/bad-values.md): each is provoked here and its defined outcome or error checked.

The xla backend's results for bad page ids and lengths are checked against a float64 oracle in
which a token is present only if its position is below the clamped length and its page id is in
range; the checked mode (``checks=True``) is checked eagerly, under ``checkify.checkify`` and jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import check_accuracy, make_problem
from jax.experimental import checkify
from oracles import as_float64, attend
from test_ffi import lower_for_cuda, lowering_stubs, run_backend  # noqa: F401  (a fixture)

import jax_mla
from jax_mla import backends, gpu, planning


# ---- an oracle for bad page ids and lengths --------------------------------------------------------

def present_keys(kv_cache, table_row, length: int) -> np.ndarray:
    """Rows of the tokens at positions [0, length) whose page id lies in [0, num_pages), in order;
    the other positions are absent. float64 [n, D]."""
    num_pages, page_size, head_dim = kv_cache.shape
    ids = [int(table_row[p // page_size]) for p in range(length)]
    rows = [kv_cache[i, p % page_size] for p, i in enumerate(ids) if 0 <= i < num_pages]
    return np.stack(rows) if rows else np.zeros((0, head_dim))


def decode_with_absent_tokens(query, kv_cache, block_tables, seq_lens, *, softmax_scale: float,
                              kv_lora_rank: int = 512):
    """The defined result: lengths clamped to [0, max_pages * page_size]; new token i of a request
    sees the present tokens at positions <= clamped_len - q_len + i. (out [B, q_len, H, R], lse)."""
    query, kv_cache = as_float64(query), as_float64(kv_cache)
    tables = np.asarray(block_tables)
    batch, q_len, num_heads, _ = query.shape
    capacity = tables.shape[1] * kv_cache.shape[1]
    out = np.zeros((batch, q_len, num_heads, kv_lora_rank))
    lse = np.full((batch, q_len, num_heads), -np.inf)
    for b in range(batch):
        length = int(np.clip(int(seq_lens[b]), 0, capacity))
        for i in range(q_len):
            seen = present_keys(kv_cache, tables[b], max(length - q_len + i + 1, 0))
            if len(seen):
                out[b, i], lse[b, i] = attend(query[b, i], seen, seen[:, :kv_lora_rank], softmax_scale)
    return out, lse


def xla_decode(problem, tables=None, lengths=None, **kwargs):
    tables = problem.block_tables if tables is None else jnp.asarray(tables, jnp.int32)
    lengths = problem.seq_lens if lengths is None else jnp.asarray(lengths, jnp.int32)
    fn = lambda q, kv, bt, sl: jax_mla.decode(q, kv, bt, sl, softmax_scale=problem.softmax_scale,
                                              return_lse=True, backend="xla", **kwargs)
    return jax.jit(fn)(problem.query, problem.kv_cache, tables, lengths)


def check_against_absent_token_oracle(problem, tables, lengths):
    out, lse = xla_decode(problem, tables, lengths)
    ref_out, ref_lse = decode_with_absent_tokens(problem.query, problem.kv_cache, tables, lengths,
                                                 softmax_scale=problem.softmax_scale)
    assert np.isfinite(np.asarray(out)).all()
    check_accuracy(out, lse, ref_out, ref_lse, backend="xla")
    return out, lse


BAD_IDS = [-1, -(2**31), "num_pages", 10**6]


@pytest.mark.parametrize("bad_id", BAD_IDS, ids=str)
def test_xla_treats_a_token_on_an_out_of_range_page_as_absent(bad_id):
    problem = make_problem(3, batch=3, q_len=2, num_heads=16, page_size=16, max_len=120)
    tables = np.asarray(problem.block_tables).copy()
    lengths = np.asarray(problem.seq_lens)
    num_pages = problem.kv_cache.shape[0]
    bad = num_pages if bad_id == "num_pages" else bad_id
    for b in range(3):  # the first page of every request, and the last page of the longest
        tables[b, 0] = bad
    longest = int(lengths.argmax())
    tables[longest, (lengths[longest] - 1) // 16] = bad
    check_against_absent_token_oracle(problem, tables, lengths)


def test_a_request_whose_pages_are_all_out_of_range_sees_nothing_and_leaves_others_alone():
    problem = make_problem(4, batch=3, q_len=1, num_heads=16, page_size=16, max_len=100)
    tables = np.asarray(problem.block_tables).copy()
    tables[1, :] = problem.kv_cache.shape[0] + 3
    out, lse = xla_decode(problem, tables)
    clean_out, clean_lse = xla_decode(problem)
    assert np.all(np.asarray(out[1]) == 0) and np.all(np.isneginf(np.asarray(lse[1])))
    for b in (0, 2):
        np.testing.assert_array_equal(np.asarray(out[b]), np.asarray(clean_out[b]))
        np.testing.assert_array_equal(np.asarray(lse[b]), np.asarray(clean_lse[b]))


def test_xla_clamps_a_length_above_the_tables_capacity():
    problem = make_problem(5, batch=2, q_len=3, num_heads=16, page_size=16, max_len=90)
    problem.kv_cache = jnp.nan_to_num(problem.kv_cache, nan=0.5)  # every token below capacity written
    capacity = problem.block_tables.shape[1] * 16
    tables = np.asarray(problem.block_tables).copy()
    tables[0, :] = np.arange(tables.shape[1])  # every page of request 0 in range, so all present
    lengths = np.array([capacity + 100, 2**31 - 1], np.int32)
    out, lse = check_against_absent_token_oracle(problem, tables, lengths)
    at_capacity = xla_decode(problem, tables, np.full(2, capacity, np.int32))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(at_capacity[0]))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(at_capacity[1]))


@pytest.mark.parametrize("length", [2, 1, 0, -5, -(2**31)])
def test_xla_rows_before_the_first_kv_token_get_zero_and_minus_inf(length):
    problem = make_problem(6, batch=2, q_len=4, num_heads=16, page_size=16, max_len=60)
    lengths = np.array([length, int(problem.seq_lens[1])], np.int32)
    out, lse = check_against_absent_token_oracle(problem, problem.block_tables, lengths)
    unseen = int(np.clip(4 - max(length, 0), 0, 4))  # rows whose own position is below 0
    assert np.all(np.asarray(out[0, :unseen]) == 0) and np.all(np.isneginf(np.asarray(lse[0, :unseen])))
    assert np.all(np.isfinite(np.asarray(lse[0, unseen:])))


# ---- an empty batch ------------------------------------------------------------------------------

def empty_arrays(dtype=jnp.float32, q_len=2, num_heads=16):
    return (jnp.zeros((0, q_len, num_heads, 576), dtype), jnp.zeros((8, 16, 576), dtype),
            jnp.zeros((0, 3), jnp.int32), jnp.zeros((0,), jnp.int32))


@pytest.mark.parametrize("backend", ["xla", "fa3", "sm90"])
def test_an_empty_batch_is_refused_at_trace_time(monkeypatch, lowering_stubs, backend):
    monkeypatch.setattr(backends, "available_backends", lambda platform=None: list(backends.ALL_BACKENDS))
    dtype = jnp.float32 if backend == "xla" else jnp.bfloat16
    arrays = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in empty_arrays(dtype)]
    with pytest.raises(ValueError, match=r"query's batch \(dim 0\) must be >= 1 \(an empty batch has "
                                         r"nothing to decode\), got query shape \(0, 2, 16, 576\)"):
        jax.jit(lambda *a: jax_mla.decode(*a, softmax_scale=0.1, backend=backend)).trace(*arrays)


# ---- the fa3/fa2 schedule: no GPU, and FlashInfer's work capacity ---------------------------------

needs_cpu_only = pytest.mark.skipif(jax.default_backend() != "cpu", reason="needs a machine without GPU")


@needs_cpu_only
def test_device_plan_without_a_gpu_names_what_is_missing():
    with pytest.raises(ValueError, match=r"jax_mla.device_plan builds the fa3/fa2 schedule on a CUDA "
                                         r"GPU; this process has none \(platform cpu\)"):
        jax_mla.device_plan(jnp.ones((4,), jnp.int32), num_heads=16, max_pages=4)


@needs_cpu_only
def test_plan_without_a_gpu_names_what_is_missing():
    with pytest.raises(ValueError, match=r"jax_mla.plan builds the fa3/fa2 schedule on a CUDA GPU; "
                                         r"this process has none \(platform cpu\)"):
        jax_mla.plan(np.array([3, 5]), num_heads=16, max_pages=4)


def test_plan_on_a_gpu_that_runs_neither_fa3_nor_fa2(monkeypatch):
    monkeypatch.setattr(gpu, "sm_count", lambda device=None: 132)
    monkeypatch.setattr(backends, "available_backends", lambda platform=None: ["xla"])
    with pytest.raises(ValueError, match=r"jax_mla.plan needs a GPU that runs fa3 or fa2; available "
                                         r"here: \['xla'\]"):
        jax_mla.plan(np.array([3, 5]), num_heads=16, max_pages=4)


# q_len 8 x 128 heads on 132 SMs: clusters of 2 CTAs (66 clusters), 8 tiles of 128 rows a request,
# so (16384 - 66) // 8 = 2039 requests fit whatever their lengths.
WIDE = dict(q_len=8, num_heads=128)
WIDE_LIMIT = 2039


def test_the_work_capacity_bound():
    layout = planning.schedule_layout(132, 8, 128, 512)
    assert layout.plan_info[:2] == (2, 66)
    planning.check_works_fit(WIDE_LIMIT, 8, 128, layout)
    with pytest.raises(ValueError, match=rf"batch {WIDE_LIMIT + 1} x q_len 8 x 128 heads may exceed "
                                         rf"FlashInfer's 16384 scheduled works; split the batch into "
                                         rf"calls of at most {WIDE_LIMIT} requests"):
        planning.check_works_fit(WIDE_LIMIT + 1, 8, 128, layout)
    narrow = planning.schedule_layout(132, 1, 16, 512)  # one tile a request, 132 clusters
    planning.check_works_fit(16384 - 132, 1, 16, narrow)
    with pytest.raises(ValueError, match="at most 16252 requests"):
        planning.check_works_fit(16384 - 131, 1, 16, narrow)


def test_host_plan_enforces_the_work_capacity_before_flashinfer_runs(monkeypatch):
    monkeypatch.setattr(gpu, "sm_count", lambda device=None: 132)
    monkeypatch.setattr(backends, "available_backends", lambda platform=None: ["fa3", "fa2", "xla"])
    monkeypatch.setattr(gpu, "fa_plan_function", lambda *a: pytest.fail("MLAPlan must not run"))
    with pytest.raises(ValueError, match=rf"batch 2100 x q_len 8 .*at most {WIDE_LIMIT} requests"):
        planning.plan(np.full(2100, 100), max_pages=4, **WIDE)


def wide_shapes(batch):
    return (jax.ShapeDtypeStruct((batch, 8, 128, 576), jnp.bfloat16),
            jax.ShapeDtypeStruct((64, 64, 576), jnp.bfloat16),
            jax.ShapeDtypeStruct((batch, 2), jnp.int32), jax.ShapeDtypeStruct((batch,), jnp.int32))


@pytest.mark.parametrize("backend", ["fa3", "fa2"])
def test_self_planning_enforces_the_work_capacity_at_trace_time(lowering_stubs, backend):
    fn = lambda *a: run_backend(backend, *a, softmax_scale=0.1, output_scale=1.0)
    assert "jax_mla_fa_decode_self_plan" in lower_for_cuda(fn, *wide_shapes(WIDE_LIMIT))
    with pytest.raises(ValueError, match=rf"batch {WIDE_LIMIT + 1} x q_len 8 x 128 heads may exceed "
                                         rf".*at most {WIDE_LIMIT} requests"):
        jax.jit(fn).trace(*wide_shapes(WIDE_LIMIT + 1))


def test_device_plan_enforces_the_same_capacity(monkeypatch):
    monkeypatch.setattr(gpu, "sm_count", lambda device=None: 132)
    monkeypatch.setattr(gpu, "register_targets", lambda: None)
    with pytest.raises(ValueError, match=rf"at most {WIDE_LIMIT} requests"):
        planning.device_plan(jnp.zeros((WIDE_LIMIT + 1,), jnp.int32), max_pages=4, **WIDE)


# ---- the checked mode ------------------------------------------------------------------------------

CHECKED = make_problem(7, batch=3, q_len=2, num_heads=16, page_size=16, max_len=80)


def bad_inputs(case):
    """(query, kv_cache, block_tables, seq_lens) with one bad value, and the message it must give."""
    query, cache, tables, lengths = (np.asarray(a).copy() for a in CHECKED.arrays)
    capacity = tables.shape[1] * 16
    if case == "page":
        tables[2, (lengths[2] - 1) // 16] = cache.shape[0] + 9
        row = (lengths[2] - 1) // 16
        message = (rf"block_tables\[2, {row}\] = {cache.shape[0] + 9} is not a page of kv_cache "
                   rf"\(ids are in \[0, {cache.shape[0]}\)\) but request 2 reads it")
    elif case == "negative page":
        tables[1, 0] = -1
        message = r"block_tables\[1, 0\] = -1 is not a page of kv_cache"
    elif case == "short":
        lengths[1] = 1
        message = r"seq_lens\[1\] = 1 is below q_len = 2"
    elif case == "negative":
        lengths[0] = -3
        message = r"seq_lens\[0\] = -3 is below q_len = 2"
    elif case == "long":
        lengths[2] = capacity + 1
        message = rf"seq_lens\[2\] = {capacity + 1} exceeds the block table's capacity max_pages \* " \
                  rf"page_size = {capacity}"
    else:
        query[1, 1, 5, 300] = np.inf if case == "inf" else np.nan
        message = rf"query\[1, 1, 5, 300\] = {'inf' if case == 'inf' else 'nan'} is not finite \(request 1"
    return (jnp.asarray(query), jnp.asarray(cache), jnp.asarray(tables), jnp.asarray(lengths)), message


CASES = ["page", "negative page", "short", "negative", "long", "nan", "inf"]


def checked_decode(*arrays):
    return jax_mla.decode(*arrays, softmax_scale=0.1, checks=True)


@pytest.mark.parametrize("case", CASES)
def test_checks_raise_eagerly_naming_argument_request_and_value(case):
    arrays, message = bad_inputs(case)
    with pytest.raises(checkify.JaxRuntimeError, match=message):
        checked_decode(*arrays)


@pytest.mark.parametrize("case", CASES)
def test_checks_under_checkify_and_jit(case):
    arrays, message = bad_inputs(case)
    err, _ = checkify.checkify(jax.jit(checked_decode))(*arrays)
    assert err.get() is not None
    with pytest.raises(checkify.JaxRuntimeError, match=message):
        err.throw()


def test_checks_pass_clean_inputs_and_change_no_result():
    err, out = jax.jit(checkify.checkify(checked_decode))(*CHECKED.arrays)
    assert err.get() is None
    np.testing.assert_array_equal(np.asarray(out), np.asarray(
        jax_mla.decode(*CHECKED.arrays, softmax_scale=0.1)))
    # Table padding past a request's pages may hold anything: it is not checked.
    assert (np.asarray(CHECKED.block_tables) >= CHECKED.kv_cache.shape[0]).any()


def test_checks_inside_jit_without_checkify_fail_before_running():
    """JAX's own message, as docs/bad-values.md quotes it: nothing runs unchecked."""
    with pytest.raises(ValueError, match=r"Cannot abstractly evaluate a checkify.check which was not "
                                         r"functionalized"):
        jax.jit(checked_decode)(*CHECKED.arrays)


def test_checks_must_be_a_bool():
    with pytest.raises(TypeError, match="checks must be a bool, got int"):
        jax_mla.decode(*CHECKED.arrays, softmax_scale=0.1, checks=1)


def primitives(fn, *arrays) -> set[str]:
    jaxpr = jax.make_jaxpr(fn)(*arrays)
    return {eqn.primitive.name for eqn in jaxpr.eqns}


def test_checks_off_stage_nothing_and_on_leave_the_kernels_inputs_alone(monkeypatch, lowering_stubs):
    """checks=False adds no op; checks=True adds ops before the kernel but passes it the same
    operands (the fa3 custom call's line is the same, operand names aside)."""
    assert "check" not in primitives(lambda *a: jax_mla.decode(*a, softmax_scale=0.1), *CHECKED.arrays)
    monkeypatch.setattr(backends, "available_backends", lambda platform=None: ["fa3", "xla"])
    shapes = [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16 if a.dtype == jnp.float32 else a.dtype)
              for a in CHECKED.arrays]

    def fa3_call(checks):
        fn = lambda *a: jax_mla.decode(*a, softmax_scale=0.1, backend="fa3", checks=checks)
        text = jax.jit(checkify.checkify(fn)).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
        line = next(line for line in text.splitlines() if "@jax_mla_fa_decode_self_plan(" in line)
        return line.split("=", 1)[1].split("(", 1)[1].split(")", 1)[1], text

    plain, _ = fa3_call(False)
    checked, text = fa3_call(True)
    assert checked == plain and "stablehlo.is_finite" in text


# ---- write_kv with duplicate slots -------------------------------------------------------------------

def test_write_kv_duplicate_slots_hold_one_of_the_written_rows_channel_by_channel():
    """The documented outcome: each channel of a slot written twice holds that channel of one of
    its writes (which one is unspecified); every other slot is written or left exactly."""
    cache = jnp.full((4, 8, 576), -1.0, jnp.float32)
    rng = np.random.default_rng(0)
    latent = rng.standard_normal((4, 512)).astype(np.float32)
    rope = rng.standard_normal((4, 64)).astype(np.float32)
    slots = np.array([9, 3, 9, 9], np.int32)
    flat = np.asarray(jax_mla.write_kv(cache, jnp.asarray(latent), jnp.asarray(rope),
                                       jnp.asarray(slots))).reshape(32, 576)
    rows = np.concatenate([latent, rope], axis=-1)
    candidates = rows[[0, 2, 3]]
    assert np.all((flat[9][None, :] == candidates).any(axis=0))
    np.testing.assert_array_equal(flat[3], rows[1])
    untouched = np.delete(np.arange(32), [3, 9])
    assert np.all(flat[untouched] == -1.0)
