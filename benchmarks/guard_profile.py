"""The guard of bad values in a whole decode step, by the GPU kernels' own durations.

At B=1 a 61-layer step is short and bound by the host's dispatch, and its wall time drifts by more
than the guard costs, so medians of step times cannot resolve 1%. This runs the benchmark's steps (61 layers,
fa3 through ``backend="auto"``, H=128, L=4k, the schedule built on the GPU inside the step or on
the host and passed in) with and without the guard (``fail_closed``), traces 5 steps of each
under the JAX profiler and sums the durations of every GPU kernel per step, split into the
attention kernels (names containing ``MLA``, ``Merge`` or ``jax_mla``) and everything else. The
guard's own kernels are the difference of "everything else" between the two steps; its share is
that difference over the unguarded step's summed kernel time, and over its wall time.

    .ci/gpu-h200.sh cmd python3 -m benchmarks.guard_profile     # on the GPU machine
"""

from __future__ import annotations

import collections
import functools
import tempfile
import time

import numpy as np

from benchmarks.environment import require_cuda_gpu, script_args
from benchmarks.grid import Point
from benchmarks.methods import decode_with_plan, device_planned, layered
from benchmarks.problem import HEAD_DIM, make_layout, random_cache
from benchmarks.timing import gpu_stream_kernels

LAYERS, STEPS = 61, 5
ATTENTION_MARKERS = ("mla", "merge", "jax_mla")


def gpu_kernel_events(trace_dir: str) -> list[tuple[str, float]]:
    """(name, µs) of every kernel event on a GPU's stream lines of the perfetto traces under
    ``trace_dir`` (the lines of XLA modules and ops repeat the same time and are left out)."""
    return [(name, dur) for name, _, dur in gpu_stream_kernels(trace_dir)]


def traced_step(step, args) -> tuple[list[tuple[str, float]], float]:
    """(GPU kernel events of STEPS steps, median wall µs of one step) after a warm-up call."""
    import jax

    jax.block_until_ready(step(*args))
    walls = []
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(STEPS):
                t0 = time.perf_counter()
                jax.block_until_ready(step(*args))
                walls.append(time.perf_counter() - t0)
        events = gpu_kernel_events(trace_dir)
    if not events:
        raise RuntimeError("no GPU stream events in the profiler trace")
    return events, float(np.median(walls)) * 1e6


def is_attention(name: str) -> bool:
    return any(marker in name.lower() for marker in ATTENTION_MARKERS)


def summarize(events) -> dict:
    """Per-step kernel counts and summed µs, attention vs other, and the other kernels by name."""
    other = collections.defaultdict(lambda: [0, 0.0])
    attention_us = other_us = 0.0
    for name, us in events:
        if is_attention(name):
            attention_us += us
        else:
            other_us += us
            other[name][0] += 1
            other[name][1] += us
    return {"kernels": len(events) / STEPS, "attention_us": attention_us / STEPS,
            "other_us": other_us / STEPS,
            "other_by_name": {k: (c / STEPS, t / STEPS) for k, (c, t) in sorted(other.items())}}


def main():
    import jax
    import jax.numpy as jnp
    import jax_mla

    rows = []
    for batch in (1, 128):
        point = Point(B=batch, L=4096, H=128, q_len=1, page_size=64)
        layout = make_layout(point, 0)
        pool = [random_cache(i, layout.num_pages, 64) for i in range(4)]
        caches = tuple(pool[i % 4] for i in range(LAYERS))
        query = jax.random.normal(jax.random.PRNGKey(1), (batch, 1, 128, HEAD_DIM),
                                  jnp.float32).astype(jnp.bfloat16)
        tables, lens = jnp.asarray(layout.tables), jnp.asarray(layout.lengths)
        plan = jax_mla.plan(np.asarray(layout.lengths, np.int32), num_heads=128, q_len=1,
                            max_pages=layout.max_pages)
        for plan_kind in ("device", "host"):
            summaries = {}
            for guarded in (True, False):
                one = functools.partial(decode_with_plan, fail_closed=guarded)
                if plan_kind == "device":
                    step = device_planned(one, LAYERS, point, layout.max_pages)
                    step_args = (query, caches, tables, lens, None)
                else:
                    step = layered(one, LAYERS)
                    step_args = (query, caches, tables, lens, plan)
                events, wall_us = traced_step(step, step_args)
                summaries[guarded] = dict(summarize(events), wall_us=wall_us)
            g, u = summaries[True], summaries[False]
            guard_us = g["other_us"] - u["other_us"]
            total_u = u["attention_us"] + u["other_us"]
            rows.append((batch, plan_kind, g, u, guard_us, total_u))
            print(f"B={batch} plan={plan_kind}: kernels/step guarded {g['kernels']:.0f} unguarded "
                  f"{u['kernels']:.0f}; attention µs/step {g['attention_us']:.1f} / "
                  f"{u['attention_us']:.1f}; other µs/step {g['other_us']:.2f} / {u['other_us']:.2f};"
                  f" wall µs/step {g['wall_us']:.0f} / {u['wall_us']:.0f}", flush=True)
            for label, s in (("guarded", g), ("unguarded", u)):
                for name, (count, us) in s["other_by_name"].items():
                    print(f"    {label:9s} {count:5.1f}x {us:8.2f} µs  {name[:100]}")
    print("\n| B | plan | kernels/step, guarded | unguarded | guard kernels µs/step | "
          "unguarded kernel µs/step | guard / kernel time | unguarded wall µs/step | "
          "guard / wall |")
    print("|---|---|---|---|---|---|---|---|---|")
    for batch, plan_kind, g, u, guard_us, total_u in rows:
        print(f"| {batch} | {plan_kind} | {g['kernels']:.0f} | {u['kernels']:.0f} | {guard_us:.2f} | "
              f"{total_u:.1f} | {100 * guard_us / total_u:.2f}% | {u['wall_us']:.0f} | "
              f"{100 * guard_us / u['wall_us']:.2f}% |")


if __name__ == "__main__":
    script_args("benchmarks.guard_profile", __doc__)
    require_cuda_gpu()
    main()
