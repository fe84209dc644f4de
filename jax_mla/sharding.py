"""Tensor- and data-parallel MLA decode: every backend runs per device on its own shard.

``jax_mla.decode`` routes its backend call through :func:`call`, which wraps the per-shard kernel in
a ``jax.experimental.custom_partitioning`` op. Under ``jax.jit`` over a multi-device mesh the SPMD
partitioner then runs the kernel once per device on that device's shard (no all-gather of the query
or the cache), with rules for both partitioners: Shardy through an einsum-style ``sharding_rule``
and GSPMD through ``infer_sharding_from_operands``; ``partition`` chooses the final shardings in
both cases. Single-device calls and calls under ``jvp`` run the kernel directly; under ``vmap`` with
several devices the wrapped call runs once per mapped index.

Layouts (``d``: data axes, ``t``: head axes)::

    query   P(d, None, t, None)     kv_cache  P(None, None, None)     global page ids
    query   P(d, None, t, None)     kv_cache  P(d,    None, None)     per-shard page pools
    out     P(d, None, t, None)     lse       P(d, None, t)
    block_tables P(d, None)         seq_lens  P(d)

docs/sharding.md describes the layouts, plans under sharding, and where layout errors surface
(``LayoutError``, wrapped in a ``JaxRuntimeError`` while the program compiles).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental.custom_partitioning import SdyShardingRule, custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from jax_mla import validation
from jax_mla.planning import PlanMismatchError

__all__ = ["LayoutError", "call", "explicit_mesh_axes", "may_be_sharded", "spec_of",
           "with_auto_axes"]

Kernel = Callable[..., Any]


class LayoutError(ValueError):
    """A sharding layout that decode cannot run per device."""

    def __init__(self, message: str):
        super().__init__(f"jax_mla sharding: {message}")


def _is_jit_tracer(x) -> bool:
    """Whether ``x`` is being traced by jit itself (not by vmap, grad, ... inside it)."""
    try:
        from jax._src.interpreters.partial_eval import DynamicJaxprTracer
    except ImportError:  # a JAX that moved it: treat every tracer as a jit tracer
        return True
    return isinstance(x, DynamicJaxprTracer)


def may_be_sharded(*arrays) -> bool:
    """Whether any of ``arrays`` may be sharded over several devices."""
    for array in arrays:
        if isinstance(array, jax.core.Tracer):
            return True
        sharding = getattr(array, "sharding", None)
        if sharding is not None and len(sharding.device_set) > 1:
            return True
    return False


def call(kernel: Kernel, query, kv_cache, block_tables, seq_lens, *, plan=None):
    """Run ``kernel`` on every device's shard of the decode arrays (see the module docstring).

    Args:
      kernel: ``kernel(query, kv_cache, block_tables, seq_lens)`` -- or, when ``plan`` is not None,
        ``kernel(query, kv_cache, block_tables, seq_lens, plan=plan)`` -- returning ``out`` or
        ``(out, lse)`` (of the same types with and without a plan; for the global shapes a
        kernel that takes a plan may raise ``PlanMismatchError``, and any kernel
        ``validation.ShardLimitError``: the call then needs partitioning), with static
        parameters closed over (prefer ``functools.partial``: eager calls on multi-device arrays
        are then compiled once per distinct partial, not once per call). It is called with
        per-device shards and must take every size from its arguments.
      query, kv_cache, block_tables, seq_lens: the (validated) decode arrays.
      plan: None or a pytree; its array leaves are passed to every device replicated, its other
        leaves are static.

    Returns:
      What ``kernel`` returns: out [B, q_len, H, R] (and lse [B, q_len, H]) sharded over the batch
      and heads like the query.

    Single-device calls (one device in the process, or concrete arrays on one device) call
    ``kernel`` directly, with no wrapper at all. custom_partitioning has no rules for ``vmap`` and
    ``jvp``: under ``vmap`` the wrapped call runs once per mapped index (``lax.map``); under
    ``jvp`` (with or without ``vmap``) ``kernel`` is called directly, and a cache visibly sharded
    into page pools raises ``LayoutError``. On a mesh of Explicit axes neither transformation is
    supported.
    """
    arrays = (query, kv_cache, block_tables, seq_lens)
    leaves, treedef = jax.tree_util.tree_flatten(plan)
    is_array = tuple(isinstance(leaf, (jax.Array, np.ndarray)) for leaf in leaves)
    plan_arrays = tuple(leaf for leaf, a in zip(leaves, is_array) if a)
    operands = arrays + plan_arrays
    statics = tuple(None if a else leaf for leaf, a in zip(leaves, is_array))
    explicit = explicit_mesh_axes(*operands)
    if explicit is not None:
        # A mesh of Explicit axes (jax.make_mesh's default): the partitioned call below traces
        # its per-shard program on the global types, which Explicit axes would make carry shardings
        # (a gather of sharded page ids then has no resolvable output sharding). So it runs with
        # those axes made Auto (the plan's arrays too), its outputs sharded like the query again.
        batch, _, heads, _ = _dim_axes(_sharding_type(query), 4)
        again = _PerShard(functools.partial(call, kernel), plan is not None, treedef, statics,
                          is_array)
        return with_auto_axes(again, explicit,
                              PartitionSpec(_spec_entry(batch), None, _spec_entry(heads)),
                              *operands)
    tracers = [x for x in operands if isinstance(x, jax.core.Tracer)]
    traced = [_traced(x) for x in operands]
    several = jax.device_count() > 1 and may_be_sharded(*(value for value, *_ in traced))
    jvp, vmap = (any(t[i] for t in traced) for i in (2, 3))
    if several and vmap and not jvp:
        return _mapped(functools.partial(call, kernel), plan is not None, treedef, statics,
                       is_array, operands)
    if not several or not all(_is_jit_tracer(x) for x in tracers):
        if several and page_pools(kv_cache) > 1:
            raise LayoutError(
                "kv_cache is sharded into per-shard page pools, which only jit (and vmap) of decode "
                "can run: under other transformations (jvp) the kernel would read the pools' page "
                "ids as global; replicate the cache and use global page ids there")
        return kernel(*arrays) if plan is None else kernel(*arrays, plan=plan)
    per_shard = _PerShard(kernel, plan is not None, treedef, statics, is_array)
    if tracers:
        return _partitioned(per_shard, *(_pinned(x) for x in operands))
    # Concrete arrays on several devices: compile through the same partitioner as under jit, so
    # the page ids of a sharded pool are read the same way (the custom call's eager impl would
    # run the kernel on the global arrays instead).
    return _eager(per_shard, *operands)


def _traced(x):
    """(value, dim, jvp, vmap): what ``x`` traces under jvp and vmap (the primal or the batched
    value, recursively), the dim of that value that is ``x``'s dim 0, and whether a jvp and a vmap
    are among those transformations."""
    try:
        from jax._src.interpreters.ad import JVPTracer
        from jax._src.interpreters.batching import BatchTracer
    except ImportError:  # a JAX that moved them: seen as no transformation
        return x, 0, False, False
    dim, jvp, vmap = 0, False, False
    while isinstance(x, (JVPTracer, BatchTracer)):
        if isinstance(x, JVPTracer):
            x, jvp = x.primal, True
        else:
            if isinstance(x.batch_dim, int) and x.batch_dim <= dim:
                dim += 1
            x, vmap = x.val, True
    return x, dim, jvp, vmap


def page_pools(kv_cache) -> int:
    """How many per-shard page pools kv_cache is visibly sharded into (docs/sharding.md): 1 where
    its page dim is not sharded, or its sharding is not known at trace time (a jit argument on a
    mesh of Auto axes)."""
    value, page_dim, _, _ = _traced(kv_cache)
    sharding = _sharding_type(value)
    if not isinstance(sharding, NamedSharding):
        return 1
    return _shards(sharding.mesh, _spec_axes(sharding.spec, len(value.shape))[page_dim])


def _mapped(again, has_plan, treedef, statics, is_array, operands):
    """``again`` (``call`` for the same kernel) under ``vmap``, run once per mapped index with
    ``lax.map``: custom_partitioning has no batching rule, and the kernel called directly would
    read a per-shard pool's page ids as global."""
    per_index = _PerShard(again, has_plan, treedef, statics, is_array)
    one = jax.custom_batching.custom_vmap(per_index)

    @one.def_vmap
    def _rule(axis_size, in_batched, *args):
        out = _map_each(per_index, tuple(in_batched), *args)
        return out, jax.tree_util.tree_map(lambda _: True, out)

    return one(*(_pinned(x) for x in operands))


