"""Bad values (docs/bad-values.md): each is provoked here and its defined outcome or error checked.

By default (``fail_closed=True``) a request with a bad page id or length, or a length other than its
plan's, gets out 0 and lse -inf on every backend and the others their exact results; that is
checked on every backend and plan mode this machine runs (sm90 also with ``fail_closed=False`` for
a length other than its plan's). Beneath it, with ``fail_closed=False``, the xla backend's own
handling is checked against a float64 oracle in which a token is present only if its position is
below the clamped length and its page id is in range. The checked mode (``checks=True``) is
checked eagerly, under ``checkify.checkify`` and jit.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import backend_params, check_accuracy, make_problem, record_kernel_runs
from jax.experimental import checkify
from oracles import as_float64, attend
from test_ffi import lower_for_cuda, lowering_stubs, run_backend  # noqa: F401  (a fixture)

import jax_mla
from jax_mla import backends, gpu, guard, planning, value_checks
from jax_mla.reference import reference_from_jax


# ---- failing closed: bad requests read nothing, the others are unaffected ---------------------------

BACKENDS = backend_params()
# (backend, plan) pairs: fa3 and fa2 read their schedule from a plan built three ways, sm90 from
# its own plan or from its call.
PLANNED = [pytest.param(p.values[0], plan, id=f"{p.id}-{plan or 'self'}", marks=p.marks)
           for p in BACKENDS if p.values[0] in (backends.FA3, backends.FA2)
           for plan in (None, "device", "host")]
SM90_PLANNED = [pytest.param(p.values[0], "sm90", id=f"{p.id}-plan", marks=p.marks)
                for p in BACKENDS if p.values[0] == backends.SM90]
UNPLANNED = [pytest.param(p.values[0], None, id=p.id, marks=p.marks)
             for p in BACKENDS if p.values[0] not in (backends.FA3, backends.FA2)]


def bad_requests_problem(q_len: int, dtype):
    """A batch of 8 in which requests 1-6 each carry one kind of bad value (page size 32, so that
    every backend runs it) and 0 and 7 are clean, with garbage in their table padding.
    Returns (problem, tables, lengths, the bad requests)."""
    problem = make_problem(11 + q_len, batch=8, q_len=q_len, num_heads=16, page_size=32,
                           max_len=200, dtype=dtype)
    tables = np.asarray(problem.block_tables).copy()
    lengths = np.asarray(problem.seq_lens).copy()
    num_pages, capacity = problem.kv_cache.shape[0], tables.shape[1] * 32
    lengths[1:7] = np.maximum(lengths[1:7], 40)  # two pages at least, where an id is replaced
    tables[1, 0] = -1                             # read ids out of range, first and last page
    tables[2, (lengths[2] - 1) // 32] = num_pages
    tables[3, 1] = 10**6
    lengths[4] = capacity + 5                     # past the table's capacity
    lengths[5] = 2**31 - 1
    lengths[6] = q_len - 1 if q_len > 1 else -(2**31)  # below q_len: no room for the new tokens
    return problem, tables, lengths, [1, 2, 3, 4, 5, 6]


def decode_all(backend, plan_mode, problem, tables, lengths, *, plan_lengths=None,
               fail_closed=True):
    """(out, lse) of ``decode`` inside jit with the plan built as ``plan_mode`` says: None (fa3/fa2
    plan in the call, sm90 schedule in the call), "device" (in the call, on the GPU), "host"
    (``jax_mla.plan`` from ``plan_lengths``), "step" (``jax_mla.device_plan`` from
    ``plan_lengths`` in the step), "sm90" (``jax_mla.sm90_plan`` from ``plan_lengths`` in the
    step)."""
    _, q_len, num_heads, _ = problem.query.shape
    shape = dict(num_heads=num_heads, max_pages=tables.shape[1], q_len=q_len)
    plan = jax_mla.plan(plan_lengths, **shape) if plan_mode == "host" else plan_mode

    def step(q, kv, bt, sl, plan, planned_lengths):
        if plan == "step":
            plan = jax_mla.device_plan(planned_lengths, **shape)
        elif plan == "sm90":
            plan = jax_mla.sm90_plan(planned_lengths, max_pages=bt.shape[1], page_size=kv.shape[1])
        return jax_mla.decode(q, kv, bt, sl, softmax_scale=problem.softmax_scale, return_lse=True,
                              backend=backend, plan=plan, fail_closed=fail_closed)

    fn = jax.jit(step, static_argnums=4) if isinstance(plan, str) or plan is None else jax.jit(step)
    planned = jnp.asarray(lengths if plan_lengths is None else plan_lengths, jnp.int32)
    return fn(problem.query, problem.kv_cache, jnp.asarray(tables), jnp.asarray(lengths), plan,
              planned)


def check_failed_closed(out, lse, problem, tables, lengths, bad, backend):
    """Bad requests: out exactly 0 and lse -inf. The others: the reference's result."""
    values, lse = np.asarray(out.astype(jnp.float32)), np.asarray(lse)
    assert np.all(values[bad] == 0) and np.all(np.isneginf(lse[bad])), backend
    good = np.asarray([b for b in range(len(lengths)) if b not in bad])
    arrays = (problem.query[good], problem.kv_cache, jnp.asarray(tables[good]),
              jnp.asarray(lengths[good]))
    ref_out, ref_lse = reference_from_jax(*arrays, softmax_scale=problem.softmax_scale)
    check_accuracy(out[good], lse[good], ref_out.numpy(), ref_lse.numpy(), backend=backend)


