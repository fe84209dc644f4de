"""Timers: jitted JAX calls on the wall clock, torch calls with triton's do_bench or CUDA events,
host calls, and GPU kernels by their durations in a JAX profiler trace (one kernel's launches, or
the time a run of calls keeps the GPU busy)."""

from __future__ import annotations

import glob
import gzip
import inspect
import json
import math
import os
import statistics
import tempfile
import time


def median(xs) -> float:
    return float(statistics.median(xs))


def time_jax(fn, arg_sets: list[tuple], layers: int, args) -> tuple[float, int]:
    """Seconds per layer: back-to-back jitted calls (async dispatch), blocking once per round.

    Returns (median seconds per layer, rounds). A call slower than --max-method-s is measured once.
    """
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fn(*arg_sets[0]))
    one = time.perf_counter() - start
    if one >= args.max_method_s:
        return one / layers, 1
    calls = max(1, min(2000, math.ceil(args.round_s / max(one, 1e-6))))
    samples = []
    spent = one
    k = 1
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*arg_sets[k % len(arg_sets)])
            k += 1
        jax.block_until_ready(out)
        dt = time.perf_counter() - t0
        del out
        samples.append(dt / (calls * layers))
        spent += dt
        if spent > args.max_method_s and len(samples) >= 2:
            break
    return median(samples), len(samples)


def interleaved_ratios(fn_a, fn_b, arg_sets: list[tuple], args, pairs: int = 15) -> list[float]:
    """time(a) / time(b) for ``pairs`` rounds run a, b, a, b, ...: each round is the same number of
    back-to-back jitted calls (blocking once), so drift and noise that span rounds cancel in the
    ratio of neighbours. Both functions must already be compiled."""
    import jax

    def one_round(fn, calls):
        t0 = time.perf_counter()
        out = None
        for k in range(calls):
            out = fn(*arg_sets[k % len(arg_sets)])
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    calls = max(1, min(2000, math.ceil(args.round_s / max(one_round(fn_a, 1), 1e-6))))
    return [one_round(fn_a, calls) / one_round(fn_b, calls) for _ in range(pairs)]


def quartiles(xs) -> list[float]:
    """[25th, 75th] percentiles of ``xs``."""
    q = statistics.quantiles(xs, n=4)
    return [float(q[0]), float(q[2])]


def time_torch(fn, per_call: int, args, torch) -> tuple[float, str]:
    """Seconds per layer of ``fn`` (which runs ``per_call`` layers) on the GPU, and the timer used.

    triton.testing.do_bench (median; it flushes L2 before each call) where triton imports, else
    CUDA events around rounds of back-to-back calls."""
    try:
        from triton.testing import do_bench
    except Exception:  # noqa: BLE001
        do_bench = None
    if do_bench is not None:
        kwargs = {"warmup": args.do_bench_warmup_ms, "rep": args.do_bench_rep_ms}
        if "return_mode" in inspect.signature(do_bench).parameters:
            ms = do_bench(fn, return_mode="median", **kwargs)
        else:
            ms = do_bench(fn, quantiles=[0.5], **kwargs)
        if isinstance(ms, (list, tuple)):
            ms = ms[0]
        return float(ms) * 1e-3 / per_call, "triton.do_bench(median)"
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    one = start.elapsed_time(end) * 1e-3
    calls = max(1, min(1000, math.ceil(args.round_s / max(one, 1e-6))))
    samples = []
    for _ in range(args.rounds):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3 / (calls * per_call))
    return median(samples), "cuda_events(median of rounds)"


