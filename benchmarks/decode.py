"""Benchmark MLA decode: jax_mla against FlashInfer called from torch and against plain XLA.

One command per piece of the grid, on one GPU (see benchmarks/README.md):

    python -m benchmarks.decode --grid full --piece 1/4 --time-limit 450
    python -m benchmarks.decode --dry-run --out /tmp/bench.json    # CPU, xla backends, tiny grid

For every point (B, L, H, q_len, page_size) it builds one paged problem (lengths uniform in
[L/2, 3L/2], shuffled pages, random bf16 data) in several cache copies that are rotated between
calls so that L2 never serves the reads, checks every method's output against a float32 torch
reference before timing it, times it, and merges one record per point into the JSON file given by
``--out`` (existing records with other keys are kept; a rerun skips points already measured).

Methods (``--backends``):
  jax_mla         jax_mla.decode(backend="auto", plan=jax_mla.plan(...)) inside jax.jit, N layers
  jax_mla_graph   jax_mla with XLA command buffers (CUDA graphs) forced on for the step; B <= 32
  jax_mla_noplan  jax_mla without a plan (plans inside each call); on a small sub-grid only
  jax_mla_device_plan  the schedule built on the GPU inside the jitted step (jax_mla.device_plan),
                  shared by its layers (as a CUDA graph where jax_mla_graph is timed too); also
                  times the planner kernel alone (device_plan_us, from a profiler trace) and per
                  call in CUDA graphs of 128 planner calls (device_plan_graph_us)
  jax_mla_sm90    jax_mla.decode(backend="sm90"): jax_mla's own Hopper kernel, N layers
  jax_mla_sm90_graph  jax_mla_sm90 with XLA command buffers forced on for the step; B <= 32
  jax_mla_sm90_fp8  the same on the point's caches quantised as write_kv does (docs/fp8-cache.md)
  flashinfer      flashinfer.mla.BatchMLAPagedAttentionWrapper from torch (run() timed, plan apart)
  flashinfer_fp8  (only when named) the same on FlashInfer's fp8 cache made from the point's caches,
                  two scale layouts (benchmarks/peers.py, flashinfer_fp8_views): the output's
                  distance from the bf16 cache's reference, then the time (CUDA graph unless
                  --no-fi-graph)
  xla_naive       plain XLA: gather pages with the block table, einsum, masked softmax, einsum
  jax_mla_xla     jax_mla.decode(backend="xla") (the chunked pure-XLA backend)
  jax_mla_step    (only when named) a whole --step-layers (61) step end to end, host plan every
                  step vs device plan in the step: step_host_plan_ms, step_device_plan_ms; each
                  also with fail_closed=False (*_unguarded_ms), the guard's cost
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from benchmarks.bench import Bench
from benchmarks.environment import environment, utc_now
from benchmarks.grid import GRIDS, Point, parse_point_filters, point_matches, split_pieces
from benchmarks.methods import (DRY_DEFAULT_METHODS, FI_BACKENDS, GPU_DEFAULT_METHODS, GPU_ONLY_METHODS,
                                METHODS, estimate_cost_s, method_applies)
from benchmarks.problem import (FLOOR_MODELS, GIB, L2_BYTES, Layout, cache_count, floor_model,
                                make_layout, work)
from benchmarks.progress import Progress
from benchmarks.results import default_out, load_results, merge_record, save_results, summary_line


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="CPU smoke run: xla backends only, the tiny 'dry' grid, short timings")
    p.add_argument("--grid", default=None,
                   help=f"one of {sorted(GRIDS)} (default full; dry with --dry-run), or a piece of "
                        "one: full:2/4 is piece 2 of 4 of the full grid")
    p.add_argument("--piece", default=None, metavar="K/N",
                   help="run the K-th of N pieces of similar estimated time (e.g. 1/4)")
    p.add_argument("--points", action="append", default=[], metavar="SPEC",
                   help="keep points matching SPEC, e.g. 'B=128,L=4k|16k,H=16' (repeatable, ';' = or)")
    p.add_argument("--backends", default=None,
                   help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--fi-backends", default=",".join(FI_BACKENDS),
                   help="FlashInfer backends to time (flashinfer_torch_us is the faster one)")
    p.add_argument("--no-fi-graph", dest="fi_graph", action="store_false",
                   help="skip the CUDA-graph replay timing of FlashInfer")
    p.add_argument("--out", default=None, help="JSON file (merged by point key); default "
                   "benchmarks/results/<gpu>-decode.json")
    p.add_argument("--copy-to", default=None, metavar="DIR",
                   help="also copy the JSON into DIR after every point (e.g. $OUT on the GPU machine)")
    p.add_argument("--overwrite", action="store_true", help="re-measure points already in --out")
    p.add_argument("--mem-budget-gib", type=float, default=60.0,
                   help="GPU memory for the rotated caches of one point; bigger points are skipped")
    p.add_argument("--naive-mem-gib", type=float, default=24.0,
                   help="skip xla_naive where its gathered cache + logits exceed this")
    p.add_argument("--layers", type=positive_int, default=12,
                   help="decode calls per jitted step (jax_mla, flashinfer)")
    p.add_argument("--step-layers", type=positive_int, default=61,
                   help="decode calls in jax_mla_step's whole model step (DeepSeek-V3: 61)")
    p.add_argument("--xla-layers", type=positive_int, default=2,
                   help="decode calls per step for the XLA methods")
    p.add_argument("--rounds", type=positive_int, default=7, help="timed rounds per JAX measurement (median)")
    p.add_argument("--round-s", type=float, default=0.05, help="target seconds per timed round")
    p.add_argument("--max-method-s", type=float, default=4.0,
                   help="cap on the timing loop of one measurement (a slower call is timed once)")
    p.add_argument("--max-call-s", type=float, default=10.0,
                   help="skip an XLA method whose predicted call time exceeds this")
    p.add_argument("--plan-repeats", type=positive_int, default=9, help="host timings of plan() (median)")
    p.add_argument("--do-bench-warmup-ms", type=float, default=25.0)
    p.add_argument("--do-bench-rep-ms", type=float, default=100.0)
    p.add_argument("--noplan-everywhere", action="store_true",
                   help="time jax_mla_noplan on every point, not only B<=128, L<=4k, q=1, page 64")
    p.add_argument("--time-limit", type=float, default=0.0,
                   help="stop starting points after this many seconds (rerun to continue)")
    p.add_argument("--l2-mb", type=float, default=L2_BYTES / 1e6,
                   help="L2 size the cache rotation must defeat (2x of it between reuses)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="print the points and pieces, run nothing")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failures")
    args = p.parse_args(argv)

    if args.dry_run:
        args.grid = args.grid or "dry"
        args.layers = min(args.layers, 2)
        args.xla_layers = min(args.xla_layers, 2)
        args.rounds = min(args.rounds, 3)
        args.round_s = min(args.round_s, 0.01)
        args.max_method_s = min(args.max_method_s, 0.2)
        args.plan_repeats = min(args.plan_repeats, 3)
        args.l2_mb = min(args.l2_mb, 0.25)  # a few caches: exercise rotation, not a CPU cache study
    args.grid = args.grid or "full"
    if ":" in args.grid:  # --grid full:2/4 is --grid full --piece 2/4
        args.grid, args.piece = args.grid.split(":", 1)
    args.l2_bytes = args.l2_mb * 1e6
    args.floor_model = FLOOR_MODELS[0]  # main sets the GPU's once it is known
    if args.grid not in GRIDS:
        p.error(f"--grid must be one of {sorted(GRIDS)}")
    default = DRY_DEFAULT_METHODS if args.dry_run else GPU_DEFAULT_METHODS
    args.methods = [m.strip() for m in (args.backends or ",".join(default)).split(",") if m.strip()]
    if not args.methods:
        p.error(f"--backends names no method; choose from {list(METHODS)}")
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        p.error(f"unknown --backends {bad}; choose from {list(METHODS)}")
    if args.dry_run and any(m in GPU_ONLY_METHODS for m in args.methods):
        p.error(f"--dry-run runs the XLA backends only ({', '.join(DRY_DEFAULT_METHODS)})")
    args.fi_backends = [b.strip() for b in args.fi_backends.split(",") if b.strip()]
    if args.piece:
        try:
            k, n = (int(x) for x in args.piece.split("/"))
            assert 1 <= k <= n
        except (ValueError, AssertionError):
            p.error("--piece must be K/N with 1 <= K <= N")
        args.piece_k, args.piece_n = k, n
    return args


def select_points(args) -> tuple[list[Point], dict[Point, Layout], dict[Point, float]]:
    """The grid's points that match --points (the --piece of them), cheapest first."""
    filters = parse_point_filters(args.points)
    points = [pt for pt in GRIDS[args.grid]() if point_matches(pt, filters)]
    layouts = {pt: make_layout(pt, args.seed) for pt in points}
    costs = {pt: estimate_cost_s(layouts[pt], args.methods, args) for pt in points}
    if args.piece:
        points = split_pieces(points, costs, args.piece_n)[args.piece_k - 1]
    else:
        points = sorted(points, key=lambda q: (costs[q], q))
    return points, layouts, costs