@pytest.mark.parametrize("q_len", [1, 2])
def test_the_reference_fails_bad_requests_closed_as_decode_does(q_len):
    """The torch reference gives the requests decode fails closed out 0 and lse -inf (a negative
    id would otherwise read torch's last page), and the others their own results."""
    problem, tables, lengths, bad = bad_requests_problem(q_len, jnp.float32)
    ref_out, ref_lse = reference_from_jax(problem.query, problem.kv_cache, jnp.asarray(tables),
                                          jnp.asarray(lengths), softmax_scale=problem.softmax_scale)
    assert np.all(ref_out.numpy()[bad] == 0) and np.all(np.isneginf(ref_lse.numpy()[bad]))
    out, lse = jax_mla.decode(problem.query, problem.kv_cache, jnp.asarray(tables),
                              jnp.asarray(lengths), softmax_scale=problem.softmax_scale,
                              return_lse=True, backend="xla")
    check_accuracy(out, lse, ref_out.numpy(), ref_lse.numpy(), backend="xla")


@pytest.mark.parametrize("backend,plan_mode",
                         UNPLANNED + SM90_PLANNED + [p for p in PLANNED if p.values[1] != "host"])
@pytest.mark.parametrize("q_len", [1, 2])
def test_requests_with_bad_ids_or_lengths_get_zero_and_minus_inf(backend, plan_mode, q_len):
    dtype = jnp.float32 if backend == backends.XLA else jnp.bfloat16
    problem, tables, lengths, bad = bad_requests_problem(q_len, dtype)
    out, lse = decode_all(backend, plan_mode, problem, tables, lengths)
    check_failed_closed(out, lse, problem, tables, lengths, bad, backend)


@pytest.mark.parametrize("backend,plan_mode", [
    *[p for p in PLANNED if p.values[1] == "host"],
    *[pytest.param(p.values[0], "step", id=f"{p.id}-step", marks=p.marks)
      for p in BACKENDS if p.values[0] in (backends.FA3, backends.FA2)],
    *SM90_PLANNED])
def test_a_plan_used_with_other_lengths_gives_those_requests_nothing(backend, plan_mode):
    """A plan is tied to the lengths it was built from: the requests whose length changed get 0
    and -inf (not a result over the plan's ranges); bad values count as before."""
    problem, tables, lengths, planned = other_lengths_problem()
    out, lse = decode_all(backend, plan_mode, problem, tables, lengths, plan_lengths=planned)
    check_failed_closed(out, lse, problem, tables, lengths, [1, 2, 3, 4, 5, 6], backend)


