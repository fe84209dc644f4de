"""benchmarks/decode.py --dry-run (CPU, XLA backends, tiny grid) and benchmarks/report.py on its output."""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys

import pytest
from conftest import load_bench_decode

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECODE = os.path.join(REPO, "benchmarks", "decode.py")
REPORT = os.path.join(REPO, "benchmarks", "report.py")

ENV_KEYS = {"gpu", "driver", "cuda", "jax", "torch", "flashinfer", "commit"}
RECORD_KEYS = {"key", "B", "L", "H", "q_len", "page_size", "floor_us", "flops", "bytes", "intensity",
               "sum_len", "n_caches", "layers", "methods_done", "errors"}
TIMED = ("jax_mla", "xla_naive", "jax_mla_xla")


def run_script(*args, cwd=REPO):
    path = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=path)
    result = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "dry.json"
    result = run_script(DECODE, "--dry-run", "--out", str(out))
    return out, result


def test_dry_run_writes_schema(dry_run):
    out, result = dry_run
    data = json.loads(out.read_text())
    assert ENV_KEYS <= set(data["env"]), sorted(data["env"])
    assert data["env"]["dry_run"] is True and data["env"]["jax_platform"] == "cpu"
    assert data["records"], "no records"
    for record in data["records"]:
        assert RECORD_KEYS <= set(record), sorted(RECORD_KEYS - set(record))
        assert record["errors"] == {}, record["errors"]
        assert record["floor_us"] > 0 and record["flops"] > 0 and record["bytes"] > 0
        assert record["n_caches"] >= 2, "caches are rotated"
        assert sorted(record["methods_done"]) == sorted(TIMED)
        for method in TIMED:
            assert record[f"{method}_us"] > 0
            # every timed method was checked against the float32 reference first
            assert record[f"{method}_rel_err"] < 2e-2
        assert record["jax_mla_backend"] == "xla"
        assert record["key"] == (f"B{record['B']}-L{record['L']}-H{record['H']}-q{record['q_len']}"
                                 f"-p{record['page_size']}")
    assert "[2/2" in result.stderr, "one progress line per point"


def test_rerun_skips_measured_points(dry_run):
    out, _ = dry_run
    before = json.loads(out.read_text())
    result = run_script(DECODE, "--dry-run", "--out", str(out))
    assert "already in" in result.stderr
    after = json.loads(out.read_text())
    assert [r["key"] for r in after["records"]] == [r["key"] for r in before["records"]]
    assert len(after["runs"]) == len(before["runs"]) + 1


def test_pieces_partition_the_grid():
    listed = []
    for k in (1, 2, 3):
        text = run_script(DECODE, "--list", "--grid", "full", "--piece", f"{k}/3").stdout
        listed += [line.split(" est ")[0].strip() for line in text.splitlines()[1:]]
    full = run_script(DECODE, "--list", "--grid", "full").stdout
    assert sorted(listed) == sorted(line.split(" est ")[0].strip() for line in full.splitlines()[1:]
                                    if " est " in line)
    assert len(listed) == len(set(listed)) > 64


def test_report_markdown(dry_run, tmp_path):
    out, _ = dry_run
    md, png = tmp_path / "report.md", tmp_path / "roofline.png"
    run_script(REPORT, str(out), "--md", str(md), "--png", str(png))
    text = md.read_text()
    assert "## Goals (computed from the data)" in text
    for goal in ("within 3% of FlashInfer-torch", "than FlashInfer-torch at B=1",
                 "5x faster than plain XLA"):
        assert goal in text
    assert "CPU dry run" in text
    assert "| H | q | page | B | L | floor µs | jax_mla µs |" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line[2:3].isdigit()]
    assert len(rows) == len(json.loads(out.read_text())["records"])


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None,
                    reason="matplotlib not installed (pip install matplotlib, or '.[bench]')")