def grid_name(args) -> str:
    return f"{args.grid}{' piece ' + args.piece if args.piece else ''}"


def list_points(args, points, layouts, costs) -> None:
    total = sum(costs[p] for p in points)
    print(f"grid {grid_name(args)}: {len(points)} points, estimated {total / 60:.1f} min")
    for pt in points:
        lay = layouts[pt]
        n = cache_count(lay, args.mem_budget_gib * GIB, args.l2_bytes)
        floor_us = work(lay, model=args.floor_model)["floor_us"]
        print(f"  {pt.label:32s} est {costs[pt]:6.1f}s  floor {floor_us:9.1f}us  "
              f"{n:3d} caches x {lay.cache_bytes / 2**20:9.1f} MiB")
    if args.grid == "full" and not args.piece:
        for n in (2, 3, 4, 6):
            loads = [sum(costs[p] for p in piece) for piece in split_pieces(points, costs, n)]
            print(f"  --piece K/{n}: estimated minutes per piece "
                  + ", ".join(f"{x / 60:.1f}" for x in loads))


def import_torch(args):
    """torch, imported before JAX allocates anything; None on a dry run or where it is missing."""
    if args.dry_run:
        return None
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        print(f"warning: torch unavailable ({e}); flashinfer and the reference check are off",
              file=sys.stderr)
        return None
    return torch