@functools.partial(jax.jit, static_argnums=(0, 1))
def _map_each(per_index, in_batched, *args):
    """``per_index`` over the leading dim of the ``args`` marked in ``in_batched`` (``lax.map``),
    the others passed whole; jitted so that eager vmaps compile once."""
    def each(mapped):
        mapped = iter(mapped)
        return per_index(*(next(mapped) if batched else x for x, batched in zip(args, in_batched)))

    return jax.lax.map(each, [x for x, batched in zip(args, in_batched) if batched])


def _pinned(x):
    """``x``, or for a concrete array on several devices (one a jitted function closed over) the
    array constrained to its sharding: as a plain constant it would reach the partitioner without
    one, so a per-shard page pool would be read as one global pool."""
    sharding = None if isinstance(x, jax.core.Tracer) else getattr(x, "sharding", None)
    if sharding is None or len(sharding.device_set) == 1:
        return x
    return jax.lax.with_sharding_constraint(x, sharding)


def _sharding_type(x):
    """The sharding of ``x``'s type (a tracer's under jit), or of a concrete array; None for NumPy
    arrays and Python values."""
    if isinstance(x, jax.core.Tracer):
        return getattr(jax.typeof(x), "sharding", None)
    return getattr(x, "sharding", None)


def explicit_mesh_axes(*arrays):
    """(mesh, its Explicit axis names) of the first of ``arrays`` sharded over a mesh with Explicit
    axes, or None."""
    for array in arrays:
        sharding = _sharding_type(array)
        mesh = getattr(sharding, "mesh", None)
        axis_types = getattr(mesh, "axis_types", ())
        names = tuple(name for name, kind in zip(getattr(mesh, "axis_names", ()), axis_types)
                      if kind == jax.sharding.AxisType.Explicit)
        if names:
            return mesh, names
    return None


