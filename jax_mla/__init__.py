"""jax_mla: DeepSeek-style Multi-head Latent Attention decode for JAX.

``decode`` runs an MLA decode kernel through an XLA FFI custom call on NVIDIA GPUs and a chunked
pure-XLA implementation everywhere else (``jax_mla.backends.TABLE`` lists the backends); ``plan``
and ``device_plan`` build the fa3/fa2 work schedule once per step, ``sm90_plan`` the sm90 kernel's;
``write_kv`` updates the paged cache in place: a float cache, the fp8 cache of
``jax_mla.fp8_cache`` (``allocate_cache(..., dtype="fp8")``) or the e4m3 cache of
``jax_mla.e4m3_cache`` (``dtype=jnp.float8_e4m3fn``); ``backend_for`` names the backend ``decode``
runs for a device's arrays.
"""

from jax_mla.api import backend_for, decode
from jax_mla.backends import available_backends
from jax_mla.cache import allocate_cache, torch_view, write_kv
from jax_mla.planning import Plan, device_plan, plan
from jax_mla.sm90_planning import Sm90Plan, sm90_plan

__all__ = [
    "Plan", "Sm90Plan", "allocate_cache", "available_backends", "backend_for", "decode",
    "device_plan", "plan", "sm90_plan", "torch_view", "write_kv",
]
__version__ = "0.1.0"
