"""B=1 decode steps, host schedule vs GPU schedule, compared by the fa3 kernel's own durations.

At B=1 a 61-layer step replayed as a CUDA graph is bound by the host's dispatch, so its wall time
cannot judge a few percent between schedules. This times the same two steps as the benchmark
(``benchmarks.methods.layered`` and ``device_planned``, command buffers on) by the durations of
FlashInfer's fa3 kernel in a jax.profiler trace of 5 steps each, and prints both medians and sums
per step.

    .ci/gpu-h200.sh cmd python3 -m benchmarks.planner_b1_profile     # on the GPU machine
"""

from __future__ import annotations

import numpy as np

from benchmarks.environment import require_cuda_gpu, script_args
from benchmarks.grid import Point
from benchmarks.methods import GRAPH_COMPILER_OPTIONS, decode_with_plan, device_planned, layered
from benchmarks.problem import HEAD_DIM, make_layout, random_cache
from benchmarks.timing import profiled_kernel_us

KERNEL = "BatchMLAPageAttentionHopperKernel"
LAYERS, STEPS = 61, 5


def kernel_durations(step, args) -> list[float]:
    """µs of every fa3 kernel launch in STEPS calls of ``step(*args)`` (one compile call first)."""
    import jax

    jax.block_until_ready(step(*args))

    def run():
        for _ in range(STEPS):
            jax.block_until_ready(step(*args))

    found, why = profiled_kernel_us(run, KERNEL)
    if why:
        raise RuntimeError(why)
    return found


def main():
    import jax
    import jax.numpy as jnp
    import jax_mla

    for mean_len, num_heads in [(1024, 16), (1024, 128), (4096, 16), (4096, 128), (16384, 16),
                                (16384, 128)]:
        point = Point(B=1, L=mean_len, H=num_heads, q_len=1, page_size=64)
        layout = make_layout(point, 0)
        pool = [random_cache(i, layout.num_pages, 64) for i in range(4)]
        caches = tuple(pool[i % 4] for i in range(LAYERS))
        query = jax.random.normal(jax.random.PRNGKey(1), (1, 1, num_heads, HEAD_DIM),
                                  jnp.float32).astype(jnp.bfloat16)
        tables, lens = jnp.asarray(layout.tables), jnp.asarray(layout.lengths)
        plan = jax_mla.plan(np.asarray(layout.lengths, np.int32), num_heads=num_heads, q_len=1,
                            max_pages=layout.max_pages)
        host_step = layered(decode_with_plan, LAYERS, GRAPH_COMPILER_OPTIONS)
        device_step = device_planned(decode_with_plan, LAYERS, point, layout.max_pages,
                                     GRAPH_COMPILER_OPTIONS)
        host = kernel_durations(host_step, (query, caches, tables, lens, plan))
        device = kernel_durations(device_step, (query, caches, tables, lens, None))
        print(f"B=1 L={mean_len} H={num_heads}: fa3 kernel launches host {len(host)} device "
              f"{len(device)}; median us host {np.median(host):.2f} device {np.median(device):.2f} "
              f"ratio {np.median(device) / np.median(host):.3f}; sum over launches host "
              f"{sum(host):.1f} device {sum(device):.1f} ratio {sum(device) / sum(host):.3f}",
              flush=True)


if __name__ == "__main__":
    script_args("benchmarks.planner_b1_profile", __doc__)
    require_cuda_gpu()
    main()
