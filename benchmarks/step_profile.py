"""Where a short decode step's time goes: the host or the GPU.

A short step's wall time mixes the host's dispatch with the kernels' time. For sm90 and fa3
(``backend="auto"`` with a plan from the host) at each point (by default B=1 L=4k, H=128 and 16;
q_len 1 unless a point names it, pages of 64, lengths as the benchmark draws them), this prints
per layer of a 61-layer jitted step (the benchmark's ``--layers 61`` step), its layers unrolled
in Python; and for sm90 also as a ``lax.scan`` over the layers' stacked caches, with the schedule
built in every layer (``plan=None``) and once before the loop (``jax_mla.sm90_plan``), where the
stacked caches take at most ``--scan-gib`` GiB:

- the wall time of back-to-back calls (``timing.time_jax``), with the caches rotated between
  calls as the benchmark does (every call its own cache tuple; not for the scans, whose caches
  are one stacked array) and with the same caches every call (as a serving loop passes its one
  cache per layer);
- from a JAX profiler trace of back-to-back steps: the GPU's span per step (its first kernel's
  start to its last kernel's end), the time within it that some kernel runs (the union of the
  kernels' intervals: the span less the gaps where the GPU waited for the host, which the
  tracer's own dispatch cost can open at B = 1) and the summed kernel durations, by kernel name,
  with each kernel's median start after the end of the kernel before it (negative where it
  launched under that kernel, as programmatic dependent launch lets it). A trace's steps are told
  apart by count: every step launches the same kernels.

Each step compiled with XLA's own command-buffer settings (``default``: XLA captures custom calls
into command buffers once a graph would hold enough commands), with command buffers off (``off``:
every kernel launched on the stream) and forced on for every command type and size (``on``,
``GRAPH_COMPILER_OPTIONS``), or some of them.

    .ci/gpu-h200.sh cmd python3 -m benchmarks.step_profile     # on the GPU machine
    ... step_profile --points "1,4096,128;8,1024,128" --command-buffers off,default
"""

from __future__ import annotations

import argparse
import collections
import statistics
import types

import numpy as np

from benchmarks.grid import Point
from benchmarks.methods import (GRAPH_COMPILER_OPTIONS, NO_GRAPH_COMPILER_OPTIONS, decode_with_plan,
                               layered, scanned)
from benchmarks.problem import GIB, HEAD_DIM, SOFTMAX_SCALE, Layout, make_layout, random_cache
from benchmarks.timing import busy_us, time_jax, traced_gpu_kernels

LAYERS, TRACED_STEPS, CACHES = 61, 8, 27
# --methods keys and the rows' names.
METHODS = {"sm90": "sm90", "fa3": "fa3 (auto, host plan)", "sm90-scan": "sm90, scan",
           "sm90-scan-plan": "sm90, scan, sm90_plan"}
DEFAULT_POINTS = "1,4096,128;1,4096,16"
# --command-buffers modes: the step's compiler options.
COMMAND_BUFFER_MODES = {"default": None, "off": NO_GRAPH_COMPILER_OPTIONS,
                        "on": GRAPH_COMPILER_OPTIONS}
# time_jax's settings: 7 rounds of about 20 ms of back-to-back calls each (about 20 steps at B = 1).
WALL_TIMER = types.SimpleNamespace(rounds=7, round_s=0.02, max_method_s=60.0)


def wall_us_per_layer(step, arg_sets: list[tuple]) -> float:
    """µs per layer of back-to-back calls, blocking once per round (the benchmark's timer)."""
    return time_jax(step, arg_sets, LAYERS, WALL_TIMER)[0] * 1e6