@pytest.mark.parametrize("backend,plan_mode", SM90_PLANNED)
def test_sm90_reads_nothing_of_a_length_other_than_its_plans_without_the_guard(backend, plan_mode):
    """The sm90 kernel finds a request's blocks from its length and their parts from the schedule,
    so with fail_closed=False too a request whose length is not its plan's reads nothing; the
    bad ids of requests 1 and 2 (lengths as planned) are then the kernel's to mask."""
    problem, tables, lengths, planned = other_lengths_problem()
    out, lse = decode_all(backend, plan_mode, problem, tables, lengths, plan_lengths=planned,
                          fail_closed=False)
    changed = np.array([3, 4, 5, 6])
    assert np.all(np.asarray(out.astype(jnp.float32))[changed] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[changed]))
    as_planned = np.array([0, 7])
    arrays = (problem.query[as_planned], problem.kv_cache, jnp.asarray(tables[as_planned]),
              jnp.asarray(lengths[as_planned]))
    ref_out, ref_lse = reference_from_jax(*arrays, softmax_scale=problem.softmax_scale)
    check_accuracy(out[as_planned], lse[as_planned], ref_out.numpy(), ref_lse.numpy(),
                   backend=backend)


def other_lengths_problem():
    """``bad_requests_problem`` at q_len 2 with lengths that differ from the planned ones for
    requests 3-6, bad ids at lengths as planned for 1 and 2, and 0 and 7 clean and as planned.
    Returns (problem, tables, lengths, the planned lengths)."""
    problem, tables, lengths, _ = bad_requests_problem(2, jnp.bfloat16)
    planned = np.asarray(problem.seq_lens)  # the lengths the tables were built for
    lengths[[0, 7]] = planned[[0, 7]]  # clean and as planned
    lengths[3] = planned[3] + 1        # clean but not as planned
    tables[3] = np.asarray(problem.block_tables)[3]
    lengths[1:3] = planned[1:3]        # as planned, with bad ids
    lengths[4:7] = planned[4:7] - 1    # clean ids, lengths not as planned
    tables[4:7] = np.asarray(problem.block_tables)[4:7]
    return problem, tables, lengths, planned


def sanitize_program() -> None:
    """Every GPU kernel backend and plan mode here on bad values, for ``compute-sanitizer``
    (.ci/gpu-memcheck.sh): no kernel may touch memory outside the cache, the tables, its workspace
    or its outputs."""
    for name in [b for b in backends.available_backends("gpu") if b != backends.XLA]:
        reads = backends.BY_NAME[name].reads_plan
        plans = {backends.FA_PLAN: ("device", ("host", "step")),
                 backends.SM90_PLAN: ("sm90", ("sm90",))}.get(reads)
        for q_len in (1, 2):
            for mode in (None,) + plans[:1] if plans else (None,):
                test_requests_with_bad_ids_or_lengths_get_zero_and_minus_inf(name, mode, q_len)
                print(f"ok {name} plan={mode} q_len={q_len}", flush=True)
        for mode in plans[1] if plans else ():
            test_a_plan_used_with_other_lengths_gives_those_requests_nothing(name, mode)
            print(f"ok {name} plan={mode} other lengths", flush=True)
        if reads == backends.SM90_PLAN:
            test_sm90_reads_nothing_of_a_length_other_than_its_plans_without_the_guard(name, "sm90")
            print(f"ok {name} plan=sm90 other lengths, fail_closed=False", flush=True)


def test_the_guard_changes_nothing_for_clean_values():
    problem = make_problem(21, batch=5, q_len=2, num_heads=16, page_size=16, max_len=120)
    on, off = (jax.jit(lambda *a, f=f: jax_mla.decode(*a, softmax_scale=0.1, return_lse=True,
                                                        fail_closed=f))(*problem.arrays)
               for f in (True, False))
    for a, b in zip(on, off):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_usable_requests_rule():
    """Each condition alone makes a request unusable; the fa3/fa2 schedule's longest length too."""
    tables = jnp.asarray([[0, 1, 99], [2, -1, 5], [3, 4, 0], [5, 6, 7], [1, 2, 3]], jnp.int32)
    lengths = jnp.asarray([32, 33, 48, 1, 40], jnp.int32)  # page size 16, 8 pages, capacity 48
    usable = guard.usable_requests(tables, lengths, num_pages=8, page_size=16, q_len=2)
    # 0: reads pages 0-1 (99 is padding); 1: reads -1; 2: at capacity; 3: below q_len; 4: fine
    assert usable.tolist() == [True, False, True, False, True]
    capped = guard.usable_requests(tables, lengths, num_pages=8, page_size=16, q_len=2, max_len=40)
    assert capped.tolist() == [True, False, False, False, True]
    np.testing.assert_array_equal(guard.neutralised_lengths(lengths, usable), [32, 0, 48, 0, 40])


