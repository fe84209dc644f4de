"""The floor model's two rates on this GPU (docs/performance.md, "The floor"), measured with torch.

    python -m benchmarks.floor_rates

Device copy: bytes read plus bytes written per second by ``Tensor.copy_`` of 4 GiB. Dense bf16
matmul: FLOP/s of an 8192 x 8192 x 8192 product. Each is the best of five rounds of 20 calls timed
by CUDA events. ``benchmarks/problem.py``'s ``FLOOR_MODELS`` holds the H100 80GB HBM3's rates,
which this measured, and the H200's, measured before it was written.
"""

from __future__ import annotations

import torch

from benchmarks.environment import require_cuda_gpu, script_args


def best_seconds(fn, calls: int = 20, rounds: int = 5) -> float:
    """The shortest per-call time of ``rounds`` rounds of ``calls`` calls of ``fn``, after three."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / calls)
    return best


def copy_bytes_per_s(nbytes: int = 4 << 30) -> float:
    """Bytes read plus bytes written per second by a device-to-device copy of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / best_seconds(lambda: dst.copy_(src))


def matmul_flops_per_s(n: int = 8192) -> float:
    """FLOP/s of an n x n x n bf16 matmul."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return 2 * n**3 / best_seconds(lambda: a @ b)


def main() -> None:
    name = torch.cuda.get_device_name()
    print(f"{name}: device copy {copy_bytes_per_s() / 1e12:.2f} TB/s", flush=True)
    print(f"{name}: bf16 matmul {matmul_flops_per_s() / 1e12:.0f} TFLOP/s", flush=True)


if __name__ == "__main__":
    script_args("benchmarks.floor_rates", __doc__)
    require_cuda_gpu(torch)
    main()
