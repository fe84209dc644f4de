"""The decode backends: one table of what each runs on and supports, and what "auto" picks.

Every backend's ``decode`` has one signature::

    decode(query, kv_cache, block_tables, seq_lens, *, softmax_scale, output_scale, kv_lora_rank,
           plan, fail_closed) -> (out [B, q_len, H, kv_lora_rank] in query.dtype,
                                  lse float32 [B, q_len, H])

``fail_closed`` matters only to a backend whose kernel fails closed itself
(``Backend.fails_closed_in_kernel``); for the others ``jax_mla.decode`` runs the guard
(``jax_mla.guard``) before them.

``TABLE`` lists the backends best first; on a given machine "auto" takes the first one that runs
there and takes the query's dtype and the cache's format (``FLOAT_CACHE``, ``FP8_CACHE`` or
``E4M3_CACHE``). That order gives trtllm-gen on Blackwell (SM100/SM103), fa3 on Hopper (SM90), fa2
on other CUDA GPUs from SM80, and xla everywhere else and for the fp8 cache; for the e4m3 cache fa3
on Hopper and xla elsewhere (trtllm-gen takes it when named: not yet run on hardware). With a plan
"auto" takes the first available backend that reads that kind of plan (``Backend.reads_plan``): for
a ``jax_mla.Plan`` fa3 on Hopper and fa2 on other GPUs, for a ``jax_mla.Sm90Plan`` sm90. Without
one sm90 is never the first pick, because what it takes depends on the shape of each device's
shard: on Hopper each device takes sm90 instead of fa3 or xla where its shard's shape is one sm90
runs and is faster at (``auto_alternative``, ``prefers_sm90``); on Blackwell a device whose shard
trtllm-gen does not run (its dims, page sizes and head counts) takes fa2.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable

import jax
import jax.numpy as jnp

from jax_mla import e4m3_cache, fp8_cache, gpu, xla_backend

XLA = "xla"
FA3 = "fa3"
FA2 = "fa2"
TRTLLM_GEN = "trtllm-gen"
SM90 = "sm90"
AUTO = "auto"

Capability = tuple[int, int]

# The kinds of plan (``decode``'s ``plan=``) a backend may read: FlashInfer's fa3/fa2 work schedule
# (``jax_mla.Plan`` from ``jax_mla.plan`` or ``jax_mla.device_plan``, or "device" to build one in
# the call), and the sm90 kernel's schedule (``jax_mla.Sm90Plan`` from ``jax_mla.sm90_plan``).
FA_PLAN = "jax_mla.Plan"
SM90_PLAN = "jax_mla.Sm90Plan"

# Cache formats: a cache of the query's floating dtype, the fp8 cache (e4m3 with a scale per 128
# latent channels) or the e4m3 cache (one scale) (docs/fp8-cache.md).
FLOAT_CACHE = "float"
FP8_CACHE = fp8_cache.FP8
E4M3_CACHE = e4m3_cache.E4M3
FORMAT_NAMES = {FLOAT_CACHE: "the query's dtype", FP8_CACHE: "the fp8 cache (uint8)",
                E4M3_CACHE: "the e4m3 cache (float8_e4m3fn)"}


@dataclasses.dataclass(frozen=True, eq=False)
class Backend:
    """One decode implementation. Compared and hashed by identity (the rows of ``TABLE``), so that
    a kernel closed over one is a static argument JAX can cache on.

    Attributes:
      name: the ``backend=`` string.
      runs_on: where it runs, in words (for messages and docs).
      runs_on_capability: whether a CUDA GPU of this compute capability runs it; None for a backend
        that needs no GPU.
      dtypes: the query dtypes it takes (a float cache has the query's dtype); empty for any
        floating dtype.
      cache_formats: the cache formats it takes (``FLOAT_CACHE``, ``FP8_CACHE``, ``E4M3_CACHE``).
      reads_plan: the kind of plan it reads (``FA_PLAN`` or ``SM90_PLAN``), None for none.
      applies_output_scale: whether its kernel multiplies by ``output_scale`` itself.
      fails_closed_in_kernel: whether its kernel gives bad requests out 0 and lse -inf itself
        (its ``decode``'s ``fail_closed``), so that ``jax_mla.decode`` runs no guard before it.
      decode: the implementation, with the signature in the module docstring.
      missing: for a backend that needs more than its GPU and jax_mla's GPU runtime, a function
        saying why it cannot run here (None when it can).
      first_pick: whether "auto" may take it before the arrays are split over devices; a backend
        whose shape limits depend on the shard is taken per device instead (``auto_alternative``).
      format_capability: for a cache format that needs more than the backend's GPU, (whether a
        GPU of a compute capability runs the backend on it, those GPUs in words).
      named_only_formats: cache formats it takes only when named (``backend=``), never as
        "auto"'s pick: paths not yet run on hardware.
      check_shapes: ``(query, kv_cache, block_tables, kv_lora_rank)`` -> None, raising
        ``ValueError`` for the shapes its kernel does not run (one device's shapes).
    """

    name: str
    runs_on: str
    runs_on_capability: Callable[[Capability], bool] | None
    dtypes: tuple
    cache_formats: tuple[str, ...]
    reads_plan: str | None
    applies_output_scale: bool
    decode: Callable
    fails_closed_in_kernel: bool = False
    missing: Callable[[], str | None] = lambda: None
    first_pick: bool = True
    format_capability: dict = dataclasses.field(default_factory=dict)
    named_only_formats: tuple[str, ...] = ()
    check_shapes: Callable[..., None] = lambda query, kv_cache, block_tables, kv_lora_rank: None

    def takes_dtype(self, dtype) -> bool:
        return not self.dtypes or jnp.dtype(dtype) in self.dtypes

    def takes(self, dtype, cache_format: str) -> bool:
        """Whether it takes a query of ``dtype`` with a cache of ``cache_format``."""
        return self.takes_dtype(dtype) and cache_format in self.cache_formats

    def runs_on_gpu(self, capability: Capability) -> bool:
        return self.runs_on_capability is not None and self.runs_on_capability(capability)


def _xla_decode(query, kv_cache, block_tables, seq_lens, *, softmax_scale, output_scale,
                kv_lora_rank, plan, fail_closed):
    del plan, fail_closed
    return xla_backend.decode(query, kv_cache, block_tables, seq_lens, softmax_scale=softmax_scale,
                              output_scale=output_scale, kv_lora_rank=kv_lora_rank, return_lse=True)


def _fa_decode(name: str) -> Callable:
    def decode(query, kv_cache, block_tables, seq_lens, *, softmax_scale, output_scale,
               kv_lora_rank, plan, fail_closed):
        del output_scale, fail_closed  # output_scale: applied by jax_mla.decode
        return gpu.fa_decode(name, query, kv_cache, block_tables, seq_lens,
                             softmax_scale=softmax_scale, kv_lora_rank=kv_lora_rank, plan=plan)

    decode.__name__ = f"{name}_decode"
    return decode


def _trtllm_decode(query, kv_cache, block_tables, seq_lens, *, softmax_scale, output_scale,
                   kv_lora_rank, plan, fail_closed):
    del plan, fail_closed
    return gpu.trtllm_decode(query, kv_cache, block_tables, seq_lens, softmax_scale=softmax_scale,
                             output_scale=output_scale, kv_lora_rank=kv_lora_rank)


def _sm90_decode(query, kv_cache, block_tables, seq_lens, *, softmax_scale, output_scale,
                 kv_lora_rank, plan, fail_closed):
    if plan is not None:  # a jax_mla.Sm90Plan
        plan.check_for(seq_lens, block_tables, kv_cache.shape[1])
    return gpu.sm90_decode(query, kv_cache, block_tables, seq_lens, softmax_scale=softmax_scale,
                           output_scale=output_scale, kv_lora_rank=kv_lora_rank,
                           plan=None if plan is None else (plan.schedule, plan.seq_lens),
                           fail_closed=fail_closed)


BF16 = (jnp.dtype(jnp.bfloat16),)
FLOAT_OR_E4M3 = (FLOAT_CACHE, E4M3_CACHE)

TABLE: tuple[Backend, ...] = (
    Backend(TRTLLM_GEN, "SM100/SM103 (B200, GB200, B300)", lambda cc: cc in ((10, 0), (10, 3)),
            BF16, FLOAT_OR_E4M3, reads_plan=None, applies_output_scale=True,
            decode=_trtllm_decode, named_only_formats=(E4M3_CACHE,),
            check_shapes=lambda query, kv_cache, block_tables, kv_lora_rank:
                gpu.check_trtllm_shapes(query, kv_cache, kv_lora_rank)),
    Backend(FA3, "SM90 (H100, H200)", lambda cc: cc == (9, 0),
            BF16, FLOAT_OR_E4M3, reads_plan=FA_PLAN, applies_output_scale=False,
            decode=_fa_decode(FA3)),
    Backend(FA2, "SM80 and newer", lambda cc: cc >= (8, 0),
            BF16, FLOAT_OR_E4M3, reads_plan=FA_PLAN, applies_output_scale=False,
            decode=_fa_decode(FA2),
            format_capability={E4M3_CACHE: (lambda cc: cc == (9, 0),
                                            "SM90 (FlashInfer's fp8 MLA)")}),
    # jax_mla's own Hopper kernel (ffi/sm90); "auto" takes it per device (auto_alternative), or
    # for its plan.
    Backend(SM90, "SM90 (H100, H200)", lambda cc: cc == (9, 0),
            BF16, (FLOAT_CACHE, FP8_CACHE), reads_plan=SM90_PLAN, applies_output_scale=True,
            decode=_sm90_decode, fails_closed_in_kernel=True,
            missing=lambda: gpu.sm90_missing(), first_pick=False,
            check_shapes=lambda query, kv_cache, block_tables, kv_lora_rank:
                gpu.check_sm90_shapes(query, kv_cache, block_tables, kv_lora_rank)),
    Backend(XLA, "any JAX platform", None,
            (), (FLOAT_CACHE, FP8_CACHE, E4M3_CACHE), reads_plan=None, applies_output_scale=True,
            decode=_xla_decode),
)
BY_NAME = {backend.name: backend for backend in TABLE}
ALL_BACKENDS = tuple(BY_NAME)


def runnable_on(capability: Capability | None) -> list[str]:
    """Backends that run on a CUDA GPU of ``capability`` (None: no usable GPU), best first."""
    return [b.name for b in TABLE
            if b.runs_on_capability is None or (capability is not None and b.runs_on_gpu(capability))]


def platform_of(*arrays) -> str:
    """The platform the arrays live on, or JAX's default platform for tracers."""
    for array in arrays:
        if isinstance(array, jax.Array) and not isinstance(array, jax.core.Tracer):
            return next(iter(array.devices())).platform
    return jax.default_backend()


def _is_cuda(platform: str) -> bool:
    return platform in ("gpu", "cuda")


# JAX's platform names ("cuda" and "rocm" are the GPU plugins' own).
PLATFORMS = ("cpu", "gpu", "cuda", "rocm", "tpu", "metal")


def available_backends(platform: str | None = None) -> list[str]:
    """Backends that can run on ``platform`` (default: JAX's default platform), best first.

    ``platform``: one of ``PLATFORMS``, in any case; a TypeError for a non-str, a ValueError for
    another name (a misspelt one would otherwise report only xla)."""
    if platform is None:
        platform = jax.default_backend()
    elif not isinstance(platform, str):
        raise TypeError(f"platform must be a str, one of {list(PLATFORMS)}, or None (JAX's default "
                        f"platform), got {type(platform).__name__}")
    elif platform.lower() not in PLATFORMS:
        raise ValueError(f"platform must be one of {list(PLATFORMS)} (any case) or None, got "
                         f"{platform!r}")
    platform = platform.lower()
    if not _is_cuda(platform) or gpu.runtime_missing() is not None:
        return runnable_on(None)
    return [name for name in runnable_on(gpu.capability()) if BY_NAME[name].missing() is None]


def cache_format_of(kv_cache) -> str:
    """``FP8_CACHE`` for an fp8 cache (uint8), ``E4M3_CACHE`` for an e4m3 cache (float8_e4m3fn),
    else ``FLOAT_CACHE``."""
    if fp8_cache.is_fp8_cache(kv_cache):
        return FP8_CACHE
    return E4M3_CACHE if e4m3_cache.is_e4m3_cache(kv_cache) else FLOAT_CACHE


def resolve(backend: str, platform: str, dtype=jnp.bfloat16, cache_format: str = FLOAT_CACHE,
            plan_kind: str | None = None) -> str:
    """The name of the backend to run for a ``backend=`` argument on ``platform`` with a query of
    ``dtype`` and a cache of ``cache_format``.

    "auto" takes the first available backend that takes both, and given a ``plan_kind``
    (``FA_PLAN``, ``SM90_PLAN``) the first available backend that takes both and reads that kind
    (none: a ValueError says why each reader cannot); ``auto_alternative`` says what a device may
    take instead. A named backend must be available here and take both; otherwise the error says
    why and what is available.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a str ('auto' or one of {list(ALL_BACKENDS)}), got "
                        f"{type(backend).__name__}")
    available = available_backends(platform)
    if backend == AUTO:
        candidates = _auto_candidates(available, platform, dtype, cache_format)
        readers = [name for name in available if plan_kind is not None
                   and BY_NAME[name].reads_plan == plan_kind
                   and _auto_takes(BY_NAME[name], platform, dtype, cache_format)]
        if plan_kind is not None and not readers:
            raise ValueError(_why_no_reader(plan_kind, available, platform, dtype, cache_format))
        picked = (readers or candidates)[0]
        missing = gpu.runtime_missing() if picked == XLA and _is_cuda(platform) else None
        if missing is not None and _a_gpu_kernel_takes(platform, dtype, cache_format):
            warnings.warn(f"jax_mla: backend='auto' runs the xla backend on this GPU, many times "
                          f"slower than its kernels, because {missing}", RuntimeWarning,
                          stacklevel=4)
        return picked
    if backend not in BY_NAME:
        raise ValueError(f"unknown backend {backend!r}; expected 'auto' or one of {list(ALL_BACKENDS)} "
                         f"(available here: {available})")
    chosen = BY_NAME[backend]
    if backend not in available:
        raise ValueError(f"{_why_unavailable(chosen, platform)}; available here: {available}")
    if cache_format not in chosen.cache_formats:
        takers = [b.name for b in TABLE if cache_format in b.cache_formats]
        taken = " or ".join(FORMAT_NAMES[f] for f in chosen.cache_formats)
        raise TypeError(f"backend {backend!r} takes caches of {taken}, got "
                        f"{FORMAT_NAMES[cache_format]} (docs/fp8-cache.md); backends that take it: "
                        f"{takers}")
    if not _runs_format_here(chosen, cache_format, platform):
        where = chosen.format_capability[cache_format][1]
        major, minor = gpu.capability()
        raise ValueError(f"backend {backend!r} takes {FORMAT_NAMES[cache_format]} on {where} only, "
                         f"not on this GPU (compute capability {major}.{minor})")
    if not chosen.takes_dtype(dtype):
        raise TypeError(f"backend {backend!r} needs query and kv_cache of dtype "
                        f"{' or '.join(str(d) for d in chosen.dtypes)}, got {jnp.dtype(dtype)}; "
                        "use backend='xla' for other dtypes")
    return backend


def _auto_takes(backend: Backend, platform: str, dtype, cache_format: str) -> bool:
    """Whether "auto" may run ``backend`` here on a query of ``dtype`` and a cache of
    ``cache_format``, as its first pick or per device."""
    return (backend.takes(dtype, cache_format) and cache_format not in backend.named_only_formats
            and _runs_format_here(backend, cache_format, platform))


def _auto_candidates(available: list[str], platform: str, dtype, cache_format: str) -> list[str]:
    """The backends of ``available`` that "auto" may pick for a query of ``dtype`` and a cache of
    ``cache_format`` before the arrays are split, best first (xla is always one)."""
    return [name for name in available if BY_NAME[name].first_pick
            and _auto_takes(BY_NAME[name], platform, dtype, cache_format)]


def _a_gpu_kernel_takes(platform: str, dtype, cache_format: str) -> bool:
    """Whether a GPU backend that runs on this machine's GPU takes a query of ``dtype`` and a cache
    of ``cache_format`` (as "auto" or per device), whatever the runtime installed."""
    return any(name != XLA and _auto_takes(BY_NAME[name], platform, dtype, cache_format)
               for name in runnable_on(gpu.capability()))


def _runs_format_here(backend: Backend, cache_format: str, platform: str) -> bool:
    """Whether ``backend``, available here, runs on a cache of ``cache_format`` on this machine's
    GPU; the GPU is asked only for a format that needs more than the backend's GPU."""
    needs = backend.format_capability.get(cache_format)
    return needs is None or (_is_cuda(platform) and needs[0](gpu.capability()))


def prefers_sm90(batch: int, q_len: int, num_heads: int, instead_of: str = FA3) -> bool:
    """Whether one device's shard of ``batch`` requests, ``q_len`` query tokens and ``num_heads``
    heads is a shape where sm90 is faster than the backend ``instead_of``: than xla always; than
    fa3 where the committed measurements have it faster (the H200's benchmark,
    benchmarks/results/h200-sm90.md, and an H100's: benchmarks/results/h100-sm90.md and 61-layer
    steps, tests/gpu_logs/h100/step-profile-*.log).
    - q_len 1: any heads from 32 requests; below, up to 16 heads or 33-64 at any batch, 17-32 heads
      up to 4 requests, more than 64 heads at any batch but 7.
    - q_len 2: more than 64 heads at any batch; 17-64 heads below 512 requests; up to 16 heads
      up to 8 requests and from 32 to 511.
    - q_len 3: 33-64 heads at any batch; more than 64 heads below 512 requests; 17-32 heads up to
      2 requests and from 16 to 511; 9-16 heads up to 4 and from 24 to 511; 8 or fewer from 32 to
      511.
    - q_len 4: more than 8 heads below 512 requests; 8 or fewer up to 8 requests and from 32 to
      511."""
    if instead_of == XLA:
        return True
    if batch >= 512:
        return (q_len == 1 or (q_len == 2 and num_heads > 64)
                or (q_len == 3 and 32 < num_heads <= 64))
    if batch >= 32:
        return True
    if q_len == 1:
        if num_heads > 64:
            return batch != 7
        if 16 < num_heads <= 32:
            return batch <= 4
        return True
    if q_len == 2:
        return num_heads > 16 or batch <= 8
    if q_len == 3:
        if num_heads > 32:
            return True
        if num_heads > 16:
            return batch <= 2 or batch >= 16
        if num_heads > 8:
            return batch <= 4 or batch >= 24
        return False
    return num_heads > 8 or batch <= 8


def auto_alternative(requested: str, chosen: Backend, plan, platform: str, dtype=jnp.bfloat16,
                     cache_format: str = FLOAT_CACHE) -> Backend | None:
    """The backend each device may take instead of ``chosen`` for ``backend=requested``, or None.

    Only "auto" without a plan has one. Where it resolved to fa3 or xla: sm90, if sm90 runs here
    and takes the query and cache (a device takes it where ``prefers_sm90`` holds for its shard's
    shape and ``gpu.check_sm90_shapes`` passes). Elsewhere: the next backend "auto" may pick, which
    a device takes where ``chosen`` does not run its shard's shapes (``Backend.check_shapes``:
    trtllm-gen's page sizes and head counts). The choice is made per device because "auto" is
    resolved before the arrays are split."""
    if requested != AUTO or plan is not None:
        return None
    if chosen.name not in (FA3, XLA):
        candidates = _auto_candidates(available_backends(platform), platform, dtype, cache_format)
        later = candidates[candidates.index(chosen.name) + 1:] if chosen.name in candidates else []
        return BY_NAME[later[0]] if later else None
    sm90 = BY_NAME[SM90]
    if SM90 not in available_backends(platform) or not sm90.takes(dtype, cache_format):
        return None
    return sm90


def _why_no_reader(plan_kind: str, available: list[str], platform: str, dtype,
                   cache_format: str) -> str:
    """Why "auto" can take no backend that reads a plan of ``plan_kind`` here: each reader's
    reason."""
    readers = [b for b in TABLE if b.reads_plan == plan_kind]
    reasons = []
    for reader in readers:
        if reader.name not in available:
            reasons.append(_why_unavailable(reader, platform))
        elif not reader.takes(dtype, cache_format):
            given = (f"a {jnp.dtype(dtype)} cache" if cache_format == FLOAT_CACHE
                     else FORMAT_NAMES[cache_format])
            dtypes = " or ".join(str(d) for d in reader.dtypes) or "floating"
            formats = " or ".join(FORMAT_NAMES[f] for f in reader.cache_formats)
            reasons.append(f"backend {reader.name!r} takes {dtypes} queries with caches of "
                           f"{formats}, not a {jnp.dtype(dtype)} query with {given}")
        else:
            reasons.append(f"backend {reader.name!r} does not take {FORMAT_NAMES[cache_format]} "
                           "on this GPU")
    which = "either" if len(readers) > 1 else "it"
    return (f"{only_read_by(plan_kind)}, and backend='auto' cannot take {which} here: "
            f"{'; '.join(reasons)}; available here: {available}")


def only_read_by(plan_kind: str) -> str:
    """"<the plan> is only read by the <readers> backend(s)", for errors about a plan of
    ``plan_kind``."""
    readers = [b.name for b in TABLE if b.reads_plan == plan_kind]
    what = "plan" if plan_kind == FA_PLAN else f"a {plan_kind}"
    return f"{what} is only read by the {'/'.join(readers)} backend{'s' * (len(readers) > 1)}"


def _why_unavailable(backend: Backend, platform: str) -> str:
    if not _is_cuda(platform):
        return (f"backend {backend.name!r} needs an NVIDIA GPU ({backend.runs_on}) but the arrays "
                f"are on {platform!r}")
    missing = gpu.runtime_missing()
    if missing:
        return f"backend {backend.name!r} is unavailable: {missing}"
    major, minor = gpu.capability()
    extra = backend.missing()
    if backend.runs_on_gpu((major, minor)) and extra:
        return f"backend {backend.name!r} is unavailable: {extra}"
    return (f"backend {backend.name!r} runs on {backend.runs_on} and cannot run on this GPU "
            f"(compute capability {major}.{minor})")
