"""The host planning code under AddressSanitizer, on lengths that include bad ones (issue 16).

``tests/planner_asan.cu`` runs the GPU planner's host twin (the kernel's own range walks) into a
workspace of exactly the planned size, and the length clamping that the self-planning handler
applies before FlashInfer's MLAPlan, all built with ``-fsanitize=address``: a read or write past
any buffer aborts the run with a report.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import pytest
from conftest import skip_or_fail

from jax_mla import planning

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_SM = 132
PAGE_SIZE = 64
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


@pytest.fixture(scope="module")
def planner_asan(tmp_path_factory):
    if shutil.which("nvcc") is None:
        skip_or_fail("building tests/planner_asan.cu needs nvcc")
    binary = tmp_path_factory.mktemp("asan") / "planner_asan"
    subprocess.run(["nvcc", "-std=c++17", "-O1", "-g", f"-I{ROOT}/ffi",
                    "-Xcompiler=-fsanitize=address,-fno-omit-frame-pointer",
                    f"{ROOT}/tests/planner_asan.cu", "-o", str(binary)], check=True)
    return binary


def length_sets(rng, batch: int, q_len: int, capacity: int):
    """Clean lengths, and lengths with every kind of bad value mixed in with long ones."""
    clean = rng.integers(q_len, capacity + 1, size=batch)
    yield "clean", clean
    bad = clean.copy()
    bad[::3] = rng.choice([-1, -7, INT32_MIN, 0], size=len(bad[::3]))
    bad[1::5] = rng.choice([capacity + 1, 2**30, INT32_MAX], size=len(bad[1::5]))
    yield "mixed", bad
    yield "negative", np.full(batch, -3)
    yield "huge", np.full(batch, INT32_MAX)


def cases():
    rng = np.random.default_rng(16)
    for q_len, num_heads in [(1, 16), (1, 128), (2, 128), (4, 64), (8, 128)]:
        layout = planning.schedule_layout(NUM_SM, q_len, num_heads, 512)
        cluster_size, num_clusters = layout.plan_info[:2]
        largest = planning.max_batch_for_works(q_len, num_heads, num_clusters, cluster_size)
        for batch in (1, 7, 300, largest):
            max_pages = 64
            for name, lengths in length_sets(rng, batch, q_len, max_pages * PAGE_SIZE):
                header = [q_len, num_heads, max_pages, PAGE_SIZE, NUM_SM, int(q_len > 1),
                          layout.int_workspace_bytes, batch, *layout.plan_info]
                yield (q_len, num_heads, batch, name), " ".join(map(str, [*header, *lengths]))


def test_host_planning_is_clean_under_address_sanitizer(planner_asan):
    labels, lines = zip(*cases())
    run = subprocess.run([str(planner_asan)], input="\n".join(lines) + "\n", capture_output=True,
                         text=True, env={**os.environ, "ASAN_OPTIONS": "detect_leaks=0"})
    assert run.returncode == 0 and "AddressSanitizer" not in run.stderr, run.stderr[-4000:]
    results = [tuple(map(int, line.split())) for line in run.stdout.splitlines()]
    assert len(results) == len(labels)
    capacity = 64 * PAGE_SIZE
    for label, (works, low, high) in zip(labels, results):
        assert works >= 1, label  # within the capacities, whatever the lengths
        assert 0 <= low <= high <= capacity, label
