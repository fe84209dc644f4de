"""FlashInfer's compiled MLA entry points, loaded once and published in TVM-FFI's global registry.

The FFI handlers find them there by name at execute time, so no Python runs inside a decode call.
FlashInfer JIT-compiles a module with nvcc on first use (~20 s for fa3) and caches it under
~/.cache/flashinfer.
"""

from __future__ import annotations

import functools

FLASHINFER_VERSION = "0.7.2.post1"


def _import_flashinfer():
    try:
        import flashinfer
    except ImportError as error:
        raise RuntimeError(f"the GPU backends need flashinfer-python=={FLASHINFER_VERSION} and "
                           "apache-tvm-ffi: pip install 'jax_mla[cuda]'") from error
    if flashinfer.__version__ != FLASHINFER_VERSION:
        raise RuntimeError(f"jax_mla is built against flashinfer-python=={FLASHINFER_VERSION}, found "
                           f"{flashinfer.__version__}: its C++ entry points change between releases")
    return flashinfer


def _publish(name: str, function) -> str:
    import tvm_ffi

    tvm_ffi.register_global_func(name, function, override=True)
    return name


@functools.cache
def fa_entry_points(backend: str, kv_lora_rank: int, rope_dim: int) -> tuple[str, str]:
    """Global names of the (run, plan) functions of FlashInfer's ``backend`` batch-MLA module."""
    import torch

    _import_flashinfer()
    from flashinfer.mla._batch_mla._backends._fa_common import get_batch_mla_module

    try:
        module = get_batch_mla_module(backend, torch.bfloat16, torch.bfloat16, torch.bfloat16,
                                      torch.int32, kv_lora_rank, rope_dim, False)
    except Exception as error:  # nvcc missing, wrong arch, compile failure
        raise RuntimeError(f"building FlashInfer's {backend} MLA module failed (it needs nvcc from the "
                           f"CUDA toolkit and a GPU that supports {backend}): {error}") from error
    raw = getattr(module, "_module", module)  # past FlashInfer's torch staging proxy
    prefix = f"jax_mla.{backend}.mla_{kv_lora_rank}_{rope_dim}"
    return _publish(f"{prefix}.run", raw.run), _publish(f"{prefix}.plan", raw.plan)


@functools.cache
def fa_plan_function(backend: str, kv_lora_rank: int, rope_dim: int):
    """FlashInfer's host planner for ``backend`` as a callable (used by ``jax_mla.plan``)."""
    import tvm_ffi

    return tvm_ffi.get_global_func(fa_entry_points(backend, kv_lora_rank, rope_dim)[1])


@functools.cache
def trtllm_entry_point() -> str:
    """Global name of FlashInfer's trtllm-gen paged-attention decode (SM100/SM103)."""
    _import_flashinfer()
    from flashinfer.mla._batch_mla._backends.trtllm_gen_backend import get_trtllm_gen_fmha_module

    try:
        module = get_trtllm_gen_fmha_module()
    except Exception as error:
        raise RuntimeError("loading FlashInfer's trtllm-gen module failed: it needs its cubins "
                           "(flashinfer-cubin matching flashinfer-python, or FLASHINFER_CUBIN_DIR): "
                           f"{error}") from error
    return _publish("jax_mla.trtllm_gen.decode", module.trtllm_paged_attention_decode)