def spec_of(x) -> PartitionSpec:
    """The PartitionSpec of ``x``'s sharding (P() where it has none or is not a NamedSharding)."""
    sharding = _sharding_type(x)
    return sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()


def with_auto_axes(fn, explicit, out_spec: PartitionSpec, *args):
    """``fn(*args)`` traced with ``explicit`` = (mesh, axis names)'s axes Auto, under ``jax.jit``
    (so concrete arrays take the same path; ``fn`` is a static argument, so equal ``fn``s compile
    once), its outputs sharded ``out_spec`` on those axes (its other axes, Auto ones of a mixed
    mesh, are left to propagation)."""
    mesh, names = explicit
    out_spec = PartitionSpec(*(_spec_entry(tuple(a for a in axes if a in names))
                               for axes in _spec_axes(out_spec, len(out_spec))))
    abstract_mesh = getattr(mesh, "abstract_mesh", mesh)
    with jax.sharding.use_abstract_mesh(abstract_mesh):
        return _auto_axes_call(fn, names, out_spec, *args)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _auto_axes_call(fn, names, out_spec, *args):
    return jax.sharding.auto_axes(fn, axes=names, out_sharding=out_spec)(*args)


class _PerShard:
    """The per-device computation: rebuilds the plan from its arrays and statics, calls the kernel.

    A static argument of the custom_partitioning op; equal for equal partials so that ``_eager``'s
    compilation cache hits.
    """

    def __init__(self, kernel, has_plan, treedef, statics, is_array):
        self.kernel = kernel
        self.has_plan = has_plan
        self.treedef = treedef
        self.statics = statics
        self.is_array = is_array
        try:
            key = (_kernel_key(kernel), has_plan, treedef, statics, is_array)
            hash(key)
        except TypeError:
            key = (id(self),)
        self._key = key

    def __eq__(self, other):
        return isinstance(other, _PerShard) and self._key == other._key

    def __hash__(self):
        return hash(self._key)

    def __call__(self, query, kv_cache, block_tables, seq_lens, *plan_arrays):
        if not self.has_plan:
            return self.kernel(query, kv_cache, block_tables, seq_lens)
        arrays = iter(plan_arrays)
        leaves = [next(arrays) if a else s for a, s in zip(self.is_array, self.statics)]
        plan = jax.tree_util.tree_unflatten(self.treedef, leaves)
        return self.kernel(query, kv_cache, block_tables, seq_lens, plan=plan)