def test_fail_closed_must_be_a_bool():
    with pytest.raises(TypeError, match="fail_closed must be a bool, got str"):
        jax_mla.decode(*CHECKED.arrays, softmax_scale=0.1, fail_closed="yes")


def guard_reductions(hlo: str, batch: int) -> int:
    """How many any-reductions to a [batch] predicate (the guard's, over the read pages) a compiled
    program has."""
    return len(re.findall(rf"= pred\[{batch}\]\{{0\}} reduce\(.*op_name=\S*reduce_or", hlo))


@pytest.mark.parametrize("fail_closed", [True, False])
def test_the_guard_runs_once_per_step_not_once_per_layer(fail_closed):
    """Every layer's guard reads the same tables and lengths, so XLA computes it once."""
    problem = make_problem(22, batch=5, q_len=1, num_heads=16, page_size=16, max_len=100)
    caches = [problem.kv_cache * (i + 1) for i in range(4)]

    def step(query, caches, tables, lengths):
        outs = [jax_mla.decode(query, cache, tables, lengths, softmax_scale=0.1,
                               fail_closed=fail_closed) for cache in caches]
        return sum(outs)

    hlo = jax.jit(step).lower(problem.query, caches, problem.block_tables,
                              problem.seq_lens).compile().as_text()
    found = guard_reductions(hlo, 5)
    assert found == (1 if fail_closed else 0), found


def test_the_plan_rewrite_also_runs_once_per_step():
    """Layers that pass the same plan, tables and lengths share one guard, plan rewrite included:
    the compiled program of four guards has the gathers of one."""
    plan, _, _ = synthetic_plan()
    tables, lengths = jnp.zeros((4, 8), jnp.int32), plan.seq_lens

    def layers(count, tables, lengths, plan):
        outs = [guard.guard(tables, lengths, plan, num_pages=40, page_size=16, q_len=1)
                for _ in range(count)]
        return [(safe, guarded.int_workspace) for safe, guarded in outs]

    gathers = [jax.jit(layers, static_argnums=0).lower(count, tables, lengths, plan).compile()
               .as_text().count(" gather(") for count in (1, 4)]
    assert gathers[0] >= 1 and gathers[1] == gathers[0], gathers


