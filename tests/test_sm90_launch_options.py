"""The sm90 launcher's argument checks, run on the host (``tests/sm90_launch_options_check.cu``
calls ``LaunchDecode`` from ``ffi/sm90/launch.cuh``): launch options outside their documented
values, combinations no kernel implements and shapes the kernels do not take return
cudaErrorInvalidValue before any CUDA call, and valid ones pass the same checks. ``jax_mla.decode`` always passes the default options;
the harness (benchmarks/sm90_harness.cu) is what sets the others."""

from __future__ import annotations

import os
import runpy
import subprocess

import pytest
from conftest import build_host_check, skip_or_fail

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CASES = ["transposed_scores=1", "transposed_scores=-2", "wide_combine=2", "wide_combine=-2",
         "split_release=2", "split_release=-2", "bf16_partials=2", "bf16_partials=-2",
         "bf16_partials=1,transposed", "combine_rows_in_flight=12", "combine_rows_in_flight=0",
         "staged_combine=2", "staged_combine=-2",
         "kv_l2_promotion=64", "fp8_registers=2", "fp8_registers=-2", "column_halves=2",
         "column_halves=-2", "cluster=3", "cluster=0",
         "cluster=-2", "cluster=2,odd_m_tiles", "cluster=2,late_release", "cluster=2,experiment=1",
         "experiment=5", "page_size=48", "max_pages_2^24,page_size=64", "batch=0",
         "softmax_scale=0", "query_misaligned", "no_schedule", "min_blocks_per_part=0",
         "block_to_split_cost=0",
         "fp8,experiment=1", "fp8,late_release", "fp8,cluster=2"]

# The same checks let these through (the arguments of ValidParams, changed as each name says),
# where the build has the launcher's experiment kernels (the harness's); the FFI library's build
# refuses those that need them.
PASSING = ["valid", "valid,h128", "valid,page_size=32,q_len=4", "valid,combine_rows_in_flight=16",
           "valid,fp8,h128"]
EXPERIMENTS_ONLY = ["valid,h128,cluster=1,late_release", "valid,h128,split_release=1",
                    "valid,fp8,fp8_registers=0",
                    "valid,experiment=1", "valid,no_combine"]

