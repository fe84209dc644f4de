"""Loads jax_mla's XLA FFI library (built from ffi/) and registers its CUDA targets with JAX."""

from __future__ import annotations

import ctypes
import functools
import os
import sysconfig
from pathlib import Path

import jax

LIBRARY_NAME = "libjax_mla_ffi.so"
# XLA custom-call target name -> exported handler symbol.
TARGETS = {
    "jax_mla_fa_decode": "JaxMlaFaDecode",
    "jax_mla_fa_decode_self_plan": "JaxMlaFaDecodeSelfPlan",
    "jax_mla_trtllm_decode": "JaxMlaTrtllmDecode",
    "jax_mla_device_plan": "JaxMlaDevicePlan",
}


def library_path() -> Path | None:
    """The FFI library: $JAX_MLA_FFI_LIB, else next to this package (regular or editable install)."""
    override = os.environ.get("JAX_MLA_FFI_LIB")
    if override:
        return Path(override) if Path(override).is_file() else None
    candidates = [Path(__file__).with_name(LIBRARY_NAME)]
    for scheme_path in ("platlib", "purelib"):
        candidates.append(Path(sysconfig.get_paths()[scheme_path]) / "jax_mla" / LIBRARY_NAME)
    return next((path for path in candidates if path.is_file()), None)


@functools.cache
def register_targets() -> None:
    """Load the library (after TVM-FFI, whose runtime it links to) and register every target."""
    import tvm_ffi  # noqa: F401  loads libtvm_ffi.so globally, which the library resolves by soname

    path = library_path()
    if path is None:
        raise RuntimeError("jax_mla's FFI library is not built: reinstall jax_mla where nvcc and the "
                           "CUDA toolkit are available (pip install 'jax_mla[cuda]'), or set "
                           "JAX_MLA_FFI_LIB to a built libjax_mla_ffi.so")
    library = ctypes.CDLL(str(path))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                    platform="CUDA")
