"""The benchmarks package: ``python -m benchmarks.decode --dry-run`` (CPU, XLA backends, tiny grid),
``python -m benchmarks.report`` on its output, and the pieces they are made of."""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks import decode, grid, methods, peers, problem, progress, report, results, timing

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DECODE = ("-m", "benchmarks.decode")
REPORT = ("-m", "benchmarks.report")
PLANNER_KERNEL = ("-m", "benchmarks.planner_kernel")

ENV_KEYS = {"gpu", "driver", "cuda", "jax", "torch", "flashinfer", "commit"}
RECORD_KEYS = {"key", "B", "L", "H", "q_len", "page_size", "floor_us", "flops", "bytes", "intensity",
               "sum_len", "n_caches", "layers", "methods_done", "errors"}
TIMED = ("jax_mla", "xla_naive", "jax_mla_xla")


def run_module(module, *args, check=True):
    """``python -m MODULE ARGS`` from the repository root, on the CPU (no GPU visible to JAX or
    torch, also on a GPU machine)."""
    path = REPO + os.pathsep + os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path)
    result = subprocess.run([sys.executable, *module, *args], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=120)
    if check:
        assert result.returncode == 0, f"{module} {args} failed:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "dry.json"
    result = run_module(DECODE, "--dry-run", "--out", str(out))
    return out, result


def test_floor_model_is_the_gpus_own_or_the_default():
    for model in problem.FLOOR_MODELS:
        assert problem.floor_model(model.gpu) is model
    assert problem.floor_model(None) is problem.FLOOR_MODELS[0]
    assert problem.floor_model("NVIDIA H800") is problem.FLOOR_MODELS[0]


def test_dry_run_writes_schema(dry_run):
    out, result = dry_run
    data = json.loads(out.read_text())
    assert ENV_KEYS <= set(data["env"]), sorted(data["env"])
    assert data["env"]["dry_run"] is True and data["env"]["jax_platform"] == "cpu"
    # The floor model the records divide by: the machine's GPU's (a dry run on a GPU machine still
    # reports its GPU), the default's where that GPU was not measured or there is none.
    model = problem.floor_model(data["env"]["gpu"])
    assert model in problem.FLOOR_MODELS
    assert (data["env"]["floor_model"], data["env"]["peak_flops"],
            data["env"]["peak_bytes_per_s"]) == (model.gpu, model.flops_per_s, model.bytes_per_s)
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
    assert "\r" not in result.stderr and "\x1b" not in result.stderr, "plain lines when not a terminal"


def test_rerun_skips_measured_points(dry_run):
    out, _ = dry_run
    before = json.loads(out.read_text())
    result = run_module(DECODE, "--dry-run", "--out", str(out))
    assert "already in" in result.stderr
    after = json.loads(out.read_text())
    assert [r["key"] for r in after["records"]] == [r["key"] for r in before["records"]]
    assert len(after["runs"]) == len(before["runs"]) + 1


def test_pieces_partition_the_grid():
    listed = []
    for k in (1, 2, 3):
        text = run_module(DECODE, "--list", "--grid", "full", "--piece", f"{k}/3").stdout
        listed += [line.split(" est ")[0].strip() for line in text.splitlines()[1:]]
    full = run_module(DECODE, "--list", "--grid", "full").stdout
    assert sorted(listed) == sorted(line.split(" est ")[0].strip() for line in full.splitlines()[1:]
                                    if " est " in line)
    assert len(listed) == len(set(listed)) > 64