def test_report_png(dry_run, tmp_path):
    out, _ = dry_run
    md, png = tmp_path / "report.md", tmp_path / "roofline.png"
    run_script(REPORT, str(out), "--md", str(md), "--png", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![roofline](roofline.png)" in md.read_text()


def test_layout_floor_and_rotation():
    bench = load_bench_decode()
    pt = bench.Point(B=32, L=4096, H=128, q_len=1, page_size=64)
    layout = bench.make_layout(pt, 0)
    lengths = layout.lengths
    assert lengths.min() >= 2048 and lengths.max() <= 6144
    assert abs(lengths.mean() - 4096) < 1
    # Every request's pages are distinct cache pages, shuffled, and the CSR view matches the table.
    indices = layout.kv_indices
    assert sorted(indices.tolist()) == list(range(layout.num_pages))
    assert (indices != sorted(indices)).any()
    assert layout.kv_indptr[-1] == indices.size
    assert (layout.pages_per_request == -(-lengths // 64)).all()
    # The floor of ../shared/docs/performance.md: H=128 B=32 L=4k is 46 us, compute-bound.
    work = bench.work(layout)
    assert abs(work["floor_us"] - 46.4) < 1.5 and work["floor_bound"] == "compute"
    # Enough cache copies that the others exceed 2x L2 between two reads of one.
    n = bench.cache_count(layout, 60 * bench.GIB)
    assert n >= 2 and (n - 1) * layout.cache_bytes > 2 * bench.L2_BYTES
    assert bench.cache_count(layout, layout.cache_bytes - 1) == 0  # over budget: skipped
    sets = bench.rotation_sets(list(range(n)), 12)
    flat = [c for s in sets for c in s]
    assert all(a != b for a, b in zip(flat, flat[1:])), "consecutive layers read different copies"
    assert sorted(set(flat)) == list(range(n))


def test_report_planner_tables(tmp_path):
    """The host- vs device-schedule and whole-step tables and the planner goals, on GPU-shaped
    records (what a GPU run writes; numbers made up so both verdicts occur)."""
    decode = load_bench_decode()
    records = []
    for batch, device_run, planner in ((32, 101.5, 6.0), (512, 120.0, 12.0)):
        record = {"key": f"B{batch}-L4096-H128-q1-p64", "B": batch, "L": 4096, "H": 128, "q_len": 1,
                  "page_size": 64, "floor_us": 80.0, "jax_mla_us": 100.0, "plan_us": 400.0,
                  "plan_ready_us": 450.0, "jax_mla_device_plan_us": device_run,
                  "device_plan_us": planner, "layers": 12, "step_layers": 61, "step_host_plan_ms": 6.5,
                  "step_device_plan_ms": 6.2, "errors": {}}
        decode.name_plan_comparison(record)
        assert record["run_with_host_plan_us"] == 100.0
        assert record["run_with_device_plan_us"] == device_run - planner / 12  # its share taken out
        records.append(record)
    in_graph = dict(records[0], jax_mla_graph_us=90.0, jax_mla_device_plan_in_graph=True)
    decode.name_plan_comparison(in_graph)
    assert in_graph["run_with_host_plan_us"] == 90.0  # graph against graph
    src, md = tmp_path / "gpu.json", tmp_path / "gpu.md"
    src.write_text(json.dumps({"env": {"gpu": "NVIDIA H200"}, "records": records}))
    run_script(REPORT, str(src), "--md", str(md), "--png", str(tmp_path / "gpu.png"))
    text = md.read_text()
    assert "## Host schedule vs GPU schedule" in text
    assert "## Whole decode step, host plan vs GPU plan" in text
    assert "| 128 | 1 | 32 | 4k | 80.0 | 100.0 | 101.0 | 1.010 | 101.5 | 6.0 | – | 450.0 |" in text
    assert "| 128 | 1 | 512 | 4k | 61 | 6.50 | 6.20 | 0.954 | 450.0 |" in text
    planner_goal = next(line for line in text.splitlines() if "GPU planner at most 10 us" in line)
    assert "NOT MET at any of the 1 measured point(s)" in planner_goal, planner_goal
    run_goal = next(line for line in text.splitlines() if "device-planned run within 3%" in line)
    assert "met at 1 of 2" in run_goal.lower() or "1 of the 2" in run_goal, run_goal


def test_planner_share_uses_its_graph_node_time_when_measured():
    decode = load_bench_decode()
    record = {"plan_us": 400.0, "jax_mla_us": 100.0, "jax_mla_device_plan_us": 101.0,
              "device_plan_us": 6.0, "device_plan_graph_us": 9.0, "layers": 12}
    decode.name_plan_comparison(record)
    assert record["run_with_device_plan_us"] == 101.0 - 9.0 / 12


def test_kernel_durations_come_from_the_perfetto_trace(tmp_path):
    """Only the named kernel's complete events count (not its launch API calls, not other kernels)."""
    decode = load_bench_decode()
    events = [{"ph": "X", "name": "void jax_mla::PlanKernel(ScheduleShape)", "dur": 8.5},
              {"ph": "X", "name": "cudaLaunchKernel", "dur": 3.0, "args": {"kernel": "PlanKernel"}},
              {"ph": "X", "name": "BatchMLAPageAttentionHopperKernel", "dur": 300.0},
              {"ph": "i", "name": "PlanKernel marker"},
              {"ph": "X", "name": "jax_mla::PlanKernel", "dur": 7.5}]
    nested = tmp_path / "plugins" / "profile" / "run1"
    nested.mkdir(parents=True)
    with gzip.open(nested / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert decode.kernel_durations_us(str(tmp_path), "PlanKernel") == [8.5, 7.5]
    assert decode.kernel_durations_us(str(tmp_path), "NoSuchKernel") == []


def test_profiled_kernel_time_says_why_when_the_trace_has_no_such_kernel():
    """On a CPU the profiler runs but sees no GPU kernel: no durations, and the reason recorded
    (time_device_plan then falls back to the graph wall time and keeps the reason)."""
    import jax.numpy as jnp

    decode = load_bench_decode()
    durations, why = decode.profiled_kernel_us(lambda: (jnp.ones(3) + 1).block_until_ready(),
                                               "PlanKernel")
    assert durations == []
    assert why == "no PlanKernel events in the profiler trace"


def test_dry_run_refuses_the_gpu_only_methods(capsys):
    bench = load_bench_decode()
    for method in ("flashinfer", "jax_mla_noplan", "jax_mla_device_plan", "jax_mla_step"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--dry-run", "--backends", method])
        assert "--dry-run runs the XLA backends only" in capsys.readouterr().err


def test_planner_kernel_table_reads_the_committed_ncu_csv(tmp_path):
    csv_path = os.path.join(REPO, "benchmarks", "results", "2026-11-30-h200-planner-ncu.csv")
    table = run_script(os.path.join(REPO, "benchmarks", "planner_kernel.py"), "--table", csv_path).stdout
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 16
    assert rows[0].split("|")[1:4] == [" 1 ", " 16 ", " 1 "]
    times = [float(row.split("|")[5]) for row in rows]
    assert all(5 < t < 100 for t in times), times  # µs, read from "ns" with thousands separators
    short = tmp_path / "short.csv"
    with open(csv_path) as f:
        short.write_text("".join(f.readlines()[:-3]))  # a profile cut short: rows missing
    result = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "planner_kernel.py"),
                             "--table", str(short)], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert result.returncode != 0 and "expected 32 PlanKernel rows, found 29" in result.stderr
