"""A 16-layer jitted decode step (shared plan, per-layer caches) for the command-buffer test.

Run as a program so XLA_FLAGS can differ between runs:
``python gpu_step_program.py OUT_DIR [host|device]`` (where the step's schedule is built).
Prints one JSON line: checksum, and layer 0's output and lse errors against the torch reference.
"""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parent.parent)]
from conftest import lse_error, make_problem, request_head_error  # noqa: E402

import jax_mla  # noqa: E402
from jax_mla.reference import reference_from_jax  # noqa: E402

LAYERS = 16


def main(out_dir: Path, planner: str):
    problem = make_problem(21, batch=16, q_len=2, num_heads=128, page_size=64, max_len=2000,
                           dtype=jnp.bfloat16)
    caches = jnp.stack([problem.kv_cache * (1 + 0.01 * i) for i in range(LAYERS)])
    plan = jax_mla.plan(np.asarray(problem.seq_lens), num_heads=128, q_len=2,
                        max_pages=problem.block_tables.shape[1])

    @jax.jit
    def step(query, caches, tables, lens, plan):
        if planner == "device":
            plan = jax_mla.device_plan(lens, num_heads=128, q_len=2, max_pages=tables.shape[1])

        def layer(q, cache):
            out, lse = jax_mla.decode(q, cache, tables, lens, softmax_scale=problem.softmax_scale,
                                      return_lse=True, plan=plan)
            next_q = q.at[..., :512].add(out * 0.1)
            return next_q, (out, lse)
        _, (outs, lses) = jax.lax.scan(layer, query, caches)
        return outs, lses

    outs, lses = step(problem.query, caches, problem.block_tables, problem.seq_lens, plan)
    outs, lses = step(problem.query, caches, problem.block_tables, problem.seq_lens, plan)
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / "out.npy", np.asarray(outs, np.float32))
    np.save(out_dir / "lse.npy", np.asarray(lses))
    ref, ref_lse = reference_from_jax(problem.query, caches[0], problem.block_tables,
                                      problem.seq_lens, softmax_scale=problem.softmax_scale)
    print(json.dumps({"checksum": float(np.asarray(outs, np.float64).sum()),
                      "output_error": request_head_error(outs[0], ref.numpy()),
                      "lse_error": lse_error(lses[0], ref_lse.numpy())}))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "host")