def test_report_markdown(dry_run, tmp_path):
    out, _ = dry_run
    md, png = tmp_path / "report.md", tmp_path / "roofline.png"
    run_module(REPORT, str(out), "--md", str(md), "--png", str(png))
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
    run_module(REPORT, str(out), "--md", str(md), "--png", str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "![roofline](roofline.png)" in md.read_text()


def test_layout_floor_and_rotation():
    pt = grid.Point(B=32, L=4096, H=128, q_len=1, page_size=64)
    layout = problem.make_layout(pt, 0)
    lengths = layout.lengths
    assert lengths.min() >= 2048 and lengths.max() <= 6144
    assert abs(lengths.mean() - 4096) < 1
    # Every request's pages are distinct cache pages, shuffled, and the CSR view matches the table.
    indices = layout.kv_indices
    assert sorted(indices.tolist()) == list(range(layout.num_pages))
    assert (indices != sorted(indices)).any()
    assert layout.kv_indptr[-1] == indices.size
    assert (layout.pages_per_request == -(-lengths // 64)).all()
    # The floor model: H=128 B=32 L=4k is 46 us, compute-bound.
    work = problem.work(layout)
    assert abs(work["floor_us"] - 46.4) < 1.5 and work["floor_bound"] == "compute"
    # Enough cache copies that the others exceed 2x L2 between two reads of one.
    n = problem.cache_count(layout, 60 * problem.GIB)
    assert n >= 2 and (n - 1) * layout.cache_bytes > 2 * problem.L2_BYTES
    assert problem.cache_count(layout, layout.cache_bytes - 1) == 0  # over budget: skipped
    sets = methods.rotation_sets(list(range(n)), 12)
    flat = [c for s in sets for c in s]
    assert all(a != b for a, b in zip(flat, flat[1:])), "consecutive layers read different copies"
    assert sorted(set(flat)) == list(range(n))


def test_floor_model_follows_the_gpu():
    """A run's floors divide by its GPU's measured rates; a GPU not measured gets the H200's."""
    memory_bound = problem.make_layout(grid.Point(B=32, L=16384, H=16, q_len=1, page_size=64), 0)
    compute_bound = problem.make_layout(grid.Point(B=32, L=4096, H=128, q_len=1, page_size=64), 0)
    assert problem.floor_model(None) is problem.FLOOR_MODELS[0]
    assert problem.floor_model("NVIDIA A100-SXM4-80GB") is problem.FLOOR_MODELS[0]
    h200 = problem.work(memory_bound)["floor_us"]
    assert problem.work(memory_bound, model=problem.floor_model("NVIDIA H200"))["floor_us"] == h200
    assert problem.work(compute_bound)["floor_bound"] == "compute"
    h100 = problem.floor_model("NVIDIA H100 80GB HBM3")
    assert (h100.flops_per_s, h100.bytes_per_s) == (796e12, 3.03e12)
    assert problem.work(memory_bound, model=h100)["floor_us"] == pytest.approx(h200 * 4.3 / 3.03)
    # 128 heads at q_len 1 (about 230 FLOP/byte here) is past the H100's ridge of 263.
    assert problem.work(compute_bound, model=h100)["floor_bound"] == "memory"
    # Before main knows the GPU (cost estimates, --list) a run divides by the default's.
    assert decode.parse_args(["--dry-run"]).floor_model is problem.FLOOR_MODELS[0]
    assert report.peaks({}) == (790e12, 4.3e12)  # runs recorded before the model was
    assert report.peaks({"peak_flops": 796e12, "peak_bytes_per_s": 3.03e12}) == (796e12, 3.03e12)


def test_report_planner_tables(tmp_path):
    """The host- vs device-schedule and whole-step tables and the planner goals, on GPU-shaped
    records (what a GPU run writes; numbers made up so both verdicts occur)."""
    records = []
    for batch, device_run, planner in ((32, 101.5, 6.0), (512, 120.0, 12.0)):
        record = {"key": f"B{batch}-L4096-H128-q1-p64", "B": batch, "L": 4096, "H": 128, "q_len": 1,
                  "page_size": 64, "floor_us": 80.0, "jax_mla_us": 100.0, "plan_us": 400.0,
                  "plan_ready_us": 450.0, "jax_mla_device_plan_us": device_run,
                  "device_plan_us": planner, "layers": 12, "step_layers": 61, "step_host_plan_ms": 6.5,
                  "step_device_plan_ms": 6.2, "step_host_plan_unguarded_ms": 6.5,
                  "step_device_plan_unguarded_ms": 6.1, "guard_us": 3.05, "guard_plan_us": 6.1,
                  "step_host_plan_guard_ratio": 1.002, "step_device_plan_guard_ratio": 0.999,
                  "errors": {}}
        results.name_plan_comparison(record)
        assert record["run_with_host_plan_us"] == 100.0
        assert record["run_with_device_plan_us"] == device_run - planner / 12  # its share taken out
        records.append(record)
    in_graph = dict(records[0], jax_mla_graph_us=90.0, jax_mla_device_plan_in_graph=True)
    results.name_plan_comparison(in_graph)
    assert in_graph["run_with_host_plan_us"] == 90.0  # graph against graph
    src, md = tmp_path / "gpu.json", tmp_path / "gpu.md"
    src.write_text(json.dumps({"env": {"gpu": "NVIDIA H200"}, "records": records}))
    run_module(REPORT, str(src), "--md", str(md), "--png", str(tmp_path / "gpu.png"))
    text = md.read_text()
    assert "## Host schedule vs GPU schedule" in text
    assert "## Whole decode step, host plan vs GPU plan" in text
    assert "| 128 | 1 | 32 | 4k | 80.0 | 100.0 | 101.0 | 1.010 | 101.5 | 6.0 | – | 450.0 |" in text
    assert ("| 128 | 1 | 512 | 4k | 61 | 6.50 | 6.20 | 0.954 | 6.50 | 6.10 | +0.00% | +1.64% | +0.20% | "
            "-0.10% | 3.05 | 6.10 | 0.10% | 450.0 |" in text)
    planner_goal = next(line for line in text.splitlines() if "GPU planner at most 10 us" in line)
    assert "NOT MET at any of the 1 measured point(s)" in planner_goal, planner_goal
    run_goal = next(line for line in text.splitlines() if "device-planned run within 3%" in line)
    assert "met at 1 of 2" in run_goal.lower() or "1 of the 2" in run_goal, run_goal


def test_planner_share_uses_its_graph_node_time_when_measured():
    record = {"plan_us": 400.0, "jax_mla_us": 100.0, "jax_mla_device_plan_us": 101.0,
              "device_plan_us": 6.0, "device_plan_graph_us": 9.0, "layers": 12}
    results.name_plan_comparison(record)
    assert record["run_with_device_plan_us"] == 101.0 - 9.0 / 12


def test_kernel_durations_come_from_the_perfetto_trace(tmp_path):
    """Only the named kernel's complete events count (not its launch API calls, not other kernels)."""
    events = [{"ph": "X", "name": "void jax_mla::PlanKernel(ScheduleShape)", "dur": 8.5},
              {"ph": "X", "name": "cudaLaunchKernel", "dur": 3.0, "args": {"kernel": "PlanKernel"}},
              {"ph": "X", "name": "BatchMLAPageAttentionHopperKernel", "dur": 300.0},
              {"ph": "i", "name": "PlanKernel marker"},
              {"ph": "X", "name": "jax_mla::PlanKernel", "dur": 7.5}]
    nested = tmp_path / "plugins" / "profile" / "run1"
    nested.mkdir(parents=True)
    with gzip.open(nested / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert timing.kernel_durations_us(str(tmp_path), "PlanKernel") == [8.5, 7.5]
    assert timing.kernel_durations_us(str(tmp_path), "NoSuchKernel") == []


def test_gpu_stream_kernels_leave_out_host_and_annotation_lines(tmp_path):
    """Only complete events on a GPU process's stream lines count, sorted by start; the XLA-op
    lines of the same GPU (which repeat the kernels' times) and host threads do not."""
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 7, "args": {"name": "Stream #13"}},
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": 8, "args": {"name": "XLA Ops"}},
            {"ph": "M", "name": "thread_name", "pid": 2, "tid": 9, "args": {"name": "python"}}]
    events = [{"ph": "X", "pid": 1, "tid": 7, "name": "DecodeKernel", "ts": 20.0, "dur": 5.0},
              {"ph": "X", "pid": 1, "tid": 7, "name": "ScheduleKernel", "ts": 10.0, "dur": 1.0},
              {"ph": "X", "pid": 1, "tid": 8, "name": "custom-call", "ts": 20.0, "dur": 5.0},
              {"ph": "X", "pid": 2, "tid": 9, "name": "cudaLaunchKernel", "ts": 19.0, "dur": 2.0}]
    with gzip.open(tmp_path / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + events}, f)
    assert timing.gpu_stream_kernels(str(tmp_path)) == [("ScheduleKernel", 10.0, 1.0),
                                                        ("DecodeKernel", 20.0, 5.0)]


def test_step_profile_splits_steps_by_count():
    """Each step is the same number of kernels; a step's span runs to its last kernel's end, idle
    gaps between steps excluded; its busy time also leaves out the gaps inside it; a kernel's
    start is also measured from the end of the one before it in its step (negative where it
    launched under it); a trace that does not split evenly is an error."""
    from benchmarks import step_profile

    events = [("Schedule", 0.0, 1.0), ("Decode", 1.0, 10.0), ("Combine", 5.0, 8.0),
              ("Schedule", 50.0, 1.0), ("Decode", 53.0, 12.0), ("Combine", 55.0, 8.0)]
    stats = step_profile.per_step(events, 2, layers=1)
    assert stats["span_us"] == (13.0 + 15.0) / 2
    assert stats["busy_us"] == (13.0 + 13.0) / 2
    assert stats["kernels_us"] == (19.0 + 21.0) / 2
    assert stats["by_name"] == {"Schedule": (1.0, 1.0, None), "Decode": (1.0, 11.0, 1.0),
                                "Combine": (1.0, 8.0, -8.0)}
    assert step_profile.per_step(events, 1, layers=2)["span_us"] == 65.0 / 2
    with pytest.raises(RuntimeError, match="7 kernels in the trace do not split into 2 steps"):
        step_profile.per_step(events + [("Decode", 95.0, 1.0)], 2, layers=1)


def test_step_profile_points_are_batch_length_heads_and_q_len_with_pages_of_64():
    from benchmarks import step_profile

    points = step_profile.parse_points("1,4096,128; 8,1024,16;2,2048,128,2")
    assert [(p.B, p.L, p.H, p.q_len, p.page_size) for p in points] == [(1, 4096, 128, 1, 64),
                                                                       (8, 1024, 16, 1, 64),
                                                                       (2, 2048, 128, 2, 64)]
    for bad in ("1,4096", "1,4096,0", "a,4096,16", "1,4096,16,0", "1,4096,16,2,1"):
        with pytest.raises(SystemExit, match="a point is B,L,H or B,L,H,q_len"):
            step_profile.parse_points(bad)


def test_step_profile_leaves_out_points_whose_caches_exceed_the_pool_budget(capsys):
    """A point whose rotated caches would not fit is left out with its size, before any cache is
    made (512 requests of 4k tokens take about 61 GiB), and the loop goes on to the next point."""
    from benchmarks import step_profile
    from benchmarks.problem import make_layout

    big = make_layout(step_profile.parse_points("512,4096,64,2")[0], 0)
    assert 60 < step_profile.pool_gib(big) < 70
    step_profile.main(["--points", "512,4096,64,2;2,1024,8,2", "--pool-gib", "0.001",
                       "--methods", "sm90", "--command-buffers", "default"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 5")
            or line.startswith("| 2 ")]
    assert len(rows) == 2 and all("left out: its 27 caches take" in row for row in rows)
    assert "(--pool-gib 0.001)" in rows[0]


def test_step_profile_says_so_when_the_trace_has_no_gpu_kernels():
    """A step that runs on the CPU leaves the profiler trace without GPU kernels: the step profile
    stops with the reason instead of reporting spans of nothing."""
    import jax
    from benchmarks import step_profile

    on_cpu = jax.device_put(np.ones(3, np.float32), jax.devices("cpu")[0])
    with pytest.raises(RuntimeError, match="no GPU kernel events in the profiler trace"):
        step_profile.traced(jax.jit(lambda x: x + 1), (on_cpu,))


def test_sm90_ab_table_sets_the_builds_side_by_side_per_point():
    """Rows of both builds over two passes: per point each build's times in pass order and new /
    base over their sums; check rows and the header are not times; a FAIL row is counted."""
    from benchmarks import sm90_ab

    def row(b, label, us):
        return f"| 128 | {b} | 4096 | 1 | 64 | {label} | {us} | 1.4 | 0.1 | 50.0 | 10% | 0.1 |"

    def check_row(b, result):
        return f"| one | {b} | 1 | 128 | 64 | uniform | 3.0e-03 (0) | 1.9e-06 | no | yes | {result} |"

    lines = ["| H | B | L | q_len | page | variant | µs/layer | floor µs |", check_row(1, "PASS"),
             row(1, "base", 14.6), row(1, "new", 14.2), row(4, "base", 21.6), row(4, "new", 21.0),
             row(1, "base", 14.6), row(1, "new", 14.0), row(4, "base", 21.4), row(4, "new", 21.2),
             check_row(4, "FAIL")]
    text = sm90_ab.table(lines)
    assert "| 128 | 1 | 4096 | 1 | 64 | 14.6, 14.6 | 14.2, 14.0 | 0.966 |" in text
    assert "| 128 | 4 | 4096 | 1 | 64 | 21.6, 21.4 | 21.0, 21.2 | 0.981 |" in text
    assert text.endswith("1 failed check(s)")
    assert sm90_ab.parse_points("1,4096,128,1,3000,fixed; 4,4096,16,2,500,uniform") == [
        ("1", "4096", "128", "1", "3000", "fixed"), ("4", "4096", "16", "2", "500", "uniform")]
    with pytest.raises(SystemExit, match="B,L,H,q_len,iters,dist"):
        sm90_ab.parse_points("1,4096,128")


def test_sm90_ab_runs_every_other_pass_in_reverse_order(tmp_path, monkeypatch):
    """No build always runs first at a point: the second pass times the builds in reverse."""
    from benchmarks import sm90_ab

    calls = []
    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(sm90_ab.os.path, "exists", lambda path: True)
    monkeypatch.setattr(sm90_ab, "harness_rows",
                        lambda binary, label, point, flags: calls.append((label, point[0])) or [])
    sm90_ab.run([("1", "4096", "128", "1", "10", "fixed"), ("4", "4096", "128", "1", "10", "fixed")],
                passes=2, with_checks=False, flags=[], variants=["other"])
    assert calls == [("base", "1"), ("new", "1"), ("other", "1"),
                     ("base", "4"), ("new", "4"), ("other", "4"),
                     ("other", "1"), ("new", "1"), ("base", "1"),
                     ("other", "4"), ("new", "4"), ("base", "4")]


def test_sm90_ab_times_other_builds_beside_base():
    """A build named by --variants gets its own times and its ratio to base, after new's; a point
    one build missed shows "-", and one it missed a pass of compares means; a table printed
    before in the same log is not read as times; variant names that the rows could not tell
    apart are refused, and so is a run whose builds are not there."""
    from benchmarks import sm90_ab

    def row(label, us, b=1):
        return f"| 16 | {b} | 4096 | 2 | 64 | {label} | {us} | 1.4 | 0.1 | 50.0 | 10% | 0.1 |"

    printed = "| 16 | 1 | 4096 | 2 | 64 | 10.0, 10.0 | 9.0, 9.0 | 0.900 |"
    text = sm90_ab.table([row("base", 10.0), row("new", 9.0), row("s1", 11.0), row("base", 10.0),
                          row("new", 9.0), row("s1", 11.0), row("base", 5.0, b=2), printed,
                          row("base", 6.0, b=3), row("new", 6.3, b=3), row("base", 6.0, b=3)])
    lines = text.splitlines()
    assert lines[0] == ("| H | B | L | q_len | page | base µs | new µs | s1 µs | new / base "
                        "| s1 / base |")
    assert lines[1] == "|" + "---|" * 10
    assert "| 16 | 1 | 4096 | 2 | 64 | 10.0, 10.0 | 9.0, 9.0 | 11.0, 11.0 | 0.900 | 1.100 |" in text
    assert "| 16 | 2 | 4096 | 2 | 64 | 5.0 |  |  | - | - |" in text
    assert "| 16 | 3 | 4096 | 2 | 64 | 6.0, 6.0 | 6.3 |  | 1.050 | - |" in text  # a failed pass
    assert sm90_ab.parse_variants(["s1=kv-before-query", "old=HEAD~2"]) == [
        ("s1", "kv-before-query"), ("old", "HEAD~2")]
    for spec in ("s1", "s1=", "s1=--output=x"):
        with pytest.raises(SystemExit, match="a variant is NAME=REV"):
            sm90_ab.parse_variants([spec])
    for spec in ("=main", "new=main", "two words=main"):
        with pytest.raises(SystemExit, match="a variant's name is a word other than"):
            sm90_ab.parse_variants([spec])
    with pytest.raises(SystemExit, match="each variant is named once"):
        sm90_ab.parse_variants(["s1=main", "s1=HEAD~1"])
    with pytest.raises(SystemExit, match="a variant's name is a word other than"):
        sm90_ab.run([("1", "4096", "16", "1", "10", "fixed")], 1, False, [], ["base"])
    with pytest.raises(SystemExit, match="sm90_harness_nope.*run `build` first"):
        sm90_ab.run([("1", "4096", "16", "1", "10", "fixed")], 1, False, [], ["nope"])


def test_sm90_ab_same_code_names_the_kernels_whose_machine_code_changed(tmp_path):
    """Two cubins of the same kernels but for one changed in its code, one in its shared memory,
    one in its parameters and one in its launch bounds, and one kernel left out of the second:
    the comparison names those five and not the kernel kept as it was (whose symbol index moved);
    a file that is not an ELF file is refused."""
    import shutil

    from benchmarks import sm90_ab

    if shutil.which("nvcc") is None:
        pytest.skip("compiling cubins needs nvcc")

    def source(version):
        new = version == "new"
        kernel = 'extern "C" __global__ void {}({}float* out, float a) {{ {} }}\n'.format
        return "".join([
            kernel("kept", "", "out[0] = a;"),
            kernel("changed", "", "out[0] = a * 3.f;" if new else "out[0] = a + 1.f;"),
            kernel("smem", "", f"__shared__ float s[{64 if new else 32}]; s[threadIdx.x] = a; "
                               "__syncthreads(); out[0] = s[0];"),
            kernel("params", "float unused, " if new else "", "out[0] = a;"),
            kernel("bounds", "", "out[0] = a;").replace(
                "__global__", f"__global__ __launch_bounds__({128 if new else 256})"),
            "" if new else kernel("dropped", "", "out[0] = 2.f;")])

    cubins = []
    for version in ("old", "new"):
        (tmp_path / f"{version}.cu").write_text(source(version))
        subprocess.run(["nvcc", "-cubin", "-gencode", "arch=compute_90a,code=sm_90a",
                        str(tmp_path / f"{version}.cu"), "-o", str(tmp_path / f"{version}.cubin")],
                       check=True, capture_output=True)
        cubins.append(sm90_ab.elf_sections(str(tmp_path / f"{version}.cubin")))
    assert sm90_ab.kernels_differing(*cubins) == (
        6, ["bounds", "changed", "dropped", "params", "smem"])
    assert sm90_ab.kernels_differing(cubins[0], cubins[0]) == (6, [])
    for bad in (b"#!/bin/sh\n", b"\x7fELF"):
        (tmp_path / "not.cubin").write_bytes(bad)
        with pytest.raises(SystemExit, match="not a 64-bit little-endian ELF file"):
            sm90_ab.elf_sections(str(tmp_path / "not.cubin"))


def test_sm90_ab_says_where_to_get_cutlass_when_it_finds_none(monkeypatch):
    from benchmarks import sm90_ab

    monkeypatch.setattr(sm90_ab.runpy, "run_path",
                        lambda path: {"configured_cutlass_include": lambda: None})
    with pytest.raises(SystemExit, match="set CUTLASS_INCLUDE_DIR or install nvidia-cutlass"):
        sm90_ab.cutlass_include()


def test_sm90_ab_reports_a_harness_that_exits_with_an_error(tmp_path):
    """A harness that stops with an error and no check row gives a FAIL line naming the build,
    the point, the exit status and its last words (the table then counts it)."""
    from benchmarks import sm90_ab

    harness = tmp_path / "sm90_harness"
    harness.write_text("#!/bin/sh\necho 'CUDA error: out of memory'\nexit 3\n")
    harness.chmod(0o755)
    rows = sm90_ab.harness_rows(str(harness), "new", ("1", "4096", "128", "1", "10", "fixed"), [])
    assert rows == ["FAIL new 1,4096,128,1,10,fixed: exit 3 ['CUDA error: out of memory']"]
    assert sm90_ab.table(rows).endswith("1 failed check(s)")


def test_sm90_ab_gives_up_on_a_hung_harness(tmp_path, monkeypatch):
    """A harness that never returns (a kernel waiting forever) costs one timeout, not the device
    call: a point gives a FAIL line, a suite a log that says so and exit status 124."""
    from benchmarks import sm90_ab

    harness = tmp_path / "sm90_harness"
    harness.write_text("#!/bin/sh\nexec sleep 30\n")
    harness.chmod(0o755)
    monkeypatch.setattr(sm90_ab, "POINT_TIMEOUT_S", 0.5)
    monkeypatch.setattr(sm90_ab, "SUITE_TIMEOUT_S", 0.5)
    rows = sm90_ab.harness_rows(str(harness), "base", ("1", "4096", "128", "1", "10", "fixed"), [])
    assert rows == ["FAIL base 1,4096,128,1,10,fixed: no result within 0.5 s"]
    log = tmp_path / "suite.log"
    assert sm90_ab.logged_run([str(harness), "check"], str(log)) == 124
    assert sm90_ab.last_line(str(log)) == "timeout: no result within 0.5 s"


def test_profiled_kernel_time_says_why_when_the_trace_has_no_such_kernel():
    """On a CPU the profiler runs but sees no GPU kernel: no durations, and the reason recorded
    (time_device_plan then falls back to the graph wall time and keeps the reason)."""
    import jax.numpy as jnp

    durations, why = timing.profiled_kernel_us(lambda: (jnp.ones(3) + 1).block_until_ready(),
                                               "PlanKernel")
    assert durations == []
    assert why == "no PlanKernel events in the profiler trace"


def test_dry_run_refuses_the_gpu_only_methods(capsys):
    for method in ("flashinfer", "jax_mla_noplan", "jax_mla_device_plan", "jax_mla_step"):
        with pytest.raises(SystemExit):
            decode.parse_args(["--dry-run", "--backends", method])
        assert "--dry-run runs the XLA backends only" in capsys.readouterr().err


@pytest.mark.parametrize("spec, message", [
    ("B=abc", "--points: B needs integers (4k = 4096) separated by |, got 'abc'"),
    ("B=", "--points: B needs integers"),
    ("L=4k|x", "--points: L needs integers"),
    ("p=16,p=32", "--points: 'p' given twice in 'p=16,p=32' (list its values as A|B)"),
    ("Z=1", "--points: unknown field 'Z'"),
])
def test_points_specs_are_refused_with_a_message(spec, message):
    with pytest.raises(SystemExit, match=re.escape(message)):
        grid.parse_point_filters([spec])


@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "argument --rounds: expected an integer >= 1, got '0'"),
    (["--layers", "-2"], "argument --layers: expected an integer >= 1, got '-2'"),
    (["--plan-repeats", "x"], "argument --plan-repeats: expected an integer >= 1, got 'x'"),
    (["--backends", ","], "--backends names no method"),
])
def test_counts_and_methods_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit):
        decode.parse_args(["--dry-run", *argv])
    assert message in capsys.readouterr().err


