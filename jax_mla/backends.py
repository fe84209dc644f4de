"""Which decode backends exist, which ones the current platform can run, and what "auto" picks."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

XLA = "xla"
FA3 = "fa3"
FA2 = "fa2"
TRTLLM_GEN = "trtllm-gen"
ALL_BACKENDS = (XLA, FA3, FA2, TRTLLM_GEN)
GPU_BACKENDS = (FA3, FA2, TRTLLM_GEN)

def arch_supports(backend: str, capability: tuple[int, int]) -> bool:
    """Whether a GPU of compute ``capability`` (major, minor) can run ``backend``'s kernels."""
    if backend == FA3:
        return capability == (9, 0)
    if backend == FA2:
        return capability >= (8, 0)
    if backend == TRTLLM_GEN:
        return capability in ((10, 0), (10, 3))
    return backend == XLA


def platform_of(*arrays) -> str:
    """The platform the arrays live on, or JAX's default platform for tracers."""
    for array in arrays:
        if isinstance(array, jax.Array) and not isinstance(array, jax.core.Tracer):
            return next(iter(array.devices())).platform
    return jax.default_backend()


def gpu_capability() -> tuple[int, int]:
    """Compute capability of the first CUDA device."""
    device = jax.devices("gpu")[0]
    major, minor = str(device.compute_capability).split(".")
    return int(major), int(minor)


def gpu_runtime_missing() -> str | None:
    """Why the FFI backends cannot run in this environment, or None when they can."""
    from jax_mla import ffi

    if ffi.library_path() is None:
        return ("jax_mla's FFI library was not built (reinstall jax_mla on a machine with nvcc and "
                "the CUDA toolkit, or set JAX_MLA_FFI_LIB)")
    for module, package in (("flashinfer", "flashinfer-python"), ("tvm_ffi", "apache-tvm-ffi")):
        if importlib.util.find_spec(module) is None:
            return f"{package} is not installed (pip install 'jax_mla[cuda]')"
    return None


def available_backends(platform: str | None = None) -> list[str]:
    """Backends that can run on ``platform`` (default: JAX's default platform), best first."""
    platform = platform or jax.default_backend()
    if platform not in ("gpu", "cuda") or gpu_runtime_missing() is not None:
        return [XLA]
    capability = gpu_capability()
    return [b for b in GPU_BACKENDS if arch_supports(b, capability)] + [XLA]


def resolve(backend: str, platform: str, dtype=jnp.bfloat16) -> str:
    """The concrete backend to run for a ``backend=`` argument on ``platform``.

    "auto" takes the first available backend that runs ``dtype`` (the GPU kernels take bfloat16
    only, so other dtypes get "xla"). On the H200 fa3 was as fast as fa2 or faster at every point
    measured, B=1 included (benchmarks/results/2026-11-30-h200.md), so Hopper always gets fa3.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str, got {type(backend).__name__}")
    available = available_backends(platform)
    if backend == "auto":
        if jnp.dtype(dtype) != jnp.bfloat16:
            return XLA
        return available[0]
    if backend not in ALL_BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected 'auto' or one of {list(ALL_BACKENDS)} "
                         f"(available here: {available})")
    if backend in available:
        return backend
    if platform not in ("gpu", "cuda"):
        raise ValueError(f"backend {backend!r} needs an NVIDIA GPU but the arrays are on {platform!r}; "
                         f"available here: {available}")
    missing = gpu_runtime_missing()
    if missing:
        raise ValueError(f"backend {backend!r} is unavailable: {missing}; available here: {available}")
    major, minor = gpu_capability()
    raise ValueError(f"backend {backend!r} cannot run on this GPU (compute capability {major}.{minor}); "
                     f"backends it supports: {available}")