def _kernel_key(kernel):
    """A value equal for equal partials (nested ones too: a partial's own hash is its identity)."""
    if isinstance(kernel, functools.partial):
        return (_kernel_key(kernel.func), tuple(_kernel_key(a) for a in kernel.args),
                tuple(sorted((k, _kernel_key(v)) for k, v in kernel.keywords.items())))
    return kernel


@functools.partial(custom_partitioning, static_argnums=(0,))
def _partitioned(per_shard, query, kv_cache, block_tables, seq_lens, *plan_arrays):
    """The computation on global shapes: traced for the output types, and run as is where the
    program turns out to use one device (custom_partitioning then skips ``_partition``)."""
    try:
        return per_shard(query, kv_cache, block_tables, seq_lens, *plan_arrays)
    except (PlanMismatchError, validation.ShardLimitError) as error:
        # What fits each device's shard but not the global shapes (a plan for the local head
        # count, a kernel's limit on the heads, batch or pages): only the output types are
        # needed here, and running this unpartitioned must fail.
        with validation.shard_limits_deferred():
            outputs = jax.eval_shape(per_shard.kernel, query, kv_cache, block_tables, seq_lens)
        leaves, treedef = jax.tree_util.tree_flatten(outputs)
        avals = tuple(jax.core.ShapedArray(leaf.shape, leaf.dtype) for leaf in leaves)
        fits = ("The plan only fits" if isinstance(error, PlanMismatchError)
                else "That limit holds for")
        message = (f"{error}. {fits} the per-device shards, but this call is not partitioned "
                   "over several devices")
        results = _needs_partitioning_p.bind(query, out_avals=avals, message=message,
                                             error=type(error))
        return jax.tree_util.tree_unflatten(treedef, results)


# Stands for a kernel call that is only valid per shard: it has output types, and lowering it
# (which happens only when the call is not partitioned) raises its error with its message.
_needs_partitioning_p = Primitive("jax_mla_needs_partitioning")
_needs_partitioning_p.multiple_results = True
_needs_partitioning_p.def_abstract_eval(lambda *args, out_avals, message, error: out_avals)


def _needs_partitioning_lowering(ctx, *args, out_avals, message, error):
    raise error(message)


mlir.register_lowering(_needs_partitioning_p, _needs_partitioning_lowering)


_eager = jax.jit(_partitioned, static_argnums=0)


# --------------------------------------------------------------------------------------------------
# Layout resolution, shared by the Shardy and GSPMD paths.


def _dim_axes(sharding, ndim: int) -> list[tuple[str, ...]]:
    """Mesh axes of each dim of a NamedSharding, as tuples (empty: replicated)."""
    if not isinstance(sharding, NamedSharding):
        if sharding is None or sharding.is_fully_replicated:
            return [()] * ndim
        raise LayoutError(
            f"cannot read mesh axes from {sharding!r}; give the inputs NamedShardings or call decode "
            "under a mesh (`with jax.set_mesh(mesh):`)")
    return _spec_axes(sharding.spec, ndim)