def synthetic_plan(batch=4, max_pages=8):
    """A Plan whose works 0..2*batch-1 belong to requests w // 2, with every per-work array filled
    with distinct values, the rest of the workspace with a pattern."""
    layout = planning.schedule_layout(132, 1, 16, 512)
    words = np.arange(layout.int_workspace_bytes // 4, dtype=np.int32) % 1000 + 7
    works = np.arange(2 * batch)
    words[layout.entry("kv_indptr") // 4 + works] = (works // 2) * max_pages
    workspace = jnp.asarray(words.view(np.uint8))
    plan = planning.Plan(workspace, jnp.arange(batch, dtype=jnp.int32) + 1, batch, 1, 16,
                         max_pages, 512, layout)
    return plan, words, works


def test_guard_plan_empties_exactly_the_works_of_unusable_requests():
    plan, words, works = synthetic_plan()
    usable = jnp.asarray([True, False, True, False])
    guarded = np.asarray(guard.guard_plan(plan, usable).int_workspace).view(np.int32)
    rewritten = [plan.layout.entry(field) // 4 for field in ("kv_len", "kv_start", "kv_end")]
    may_change = np.zeros(words.size, bool)  # entries past the plan's works are never read
    for start in rewritten:
        may_change[start + 2 * 4:start + planning.MAX_TOTAL_WORKS] = True
    emptied = [start + w for start in rewritten for w in works if w // 2 in (1, 3)]
    kept = [start + w for start in rewritten for w in works if w // 2 in (0, 2)]
    may_change[emptied] = True
    assert np.all(guarded[emptied] == 0) and np.all(guarded[kept] == words[kept])
    assert np.all(guarded[~may_change] == words[~may_change])


def test_checked_mode_names_a_plan_used_with_other_lengths():
    plan, _, _ = synthetic_plan()
    query = jnp.zeros((4, 1, 16, 576), jnp.float32)
    cache = jnp.zeros((40, 16, 576), jnp.float32)
    tables = jnp.zeros((4, 8), jnp.int32)
    lengths = plan.seq_lens.at[2].set(9)
    with pytest.raises(checkify.JaxRuntimeError,
                       match=r"seq_lens\[2\] = 9 but the plan was built for length 3: build the plan "
                             r"from this step's seq_lens"):
        value_checks.check_values(query, cache, tables, lengths, plan)
    value_checks.check_values(query, cache, tables, plan.seq_lens, plan)
    single = dataclasses.replace(plan, batch=1, seq_lens=plan.seq_lens[:1])  # would broadcast
    with pytest.raises(planning.PlanMismatchError, match=r"plan was built for batch 1 and max_pages "
                                                         r"8 but decode got batch 4"):
        value_checks.check_values(query, cache, tables, lengths, single)


def test_an_sm90_plans_lengths_are_checked_and_its_metadata_refused():
    """The checked mode names a length that is not its Sm90Plan's (the kernel reads nothing of
    such a request, test_sm90_reads_nothing_of_a_length_other_than_its_plans_without_the_guard);
    a plan for another table width or page size is refused."""
    lengths = jnp.asarray([40, 17, 3, 9], jnp.int32)
    plan = jax_mla.Sm90Plan(jnp.zeros((5,), jnp.int32), lengths.at[1].set(18), 4, 8, 16)
    tables = jnp.zeros((4, 8), jnp.int32)
    query, cache = jnp.zeros((4, 1, 16, 576), jnp.float32), jnp.zeros((40, 16, 576), jnp.float32)
    with pytest.raises(checkify.JaxRuntimeError,
                       match=r"seq_lens\[1\] = 17 but the plan was built for length 18"):
        value_checks.check_values(query, cache, tables, lengths, plan)
    value_checks.check_values(query, cache, tables, plan.seq_lens, plan)
    for change, got in ((dict(page_size=32), "'page_size': 32"), (dict(max_pages=9), "'max_pages': 9")):
        with pytest.raises(planning.PlanMismatchError,
                           match=rf"the sm90 plan was built for \{{.*{got}.*\}} but decode got "
                                 r"\{'batch': 4, 'max_pages': 8, 'page_size': 16\}"):
            dataclasses.replace(plan, **change).check_for(lengths, tables, 16)


def test_the_guard_refuses_an_sm90_plan():
    """The sm90 kernel fails closed itself, so an Sm90Plan never reaches the guard; handed one,
    the guard names what it takes instead of guarding it as a Plan."""
    lengths = jnp.asarray([40, 17], jnp.int32)
    plan = jax_mla.Sm90Plan(jnp.zeros((3,), jnp.int32), lengths, 2, 8, 16)
    with pytest.raises(TypeError, match=r"^the guard takes a jax_mla.Plan or None, got Sm90Plan "
                                        r"\(the sm90 kernel fails closed itself\)$"):
        guard.guard(jnp.zeros((2, 8), jnp.int32), lengths, plan, num_pages=40, page_size=16,
                    q_len=1)


@pytest.mark.parametrize("change,message", [
    (dict(seq_lens=jnp.zeros((3,), jnp.int32)), r"plan.seq_lens must be int32 \[4\]"),
    (dict(seq_lens=jnp.zeros((4,), jnp.float32)), r"plan.seq_lens must be int32 \[4\], .* got float32"),
    (dict(batch=3), r"plan was built for batch 3 and max_pages 8 but decode got batch 4 and max_pages 8"),
])
def test_the_guard_refuses_a_plan_that_does_not_fit(change, message):
    plan, _, _ = synthetic_plan()
    plan = dataclasses.replace(plan, **change)
    if "batch" in change:
        plan = dataclasses.replace(plan, seq_lens=jnp.zeros((3,), jnp.int32))
    with pytest.raises(planning.PlanMismatchError, match=message):
        guard.guard(jnp.zeros((4, 8), jnp.int32), jnp.ones((4,), jnp.int32), plan, num_pages=40,
                    page_size=16, q_len=1)


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
    """The xla backend's own handling of bad values, beneath the guard (fail_closed=False)."""
    tables = problem.block_tables if tables is None else jnp.asarray(tables, jnp.int32)
    lengths = problem.seq_lens if lengths is None else jnp.asarray(lengths, jnp.int32)
    fn = lambda q, kv, bt, sl: jax_mla.decode(q, kv, bt, sl, softmax_scale=problem.softmax_scale,
                                              return_lse=True, backend="xla", fail_closed=False,
                                              **kwargs)
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


@pytest.mark.parametrize("lengths,message", [
    ([3, 1], r"every seq_lens entry must be >= q_len=2 \(it counts the new tokens\), got min 1"),
    ([3, 2**22 + 1], r"every seq_lens entry must be <= 4194304, the longest request the fa3/fa2 "
                     r"schedule takes, got max 4194305"),
])
def test_host_plan_refuses_lengths_its_schedule_cannot_take(monkeypatch, lengths, message):
    monkeypatch.setattr(gpu, "sm_count", lambda device=None: 132)
    monkeypatch.setattr(backends, "available_backends", lambda platform=None: ["fa3", "fa2", "xla"])
    monkeypatch.setattr(gpu, "fa_plan_function", lambda *a: pytest.fail("MLAPlan must not run"))
    with pytest.raises(ValueError, match=message):
        planning.plan(np.array(lengths), num_heads=16, max_pages=4, q_len=2)


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


@pytest.mark.parametrize("case", ["page", "long", "nan"])
def test_checks_take_numpy_inputs_as_decode_does(case):
    """NumPy arrays, which decode takes, are checked as JAX arrays are (the same message)."""
    arrays, message = bad_inputs(case)
    with pytest.raises(checkify.JaxRuntimeError, match=message):
        checked_decode(*(np.asarray(a) for a in arrays))
    clean = tuple(np.asarray(a) for a in CHECKED.arrays)
    np.testing.assert_array_equal(np.asarray(checked_decode(*clean)),
                                  np.asarray(jax_mla.decode(*clean, softmax_scale=0.1)))


@pytest.mark.parametrize("backend, runs", [("fa3", None), ("auto", "sm90")])
def test_checks_bound_the_lengths_fa3_and_fa2_take(backend, runs, monkeypatch):
    """fa3 and fa2 fail a request beyond planning.MAX_KV_LEN closed, so checks=True names it where
    one of them runs the call; sm90 ("auto"'s pick for one 16-head request) takes it (stand-in
    kernels on a Hopper's backend table; the table holds more than that)."""
    ran = record_kernel_runs(monkeypatch, ("fa3", "sm90"))
    longest = planning.MAX_KV_LEN
    query, cache = jnp.zeros((1, 1, 16, 576), jnp.bfloat16), jnp.zeros((4, 64, 576), jnp.bfloat16)
    tables = jnp.zeros((1, longest // 64 + 1), jnp.int32)
    decode = lambda length: jax_mla.decode(query, cache, tables, jnp.asarray([length], jnp.int32),
                                           softmax_scale=0.1, backend=backend, checks=True)
    decode(longest)
    if runs is None:
        with pytest.raises(checkify.JaxRuntimeError, match=(
                rf"seq_lens\[0\] = {longest + 1} exceeds {longest}, the longest request fa3 and "
                r"fa2 take")):
            decode(longest + 1)
    else:
        decode(longest + 1)
        assert ran[-1] == runs


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
