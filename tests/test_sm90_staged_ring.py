"""The sm90 staged combine's ring bookkeeping (``StagedRing``), run on the host under random
interleavings of its producer lanes, consumer warps and copy completions
(``tests/sm90_staged_ring_check.cu``): no deadlock, every split read by every consumer warp after
its copy landed and before the slot is written again, for 2-140 splits. Each planted bug (a wrong
parity, no wait for the slots to be read, one arrival too few) must make it fail."""

from __future__ import annotations

import subprocess

import pytest
from conftest import build_host_check


@pytest.fixture(scope="module")
def ring_check(tmp_path_factory):
    return build_host_check(tmp_path_factory.mktemp("sm90_staged_ring"), "sm90_staged_ring_check")


def failures(binary, *args) -> tuple[int, list[str]]:
    lines = subprocess.run([str(binary), *args], capture_output=True, text=True,
                           check=True).stdout.splitlines()
    words = lines[-1].split()
    assert words[0] == "ring:" and words[2] == "cases,", lines[-1]
    return int(words[3]), lines[:-1]


def test_the_ring_neither_deadlocks_nor_loses_a_split(ring_check):
    count, lines = failures(ring_check)
    assert count == 0, lines[:5]


@pytest.mark.parametrize("bug", ["parity", "no-empty", "arrivals"])
def test_a_planted_bug_in_the_ring_is_caught(ring_check, bug):
    count, _ = failures(ring_check, bug)
    assert count > 0