def test_points_matching_nothing_are_an_error(tmp_path):
    result = run_module(DECODE, "--dry-run", "--points", "B=7", "--out", str(tmp_path / "x.json"),
                        check=False)
    assert result.returncode == 2 and "the dry grid has none matching --points" in result.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("module", ["guard_profile", "planner_b1_profile", "floor_rates",
                                    "planner_kernel"])
def test_gpu_only_scripts_show_help_and_say_they_need_a_gpu(module):
    help_text = run_module(("-m", f"benchmarks.{module}"), "--help").stdout
    assert help_text.startswith(f"usage: python -m benchmarks.{module}") and "GPU" in help_text
    result = run_module(("-m", f"benchmarks.{module}"), check=False)
    assert result.returncode != 0
    why = ("torch sees no CUDA device" if module == "floor_rates"
           else "JAX's backend here is 'cpu'")
    assert f"error: this script runs on a CUDA GPU; {why}" in result.stderr


def ncu_csv(times_ns: list[int]) -> str:
    """What ``ncu --csv`` prints around benchmarks.planner_kernel: its notes, the script's lines,
    then one row per PlanKernel launch (values in ns, with thousands separators)."""
    head = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
            '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
            '"Metric Value"')
    rows = [f'"{i}","7","python3","host","(anonymous namespace)::PlanKernel(ScheduleShape, const int *)",'
            f'"1","14","(512, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics",'
            f'"gpu__time_duration.sum","ns","{t:,}"' for i, t in enumerate(times_ns)]
    prints = [f"B={b} H={h} q_len={q} L~4096" for b, h, q in PLANNER_CONFIGS]
    return "\n".join(["==PROF== Connected to process 7", *prints, "==PROF== Disconnected", head,
                      *rows]) + "\n"


