"""jax_mla.decode on sharded arrays: heads over "tp", batch and page pools over "data".

On CPU these need 4 host devices (conftest.py sets XLA_FLAGS=--xla_force_host_platform_device_count=4
before jax is imported); the multi_gpu test needs two GPUs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (check_accuracy, gpu_blocker, make_problem, record_kernel_runs,
                      relative_error, request_head_error, tolerances)
from jax.experimental import checkify
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
from oracles import attend

import jax_mla
from jax_mla import backends, gpu, guard, sharding, validation, xla_backend
from jax_mla.planning import PlanMismatchError
from jax_mla.reference import reference_from_jax

COLLECTIVES = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
                         r"(-start)?\(")
NUM_HEADS = 8
SCALE = 0.11


def cpu_mesh(shape, axis_type=AxisType.Auto):
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip(f"needs 4 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4), "
                    f"have {len(devices)}")
    return Mesh(np.array(devices[:4]).reshape(shape), ("data", "tp"), axis_types=(axis_type,) * 2)


# Meshes of Auto axes and of Explicit ones (jax.make_mesh's default), which decode and write_kv
# run with their axes made Auto.
AXIS_TYPES = pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit],
                                     ids=["auto", "explicit"])


@contextlib.contextmanager
def partitioner(name):
    """Shardy (JAX's default; sharding_rule) or GSPMD (infer_sharding_from_operands)."""
    shardy = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", name == "shardy")
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", shardy)


PARTITIONERS = pytest.mark.parametrize("partitioner_name", ["shardy", "gspmd"])


def put(mesh, x, *spec):
    return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def decode_fn(backend, **kwargs):
    return jax.jit(lambda q, kv, bt, sl: jax_mla.decode(q, kv, bt, sl, softmax_scale=SCALE,
                                                        return_lse=True, backend=backend, **kwargs))


def collectives(fn, *args) -> list[str]:
    return sorted({m.group(1) for m in COLLECTIVES.finditer(fn.lower(*args).compile().as_text())})


def pooled_problem(num_pools, *, batch_per_pool, seed, dtype=jnp.float32, q_len=2,
                   num_heads=NUM_HEADS, page_size=16):
    """One problem per data shard; the global cache is the concat of the (equal-size) pools.

    Returns (global arrays, per-shard problems); block tables hold ids local to their pool.
    """
    shards = [make_problem(seed + i, batch=batch_per_pool, q_len=q_len, num_heads=num_heads,
                           page_size=page_size, max_len=150, dtype=dtype) for i in range(num_pools)]
    num_pages = max(s.kv_cache.shape[0] for s in shards)
    max_pages = max(s.block_tables.shape[1] for s in shards)
    for s in shards:  # pad every pool (NaN pages) and table (garbage ids) to a common shape
        s.kv_cache = jnp.pad(s.kv_cache, ((0, num_pages - s.kv_cache.shape[0]), (0, 0), (0, 0)),
                             constant_values=np.nan)
        s.block_tables = jnp.pad(s.block_tables, ((0, 0), (0, max_pages - s.block_tables.shape[1])),
                                 constant_values=num_pages + 3)
    arrays = tuple(jnp.concatenate(parts) for parts in zip(*(s.arrays for s in shards)))
    return arrays, shards


def assert_near(actual, expected):
    """float32 agreement up to reordered sums (a shard's matmuls block differently)."""
    assert relative_error(actual, expected) < 5e-6, relative_error(actual, expected)


def batch_and_heads(array):
    spec = tuple(array.sharding.spec) + (None,) * array.ndim
    return spec[0], spec[2]


def check_sharded_output(out, lse, query_spec):
    """out and lse are sharded over the batch and heads exactly like the query."""
    want = (query_spec[0], query_spec[2])
    assert batch_and_heads(out) == want, out.sharding
    assert batch_and_heads(lse) == want, lse.sharding


# Heads over "tp" and batch over "data"; the cache is replicated and page ids are global.
@AXIS_TYPES
@pytest.mark.parametrize("mesh_shape", [(1, 4), (2, 2), (4, 1)], ids=lambda s: "x".join(map(str, s)))
def test_heads_and_batch_sharded(mesh_shape, axis_type):
    mesh = cpu_mesh(mesh_shape, axis_type)
    problem = make_problem(10, batch=4, q_len=2, num_heads=NUM_HEADS, page_size=16, max_len=200)
    data = "data" if mesh_shape[0] > 1 else None
    tp = "tp" if mesh_shape[1] > 1 else None
    spec = (data, None, tp, None)
    args = (put(mesh, problem.query, *spec), put(mesh, problem.kv_cache),
            put(mesh, problem.block_tables, data), put(mesh, problem.seq_lens, data))
    fn = decode_fn("xla")
    out, lse = fn(*args)
    check_sharded_output(out, lse, spec)
    # Per-device kernels, no communication at all (no all-gather of the query or the cache).
    assert collectives(fn, *args) == []

    unsharded_out, unsharded_lse = fn(*problem.arrays)
    assert_near(out, unsharded_out)
    assert_near(lse, unsharded_lse)
    ref_out, ref_lse = reference_from_jax(*problem.arrays, softmax_scale=SCALE)
    check_accuracy(out, lse, ref_out.numpy(), ref_lse.numpy(), backend="xla")


@AXIS_TYPES
def test_eager_calls_on_sharded_arrays_compile_once(axis_type):
    """Equal calls find the compilation of the first (the kernel's partial, the backend in it and
    the per-shard function are static arguments with value equality)."""
    mesh = cpu_mesh((2, 2), axis_type)
    problem = make_problem(16, batch=4, q_len=1, num_heads=NUM_HEADS, page_size=16, max_len=100)
    args = (put(mesh, problem.query, "data", None, "tp"), put(mesh, problem.kv_cache),
            put(mesh, problem.block_tables, "data"), put(mesh, problem.seq_lens, "data"))
    compiled = sharding._auto_axes_call if axis_type == AxisType.Explicit else sharding._eager
    first = jax_mla.decode(*args, softmax_scale=SCALE, backend="xla")
    size = compiled._cache_size()
    for _ in range(2):
        np.testing.assert_array_equal(
            np.asarray(jax_mla.decode(*args, softmax_scale=SCALE, backend="xla")), np.asarray(first))
    assert compiled._cache_size() == size


def test_a_mesh_of_explicit_and_auto_axes():
    """Batch over an Explicit axis, heads over an Auto one: decode (eagerly and under jit) and
    write_kv into a cache sharded over the Auto axis."""
    devices = jax.devices("cpu")
    if len(devices) < 4:
        pytest.skip("needs 4 CPU devices")
    mesh = Mesh(np.array(devices[:4]).reshape(2, 2), ("data", "tp"),
                axis_types=(AxisType.Explicit, AxisType.Auto))
    problem = make_problem(14, batch=4, q_len=1, num_heads=NUM_HEADS, page_size=16, max_len=100)
    args = (put(mesh, problem.query, "data", None, "tp"), put(mesh, problem.kv_cache),
            put(mesh, problem.block_tables, "data"), put(mesh, problem.seq_lens, "data"))
    unsharded_out, _ = decode_fn("xla")(*problem.arrays)
    assert_near(decode_fn("xla")(*args)[0], unsharded_out)
    assert_near(jax_mla.decode(*args, softmax_scale=SCALE, backend="xla"), unsharded_out)
    cache = put(mesh, jax_mla.allocate_cache(8, 16, dtype=jnp.float32), "tp")
    latent, k_rope = jnp.ones((2, 512)), jnp.ones((2, 64))
    slots = jnp.array([0, cache.shape[0] * cache.shape[1] - 1], jnp.int32)
    written = np.asarray(jax_mla.write_kv(cache, latent, k_rope, slots))
    np.testing.assert_array_equal(written[0, 0], 1.0)
    np.testing.assert_array_equal(written[-1, -1], 1.0)


# decode called per device inside shard_map (the caller's own partitioning), with JAX's checks of
# values varying over mesh axes on.
@pytest.mark.parametrize("mesh_shape", [(1, 4), (2, 2)], ids=lambda s: "x".join(map(str, s)))
def test_inside_shard_map(mesh_shape):
    mesh = cpu_mesh(mesh_shape)
    problem = make_problem(12, batch=4, q_len=2, num_heads=NUM_HEADS, page_size=16, max_len=200)
    data = "data" if mesh_shape[0] > 1 else None
    query_spec, row_spec = P(data, None, "tp", None), P(data)
    per_device = jax.shard_map(
        lambda q, kv, bt, sl: jax_mla.decode(q, kv, bt, sl, softmax_scale=SCALE, return_lse=True,
                                             backend="xla"),
        mesh=mesh, in_specs=(query_spec, P(), row_spec, row_spec),
        out_specs=(query_spec, P(data, None, "tp")))
    out, lse = jax.jit(per_device)(*problem.arrays)
    unsharded_out, unsharded_lse = decode_fn("xla")(*problem.arrays)
    assert_near(out, unsharded_out)
    assert_near(lse, unsharded_lse)


# Batch over "data" with a page pool per data shard (ids local to the pool), heads over "tp".
@AXIS_TYPES
@pytest.mark.parametrize("mesh_shape", [(2, 2), (4, 1)], ids=lambda s: "x".join(map(str, s)))
def test_per_shard_page_pools(mesh_shape, axis_type):
    mesh = cpu_mesh(mesh_shape, axis_type)
    pools = mesh_shape[0]
    arrays, shards = pooled_problem(pools, batch_per_pool=4 // pools, seed=20)
    tp = "tp" if mesh_shape[1] > 1 else None
    spec = ("data", None, tp, None)
    args = (put(mesh, arrays[0], *spec), put(mesh, arrays[1], "data"),
            put(mesh, arrays[2], "data"), put(mesh, arrays[3], "data"))
    fn = decode_fn("xla")
    out, lse = fn(*args)
    check_sharded_output(out, lse, spec)
    assert collectives(fn, *args) == []

    per_shard = [fn(*s.arrays) for s in shards]  # each pool unsharded, ids global to it
    assert_near(out, np.concatenate([o for o, _ in per_shard]))
    assert_near(lse, np.concatenate([l for _, l in per_shard]))
    ref_out = np.concatenate([reference_from_jax(*s.arrays, softmax_scale=SCALE)[0].numpy()
                              for s in shards])
    assert request_head_error(out, ref_out) < tolerances("xla", jnp.float32)[0]
    if pools == 2:
        # Eager calls on sharded arrays go through the same partitioner (same page-id meaning).
        eager_out = jax_mla.decode(*args, softmax_scale=SCALE, backend="xla")
        np.testing.assert_array_equal(np.asarray(eager_out), np.asarray(out))


def pooled_args(mesh, arrays):
    """The pooled problem's arrays on ``mesh``: batch, tables, lengths and the cache's pages over
    "data", heads replicated."""
    return (put(mesh, arrays[0], "data"), put(mesh, arrays[1], "data"),
            put(mesh, arrays[2], "data"), put(mesh, arrays[3], "data"))


def test_per_shard_page_pools_closed_over_by_jit():
    """A pooled cache a jitted step closes over (a model's state) keeps its pools: as a plain
    constant it would reach the partitioner unsharded, its ids read as global."""
    mesh = cpu_mesh((2, 2))
    arrays, _ = pooled_problem(2, batch_per_pool=2, seed=21)
    query, cache, tables, lengths = pooled_args(mesh, arrays)
    expected = decode_fn("xla")(query, cache, tables, lengths)
    closed = jax.jit(lambda q: jax_mla.decode(q, cache, tables, lengths, softmax_scale=SCALE,
                                              return_lse=True, backend="xla"))(query)
    for got, want in zip(closed, expected):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("jitted", [True, False], ids=["jit-vmap", "vmap"])
def test_vmap_over_layers_of_per_shard_page_pools(jitted):
    """vmap over stacked layers runs each layer through the wrapper (lax.map), so each layer's
    pools are read as pools; layer 1 of 2 holds other values."""
    mesh = cpu_mesh((2, 2))
    arrays, _ = pooled_problem(2, batch_per_pool=2, seed=22)
    layers = [pooled_args(mesh, arrays), pooled_args(mesh, (arrays[0] * -0.5, arrays[1] * 2,
                                                            *arrays[2:]))]
    expected = [decode_fn("xla")(*layer) for layer in layers]
    stacked = [put(mesh, jnp.stack([layer[i] for layer in layers]), None, "data") for i in (0, 1)]
    step = jax.vmap(lambda q, kv: jax_mla.decode(q, kv, *layers[0][2:], softmax_scale=SCALE,
                                                 return_lse=True, backend="xla"))
    out, lse = (jax.jit(step) if jitted else step)(*stacked)
    for layer, (want_out, want_lse) in enumerate(expected):
        assert_near(out[layer], want_out)
        assert_near(lse[layer], want_lse)


def test_vmap_of_jvp_with_several_devices():
    """vmap's per-index wrapper cannot be differentiated, so under jvp the kernel is called
    directly, as with one device."""
    problem = make_problem(25, batch=2, q_len=1, num_heads=NUM_HEADS, page_size=16, max_len=60)
    query, cache, tables, lengths = problem.arrays
    decode = lambda q, kv: jax_mla.decode(q, kv, tables, lengths, softmax_scale=SCALE, backend="xla")
    tangent = jax.jvp(lambda q: decode(q, cache), (query,), (query,))[1]
    stepped = jax.jit(jax.vmap(lambda q, kv: jax.jvp(lambda a: decode(a, kv), (q,), (q,))))
    out, out_tangent = stepped(jnp.stack([query, query]), jnp.stack([cache, cache]))
    assert_near(out[1], decode(query, cache))
    assert_near(out_tangent[1], tangent)


def test_eager_vmap_on_sharded_arrays_compiles_once():
    mesh = cpu_mesh((2, 2))
    arrays, _ = pooled_problem(2, batch_per_pool=2, seed=26)
    stacked = [put(mesh, jnp.stack([x, x]), None, "data") for x in arrays[:2]]
    step = jax.vmap(lambda q, kv: jax_mla.decode(q, kv, *pooled_args(mesh, arrays)[2:],
                                                 softmax_scale=SCALE, backend="xla"))
    first = step(*stacked)
    size = sharding._map_each._cache_size()
    np.testing.assert_array_equal(np.asarray(step(*stacked)), np.asarray(first))
    assert sharding._map_each._cache_size() == size


def test_jvp_refuses_per_shard_page_pools():
    """jvp cannot go through the wrapper, and the kernel alone would read the pools' ids as global."""
    mesh = cpu_mesh((2, 2))
    arrays, _ = pooled_problem(2, batch_per_pool=2, seed=23)
    query, cache, tables, lengths = pooled_args(mesh, arrays)
    decode = lambda q: jax_mla.decode(q, cache, tables, lengths, softmax_scale=SCALE, backend="xla")
    with pytest.raises(sharding.LayoutError, match="per-shard page pools, which only jit"):
        jax.jvp(decode, (query,), (jnp.ones_like(query),))


def test_checks_bound_page_ids_by_their_pool():
    """checks=True reads a pooled cache's ids against the pool's pages (eagerly, and where a jitted
    step closes over the cache); an id of another pool is named."""
    mesh = cpu_mesh((2, 2))
    arrays, _ = pooled_problem(2, batch_per_pool=2, seed=24)
    query, cache, tables, lengths = pooled_args(mesh, arrays)
    pool_pages = cache.shape[0] // 2
    bad = np.array(arrays[2])
    bad[3, 0] = pool_pages  # a page of the cache, not of request 3's pool
    bad = put(mesh, bad, "data")
    message = (rf"block_tables\[3, 0\] = {pool_pages} is not a page of its pool \(ids are in "
               rf"\[0, {pool_pages}\): kv_cache's {cache.shape[0]} pages are sharded into 2 pools\)")
    step = lambda t: jax_mla.decode(query, cache, t, lengths, softmax_scale=SCALE, checks=True)
    with pytest.raises(checkify.JaxRuntimeError, match=message):
        step(bad)
    assert checkify.checkify(jax.jit(step))(tables)[0].get() is None
    with pytest.raises(checkify.JaxRuntimeError, match=message):
        checkify.checkify(jax.jit(step))(bad)[0].throw()


@AXIS_TYPES
def test_write_kv_into_per_shard_pools_addresses_the_whole_cache(axis_type):
    """Tokens written with write_kv into a pooled cache, a pool's page q at slot
    (pool * pages_per_pool + q) * page_size + offset (docs/sharding.md), are what that pool's
    requests read through their pool-local block tables."""
    mesh = cpu_mesh((2, 2), axis_type)
    pools, pages_per_pool, page_size, max_pages = 2, 6, 16, 3
    rng = np.random.default_rng(40)
    lengths = np.array([40, 7, 33, 48], np.int32)  # requests 0-1 in pool 0, 2-3 in pool 1
    tables = np.concatenate([rng.permutation(pages_per_pool).reshape(2, max_pages)
                             for _ in range(pools)]).astype(np.int32)  # a pool's own pages
    request = np.repeat(np.arange(4), lengths)
    position = np.concatenate([np.arange(n) for n in lengths])
    pool = request // 2
    slots = (pool * pages_per_pool + tables[request, position // page_size]) * page_size \
        + position % page_size
    latent = jnp.asarray(rng.standard_normal((len(slots), 512)), jnp.float32)
    k_rope = jnp.asarray(rng.standard_normal((len(slots), 64)), jnp.float32)
    pooled = NamedSharding(mesh, P("data", None, None))
    cache = jax_mla.allocate_cache(pools * pages_per_pool, page_size, dtype=jnp.float32,
                                   device=pooled)
    cache = jax.jit(jax_mla.write_kv, donate_argnums=0)(cache, latent, k_rope,
                                                        jnp.asarray(slots, jnp.int32))
    assert cache.sharding.is_equivalent_to(pooled, cache.ndim)
    query = jnp.asarray(rng.standard_normal((4, 1, NUM_HEADS, 576)), jnp.float32)
    args = (put(mesh, query, "data", None, "tp", None), cache,
            put(mesh, jnp.asarray(tables), "data"), put(mesh, jnp.asarray(lengths), "data"))
    out = np.asarray(decode_fn("xla")(*args)[0])
    rows = np.concatenate([np.asarray(latent), np.asarray(k_rope)], axis=-1)
    for r in range(4):
        keys = rows[request == r]  # the request's tokens in order
        ref, _ = attend(np.asarray(query[r, 0], np.float64), keys, keys[:, :512], SCALE)
        np.testing.assert_allclose(out[r, 0], ref, rtol=2e-4, atol=2e-5)


def test_gspmd_partitioner():
    """The infer_sharding_from_operands/partition path (Shardy off) gives the same layouts."""
    mesh = cpu_mesh((2, 2))
    arrays, shards = pooled_problem(2, batch_per_pool=2, seed=30)
    spec = ("data", None, "tp", None)
    args = (put(mesh, arrays[0], *spec), put(mesh, arrays[1], "data"),
            put(mesh, arrays[2], "data"), put(mesh, arrays[3], "data"))
    with partitioner("gspmd"):
        fn = decode_fn("xla")
        out, lse = fn(*args)
        assert collectives(fn, *args) == []
    check_sharded_output(out, lse, spec)
    expected = np.concatenate([np.asarray(decode_fn("xla")(*s.arrays)[0]) for s in shards])
    assert_near(out, expected)


def test_other_dims_are_gathered():
    """Shardings of q_len / D / page_size are undone by the partitioner: correct, with a gather."""
    mesh = cpu_mesh((2, 2))
    problem = make_problem(40, batch=2, q_len=2, num_heads=NUM_HEADS, page_size=16, max_len=100)
    args = (put(mesh, problem.query, None, "data", "tp", None),
            put(mesh, problem.kv_cache, None, "data", None), put(mesh, problem.block_tables),
            put(mesh, problem.seq_lens))
    fn = decode_fn("xla")
    out, _ = fn(*args)
    assert batch_and_heads(out) == (None, "tp")
    assert "all-gather" in collectives(fn, *args)
    expected, _ = fn(*problem.arrays)
    assert_near(out, expected)


def plan_kernel(query, kv_cache, block_tables, seq_lens, plan):
    """A stand-in backend that takes a plan: xla decode, offset by the plan's (replicated) data."""
    out = jax_mla.decode(query, kv_cache, block_tables, seq_lens, softmax_scale=SCALE, backend="xla")
    return out + plan["workspace"][0].astype(out.dtype) * plan["scale"]


@AXIS_TYPES
def test_plan_is_replicated_with_heads_sharded(axis_type):
    mesh = cpu_mesh((1, 4), axis_type)
    problem = make_problem(50, batch=2, q_len=1, num_heads=NUM_HEADS, page_size=16, max_len=100)
    plan = {"workspace": put(mesh, jnp.full((128,), 3, jnp.uint8)), "scale": 0.5}
    args = (put(mesh, problem.query, None, None, "tp"), put(mesh, problem.kv_cache),
            put(mesh, problem.block_tables), put(mesh, problem.seq_lens))
    fn = jax.jit(lambda *a: sharding.call(plan_kernel, *a, plan=plan))
    out = fn(*args)
    assert batch_and_heads(out) == (None, "tp")
    assert collectives(fn, *args) == []
    np.testing.assert_array_equal(  # eagerly too
        np.asarray(sharding.call(plan_kernel, *args, plan=plan)), np.asarray(out))
    expected = plan_kernel(*problem.arrays, plan={"workspace": jnp.full((128,), 3, jnp.uint8),
                                                  "scale": 0.5})
    assert_near(out, expected)


def guarded_plan_kernel(query, kv_cache, block_tables, seq_lens, plan):
    """A stand-in fa3 backend: decode's guard with a real ``Plan``, then the xla backend on the
    guarded lengths, offset by a checksum of the guarded plan's kv_end entries."""
    lengths, guarded = guard.guard(block_tables, seq_lens, plan, num_pages=kv_cache.shape[0],
                                   page_size=kv_cache.shape[1], q_len=query.shape[1])
    out = jax_mla.decode(query, kv_cache, block_tables, lengths, softmax_scale=SCALE, backend="xla",
                         fail_closed=False)
    words = jax.lax.bitcast_convert_type(guarded.int_workspace.reshape(-1, 4), jnp.int32)
    start = guarded.layout.entry("kv_end") // 4
    checksum = words[start:start + 2 * plan.batch].sum()
    return out + checksum.astype(out.dtype) * 1e-3


def test_a_guarded_plan_under_head_sharding():
    """A real Plan (two arrays) replicated over the head shards: each device guards it with its
    shard's arrays, and the result is the unsharded call's; the request whose length is not the
    plan's gets nothing."""
    from test_bad_values import synthetic_plan

    mesh = cpu_mesh((1, 4))
    problem = make_problem(52, batch=4, q_len=1, num_heads=NUM_HEADS, page_size=16, max_len=100)
    max_pages = problem.block_tables.shape[1]
    plan, _, _ = synthetic_plan(batch=4, max_pages=max_pages)
    plan = dataclasses.replace(plan, seq_lens=problem.seq_lens.at[1].add(1))
    args = (put(mesh, problem.query, None, None, "tp"), put(mesh, problem.kv_cache),
            put(mesh, problem.block_tables), put(mesh, problem.seq_lens))
    replicated = jax.device_put(plan, NamedSharding(mesh, P()))
    out = jax.jit(lambda *a: sharding.call(guarded_plan_kernel, *a, plan=replicated))(*args)
    expected = guarded_plan_kernel(*problem.arrays, plan=plan)
    assert batch_and_heads(out) == (None, "tp")
    assert_near(out, expected)
    offset = np.asarray(expected[1])  # request 1 read nothing: only the checksum's offset is left
    assert np.all(offset == offset.reshape(-1)[0]) and offset.reshape(-1)[0] != 0


def local_heads_kernel(query, kv_cache, block_tables, seq_lens, plan=None):
    """Like the fa backends: rejects a plan whose head count is not the call's (local) one."""
    if plan is None:
        return jax_mla.decode(query, kv_cache, block_tables, seq_lens, softmax_scale=SCALE,
                              backend="xla")
    if plan["num_heads"] != query.shape[2]:
        raise PlanMismatchError(f"plan was built for {plan['num_heads']} heads, got {query.shape[2]}")
    return plan_kernel(query, kv_cache, block_tables, seq_lens, plan)


@PARTITIONERS
def test_plan_for_the_local_head_count(partitioner_name):
    """A plan built for the per-device heads runs under head sharding (the global-shape trace must
    not reject it); the same plan in a call that is not partitioned raises while compiling."""
    mesh = cpu_mesh((1, 4))
    problem = make_problem(53, batch=2, q_len=1, num_heads=NUM_HEADS, page_size=16, max_len=100)
    plan = {"workspace": jnp.full((128,), 3, jnp.uint8), "scale": 0.5, "num_heads": NUM_HEADS // 4}
    args = (put(mesh, problem.query, None, None, "tp"), put(mesh, problem.kv_cache),
            put(mesh, problem.block_tables), put(mesh, problem.seq_lens))
    with_plan = lambda p: jax.jit(lambda *a: sharding.call(local_heads_kernel, *a, plan=p))  # noqa: E731
    with partitioner(partitioner_name):
        out = with_plan({**plan, "workspace": put(mesh, plan["workspace"])})(*args)
        assert batch_and_heads(out) == (None, "tp")
        assert_near(out, plan_kernel(*problem.arrays, plan=plan))
        one_device = jax.device_put(problem.arrays, jax.devices("cpu")[0])
        with pytest.raises(PlanMismatchError, match=r"built for 2 heads, got 8\. The plan only fits "
                                                    r"the per-device shards"):
            with_plan(plan)(*one_device)


@PARTITIONERS
def test_a_kernel_limit_on_the_heads_holds_per_device(monkeypatch, partitioner_name):
    """sm90 runs at most 128 heads a device: 256 heads over 4 devices run (64 a shard), though the
    trace on the global shapes sees 256; the same call on one device raises the limit. sm90's
    kernel is a stand-in here that runs its real shape checks, then the xla backend."""
    def stand_in(query, kv_cache, block_tables, seq_lens, *, softmax_scale, output_scale,
                 kv_lora_rank, plan, fail_closed):
        gpu.check_sm90_shapes(query, kv_cache, block_tables, kv_lora_rank, softmax_scale)
        checked.append(query.shape[2])
        return xla_backend.decode(query, kv_cache, block_tables, seq_lens,
                                  softmax_scale=softmax_scale, output_scale=output_scale,
                                  kv_lora_rank=kv_lora_rank, return_lse=True)

    checked = []
    monkeypatch.setattr(gpu, "sm90_decode", stand_in)
    monkeypatch.setattr(gpu, "runtime_missing", lambda: None)
    monkeypatch.setattr(gpu, "sm90_missing", lambda: None)
    monkeypatch.setattr(backends, "available_backends", lambda platform=None: ["sm90", "xla"])
    mesh = cpu_mesh((1, 4))
    problem = make_problem(54, batch=2, q_len=1, num_heads=256, page_size=64, max_len=100,
                           dtype=jnp.bfloat16)
    args = (put(mesh, problem.query, None, None, "tp"), put(mesh, problem.kv_cache),
            put(mesh, problem.block_tables), put(mesh, problem.seq_lens))
    sm90 = jax.jit(lambda *a: jax_mla.decode(*a, softmax_scale=SCALE, backend="sm90"))
    with partitioner(partitioner_name):
        out = sm90(*args)
        assert batch_and_heads(out) == (None, "tp")
        # The global trace raised, its trace for the output types deferred the limit, and the
        # shard's trace kept it.
        assert checked == [256, 64]
        assert_near(out, decode_fn("xla")(*problem.arrays)[0])
        one_device = jax.device_put(problem.arrays, jax.devices("cpu")[0])
        with pytest.raises(validation.ShardLimitError,
                           match=r"sm90 supports query num_heads \(dim 2\) in \[1, 128\], got 256\. "
                                 r"That limit holds for the per-device shards, but this call is "
                                 r"not partitioned over several devices"):
            sm90(*one_device)


@PARTITIONERS
def test_plan_with_sharded_batch_raises(partitioner_name):
    mesh = cpu_mesh((2, 2))
    problem = make_problem(51, batch=2, q_len=1, num_heads=NUM_HEADS, page_size=16, max_len=100)
    plan = {"workspace": jnp.zeros((128,), jnp.uint8), "scale": 0.5}
    args = (put(mesh, problem.query, "data", None, "tp"), put(mesh, problem.kv_cache),
            put(mesh, problem.block_tables, "data"), put(mesh, problem.seq_lens, "data"))
    fn = jax.jit(lambda *a: sharding.call(plan_kernel, *a, plan=plan))
    with partitioner(partitioner_name), pytest.raises(
            jax.errors.JaxRuntimeError, match=r"jax_mla sharding: a plan cannot be used with a batch"):
        fn.lower(*args).compile()


@PARTITIONERS
def test_uneven_page_pools_raise(partitioner_name):
    mesh = cpu_mesh((2, 2))
    problem = make_problem(52, batch=3, q_len=1, num_heads=NUM_HEADS, page_size=16, max_len=100,
                           spare_pages=3)
    kv_cache = problem.kv_cache
    if kv_cache.shape[0] % 2:
        kv_cache = jnp.concatenate([kv_cache, kv_cache[:1]])
    args = (put(mesh, problem.query), put(mesh, kv_cache, "data"), put(mesh, problem.block_tables),
            put(mesh, problem.seq_lens))
    with partitioner(partitioner_name), pytest.raises(
            jax.errors.JaxRuntimeError, match=r"jax_mla sharding: .*batch 3 .* must both be divisible by 2"):
        decode_fn("xla").lower(*args).compile()


@PARTITIONERS
def test_an_uneven_batch_raises(partitioner_name):
    """3 requests over 2 data shards: JAX refuses such an input sharding, but a constraint inside
    the program can ask for it."""
    mesh = cpu_mesh((2, 2))
    problem = make_problem(54, batch=3, q_len=1, num_heads=NUM_HEADS, page_size=16, max_len=100)

    def step(query, *rest):
        query = jax.lax.with_sharding_constraint(query, NamedSharding(mesh, P("data")))
        return jax_mla.decode(query, *rest, softmax_scale=SCALE, backend="xla")

    with partitioner(partitioner_name), pytest.raises(
            jax.errors.JaxRuntimeError, match=r"jax_mla sharding: query's batch dim \(3\) is sharded "
                                              r"over \('data',\) \(2 shards\) unevenly"):
        jax.jit(step).lower(*problem.arrays).compile()


@PARTITIONERS
def test_a_sharding_without_mesh_axes_raises(partitioner_name):
    """An input whose sharding is not a NamedSharding (here a GSPMDSharding) has no axis names to
    give the batch and heads."""
    from jax._src.sharding_impls import GSPMDSharding

    mesh = cpu_mesh((2, 2))
    problem = make_problem(55, batch=2, q_len=1, num_heads=NUM_HEADS, page_size=16, max_len=100)
    heads = NamedSharding(mesh, P(None, None, "tp"))
    query = jax.device_put(problem.query, GSPMDSharding(tuple(mesh.devices.flat),
                                                        heads._to_xla_hlo_sharding(4)))
    assert not isinstance(query.sharding, NamedSharding)
    with partitioner(partitioner_name), pytest.raises(
            jax.errors.JaxRuntimeError, match=r"jax_mla sharding: cannot read mesh axes from .*; give "
                                              r"the inputs NamedShardings"):
        decode_fn("xla")(query, *problem.arrays[1:])


def test_unsharded_calls_skip_the_wrapper():
    """Single-device arrays call the backend directly, eagerly; jit(vmap) of them gives the
    unsharded call's result."""
    problem = make_problem(60, batch=2, q_len=1, num_heads=NUM_HEADS, page_size=16, max_len=60)
    seen = []
    kernel = lambda *a: seen.append(type(a[0]).__name__) or a[0][..., :512]
    sharding.call(kernel, *problem.arrays)
    assert seen == ["ArrayImpl"]
    batched = jnp.stack([problem.query, problem.query])
    out = jax.jit(jax.vmap(lambda q: jax_mla.decode(q, *problem.arrays[1:], softmax_scale=SCALE,
                                                    backend="xla")))(batched)
    expected = jax_mla.decode(*problem.arrays, softmax_scale=SCALE, backend="xla")
    assert_near(out[1], expected)


def test_backend_for_names_what_each_shard_runs(monkeypatch):
    """With heads split over 2 devices "auto" chooses on the shard: 7 requests of 128 heads keep
    fa3 on one device, but each device's 64 heads take sm90 (stand-in kernels record which ran),
    and backend_for, given the sharded arrays, names it."""
    ran = record_kernel_runs(monkeypatch, ("fa3", "sm90"))
    mesh = cpu_mesh((2, 2))  # the query's batch is not split over "data"
    query = put(mesh, jnp.zeros((7, 1, 128, 576), jnp.bfloat16), None, None, "tp", None)
    cache = put(mesh, jnp.zeros((4, 64, 576), jnp.bfloat16))
    table = put(mesh, jnp.zeros((7, 1), jnp.int32))
    lengths = put(mesh, jnp.full((7,), 10, jnp.int32))
    assert jax_mla.backend_for(query, cache, table) == "sm90"
    unsharded = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (query, cache, table)]
    assert jax_mla.backend_for(*unsharded) == "fa3"
    jax.jit(lambda *a: jax_mla.decode(*a, softmax_scale=SCALE))(query, cache, table, lengths)
    # custom_partitioning first traces the global shapes for the output types, then each shard.
    assert ran == ["fa3", "sm90"]


# ---------------------------------------------------------------------------------------------------


def gpu_count() -> int:
    """CUDA devices JAX runs on here (0 where its default backend is not CUDA)."""
    return sum(device.platform == "gpu" for device in jax.devices())


def gpu_backend_params():
    fa3 = gpu_count() >= 2 and "fa3" in jax_mla.available_backends("gpu")
    why = gpu_blocker(2) or "this GPU does not run fa3"
    marks = [] if fa3 else [pytest.mark.skip(reason=f"fa3: {why}")]
    return [pytest.param("xla", id="xla"), pytest.param("fa3", id="fa3", marks=marks),
            pytest.param("fa3+device-plan", id="fa3-device-plan", marks=marks)]


@pytest.mark.multi_gpu
@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 2, reason=f"needs 2 GPUs, JAX sees {gpu_count()}")
@pytest.mark.parametrize("backend", gpu_backend_params())
@pytest.mark.parametrize("mesh_shape,pooled", [((1, 2), False), ((2, 1), False), ((2, 1), True)],
                         ids=["tp2", "dp2", "dp2-pools"])
def test_two_gpus(backend, mesh_shape, pooled):
    """fa3 per GPU on its shard (with the schedule built on each GPU for "+device-plan")."""
    backend, _, planner = backend.partition("+")
    mesh = Mesh(np.array(jax.devices("gpu")[:2]).reshape(mesh_shape), ("data", "tp"))
    dtype = jnp.bfloat16 if backend != "xla" else jnp.float32
    num_heads = 32  # 16 heads per GPU with tp2, DeepSeek-V3's TP8 slice
    if pooled:
        arrays, shards = pooled_problem(2, batch_per_pool=2, seed=70, dtype=dtype, q_len=1,
                                        num_heads=num_heads, page_size=32)
    else:
        problem = make_problem(71, batch=4, q_len=1, num_heads=num_heads, page_size=32,
                               max_len=500, dtype=dtype)
        arrays, shards = problem.arrays, [problem]
    data = "data" if mesh_shape[0] > 1 else None
    tp = "tp" if mesh_shape[1] > 1 else None
    spec = (data, None, tp, None)
    args = (put(mesh, arrays[0], *spec), put(mesh, arrays[1], "data" if pooled else None),
            put(mesh, arrays[2], data), put(mesh, arrays[3], data))
    fn = decode_fn(backend, **({"plan": "device"} if planner else {}))
    out, lse = fn(*args)
    check_sharded_output(out, lse, spec)
    assert "all-gather" not in collectives(fn, *args)
    single = jax.devices("gpu")[0]
    unsharded = [fn(*jax.device_put(s.arrays, single)) for s in shards]
    expected = np.concatenate([np.asarray(o, np.float32) for o, _ in unsharded])
    assert request_head_error(out, expected) < tolerances(backend, dtype)[0]
    refs = [reference_from_jax(*jax.device_put(s.arrays, single), softmax_scale=SCALE) for s in shards]
    ref_out, ref_lse = (np.concatenate([r[i].cpu().numpy() for r in refs]) for i in (0, 1))
    check_accuracy(out, lse, ref_out, ref_lse, backend=backend)


@pytest.mark.multi_gpu
@pytest.mark.gpu
@pytest.mark.skipif(gpu_count() < 2, reason=f"needs 2 GPUs, JAX sees {gpu_count()}")
def test_an_sm90_plan_on_two_gpus_with_heads_sharded():
    """One Sm90Plan, built in the step and replicated, serves both GPUs' head shards (the schedule
    depends on the lengths, not the heads); the step all-gathers nothing."""
    if "sm90" not in jax_mla.available_backends("gpu"):
        pytest.skip(f"sm90: {gpu_blocker(2) or 'this GPU does not run it'}")
    mesh = Mesh(np.array(jax.devices("gpu")[:2]).reshape(1, 2), ("data", "tp"))
    problem = make_problem(72, batch=4, q_len=1, num_heads=32, page_size=32, max_len=500,
                           dtype=jnp.bfloat16)
    spec = (None, None, "tp", None)
    args = (put(mesh, problem.query, *spec), put(mesh, problem.kv_cache),
            put(mesh, problem.block_tables), put(mesh, problem.seq_lens))

    @jax.jit
    def fn(q, kv, bt, sl):
        plan = jax_mla.sm90_plan(sl, max_pages=bt.shape[1], page_size=kv.shape[1])
        return jax_mla.decode(q, kv, bt, sl, softmax_scale=SCALE, return_lse=True, plan=plan)

    out, lse = fn(*args)
    check_sharded_output(out, lse, spec)
    assert "all-gather" not in collectives(fn, *args)
    ref_out, ref_lse = reference_from_jax(*problem.arrays, softmax_scale=SCALE)
    check_accuracy(out, lse, ref_out.cpu().numpy(), ref_lse.cpu().numpy(), backend="sm90")