def per_step(events: list[tuple[str, float, float]], steps: int, layers: int) -> dict:
    """The ``steps`` steps in ``events`` ((name, start µs, duration µs) by start, as
    ``gpu_stream_kernels`` gives them), each the same number of kernels: the median span (first
    kernel's start to last kernel's end), the median busy time (the union of the kernels'
    intervals) and the mean summed kernel time per step, all per layer, and each kernel name's
    launches per step, median duration and median start after the end of the kernel before it in
    its step (negative: launched under it, as programmatic dependent launch allows; None for a
    step's first kernel)."""
    if steps < 1 or len(events) % steps:
        raise RuntimeError(f"{len(events)} kernels in the trace do not split into {steps} steps "
                           "of the same kernels")
    per = len(events) // steps
    starts = list(range(0, len(events) + 1, per))
    spans, busy = [], []
    by_name, leads = collections.defaultdict(list), collections.defaultdict(list)
    for a, b in zip(starts, starts[1:]):
        last = max(events[i][1] + events[i][2] for i in range(a, b))
        spans.append(last - events[a][1])
        busy.append(busy_us([(start, dur) for _, start, dur in events[a:b]]))
        for i in range(a, b):
            name, start, dur = events[i]
            by_name[name].append(dur)
            if i > a:
                leads[name].append(start - (events[i - 1][1] + events[i - 1][2]))
    return {"span_us": statistics.median(spans) / layers,
            "busy_us": statistics.median(busy) / layers,
            "kernels_us": sum(sum(v) for v in by_name.values()) / steps / layers,
            "by_name": {name: (len(v) / steps, statistics.median(v),
                               statistics.median(leads[name]) if leads[name] else None)
                        for name, v in by_name.items()}}


def traced(step, args) -> dict:
    """``per_step`` of a JAX profiler trace of TRACED_STEPS back-to-back calls of ``step``."""
    events = traced_gpu_kernels(step, [args], TRACED_STEPS)
    if not events:
        raise RuntimeError("no GPU kernel events in the profiler trace")
    return per_step(events, TRACED_STEPS, LAYERS)


def pool_gib(layout: Layout) -> float:
    """GiB of the CACHES caches a point of ``layout`` rotates through."""
    return CACHES * layout.cache_bytes / GIB


