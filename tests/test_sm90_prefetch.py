"""The sm90 decode's L2 prefetch before its dependency wait, run on the host
(``tests/sm90_prefetch_check.cu``): the same ForEachPrefetchHalf code as the kernel, on valid
schedules and on schedules, lengths and block tables of arbitrary values (what the buffers may hold
while the kernels ahead are still writing them). Every read must stay inside its array and every
range asked of L2 inside one page of the cache; with a valid schedule the ranges must be the
part's first KV halves."""

from __future__ import annotations

import subprocess

from conftest import build_host_check


def test_prefetch_reads_and_ranges_stay_inside_their_buffers(tmp_path):
    binary = build_host_check(tmp_path, "sm90_prefetch_check", "--expt-relaxed-constexpr")
    run = subprocess.run([binary, "4000", "7"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-2000:]
    summary = run.stdout.split()
    assert summary[:2] == ["checked", "4000"] and summary[-2:] == ["0", "failures"], run.stdout
    assert int(summary[3]) > 100_000  # ranges were asked for