PLANNER_CONFIGS = [(b, h, q) for h in (16, 128) for q in (1, 2) for b in (1, 32, 128, 512)]


def test_planner_kernel_table_reads_an_ncu_csv(tmp_path):
    times_ns = [17888 + 100 * i for i in range(2 * len(PLANNER_CONFIGS))]
    full = tmp_path / "ncu.csv"
    full.write_text(ncu_csv(times_ns))
    table = run_module(PLANNER_KERNEL, "--table", str(full)).stdout
    rows = [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 16
    assert rows[0].split("|")[1:6] == [" 1 ", " 16 ", " 1 ", " 17.9 ", " 18.0 "]  # µs from "17,888" ns
    assert [tuple(int(c) for c in row.split("|")[1:4]) for row in rows] == PLANNER_CONFIGS
    short = tmp_path / "short.csv"
    short.write_text(ncu_csv(times_ns[:-3]))  # a profile cut short: rows missing
    result = run_module(PLANNER_KERNEL, "--table", str(short), check=False)
    assert result.returncode != 0 and "expected 32 PlanKernel rows, found 29" in result.stderr


def test_progress_rewrites_a_status_line_on_a_terminal_only():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, tty in ((io.StringIO(), False), (Terminal(), True)):
        bar = progress.Progress(total=2.0, count=2, stream=stream)
        bar.begin(1, "first")
        bar.status("compiling")
        bar.end(1.0, "done")
        text = stream.getvalue()
        assert text.endswith("[1/2 0m00s eta 0m00s] first | done\n"), text
        assert ("\r" in text) == tty and ("compiling" in text) == tty


def test_shuffled_block_tables_deal_one_permutation_of_the_pool():
    rng = np.random.default_rng(0)
    pages = np.array([3, 1, 4])
    tables, spare = problem.shuffled_block_tables(rng, pages, num_pages=10, max_pages=5, fill=-7)
    assert tables.shape == (3, 5) and tables.dtype == np.int32
    held = [tables[b, :n] for b, n in enumerate(pages)]
    assert sorted(np.concatenate(held + [spare]).tolist()) == list(range(10))  # each page once
    assert all((tables[b, n:] == -7).all() for b, n in enumerate(pages))
    assert len(spare) == 2
    assert problem.shuffled_block_tables(np.random.default_rng(0), pages)[0].shape == (3, 4)


def test_relative_error_is_inf_for_non_finite_outputs():
    expected = np.array([1.0, -2.0])
    assert problem.relative_error([1.0, -2.02], expected) == pytest.approx(0.01)
    assert problem.relative_error([np.nan, 0.0], expected) == float("inf")


def test_goals_come_from_the_data_file():
    """benchmarks/goals.toml holds every goal; the report adds the formula it checks."""
    goals = report.load_goals()
    assert [g.formula for g in goals] == [
        "jax_mla_us / flashinfer_torch_us <= 1.03",
        "(jax_mla_graph_us or jax_mla_us) / flashinfer_torch_us < 1",
        "xla_naive_us / jax_mla_us >= 5",
        "run_with_device_plan_us / run_with_host_plan_us <= 1.03",
        "device_plan_us <= 10"]
    b1 = {"B": 1, "L": 4096, "H": 16, "q_len": 1, "page_size": 64, "jax_mla_us": 50.0,
          "jax_mla_graph_us": 30.0, "flashinfer_torch_us": 40.0}
    assert goals[1].in_scope(b1) and goals[1].value(b1) == 0.75 and goals[1].met(0.75)
    assert not goals[0].in_scope(b1) and not goals[4].in_scope(b1)


class _CpuCuda:
    """torch.cuda's calls the benchmark makes, for a CPU torch: no-ops and a wall-clock event."""

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def elapsed_time(self, end):
            return (end.t - self.t) * 1e3

    @staticmethod
    def synchronize():
        pass

    @staticmethod
    def empty_cache():
        pass


class _CpuTorch:
    """torch, with torch.cuda stood in by _CpuCuda."""

    cuda = _CpuCuda

    def __getattr__(self, name):
        import torch

        return getattr(torch, name)


class _ReferencePeer:
    """A FlashInferPeer stand-in that answers with jax_mla's torch reference."""

    def plan(self, layout, meta, kv_data_type=None):
        self.layout = layout
        self.kv_data_type = kv_data_type
        assert meta["kv_indptr"][-1] == meta["kv_indices"].numel()

    def run(self, q_nope, q_pe, ckv, kpe, out=None, **scales):
        import torch

        from jax_mla.reference import mla_decode_reference

        pt = self.layout.point
        assert (ckv.dtype == torch.float8_e4m3fn) == (self.kv_data_type == torch.float8_e4m3fn)
        if ckv.dtype == torch.float8_e4m3fn:
            cache = peers.dequantize_flashinfer_fp8(torch, ckv, kpe, scales).to(torch.bfloat16)
            ckv, kpe = cache[..., :512], cache[..., 512:]
        elif scales:
            raise ValueError("scales are for an fp8 cache")
        query = torch.cat([q_nope, q_pe], -1).view(pt.B, pt.q_len, pt.H, -1)
        ref, _ = mla_decode_reference(query, torch.cat([ckv, kpe], -1),
                                      torch.from_numpy(self.layout.tables),
                                      torch.from_numpy(self.layout.lengths),
                                      softmax_scale=problem.SOFTMAX_SCALE)
        out.copy_(ref.reshape(out.shape).to(out.dtype))
        return out


def run_with_a_stand_in_peer(methods: list[str], point) -> dict:
    """One point's record, measured on the CPU with ``methods`` and the stand-in fa3 peer."""
    from benchmarks.bench import Bench

    args = decode.parse_args(["--dry-run"])
    args.methods, args.fi_backends, args.fi_graph = methods, ["fa3"], False
    bench = Bench(args, _CpuTorch(), args.methods, progress.Progress(1.0, 1, stream=io.StringIO()))
    bench.on_gpu = True  # the guard for a real FlashInfer; the stand-in runs anywhere
    bench.flashinfer.device = "cpu"
    bench.flashinfer.peers["fa3"] = _ReferencePeer()
    layout = problem.make_layout(point, 0)
    record = decode.new_record(layout, args)
    bench.run_point(layout, record)
    assert record["errors"] == {}, record["errors"]
    return record


def test_flashinfer_path_with_a_stand_in_peer():
    """FlashInfer's timing, its check against the reference and the bit-for-bit comparison with
    jax_mla, on the CPU: torch's CPU build with a stand-in for the FlashInfer wrapper."""
    pytest.importorskip("torch")
    record = run_with_a_stand_in_peer(["jax_mla", "flashinfer"],
                                      grid.Point(B=2, L=64, H=4, q_len=2, page_size=16))
    assert record["methods_done"] == ["jax_mla", "flashinfer"]
    assert record["flashinfer_torch_backend"] == "fa3"
    assert record["flashinfer_torch_us"] == record["flashinfer_fa3_us"] > 0
    assert record["flashinfer_fa3_rel_err"] < 1e-2 and record["flashinfer_fa3_plan_us"] > 0
    assert record["jax_mla_vs_flashinfer_peer"] == "flashinfer_fa3"
    assert record["jax_mla_vs_flashinfer_max_abs_diff"] < 0.1


def test_flashinfer_fp8_path_with_a_stand_in_peer():
    """FlashInfer on its own fp8 cache, both scale layouts: made from the point's caches, its output
    compared with the bf16 cache's reference, and timed; and sm90's fp8 table reading the record."""
    pytest.importorskip("torch")
    from benchmarks import sm90_table

    record = run_with_a_stand_in_peer(["flashinfer_fp8"],
                                      grid.Point(B=3, L=96, H=4, q_len=1, page_size=16))
    assert record["methods_done"] == ["flashinfer_fp8"]
    for name in ("flashinfer_fa3_fp8_group", "flashinfer_fa3_fp8_tensor"):
        # e4m3 keys and values move the output by a few percent of its norm, not more, not less.
        assert 5e-3 < record[f"{name}_vs_bf16_l2"] < 0.1, record
        assert record[f"{name}_vs_bf16_err"] < peers.FP8_VS_BF16_TOL
        assert record[f"{name}_us"] > 0
    record.update(jax_mla_sm90_fp8_us=10.0, fp8_floor_us=5.0, jax_mla_sm90_fp8_vs_bf16_l2=0.02,
                  flashinfer_fa3_fp8_group_graph_us=40.0, flashinfer_fa3_fp8_tensor_graph_us=30.0)
    text = sm90_table.fp8_table([record])
    assert "| **0.33** | 2.00% |" in text and "at 1 of these 1 points" in text
    assert sm90_table.fp8_table([dict(record, flashinfer_fa3_fp8_group_graph_us=None,
                                      flashinfer_fa3_fp8_tensor_graph_us=None)]) == ""


def test_flashinfer_fp8_views_hold_the_fp8_cache_bytes_or_one_scale():
    """The group layout is jax_mla's fp8 cache byte for byte (latent and scales); the tensor layout
    scales the bf16 latent by max/448; both keep the rope in e4m3 over one scale, within e4m3's
    half step of it."""
    torch = pytest.importorskip("torch")
    import jax
    import jax.numpy as jnp

    from benchmarks.bench import quantized_cache

    cache = (jax.random.normal(jax.random.PRNGKey(1), (3, 16, 576)) * 3).astype(jnp.bfloat16)
    fp8 = torch.from_dlpack(quantized_cache(cache))
    bf16 = torch.from_dlpack(cache)
    ckv, kpe, scales = peers.flashinfer_fp8_views(torch, bf16, fp8, "group", pages_per_chunk=2)
    assert ckv.dtype == kpe.dtype == torch.float8_e4m3fn
    assert ckv.shape == (3, 16, 512) and kpe.shape == (3, 16, 64)
    assert torch.equal(ckv.view(torch.uint8), fp8[..., :512])
    assert scales["ckv_scale_arr"].shape == (3, 16, 4) and scales["ckv_scale_arr"].is_contiguous()
    assert torch.equal(scales["ckv_scale_arr"].view(torch.uint8), fp8[..., 512:528])
    rope = bf16[..., 512:].float()
    assert scales["kpe_scale"] == pytest.approx(float(rope.abs().max()) / 448)
    assert (kpe.float() * scales["kpe_scale"] - rope).abs().max() <= rope.abs().max() / 16
    ckv_t, kpe_t, scales_t = peers.flashinfer_fp8_views(torch, bf16, fp8, "tensor")
    assert torch.equal(kpe_t.view(torch.uint8), kpe.view(torch.uint8))
    latent = bf16[..., :512].float()
    assert set(scales_t) == {"ckv_scale", "kpe_scale"}
    assert scales_t["ckv_scale"] == pytest.approx(float(latent.abs().max()) / 448)
    assert float(ckv_t.float().abs().max()) == 448.0
    assert (ckv_t.float() * scales_t["ckv_scale"] - latent).abs().max() <= latent.abs().max() / 16
    for views in ((ckv, kpe, scales), (ckv_t, kpe_t, scales_t)):
        read_back = peers.dequantize_flashinfer_fp8(torch, *views)
        assert read_back.shape == (3, 16, 576)
        assert (read_back - bf16.float()).abs().max() <= bf16.float().abs().max() / 16
    from jax_mla.reference import dequantize_fp8

    group_latent = peers.dequantize_flashinfer_fp8(torch, ckv, kpe, scales)[..., :512]
    assert torch.equal(group_latent.flatten(0, 1), dequantize_fp8(fp8.flatten(0, 1), 512)[:, :512])
    with pytest.raises(ValueError, match="scales must be one of"):
        peers.flashinfer_fp8_views(torch, bf16, fp8, "token")


def test_fp8_layouts_read_back_what_each_decoder_reads():
    """The layout comparison's read-backs: jax_mla's is the torch reference's dequantisation of
    write_kv's rows; FlashInfer's group layout shares its latent and differs in the rope only; each
    layout moves a small problem's output by a few percent, not more."""
    torch = pytest.importorskip("torch")
    from benchmarks import fp8_layouts
    from jax_mla.reference import dequantize_fp8

    cache = torch.randn(64, 576, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    read = fp8_layouts.layouts(torch, cache)
    ours, fi_group, fi_max, max_groups = (read[name] for name in (
        "jax_mla (write_kv): power-of-two scale per 128 latent channels, bf16 rope",
        "FlashInfer: jax_mla's latent bytes and scales (ckv_scale_arr), e4m3 rope (kpe_scale)",
        "FlashInfer: max/448 scale per 128 latent channels (ckv_scale_arr), e4m3 rope",
        "max/448 scale per 128 latent channels, bf16 rope"))
    assert torch.equal(ours, dequantize_fp8(fp8_layouts.jax_mla_rows(torch, cache), 512))
    assert torch.equal(ours[:, 512:], cache[:, 512:].float())
    assert torch.equal(fi_group[:, :512], ours[:, :512])
    assert not torch.equal(fi_group[:, 512:], ours[:, 512:])
    assert torch.equal(fi_max[:, :512], max_groups[:, :512])
    results = fp8_layouts.measure(problems=1, batch=2, heads=4, length=128)
    assert set(results) == set(read)
    assert all(0.005 < rows[0][0] < 0.15 for rows in results.values()), results
    assert "| jax_mla (write_kv)" in fp8_layouts.table(results)


def test_interleaved_ratios_order_a_heavy_and_a_light_step():
    import types

    import jax
    import jax.numpy as jnp

    from benchmarks.timing import interleaved_ratios, median, quartiles

    x = jnp.ones((256, 256), jnp.float32)
    heavy = jax.jit(lambda a: jax.lax.fori_loop(0, 40, lambda i, y: jnp.tanh(y @ a), a))
    light = jax.jit(lambda a: a + 1)
    jax.block_until_ready((heavy(x), light(x)))
    args = types.SimpleNamespace(round_s=0.01)
    heavy_over_light = interleaved_ratios(heavy, light, [(x,)], args, pairs=5)
    assert len(heavy_over_light) == 5 and median(heavy_over_light) > 2
    low, high = quartiles(heavy_over_light)
    assert low <= median(heavy_over_light) <= high
    assert median(interleaved_ratios(light, heavy, [(x,)], args, pairs=5)) < 0.5



def test_the_sm90_table_shows_fp8_columns_where_measured():
    from benchmarks import sm90_table

    base = dict(H=16, q_len=1, page_size=64, B=32, L=4096, floor_us=100.0, flashinfer_fa3_us=210.0,
                flashinfer_fa3_graph_us=200.0, jax_mla_sm90_us=150.0, jax_mla_sm90_rel_err=1e-3)
    text = sm90_table.table([dict(base, jax_mla_sm90_fp8_us=120.0, fp8_floor_us=60.0),
                             dict(base, H=128)])
    assert "| sm90 error | sm90 fp8 µs | fp8 / bf16 | fp8 % of fp8 floor |" in text
    assert "| 1.0e-03 | 120.0 | **0.80** | 50% |" in text
    assert "| 1.0e-03 | - | - | - |" in text
    assert "sm90 fp8" not in sm90_table.table([base])


def test_the_sm90_table_sets_the_gpu_busy_time_beside_fa3_where_measured():
    from benchmarks import sm90_table

    base = dict(H=16, q_len=1, page_size=64, B=128, L=4096, floor_us=140.0, flashinfer_fa3_us=210.0,
                flashinfer_fa3_graph_us=200.0, jax_mla_sm90_us=210.0, jax_mla_sm90_rel_err=1e-3)
    measured = dict(base, jax_mla_sm90_gpu_us=150.0, jax_mla_sm90_fp8_us=120.0, fp8_floor_us=60.0,
                    jax_mla_sm90_fp8_gpu_us=100.0)
    text = sm90_table.table([measured, dict(base, L=1024)])
    assert ("| sm90 error | sm90 GPU µs | sm90 GPU / fa3 graph | sm90 GPU % of floor | sm90 fp8 µs |"
            in text)
    assert ("| **1.05** | 70% | 67% | 1.0e-03 | 150.0 | **0.75** | 93% | 120.0 | **0.57** | 50% | "
            "100.0 | **0.67** | 60% |") in text
    assert "| 1.0e-03 | - | - | - | - | - | - | - | - | - |" in text
    assert text.endswith("faster than fa3 (graph) at 0 of these 2 points. "
                         "By the GPU's busy time: at 1 of them.")
    assert "GPU" not in sm90_table.table([base])


def test_the_sm90_ranges_span_each_group_of_points_over_both_page_sizes():
    from benchmarks import sm90_table

    base = dict(H=128, q_len=1, page_size=64, B=32, L=4096, floor_us=50.0, flashinfer_fa3_us=100.0,
                flashinfer_fa3_graph_us=100.0, jax_mla_sm90_us=80.0, jax_mla_sm90_gpu_us=70.0,
                jax_mla_sm90_rel_err=1e-3, jax_mla_sm90_fp8_us=100.0, jax_mla_sm90_fp8_gpu_us=84.0,
                fp8_floor_us=42.0)
    records = [base,
               dict(base, page_size=32, L=16384, floor_us=180.0, flashinfer_fa3_graph_us=300.0,
                    jax_mla_sm90_us=240.0, jax_mla_sm90_gpu_us=200.0, jax_mla_sm90_fp8_us=300.0,
                    jax_mla_sm90_fp8_gpu_us=260.0, fp8_floor_us=130.0),
               dict(base, L=1024, jax_mla_sm90_fp8_us=None, jax_mla_sm90_fp8_gpu_us=None),
               dict(base, B=128, jax_mla_sm90_gpu_us=None),
               dict(base, B=512, jax_mla_sm90_us=None),  # not measured: no row
               dict(base, jax_mla_sm90_us=90.0, jax_mla_sm90_gpu_us=75.0)]  # the last record wins
    lines = sm90_table.ranges(records).splitlines()
    assert lines[0].startswith("| H | q_len | B | L | points | sm90 / fa3 graph, busy (wall) |")
    assert lines[2:] == [
        "| 128 | 1 | 32 | below 4k | 1 | 0.70 (0.80) | 71% | 50% | - | - |",
        "| 128 | 1 | 32 | from 4k | 2 | 0.67-0.75 (0.80-0.90) | 67-90% | 50-60% "
        "| 1.12-1.30 (1.11-1.25) | 50% |",
        "| 128 | 1 | 128 | from 4k | 1 | - (0.80) | - | 50% | - (1.25) | 50% |"]


def test_the_sm90_summary_times_each_row_by_one_measure_at_its_points_in_order():
    from benchmarks import sm90_table

    base = dict(H=16, q_len=1, page_size=64, B=128, L=4096, floor_us=140.0, flashinfer_fa3_us=210.0,
                flashinfer_fa3_graph_us=200.0, jax_mla_sm90_us=210.0, jax_mla_sm90_rel_err=1e-3,
                jax_mla_sm90_fp8_us=120.0, fp8_floor_us=60.0)
    records = [dict(base, H=128, L=16384, jax_mla_sm90_fp8_us=None),  # no busy time: the wall
               dict(base, jax_mla_sm90_gpu_us=100.0),  # replaced by the next record of its point
               dict(base, jax_mla_sm90_gpu_us=150.0),  # busy, and no fp8 busy time: no fp8 cells
               dict(base, B=32, L=16384, jax_mla_sm90_gpu_us=150.0, jax_mla_sm90_fp8_gpu_us=90.0),
               dict(base, page_size=32, B=512, L=16384),        # pages of 32 are not summarised
               dict(base, B=512, L=16384, flashinfer_fa3_graph_us=None),  # no fa3 graph time
               dict(base, B=64)]                                 # not a summary point
    lines = sm90_table.summary(records).splitlines()
    assert lines[0].startswith("| H | q_len | B | L | floor µs | fa3 µs | sm90 µs |")
    assert lines[2:] == [
        "| 16 | 1 | 32 | 16k | 140.0 | 200.0 | 150.0 | **0.75** | 93% | 90.0 | **0.60** | 67% | busy |",
        "| 16 | 1 | 128 | 4k | 140.0 | 200.0 | 150.0 | **0.75** | 93% | - | - | - | busy |",
        "| 128 | 1 | 128 | 16k | 140.0 | 200.0 | 210.0 | **1.05** | 67% | - | - | - | wall |"]
    assert sm90_table.summary([dict(base, fp8_floor_us=None)]).splitlines()[2].endswith(
        "| **1.05** | 67% | - | - | - | wall |")


def test_gpu_busy_time_is_the_union_of_kernel_intervals_per_layer():
    """Overlapping kernels count once, gaps not at all; without GPU kernels it says why."""
    import jax

    from benchmarks import timing

    assert timing.busy_us([(0.0, 10.0), (5.0, 10.0), (20.0, 5.0), (21.0, 1.0)]) == 20.0
    on_cpu = jax.device_put(np.ones(4, np.float32), jax.devices("cpu")[0])
    us, why = timing.gpu_busy_per_layer_us(jax.jit(lambda x: x + 1), [(on_cpu,)], layers=2, calls=4)
    assert us is None and "no GPU kernel events" in why


def test_the_graph_methods_run_where_batches_are_small():
    """jax_mla_graph and jax_mla_sm90_graph: command buffers for small batches only, GPU only."""
    for method in ("jax_mla_graph", "jax_mla_sm90_graph"):
        assert method in methods.GRAPH_METHODS and method in methods.JAX_MLA_PLANNED
        assert methods.method_applies(method, grid.Point(32, 4096, 128, 1, 64), None)
        assert not methods.method_applies(method, grid.Point(128, 4096, 128, 1, 64), None)
    assert "jax_mla_sm90_graph" in methods.GPU_ONLY_METHODS
    with pytest.raises(SystemExit):
        decode.parse_args(["--dry-run", "--backends", "jax_mla_sm90_graph"])


def test_the_fp8_method_runs_every_head_count_on_caches_quantised_like_write_kv():
    import jax
    import jax.numpy as jnp

    from benchmarks.bench import quantized_cache
    from jax_mla import fp8_cache

    applies = [methods.method_applies("jax_mla_sm90_fp8", grid.Point(32, 4096, h, q, 64), None)
               for h, q in ((16, 1), (32, 1), (16, 2), (64, 1), (16, 3), (128, 1))]
    assert all(applies)
    cache = jax.random.normal(jax.random.PRNGKey(0), (5, 16, 576)).astype(jnp.bfloat16)
    rows = cache.reshape(-1, 576)
    written = fp8_cache.quantize_rows(rows[:, :512], rows[:, 512:]).reshape(5, 16, 656)
    np.testing.assert_array_equal(np.asarray(quantized_cache(cache, pages_per_chunk=2)),
                                  np.asarray(written))
    assert problem.FP8_ROW_BYTES == 656
