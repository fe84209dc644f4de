"""Measures what the xla backend achieves against the float32 torch reference over many random
problems, per dtype: the worst output error per request and head, and the worst lse error.

    python tests/measure_accuracy.py [NUM_PROBLEMS]

The tolerances in tests/conftest.py (XLA_TOLERANCES) are set from these numbers; docs/testing.md
records a run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]
from conftest import lse_error, make_problem, request_head_error  # noqa: E402

import jax_mla  # noqa: E402
from jax_mla.reference import reference_from_jax  # noqa: E402


def random_shape(rng):
    return dict(batch=int(rng.integers(1, 9)), q_len=int(rng.choice([1, 1, 2, 4])),
                num_heads=int(rng.choice([16, 128])), page_size=int(rng.choice([1, 16, 64])),
                max_len=int(rng.choice([64, 600, 4000])), kv_lora_rank=int(rng.choice([512, 256])))


def main(num_problems: int):
    rng = np.random.default_rng(2026)
    worst = {}
    for seed in range(num_problems):
        shape = random_shape(rng)
        if shape["page_size"] == 1:
            shape["max_len"] = min(shape["max_len"], 600)
        for dtype in (jnp.float32, jnp.bfloat16):
            problem = make_problem(seed, dtype=dtype, **shape)
            kwargs = dict(softmax_scale=problem.softmax_scale, kv_lora_rank=shape["kv_lora_rank"])
            out, lse = jax.jit(lambda *a: jax_mla.decode(*a, backend="xla", return_lse=True, **kwargs))(
                *problem.arrays)
            ref_out, ref_lse = reference_from_jax(*problem.arrays, **kwargs)
            errors = (request_head_error(out, ref_out.numpy()), lse_error(lse, ref_lse.numpy()))
            name = jnp.dtype(dtype).name
            previous = worst.get(name, ((0.0, None), (0.0, None)))
            worst[name] = tuple((e, shape) if e > p[0] else p
                                for p, e in zip(previous, errors))
    for name, ((out_error, out_shape), (lse_err, lse_shape)) in worst.items():
        print(f"{name}: {num_problems} problems; worst output error per request/head {out_error:.3e} "
              f"({out_shape}); worst lse error {lse_err:.3e} nats ({lse_shape})")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