def host_time_us(fn, repeats: int) -> float:
    """Median µs of ``fn()`` on the host, after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return median(samples) * 1e6


def trace_event_lists(trace_dir: str):
    """The event list of each perfetto trace under ``trace_dir`` (what
    ``jax.profiler.trace(..., create_perfetto_trace=True)`` writes), one list per file."""
    for path in glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True):
        with gzip.open(path, "rt") as f:
            yield json.load(f).get("traceEvents", [])


# Lines of a GPU's process in the trace that are not CUDA streams (XLA modules and ops, steps):
# their events repeat the kernels' times.
ANNOTATION_LINES = ("XLA", "Steps", "TensorFlow", "Framework")


def gpu_stream_kernels(trace_dir: str) -> list[tuple[str, float, float]]:
    """(name, start µs, duration µs) of every complete event on a GPU's stream lines of the
    perfetto traces under ``trace_dir``, by start."""
    found = []
    for events in trace_event_lists(trace_dir):
        processes, threads = {}, {}
        for e in events:
            if e.get("ph") == "M" and e.get("name") == "process_name":
                processes[e["pid"]] = str(e.get("args", {}).get("name", ""))
            if e.get("ph") == "M" and e.get("name") == "thread_name":
                threads[(e["pid"], e["tid"])] = str(e.get("args", {}).get("name", ""))
        for e in events:
            if e.get("ph") != "X" or "dur" not in e:
                continue
            line = threads.get((e.get("pid"), e.get("tid")), "")
            if ("GPU" in processes.get(e.get("pid"), "")
                    and not any(word in line for word in ANNOTATION_LINES)):
                found.append((str(e.get("name", "")), float(e.get("ts", 0.0)), float(e["dur"])))
    return sorted(found, key=lambda event: event[1])


def kernel_durations_us(trace_dir: str, kernel_name: str) -> list[float]:
    """Durations (µs) of the events named like ``kernel_name`` in the perfetto traces under
    ``trace_dir``."""
    return [float(e["dur"]) for events in trace_event_lists(trace_dir) for e in events
            if kernel_name in str(e.get("name", "")) and "dur" in e]


def profiled_kernel_us(run, kernel_name: str) -> tuple[list[float], str | None]:
    """(durations in µs of every launch of the GPU kernel named like ``kernel_name`` while
    ``run()`` executes under the JAX profiler, why there are none or None)."""
    import jax

    with tempfile.TemporaryDirectory() as trace_dir:
        try:
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                run()
        except RuntimeError as e:  # e.g. no CUPTI, or another trace running
            return [], f"profiler: {e}"
        durations = kernel_durations_us(trace_dir, kernel_name)
    return durations, None if durations else f"no {kernel_name} events in the profiler trace"


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, duration) intervals sorted by start."""
    total, end = 0.0, float("-inf")
    for start, dur in intervals:
        total += max(0.0, start + dur - max(start, end))
        end = max(end, start + dur)
    return total


def traced_gpu_kernels(fn, arg_sets: list[tuple], calls: int) -> list[tuple[str, float, float]]:
    """``gpu_stream_kernels`` of a JAX profiler trace of ``calls`` back-to-back calls of ``fn``
    (rotating ``arg_sets``), blocking once at the end. The profiler's RuntimeError (e.g. no CUPTI,
    or another trace running) propagates."""
    import jax

    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            out = None
            for k in range(calls):
                out = fn(*arg_sets[k % len(arg_sets)])
            jax.block_until_ready(out)
            del out
        return gpu_stream_kernels(trace_dir)


def gpu_busy_per_layer_us(fn, arg_sets: list[tuple], layers: int,
                          calls: int) -> tuple[float | None, str | None]:
    """(µs per layer that ``calls`` back-to-back jitted calls of ``fn`` (``layers`` decodes each,
    rotating ``arg_sets`` as ``time_jax`` does, blocking once) keep the GPU busy, why there is no
    such time or None): the union of their kernels' intervals in a JAX profiler trace, so the time
    the GPU waits for the host between calls is left out, as a CUDA graph's replays leave it out."""
    try:
        events = traced_gpu_kernels(fn, arg_sets, calls)
    except RuntimeError as e:  # e.g. no CUPTI, or another trace running
        return None, f"profiler: {e}"
    if not events:
        return None, "no GPU kernel events in the profiler trace"
    return busy_us([(start, dur) for _, start, dur in events]) / (calls * layers), None
