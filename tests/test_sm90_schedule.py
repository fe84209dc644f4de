"""The sm90 kernel's split-KV schedule, run on the host (``tests/sm90_schedule_check.cu``): the
same ScheduleView/SegmentWalker code as the decode and combine kernels, for every cost-model
setting the harness may sweep and for bad lengths, and for a schedule from an Sm90Plan's lengths
walked with the kernel's (each the plan's or 0). Every KV block of every request must be covered
once, in order, one segment per part, with distinct partial-result slots."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
from conftest import skip_or_fail

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def schedule_check(tmp_path_factory):
    if shutil.which("nvcc") is None:
        skip_or_fail("building tests/sm90_schedule_check.cu needs nvcc")
    binary = tmp_path_factory.mktemp("sm90_schedule") / "sm90_schedule_check"
    subprocess.run(["nvcc", "-std=c++17", "-O1", f"-I{ROOT}", "-gencode",
                    "arch=compute_90a,code=sm_90a", f"{ROOT}/tests/sm90_schedule_check.cu", "-o",
                    str(binary)], check=True, capture_output=True)
    return binary


def cases():
    rng = np.random.default_rng(90)
    max_pages, page_size = 40, 64
    capacity = max_pages * page_size
    for fixed_cost in (0, 1, 2, 4):
        for min_blocks in (1, 2, 3, 8, 64):
            for parts in (1, 2, 33, 66, 132):
                for batch in (1, 5, 64, 300):
                    lengths = rng.integers(0, capacity + 1, size=batch)
                    lengths[rng.random(batch) < 0.1] = -5
                    lengths[rng.random(batch) < 0.1] = capacity + 100
                    lengths[rng.random(batch) < 0.1] = 0
                    header = [batch, parts, max_pages, page_size, fixed_cost, min_blocks, 0]
                    yield (fixed_cost, min_blocks, parts, batch), " ".join(map(str, [*header, *lengths]))


def test_every_block_is_covered_once_for_every_cost_model(schedule_check):
    labels, lines = zip(*cases())
    run = subprocess.run([str(schedule_check)], input="\n".join(lines) + "\n", capture_output=True,
                         text=True, check=True)
    results = run.stdout.splitlines()
    assert len(results) == len(labels)
    failures = [(label, result) for label, result in zip(labels, results) if not result.startswith("ok")]
    assert not failures, failures[:5]
    assert sum(int(r.split()[1]) for r in results) > len(labels)  # segments were walked


def test_one_request_of_4k_tokens_on_66_parts(schedule_check):
    """B=1, L=4k, the default cost model (fixed cost 2, at least 2 blocks a part): 64 blocks in
    32 segments of 2 (the fixed cost fills the first part's units)."""
    run = subprocess.run([str(schedule_check)], input="1 66 64 64 2 2 0 4096\n",
                         capture_output=True, text=True, check=True)
    assert run.stdout.split() == ["ok", "32"]


def plan_cases():
    """A schedule built from planned lengths, walked with each request's planned length or 0 (as
    Sm90Plan.lengths_for gives the kernel), and as a control with other lengths."""
    rng = np.random.default_rng(91)
    max_pages, page_size, capacity = 40, 32, 40 * 32
    for parts in (1, 2, 33, 66, 132):
        for batch in (1, 5, 64, 300):
            planned = rng.integers(-5, capacity + 100, size=batch)
            kept = rng.random(batch) < 0.7
            header = [batch, parts, max_pages, page_size, 2, 2, 1]
            for kernel, label in ((np.where(kept, planned, 0), "kept or 0"),
                                  (np.where(kept, planned, planned + 200), "other")):
                yield (parts, batch, label), " ".join(map(str, [*header, *kernel, *planned]))


def test_a_plans_schedule_with_its_lengths_or_0_covers_every_kept_block_once(schedule_check):
    labels, lines = zip(*plan_cases())
    run = subprocess.run([str(schedule_check)], input="\n".join(lines) + "\n", capture_output=True,
                         text=True, check=True)
    results = dict(zip(labels, run.stdout.splitlines()))
    kept = {label: r for label, r in results.items() if label[2] == "kept or 0"}
    assert all(r.startswith("ok") for r in kept.values()), kept
    # Lengths above the plan's leave blocks uncovered or name parts past the grid: the reason the
    # kernel is given each planned length or 0.
    others = [r for label, r in results.items() if label[2] == "other" and label[1] > 1]
    assert sum(not r.startswith("ok") for r in others) >= len(others) // 2, others
