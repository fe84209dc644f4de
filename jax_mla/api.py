"""The public decode entry point: argument checks, backend choice, the plan and scale rules."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_mla import (backends, e4m3_cache, guard, planning, sharding, sm90_planning, validation,
                     value_checks)

DEVICE_PLAN = "device"  # decode(..., plan="device"): each device builds its schedule on the GPU


def decode(query: jax.Array, kv_cache: jax.Array, block_tables: jax.Array, seq_lens: jax.Array, *,
           softmax_scale: float, output_scale: float = 1.0, return_lse: bool = False,
           backend: str = "auto", kv_lora_rank: int | None = None, plan=None, checks: bool = False,
           fail_closed: bool = True, kv_scale: float | None = None):
    """Multi-head Latent Attention decode over a paged cache. Callable inside ``jax.jit``.

    Args:
      query: [B, q_len, H, kv_lora_rank + rope_dim]; the absorbed query (``q_nope @ W_UK`` then
        ``q_pe``).
      kv_cache: [num_pages, page_size, kv_lora_rank + rope_dim], same dtype as ``query``. The first
        ``kv_lora_rank`` channels of a token are both its latent key part and its value. Or the fp8
        cache: uint8 [num_pages, page_size, row_bytes] from ``allocate_cache(..., dtype="fp8")``
        (656 bytes a token for a head dim of 576; docs/fp8-cache.md), taken by the xla backend and
        by sm90. Or the e4m3 cache: float8_e4m3fn [num_pages, page_size, kv_lora_rank + rope_dim]
        whose values are multiplied by ``kv_scale``, taken by xla, fa3 and fa2 (on SM90), and
        trtllm-gen when named (not yet run on hardware; docs/fp8-cache.md, "The e4m3 cache").
      block_tables: int32 [B, max_pages]; entries past a request's pages may hold anything.
      seq_lens: int32 [B], each request's kv length, counting its q_len new tokens. Cached values past
        it may be NaN.
      softmax_scale: a float > 0 (at most ``validation.MAX_SOFTMAX_SCALE``, about 2.36e38) known at
        trace time, the pre-absorption scale, e.g. ``192**-0.5 * mscale**2`` for DeepSeek.
      output_scale: a finite float known at trace time; multiplies the output.
      return_lse: also return the log-sum-exp (natural log) of the scaled logits.
      backend: "auto" or one of ``jax_mla.backends.ALL_BACKENDS``. "auto" takes the first backend
        of ``jax_mla.backends.TABLE`` that runs here and takes the dtype and the cache's format
        (sm90 aside), and with a plan the first that reads that kind of plan (for an
        ``Sm90Plan`` sm90, which raises for shapes it does not run). With ``plan=None``, on
        Hopper each device takes sm90 instead of fa3 where ``jax_mla.backends.prefers_sm90``
        holds for its shard's shape (the README's Backends section tabulates it), and with the
        fp8 cache every device whose shard sm90 runs takes sm90 instead of xla; on Blackwell a
        device whose shard trtllm-gen does not run (dims, page size, head count) takes fa2,
        which then plans on the host. ``backend_for`` names the choice.
      kv_lora_rank: channels of the latent; default ``head_dim - 64``.
      plan: for backends that read a work schedule, built once per step and shared by every
        layer. fa3, fa2: a ``jax_mla.Plan`` from ``jax_mla.plan`` (host) or
        ``jax_mla.device_plan`` (GPU, inside jit); ``"device"`` to build one on the GPU inside
        this call; None to plan inside the call on the host, which reads ``seq_lens`` back (a
        device sync) and cannot be captured in a CUDA graph. sm90: a ``jax_mla.Sm90Plan`` from
        ``jax_mla.sm90_plan`` (GPU, inside jit), for layers under ``lax.scan``; None to build
        the schedule on the GPU inside the call (XLA keeps one per step of unrolled layers).
        Other backends take only None.
      checks: check the values before any backend runs (``jax_mla.value_checks``): page ids that a
        request reads lie in [0, num_pages) (in its pool, for a cache visibly sharded into
        per-shard page pools), q_len <= seq_lens <= max_pages * page_size (and <= 2^22 where fa3
        or fa2 may run the call), and query is finite. Eagerly a failed check raises; inside
        ``jax.jit`` wrap the jitted function in ``jax.experimental.checkify.checkify`` and call
        ``err.throw()`` (docs/bad-values.md).
      fail_closed: give a request whose values are bad (a length outside [q_len, max_pages *
        page_size], a page id it reads outside [0, num_pages), a length other than the plan's)
        out 0 and lse -inf on xla, sm90, fa3 and fa2 (trtllm-gen: not run on hardware); its
        pages outside the cache are never read. For xla, fa3, fa2 and trtllm-gen a guard of XLA
        ops before the kernel gives it nothing to read (``jax_mla.guard``; inside ``jax.jit`` XLA
        computes it once per step for layers unrolled in Python); the sm90 kernel does it itself
        (docs/bad-values.md). False skips it for callers that guarantee their values: fa3, fa2
        and trtllm-gen then read whatever the values point at (sm90 still gives a request whose
        length is not its ``Sm90Plan``'s nothing to read, and leaves out pages outside the
        cache).
      kv_scale: for the e4m3 cache only, and required there: the finite float > 0 its values are
        multiplied by (``write_kv``'s). It is folded into the scales: the logits are scaled by
        ``softmax_scale * kv_scale`` and the output by ``output_scale * kv_scale``.

    With q_len > 1 the mask is bottom-right causal: query token i of a request sees kv positions
    ``[0, seq_len - q_len + i]``.

    Returns:
      out [B, q_len, H, kv_lora_rank] in ``query.dtype`` (as JAX holds it: a NumPy float64 query
      gives float32 unless ``jax_enable_x64`` is on); with ``return_lse`` a tuple
      ``(out, lse)`` with lse float32 [B, q_len, H].
    """
    _, _, _, kv_lora_rank, _, _ = validation.check_decode_args(
        query, kv_cache, block_tables, seq_lens, kv_lora_rank)
    softmax_scale = validation.check_softmax_scale("softmax_scale", softmax_scale)
    output_scale = validation.check_finite_scale("output_scale", output_scale)
    kv_scale = e4m3_cache.check_kv_scale(kv_cache, kv_scale)
    if kv_scale is not None:
        softmax_scale = validation.check_softmax_scale("softmax_scale * kv_scale",
                                                       softmax_scale * kv_scale)
        output_scale = validation.check_finite_scale("output_scale * kv_scale",
                                                     output_scale * kv_scale)
    return_lse, checks, fail_closed = (validation.check_bool(name, flag) for name, flag in (
        ("return_lse", return_lse), ("checks", checks), ("fail_closed", fail_closed)))
    chosen, alternative = choose_backend(backend, plan, query, kv_cache)
    if isinstance(plan, sm90_planning.Sm90Plan):  # it fits every shard alike: check it here
        plan.check_for(seq_lens, block_tables, kv_cache.shape[1])
    if checks:
        value_checks.check_values(query, kv_cache, block_tables, seq_lens,
                                  None if isinstance(plan, str) else plan,
                                  pools=sharding.page_pools(kv_cache),
                                  fa_max_len=_longest_length(*_backends_that_may_run(
                                      chosen, alternative, query, kv_cache, block_tables,
                                      kv_lora_rank)))
    kernel = functools.partial(run_backend, chosen, softmax_scale=softmax_scale,
                               output_scale=output_scale, kv_lora_rank=kv_lora_rank,
                               device_plan=isinstance(plan, str), fail_closed=fail_closed,
                               alternative=alternative)
    # The kernel runs once per device on its shard when the arrays are sharded (jax_mla.sharding).
    schedule = None if isinstance(plan, str) else plan
    out, lse = sharding.call(kernel, query, kv_cache, block_tables, seq_lens, plan=schedule)
    return (out, lse) if return_lse else out


def backend_for(query, kv_cache, block_tables, *, backend: str = "auto",
                kv_lora_rank: int | None = None, plan=None) -> str:
    """The name of the backend ``decode`` runs on each device for these arguments.

    Args:
      query, kv_cache, block_tables: as ``decode`` takes them, or ``jax.ShapeDtypeStruct``s of
        them (JAX's default platform then stands for theirs). Sharded, each array's shard shape is
        the device's problem, as in the layouts of docs/sharding.md where ``decode`` runs the
        arrays as they are sharded; inside ``jax.jit`` a traced array counts with the sharding
        JAX gives it at trace time (none: its whole shape).
      backend, kv_lora_rank, plan: as ``decode`` takes them; of the plan only its kind matters.
    Returns:
      One of ``jax_mla.backends.ALL_BACKENDS``: ``backend`` itself, or what "auto" picks here for
      the shard's shape (on Hopper, sm90 where ``backends.prefers_sm90`` holds and sm90 runs it)
      and the plan's kind.
    Raises what ``decode`` raises at trace time for these arguments: their shapes and dtypes, a
    backend that cannot run here or does not take the cache, a plan it does not read, and the
    shapes the chosen kernel does not run (sm90's and trtllm-gen's limits).
    """
    seq_lens = jax.ShapeDtypeStruct(validation.shape_of("query", query)[:1], jnp.int32)
    _, _, _, kv_lora_rank, _, _ = validation.check_decode_args(
        query, kv_cache, block_tables, seq_lens, kv_lora_rank)
    chosen, alternative = choose_backend(backend, plan, query, kv_cache)
    shard = [one_device(x) for x in (query, kv_cache, block_tables)]
    runs = device_backend(chosen, alternative, *shard, kv_lora_rank=kv_lora_rank)
    runs.check_shapes(*shard, kv_lora_rank)
    return runs.name


def one_device(x) -> jax.ShapeDtypeStruct:
    """The shape and dtype of ``x`` on one device: its shard's where ``x`` has a sharding."""
    sharding = getattr(x, "sharding", None)
    shape = sharding.shard_shape(tuple(x.shape)) if sharding is not None else tuple(x.shape)
    return jax.ShapeDtypeStruct(shape, x.dtype)


def choose_backend(backend: str, plan, query, kv_cache):
    """(the backend ``backend`` resolves to for these arrays, the one each device may take instead
    or None: ``backends.auto_alternative``); the plan checked against the first."""
    platform = backends.platform_of(query, kv_cache)
    cache_format = backends.cache_format_of(kv_cache)
    chosen = backends.BY_NAME[backends.resolve(backend, platform, query.dtype, cache_format,
                                               plan_kind=plan_kind(plan))]
    check_plan_argument(plan, chosen)
    alternative = backends.auto_alternative(backend, chosen, plan, platform, query.dtype,
                                            cache_format)
    return chosen, alternative


def plan_kind(plan) -> str | None:
    """The kind of ``plan`` (``backends.FA_PLAN`` for a ``Plan`` or "device",
    ``backends.SM90_PLAN`` for an ``Sm90Plan``), None for None; TypeError for anything else."""
    if plan is None:
        return None
    if isinstance(plan, planning.Plan) or (isinstance(plan, str) and plan == DEVICE_PLAN):
        return backends.FA_PLAN
    if isinstance(plan, sm90_planning.Sm90Plan):
        return backends.SM90_PLAN
    raise TypeError("plan must be None, 'device' or a jax_mla.Plan from jax_mla.plan(...) or "
                    "jax_mla.device_plan(...), or a jax_mla.Sm90Plan from jax_mla.sm90_plan(...), "
                    f"got {plan!r}")


def check_plan_argument(plan, backend: backends.Backend) -> None:
    """Raise unless ``plan`` is None or a plan (``plan_kind``) that ``backend`` reads."""
    kind = plan_kind(plan)
    if kind is not None and backend.reads_plan != kind:
        takes = "plan=None" + (f" or a {backend.reads_plan}" if backend.reads_plan else "")
        raise ValueError(f"{backends.only_read_by(kind)}; backend {backend.name!r} takes {takes}, "
                         f"got {type(plan).__name__}")


def device_backend(backend: backends.Backend, alternative: backends.Backend | None, query,
                   kv_cache, block_tables, *, kv_lora_rank: int) -> backends.Backend:
    """The backend one device runs on its shard (arrays or shape-dtype structs), with
    ``alternative`` from ``backends.auto_alternative``: sm90 where ``backends.prefers_sm90`` holds
    for the shard's shape and sm90 runs it; another backend where ``backend`` does not run the
    shard's shapes; else ``backend``."""
    if alternative is None:
        return backend
    shard = (query, kv_cache, block_tables, kv_lora_rank)
    if alternative.name != backends.SM90:
        return backend if runs_shapes(backend, *shard) else alternative
    batch, q_len, num_heads, _ = query.shape
    prefers = backends.prefers_sm90(batch, q_len, num_heads, backend.name)
    return alternative if prefers and runs_shapes(alternative, *shard) else backend


def runs_shapes(backend: backends.Backend, query, kv_cache, block_tables, kv_lora_rank) -> bool:
    """Whether ``backend``'s kernel runs one device's shapes (its ``check_shapes`` passes)."""
    try:
        backend.check_shapes(query, kv_cache, block_tables, kv_lora_rank)
    except ValueError:
        return False
    return True


def _backends_that_may_run(chosen: backends.Backend, alternative: backends.Backend | None, query,
                           kv_cache, block_tables, kv_lora_rank: int) -> tuple:
    """The backends the devices may run: the one for the whole arrays where they are not sharded,
    else ``chosen`` and ``alternative`` (each shard chooses by its own shapes)."""
    if jax.device_count() == 1 or not sharding.may_be_sharded(query, kv_cache, block_tables):
        return (device_backend(chosen, alternative, query, kv_cache, block_tables,
                               kv_lora_rank=kv_lora_rank),)
    return chosen, alternative


def _longest_length(*candidates: backends.Backend | None) -> int | None:
    """The longest request any of the backends a device may run takes (None: the table's capacity
    bounds it)."""
    if any(b is not None and b.reads_plan == backends.FA_PLAN for b in candidates):
        return planning.MAX_KV_LEN
    return None


def run_backend(backend: backends.Backend, query, kv_cache, block_tables, seq_lens, *,
                softmax_scale: float, output_scale: float, kv_lora_rank: int, device_plan: bool,
                fail_closed: bool = True, plan: planning.Plan | sm90_planning.Sm90Plan | None = None,
                alternative: backends.Backend | None = None):
    """One device's decode: (out, lse) for its shard of the arrays; ``alternative`` as in
    ``device_backend``."""
    _, q_len, num_heads, _ = query.shape
    backend = device_backend(backend, alternative, query, kv_cache, block_tables,
                             kv_lora_rank=kv_lora_rank)
    if fail_closed and not backend.fails_closed_in_kernel:
        seq_lens, plan = guard.guard(
            block_tables, seq_lens, plan, num_pages=kv_cache.shape[0], page_size=kv_cache.shape[1],
            q_len=q_len,
            max_len=_longest_length(backend))
    if device_plan:
        plan = planning.device_plan(seq_lens, num_heads=num_heads, max_pages=block_tables.shape[1],
                                    q_len=q_len, kv_lora_rank=kv_lora_rank)
    out, lse = backend.decode(query, kv_cache, block_tables, seq_lens, softmax_scale=softmax_scale,
                              output_scale=output_scale, kv_lora_rank=kv_lora_rank, plan=plan,
                              fail_closed=fail_closed)
    if not backend.applies_output_scale and output_scale != 1.0:
        out = (out.astype(jnp.float32) * output_scale).astype(out.dtype)
    return out, lse