def _spec_axes(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...]]:
    """Mesh axes of each of ``ndim`` dims under ``spec`` (padded with replicated dims), as tuples."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    axes = []
    for entry in entries[:ndim]:
        if entry is None or entry == PartitionSpec.UNCONSTRAINED:
            axes.append(())
        elif isinstance(entry, str):
            axes.append((entry,))
        else:
            axes.append(tuple(entry))
    return axes


def _shards(mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


def _spec_entry(axes: tuple[str, ...]):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _layout(mesh, arg_shapes, validate=True):
    """(batch_axes, head_axes, pool_sharded) for the operands' shardings, validated."""
    query, kv_cache, block_tables, seq_lens, *plan_arrays = arg_shapes
    batch = query.shape[0]
    num_pages = kv_cache.shape[0]
    pool_axes = _dim_axes(kv_cache.sharding, 3)[0]
    query_axes = _dim_axes(query.sharding, 4)
    if pool_axes:
        batch_axes = pool_axes
        pools = _shards(mesh, pool_axes)
        if validate and (batch % pools or num_pages % pools):
            raise LayoutError(
                f"kv_cache's page dim is sharded over {pool_axes} into {pools} page pools, so the "
                f"batch is split into {pools} shards with one pool each; batch {batch} and num_pages "
                f"{num_pages} must both be divisible by {pools}")
    else:
        batch_axes = query_axes[0]
        if validate and batch_axes and batch % _shards(mesh, batch_axes):
            raise LayoutError(
                f"query's batch dim ({batch}) is sharded over {batch_axes} "
                f"({_shards(mesh, batch_axes)} shards) unevenly; shard the batch evenly")
    head_axes = tuple(a for a in query_axes[2] if a not in batch_axes)
    if validate and plan_arrays and _shards(mesh, batch_axes) > 1:
        raise LayoutError(
            f"a plan cannot be used with a batch sharded over {batch_axes}: its arrays reach every "
            "device whole, while each device's kernel needs the schedule of its own requests; pass "
            "plan=None (each device then schedules its own shard) or shard only the heads")
    return batch_axes, head_axes, bool(pool_axes)


def _shardings(mesh, arg_shapes, result_shape, validate=True):
    """(result shardings, operand shardings) for the resolved layout."""
    batch_axes, head_axes, pooled = _layout(mesh, arg_shapes, validate)
    b, h = _spec_entry(batch_axes), _spec_entry(head_axes)
    named = lambda *spec: NamedSharding(mesh, PartitionSpec(*spec))
    operands = [
        named(b, None, h, None),
        named(b if pooled else None, None, None),
        named(b, None),
        named(b),
    ] + [named() for _ in arg_shapes[4:]]
    if isinstance(result_shape, (tuple, list)):
        results = (named(b, None, h, None), named(b, None, h))[:len(result_shape)]
        results = type(result_shape)(results) if isinstance(result_shape, tuple) else list(results)
    else:
        results = named(b, None, h, None)
    return results, tuple(operands)


def _infer_sharding_from_operands(per_shard, mesh, arg_shapes, result_shape):
    del per_shard
    # An exception raised here aborts the process (XLA CHECK-fails on it): never raise, leave the
    # error to _partition, whose exceptions reach the caller.
    try:
        return _shardings(mesh, arg_shapes, result_shape, validate=False)[0]
    except Exception:  # noqa: BLE001
        replicated = NamedSharding(mesh, PartitionSpec())
        return jax.tree_util.tree_map(lambda _: replicated, result_shape)


def _partition(per_shard, mesh, arg_shapes, result_shape):
    results, operands = _shardings(mesh, arg_shapes, result_shape)
    return mesh, per_shard, results, operands


def _sharding_rule(per_shard, mesh, operand_types, result_types):
    """Shardy rule: batch ``b`` and heads ``h`` pass through, pages ``p`` stay as given.

    The page factor ``p`` is independent of ``b`` here (a rule cannot tie two factors together);
    ``_partition`` puts the batch on the pool's axes when the pool is sharded. Every other factor,
    the plan's dims included, is need-replication.
    """
    del per_shard, mesh
    operands = [("b", "s", "h", "d"), ("p", "t", "d"), ("b", "m"), ("b",)]
    for i, value_type in enumerate(operand_types[4:]):
        operands.append(tuple(f"x{i}_{j}" for j in range(len(value_type.shape))))
    results = [("b", "s", "h", "r"), ("b", "s", "h")][:len(result_types)]
    # Shardy wants special factors listed in order of first appearance.
    order = list(dict.fromkeys(f for mapping in operands + results for f in mapping))
    replicated = tuple(f for f in order if f not in ("b", "h", "p"))
    return SdyShardingRule(operand_mappings=tuple(operands), result_mappings=tuple(results),
                           need_replication_factors=replicated)


_partitioned.def_partition(
    partition=_partition,
    infer_sharding_from_operands=_infer_sharding_from_operands,
    sharding_rule=_sharding_rule,
)
