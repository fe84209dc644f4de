"""Measures what the xla backend achieves against the float32 torch reference over many random
problems, per dtype: the worst output error per request and head, the worst lse error, and the
worst relative L2 error of the whole output.

    python tests/measure_accuracy.py [NUM_PROBLEMS] [--fp8]

With ``--fp8`` each problem also runs on its fp8 cache (``conftest.fp8_problem``), against the
reference on the same fp8 cache and against the reference on the bf16 cache it was quantised from.
The tolerances in tests/conftest.py (XLA_TOLERANCES) and tests/test_fp8_cache.py are set from these
numbers; docs/testing.md and docs/fp8-cache.md record runs.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]
from conftest import fp8_problem, lse_error, make_problem, request_head_error  # noqa: E402

import jax_mla  # noqa: E402
from jax_mla.reference import reference_from_jax  # noqa: E402


def random_shape(rng):
    return dict(batch=int(rng.integers(1, 9)), q_len=int(rng.choice([1, 1, 2, 4])),
                num_heads=int(rng.choice([16, 128])), page_size=int(rng.choice([1, 16, 64])),
                max_len=int(rng.choice([64, 600, 4000])), kv_lora_rank=int(rng.choice([512, 256])))


def errors_against(problem, reference_problem, **kwargs) -> tuple[float, float, float]:
    """(output error per request/head, lse error in nats, relative L2 error of the output) of the
    xla backend on ``problem`` against the torch reference on ``reference_problem``."""
    out, lse = jax.jit(lambda *a: jax_mla.decode(*a, backend="xla", return_lse=True, **kwargs))(
        *problem.arrays)
    ref_out, ref_lse = (t.numpy() for t in reference_from_jax(*reference_problem.arrays, **kwargs))
    out = np.asarray(out, np.float64)
    l2 = float(np.linalg.norm(out - ref_out) / max(np.linalg.norm(ref_out), 1e-30))
    return request_head_error(out, ref_out), lse_error(lse, ref_lse), l2


def keep_worst(worst: dict, name: str, errors, shape) -> None:
    previous = worst.get(name, ((0.0, None),) * len(errors))
    worst[name] = tuple((e, shape) if e > p[0] else p for p, e in zip(previous, errors))


def main(num_problems: int, fp8: bool):
    rng = np.random.default_rng(2026)
    worst = {}
    for seed in range(num_problems):
        shape = random_shape(rng)
        if shape["page_size"] == 1:
            shape["max_len"] = min(shape["max_len"], 600)
        for dtype in (jnp.float32, jnp.bfloat16):
            problem = make_problem(seed, dtype=dtype, **shape)
            kwargs = dict(softmax_scale=problem.softmax_scale, kv_lora_rank=shape["kv_lora_rank"])
            name = jnp.dtype(dtype).name
            keep_worst(worst, name, errors_against(problem, problem, **kwargs), shape)
            if fp8:
                quantised, source = fp8_problem(problem, seed)
                keep_worst(worst, f"{name} query, fp8 cache",
                           errors_against(quantised, quantised, **kwargs), shape)
                keep_worst(worst, f"{name} query, fp8 cache against its bf16 cache",
                           errors_against(quantised, source, **kwargs), shape)
    for name, ((out_error, out_shape), (lse_err, lse_shape), (l2, l2_shape)) in worst.items():
        print(f"{name}: {num_problems} problems; worst output error per request/head {out_error:.3e} "
              f"({out_shape}); worst lse error {lse_err:.3e} nats ({lse_shape}); worst relative L2 "
              f"error {l2:.3e} ({l2_shape})")


if __name__ == "__main__":
    numbers = [arg for arg in sys.argv[1:] if arg != "--fp8"]
    main(int(numbers[0]) if numbers else 200, "--fp8" in sys.argv[1:])
