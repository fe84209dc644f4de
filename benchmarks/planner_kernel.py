"""The GPU planner's kernel time alone, read by Nsight Compute (no host or launch cost in it).

    ncu -k regex:PlanKernel --metrics gpu__time_duration.sum --csv \\
        python -m benchmarks.planner_kernel > planner_ncu.csv

Runs ``jax_mla.device_plan`` once per configuration (after one warm-up call each, so the JIT
compile is not profiled twice) and prints the configurations in launch order; the n-th PlanKernel
row of the CSV (counting the warm-up launches) is configuration n // 2.

    python -m benchmarks.planner_kernel --table planner_ncu.csv   # that CSV as a markdown table
"""

from __future__ import annotations

import csv

import numpy as np

from benchmarks.environment import require_cuda_gpu, script_args
from benchmarks.report import markdown_table

CONFIGS = [(batch, num_heads, q_len) for num_heads in (16, 128) for q_len in (1, 2)
           for batch in (1, 32, 128, 512)]
MEAN_LEN = 4096


def main() -> None:
    import jax
    import jax.numpy as jnp
    import jax_mla

    rng = np.random.default_rng(0)
    for batch, num_heads, q_len in CONFIGS:
        lengths = rng.integers(MEAN_LEN // 2, 3 * MEAN_LEN // 2 + 1, batch).astype(np.int32)
        max_pages = int(-(-lengths.max() // 64))
        plan = jax.jit(lambda lens, h=num_heads, q=q_len, p=max_pages: jax_mla.device_plan(
            lens, num_heads=h, q_len=q, max_pages=p).int_workspace)
        for _ in range(2):
            plan(jnp.asarray(lengths)).block_until_ready()
        print(f"B={batch} H={num_heads} q_len={q_len} L~{MEAN_LEN}", flush=True)


def kernel_times_us(csv_path: str) -> list[float]:
    """The PlanKernel durations (µs) in an ``ncu --csv`` file, in launch order."""
    with open(csv_path) as f:
        rows = [line for line in f if line.startswith('"')]  # skips the script's own prints
    return [float(row["Metric Value"].replace(",", "")) / 1e3 for row in csv.DictReader(rows)
            if "PlanKernel" in row["Kernel Name"] and row["Metric Name"] == "gpu__time_duration.sum"]


def ncu_table(csv_path: str) -> str:
    """The configurations and their PlanKernel times in an ``ncu --csv`` file, as a markdown table."""
    times = kernel_times_us(csv_path)
    if len(times) != 2 * len(CONFIGS):
        raise ValueError(f"{csv_path}: expected {2 * len(CONFIGS)} PlanKernel rows, found {len(times)}")
    head = ["B", "H", "q_len", "planner µs, warm-up launch", "planner µs, second launch"]
    return "\n".join(markdown_table(head, [(batch, num_heads, q_len, f"{times[2 * n]:.1f}", f"{times[2 * n + 1]:.1f}")
                                           for n, (batch, num_heads, q_len) in enumerate(CONFIGS)]))


if __name__ == "__main__":
    args = script_args("benchmarks.planner_kernel", __doc__, add_arguments=lambda parser: parser.add_argument(
        "--table", metavar="CSV", help="print that Nsight Compute CSV as a markdown table"))
    if args.table:
        print(ncu_table(args.table))
    else:
        require_cuda_gpu()
        main()