# The KV map promotes 128-byte L2 lines for the transposed kernel up to 16 rows, and up to 32 where
# each request splits over at least four of the 132 parts (33 requests, not 34), 256 bytes
# elsewhere; the fp8 cache runs DecodeFp8RegsKernel up to 16 rows and DecodeFp8SplitKernel at 17-32
# unless fp8_registers = 0. The wide combine keeps 32 rows in flight where its grid (64 blocks a
# request at 128 rows) is resident at once on the 132 SMs, else 16 where that kernel's is, and is
# the staged one where its own grid (two bf16 rows or one fp32 row a block) fits them and no rows
# in flight are named, or where staged_combine says. The bf16 cache's 64-row tiles run in clusters
# of two in an even number of M tiles where the block table holds more than 24,576 tokens. The
# schedule's split cost is 24 for the fp8 cache's 64-row tiles (score_n 0), 12 for the bf16
# cache's 16-row transposed kernel and 14 for every other kernel (or what LaunchOptions names), and
# parts take one KV block at least with a combine of 32 rows in flight, two without, or what
# min_blocks_per_part asks if more. The 64-row tiles split each part's output columns over two
# CTAs (column halves) for up to two requests (one on the fp8 cache) of up to two M tiles where a
# table's worth of blocks over half the parts makes them at most 5/3 as long, 3/2 on the fp8 cache
# (132 SMs, pages of 64: one request of up to 12,288 tokens at 128 heads, not 16,384; on the fp8
# cache up to 6,208, not 6,272), or wherever column_halves = 1.
DEFAULTS = ["promotion rows=8,batch=33 128", "promotion rows=8,batch=34 128",
            "promotion rows=16,batch=33 128", "promotion rows=16,batch=34 128",
            "promotion rows=32,batch=33 128", "promotion rows=32,batch=34 256",
            "promotion rows=128,batch=33 256", "promotion rows=128,batch=34 256",
            "promotion rows=16,kv_l2_promotion=0 0",
            "promotion rows=32,batch=33,kv_l2_promotion=256 256",
            "fp8 rows=16 registers 1", "fp8 rows=16,fp8_registers=0 registers 0",
            "fp8 rows=32 registers 0", "fp8 rows=17 split 1", "fp8 rows=32 split 1",
            "fp8 rows=64 split 0", "fp8 rows=32,fp8_registers=0 split 0", "fp8 rows=32 smem 1",
            "combine rows=128,batch=4 rows in flight 32",
            "combine rows=128,batch=5 rows in flight 16",
            "combine rows=128,batch=6 rows in flight 16",
            "combine rows=128,batch=7 rows in flight 8",
            "combine rows=16,batch=16,fp32 rows in flight 32",
            "combine rows=16,batch=17,fp32 rows in flight 16",
            "combine rows=16,batch=33,fp32 rows in flight 16",
            "combine rows=16,batch=34,fp32 rows in flight 8",
            "combine rows=128,batch=2,one block an SM rows in flight 32",
            "staged rows=128,bf16,batch=2 1", "staged rows=128,bf16,batch=3 0",
            "staged rows=16,f32,batch=8 1", "staged rows=16,f32,batch=9 0",
            "staged rows=16,f32,batch=9,staged_combine=0 0",
            "staged rows=16,f32,batch=9,staged_combine=1 1",
            "staged rows=128,bf16,batch=1,combine_rows_in_flight=8 0",
            "cluster rows=64,fp8=0,tokens=24576 1", "cluster rows=64,fp8=1,tokens=24576 1",
            "cluster rows=128,fp8=0,tokens=24576 1", "cluster rows=128,fp8=1,tokens=24576 1",
            "cluster rows=64,fp8=0,tokens=24640 1", "cluster rows=64,fp8=1,tokens=24640 1",
            "cluster rows=128,fp8=0,tokens=24640 2", "cluster rows=128,fp8=1,tokens=24640 1",
            "schedule score_n=16,fp8=0 cost 12 min 1", "schedule score_n=16,fp8=1 cost 14 min 1",
            "schedule score_n=0,fp8=0 cost 14 min 1", "schedule score_n=0,fp8=1 cost 24 min 1",
            "schedule beyond one wave min 2", "schedule block_to_split_cost=5 cost 5",
            "schedule min_blocks_per_part=3 min 3",
            "halves rows=128,tokens=4096 1", "halves rows=128,tokens=4288 1",
            "halves rows=128,tokens=12288 1", "halves rows=128,tokens=16384 0",
            "halves rows=128,batch=2,tokens=2048 1", "halves rows=128,batch=3,tokens=1024 0",
            "halves rows=256,tokens=4096 0",
            "halves rows=64,tokens=8192 1", "halves rows=16,tokens=4096 0",
            "halves rows=128,fp8,tokens=4096 1", "halves rows=128,fp8,tokens=6208 1",
            "halves rows=128,fp8,tokens=6272 0", "halves rows=128,fp8,batch=2,tokens=1024 0",
            "halves rows=128,fp8,batch=2,tokens=2048 0",
            "halves rows=128,fp8,batch=2,tokens=4096 0",
            "halves rows=128,tokens=4096,column_halves=0 0",
            "halves rows=128,tokens=4096,split_release=1 0",
            "halves rows=128,batch=512,column_halves=1 1"]


def cutlass_include() -> str | None:
    """CUTLASS headers, looked up as ffi/CMakeLists.txt does (ffi/find_cutlass.py)."""
    finder = runpy.run_path(os.path.join(ROOT, "ffi", "find_cutlass.py"))
    return finder["configured_cutlass_include"]()


@pytest.mark.parametrize("experiments", [True, False], ids=["harness-build", "library-build"])
def test_out_of_range_options_and_shapes_are_rejected(tmp_path, experiments):
    include = cutlass_include()
    if include is None:
        skip_or_fail("building tests/sm90_launch_options_check.cu needs CUTLASS headers "
                     "(pip install nvidia-cutlass, or set CUTLASS_INCLUDE_DIR)")
    binary = build_host_check(tmp_path, "sm90_launch_options_check", f"-I{include}",
                              *(["-DJAX_MLA_SM90_EXPERIMENTS"] if experiments else []),
                              "--expt-relaxed-constexpr", gencode="arch=compute_90a,code=compute_90a")
    lines = subprocess.run([binary], capture_output=True, text=True, check=True).stdout.splitlines()
    experiments_only = "passes" if experiments else "fails"
    assert lines == ([f"{case} invalid" for case in CASES] + [f"{case} passes" for case in PASSING]
                     + [f"{case} {experiments_only}" for case in EXPERIMENTS_ONLY] + DEFAULTS), lines
