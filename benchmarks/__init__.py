"""Benchmarks of jax_mla's decode (run from the repository root, see benchmarks/README.md).

Command lines: ``python -m benchmarks.decode`` (measure), ``python -m benchmarks.report``
(markdown and roofline plot from its JSON), ``python -m benchmarks.planner_kernel`` (the GPU
planner under Nsight Compute), ``python -m benchmarks.planner_b1_profile`` (B=1 schedules by
kernel durations).

Modules: ``grid`` (points, grids, filters, pieces), ``problem`` (a point's layout, cost and
caches; the shared relative error and shuffled block tables), ``methods`` (what is timed and
its JAX steps), ``peers`` (FlashInfer from torch), ``timing``, ``bench`` (one point end to end),
``results`` (the JSON files), ``environment``, ``progress``; ``goals.toml`` holds the targets
the report checks.
"""