def gpu_unready(args, torch) -> str | None:
    """Why the GPU methods asked for cannot run here, or None."""
    import jax

    if jax.default_backend() not in ("gpu", "cuda"):
        return "no JAX GPU backend; use --dry-run on a CPU machine"
    if any(m in args.methods for m in ("jax_mla", "jax_mla_noplan")):
        import jax_mla
        from jax_mla import gpu

        if jax_mla.available_backends() == ["xla"]:
            why = gpu.runtime_missing() or "no GPU backend supports this GPU"
            return (f"jax_mla's GPU backends are unavailable here ({why}); jax_mla would silently "
                    f"run its XLA backend. Fix that, or pass --backends without jax_mla.")
    if {"flashinfer", "flashinfer_fp8"} & set(args.methods) and (torch is None or not torch.cuda.is_available()):
        return "flashinfer needs torch with CUDA"
    return None


def pending(args, points, data, out_path) -> list[Point]:
    """The points not yet measured in ``data`` with every method asked for (all with --overwrite)."""
    existing = {r["key"]: r for r in data["records"]}
    todo = []
    for pt in points:
        old = existing.get(pt.key)
        wanted = {m for m in args.methods if method_applies(m, pt, args)}
        if old and not args.overwrite:
            settled = set(old.get("methods_done", [])) | {m for m in wanted if old.get(f"{m}_skip")}
            if old.get("skipped") or wanted <= settled:
                continue
        todo.append(pt)
    if len(points) > len(todo):
        print(f"{len(points) - len(todo)} point(s) already in {out_path}; skipping them "
              f"(--overwrite re-measures)", file=sys.stderr)
    return todo


def new_record(layout: Layout, args) -> dict:
    return {"key": layout.point.key, **dataclasses.asdict(layout.point), "seed": layout.seed,
            "max_pages": layout.max_pages, "num_pages": layout.num_pages,
            "cache_bytes": layout.cache_bytes, "layers": args.layers,
            **work(layout, model=args.floor_model),
            "methods_done": [], "errors": {}, "measured": utc_now()}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    else:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU

    points, layouts, costs = select_points(args)
    if not points:
        what = f" matching --points {args.points}" if args.points else ""
        print(f"error: no point to run: the {grid_name(args)} grid has none{what}",
              file=sys.stderr)
        return 2
    if args.list:
        list_points(args, points, layouts, costs)
        return 0

    torch = import_torch(args)
    if not args.dry_run:
        why = gpu_unready(args, torch)
        if why:
            print(f"error: {why}", file=sys.stderr)
            return 2

    env = environment(args.dry_run, torch)
    # Records' floors divide by this GPU's measured rates (the H200's if unmeasured).
    args.floor_model = model = floor_model(env["gpu"])
    env.update(floor_model=model.gpu, peak_flops=model.flops_per_s,
               peak_bytes_per_s=model.bytes_per_s)
    out_path = args.out or default_out(env, args.dry_run)
    data = load_results(out_path)
    if data.get("env") and data["env"].get("gpu") not in (None, env["gpu"]):
        print(f"warning: {out_path} holds results from {data['env'].get('gpu')}, this is "
              f"{env['gpu']}", file=sys.stderr)
    data["env"] = env
    run_info = {"started": env["date"], "grid": args.grid, "piece": args.piece,
                "methods": args.methods, "points": args.points, "argv": sys.argv[1:],
                "commit": env["commit"]}
    data["runs"].append(run_info)

    todo = pending(args, points, data, out_path)
    progress = Progress(sum(costs[p] for p in todo), len(todo))
    bench = Bench(args, torch, args.methods, progress)
    print(f"{len(todo)} point(s), grid {grid_name(args)}, methods {','.join(args.methods)}, "
          f"on {env['gpu']} -> {out_path}", file=sys.stderr)
    left = []
    for i, pt in enumerate(todo, 1):
        if args.time_limit and progress.elapsed() + costs[pt] > args.time_limit:
            left = todo[i - 1:]
            break
        progress.begin(i, pt.label)
        record = new_record(layouts[pt], args)
        t0 = time.perf_counter()
        try:
            bench.run_point(layouts[pt], record)
        except Exception as e:  # noqa: BLE001 - keep the other points
            bench.fail(record, "point", e)
        record["wall_s"] = time.perf_counter() - t0
        merge_record(data, record)
        run_info["finished"] = utc_now()
        save_results(out_path, data, args.copy_to)
        progress.end(costs[pt], summary_line(record))
    if left:
        print(f"time limit reached: {len(left)} point(s) left ({', '.join(p.label for p in left[:4])}"
              f"{'...' if len(left) > 4 else ''}); rerun the same command to continue", file=sys.stderr)
    run_info["left"] = [p.key for p in left]
    save_results(out_path, data, args.copy_to)
    print(f"wrote {out_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