def parse_points(spec: str) -> list[Point]:
    """"B,L,H[,q_len];..." as benchmark points with pages of 64 (q_len 1 where not given)."""
    points = []
    for item in filter(None, (p.strip() for p in spec.split(";"))):
        fields = item.split(",")
        if len(fields) not in (3, 4) or not all(f.strip().isdigit() and int(f) > 0
                                                for f in fields):
            raise SystemExit(f"a point is B,L,H or B,L,H,q_len (positive integers); got {item!r}")
        batch, length, heads, *q_len = (int(f) for f in fields)
        points.append(Point(B=batch, L=length, H=heads, q_len=q_len[0] if q_len else 1,
                            page_size=64))
    return points


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--points", default=DEFAULT_POINTS,
                        help="B,L,H[,q_len];... (default %(default)s)")
    parser.add_argument("--command-buffers", default=",".join(COMMAND_BUFFER_MODES),
                        help="comma-separated, of " + ", ".join(COMMAND_BUFFER_MODES) +
                        " (default: all)")
    parser.add_argument("--pool-gib", type=float, default=60.0,
                        help=f"largest pool of {CACHES} caches a point may take, GiB; bigger points "
                             "are left out (default %(default)s, for 80 GB cards)")
    parser.add_argument("--scan-gib", type=float, default=8.0,
                        help="largest stacked caches of the scans, GiB (default %(default)s)")
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="comma-separated, of " + ", ".join(METHODS) + " (default: all)")
    args = parser.parse_args(argv)
    keys_asked = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(keys_asked) - set(METHODS))
    if unknown:
        raise SystemExit(f"unknown --methods {unknown}; choose from {list(METHODS)}")
    methods_asked = [METHODS[key] for key in keys_asked]
    points = parse_points(args.points)
    modes = [m.strip() for m in args.command_buffers.split(",") if m.strip()]
    if not modes or set(modes) - set(COMMAND_BUFFER_MODES):
        raise SystemExit(f"--command-buffers {args.command_buffers!r}: comma-separated, of "
                         f"{list(COMMAND_BUFFER_MODES)}")

    import jax
    import jax.numpy as jnp
    import jax_mla

    print(f"{LAYERS}-layer steps, µs per layer; {CACHES} caches, rotated: call k layer i reads "
          f"cache (k * {LAYERS} + i) % {CACHES}; fixed: layer i reads cache i % {CACHES}", flush=True)
    print("| B | L | H | q_len | method | command buffers | wall, rotated | wall, fixed | "
          "GPU span per step | GPU busy per step | kernels summed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    details = []
    for point in points:
        num_heads = point.H
        layout = make_layout(point, 0)
        pool_size = pool_gib(layout)
        if pool_size > args.pool_gib:
            print(f"| {point.B} | {point.L} | {num_heads} | {point.q_len} | left out: its {CACHES} "
                  f"caches take {pool_size:.1f} GiB (--pool-gib {args.pool_gib:g}) | | | | | |",
                  flush=True)
            continue
        pool = [random_cache(i, layout.num_pages, 64) for i in range(CACHES)]
        query = jax.random.normal(jax.random.PRNGKey(1),
                                  (point.B, point.q_len, num_heads, HEAD_DIM),
                                  jnp.float32).astype(jnp.bfloat16)
        tables, lens = jnp.asarray(layout.tables), jnp.asarray(layout.lengths)
        plan = jax_mla.plan(np.asarray(layout.lengths, np.int32), num_heads=num_heads,
                            q_len=point.q_len, max_pages=layout.max_pages)

        def sm90_layer(q, cache, t, n, plan_):
            return jax_mla.decode(q, cache, t, n, softmax_scale=SOFTMAX_SCALE, backend="sm90",
                                  plan=plan_)

        def sm90_plan(caches, t, n):
            return jax_mla.sm90_plan(n, max_pages=t.shape[1], page_size=caches.shape[2])

        sets = [tuple(pool[(k * LAYERS + i) % CACHES] for i in range(LAYERS))
                for k in range(CACHES)]
        methods = [("sm90", lambda o: layered(sm90_layer, LAYERS, o), None, sets),
                   ("fa3 (auto, host plan)", lambda o: layered(decode_with_plan, LAYERS, o), plan,
                    sets)]
        stacked_gib = LAYERS * pool[0].nbytes / 2**30
        scans_asked = any("scan" in m for m in methods_asked)
        if scans_asked and stacked_gib <= args.scan_gib:
            stacked = [jnp.stack(sets[0])]
            methods += [("sm90, scan", lambda o: scanned(sm90_layer, o), None, stacked),
                        ("sm90, scan, sm90_plan", lambda o: scanned(sm90_layer, o, sm90_plan),
                         None, stacked)]
        elif scans_asked:
            print(f"scans at B={point.B} L={point.L} left out: the stacked caches take "
                  f"{stacked_gib:.1f} GiB (--scan-gib {args.scan_gib})", flush=True)
        for name, build, step_plan, cache_sets in methods:
            if name not in methods_asked:
                continue
            for mode in modes:
                step = build(COMMAND_BUFFER_MODES[mode])
                arg_sets = [(query, s, tables, lens, step_plan) for s in cache_sets]
                jax.block_until_ready(step(*arg_sets[0]))
                wall_rot = wall_us_per_layer(step, arg_sets) if len(arg_sets) > 1 else None
                wall_fixed = wall_us_per_layer(step, arg_sets[:1])
                rotated_text = "-" if wall_rot is None else f"{wall_rot:.1f}"
                row = (f"| {point.B} | {point.L} | {num_heads} | {point.q_len} | {name} | "
                       f"{mode} | {rotated_text} | {wall_fixed:.1f} |")
                try:
                    stats = traced(step, arg_sets[0])
                except RuntimeError as error:  # the profiler's, or a trace that does not split
                    print(f"{row} trace: {error} | | |", flush=True)
                    continue
                print(f"{row} {stats['span_us']:.1f} | {stats['busy_us']:.1f} | "
                      f"{stats['kernels_us']:.1f} |", flush=True)
                details.append((point, name, mode, stats["by_name"]))
    print("\nKernels per step (count, median µs, median start after the kernel before it ends):")
    for point, name, mode, by_name in details:
        kernels = "; ".join(f"{k[:60]} x{c:g} {d:.1f}" + ("" if lead is None else f" {lead:+.1f}")
                            for k, (c, d, lead) in sorted(by_name.items()))
        print(f"- B={point.B} L={point.L} H={point.H} q_len={point.q_len} {name}, "
              f"command buffers {mode}: {kernels}")


if __name__ == "__main__":
    main()
