"""The sm90 kernel's split-KV schedule, run on the host (``tests/sm90_schedule_check.cu``): the
same ScheduleView/SegmentWalker/RequestLengths code as the decode and combine kernels, for every
cost-model setting the harness may sweep and for bad lengths, failing closed or not, and for a
schedule from an Sm90Plan's lengths walked with the call's (compared with the plan's by the
kernels). Every KV block of every request must be covered once, in order, one segment per part,
with distinct partial-result slots, and each request's length must be the rule's."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
from conftest import build_host_check


@pytest.fixture(scope="module")
def schedule_check(tmp_path_factory):
    return build_host_check(tmp_path_factory.mktemp("sm90_schedule"), "sm90_schedule_check")


def kernel_lengths(lengths, planned, capacity, q_len, fail_closed):
    """The length the kernels give each request (docs/bad-values.md): clamped to [0, capacity];
    failing closed 0 outside [q_len, capacity]; 0 where it differs from the planned one."""
    out = np.where(fail_closed & ((lengths < q_len) | (lengths > capacity)), 0,
                   np.clip(lengths, 0, capacity))
    return out if planned is None else np.where(lengths != planned, 0, out)


def run_cases(schedule_check, cases):
    """Runs (label, header, lengths, planned) cases; returns {label: (result words, expected
    lengths)}."""
    lines = [" ".join(map(str, [*header, *lengths, *(() if planned is None else planned)]))
             for _, header, lengths, planned in cases]
    run = subprocess.run([str(schedule_check)], input="\n".join(lines) + "\n",
                         capture_output=True, text=True, check=True)
    results = run.stdout.splitlines()
    assert len(results) == len(cases)
    expected = [kernel_lengths(lengths, planned if header[-1] == 1 else None,
                               header[2] * header[3], header[7], header[8])
                for _, header, lengths, planned in cases]
    return {case[0]: (result.split(), want)
            for case, result, want in zip(cases, results, expected)}


def check_ok(results):
    """Every case walked ("ok"), with the rule's lengths."""
    failures = [(label, words[:8]) for label, (words, want) in results.items()
                if words[0] != "ok" or [int(w) for w in words[2:]] != list(want)]
    assert not failures, failures[:5]


def cost_model_cases():
    rng = np.random.default_rng(90)
    max_pages, page_size = 40, 64
    capacity = max_pages * page_size
    for fixed_cost in (0, 1, 2, 4):
        for min_blocks, split_cost in ((1, 14), (1, 24), (1, 1), (2, 14), (3, 10**6), (8, 14),
                                       (64, 14)):
            for parts in (1, 2, 33, 66, 132):
                for batch in (1, 5, 64, 300):
                    lengths = rng.integers(0, capacity + 1, size=batch)
                    lengths[rng.random(batch) < 0.1] = -5
                    lengths[rng.random(batch) < 0.1] = capacity + 100
                    lengths[rng.random(batch) < 0.1] = 0
                    lengths[rng.random(batch) < 0.1] = 1
                    q_len, fail_closed = int(rng.integers(1, 5)), int(rng.integers(0, 2))
                    header = [batch, parts, max_pages, page_size, fixed_cost, min_blocks,
                              split_cost, q_len, fail_closed, 0]
                    yield (fixed_cost, min_blocks, split_cost, parts, batch), header, lengths, None


def test_every_block_is_covered_once_for_every_cost_model(schedule_check):
    results = run_cases(schedule_check, list(cost_model_cases()))
    check_ok(results)
    assert sum(int(words[1]) for words, _ in results.values()) > len(results)  # segments walked


def test_one_request_of_4k_tokens_on_66_parts(schedule_check):
    """B=1, L=4k, fixed cost 2, at least 2 blocks a part: 64 blocks in 32 segments of 2 (the
    fixed cost fills the first part's units)."""
    run = subprocess.run([str(schedule_check)], input="1 66 64 64 2 2 14 1 1 0 4096\n",
                         capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["ok", "32", "4096"]


@pytest.mark.parametrize("length, parts, segments", [
    (1024, 132, 16), (2048, 132, 16), (4096, 132, 32), (8192, 132, 44), (16384, 132, 65),
    (32768, 132, 86), (16384, 66, 65)])
def test_a_request_is_split_about_sqrt_of_its_blocks_over_the_split_cost_ways(
        schedule_check, length, parts, segments):
    """One request alone (fixed cost 2, min_blocks_per_part 1, the bf16 cache's split cost 14):
    a part takes q units, q = sqrt(units / 14) rounded, unless the parts need more (ceil(units /
    parts)): 18 units (1k tokens) give parts of one block, 34 and 66 of two, 130 of three, 258 of
    four (on 66 parts too: ceil(258 / 66) is 4 as well) and 514 of six, the first part's units
    also holding the fixed cost."""
    run = subprocess.run([str(schedule_check)],
                         input=f"1 {parts} 512 64 2 1 14 1 0 0 {length}\n",
                         capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["ok", str(segments), str(length)]


def plan_cases():
    """A schedule built from planned lengths, walked with the call's lengths (each the planned one
    or another) compared with the planned ones (mode 1), and as a control not compared (mode
    2)."""
    rng = np.random.default_rng(91)
    max_pages, page_size, capacity = 40, 32, 40 * 32
    for parts in (1, 2, 33, 66, 132):
        for batch in (1, 5, 64, 300):
            planned = rng.integers(-5, capacity + 100, size=batch)
            kept = rng.random(batch) < 0.7
            lengths = np.where(kept, planned, planned + rng.choice([-1, 200], size=batch, p=[0.3, 0.7]))
            for fail_closed in (0, 1):
                for mode in (1, 2):
                    header = [batch, parts, max_pages, page_size, 2, 2, 14, 2, fail_closed, mode]
                    yield (parts, batch, fail_closed, mode), header, lengths, planned


def test_a_plans_schedule_walked_with_other_lengths_covers_every_kept_block_once(schedule_check):
    results = run_cases(schedule_check, list(plan_cases()))
    check_ok({label: r for label, r in results.items() if label[3] == 1})
    # Lengths above the plan's, not compared with it, leave blocks uncovered or name parts past
    # the grid: the reason the kernels compare each length with its planned one.
    others = [words[:3] for label, (words, _) in results.items() if label[3] == 2 and label[1] > 1]
    assert sum(words[0] != "ok" for words in others) >= len(others) // 2, others
