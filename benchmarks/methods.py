"""The methods a point is timed with (``--backends``), where each applies, what each is estimated
to cost, and the JAX steps they run: N decode calls (layers) per jitted step."""

from __future__ import annotations

import math

from benchmarks.grid import Point
from benchmarks.problem import GIB, KV_LORA_RANK, SOFTMAX_SCALE, Layout, cache_count, naive_temp_bytes, work

METHODS = ("jax_mla", "jax_mla_graph", "jax_mla_noplan", "jax_mla_device_plan", "jax_mla_sm90",
           "jax_mla_sm90_graph", "jax_mla_sm90_fp8", "flashinfer", "flashinfer_fp8", "xla_naive",
           "jax_mla_xla", "jax_mla_step")
# A whole step, and FlashInfer on its fp8 cache (two more JIT builds): when asked.
GPU_DEFAULT_METHODS = tuple(m for m in METHODS if m not in ("jax_mla_step", "flashinfer_fp8"))
DRY_DEFAULT_METHODS = ("jax_mla", "xla_naive", "jax_mla_xla")
GPU_ONLY_METHODS = ("flashinfer", "flashinfer_fp8", "jax_mla_noplan", "jax_mla_device_plan",
                    "jax_mla_sm90", "jax_mla_sm90_graph", "jax_mla_sm90_fp8", "jax_mla_step")
# Methods timed over --layers decode calls per step (the others, slower, over --xla-layers).
JAX_MLA_PLANNED = ("jax_mla", "jax_mla_graph", "jax_mla_noplan", "jax_mla_device_plan",
                   "jax_mla_sm90", "jax_mla_sm90_graph", "jax_mla_sm90_fp8")
# Methods whose GPU busy time per layer is also recorded on a GPU (``<method>_gpu_us``): the wall
# clock of a short step also holds the time the GPU waits for the host between calls, which fa3's
# CUDA-graph replays from torch leave out.
GPU_BUSY_METHODS = ("jax_mla", "jax_mla_sm90", "jax_mla_sm90_fp8")
# Methods whose step is compiled with XLA command buffers forced on (GRAPH_COMPILER_OPTIONS).
GRAPH_METHODS = ("jax_mla_graph", "jax_mla_sm90_graph")
FI_BACKENDS = ("fa3", "fa2")
# XLA command buffers (CUDA graphs) for every run of the step, custom calls included, whatever its
# size; per compile, so one process times the step with and without them.
GRAPH_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL,WHILE,CONDITIONAL",
                          "xla_gpu_graph_min_graph_size": "1"}
# No XLA command buffers: every kernel of the step launched on the stream, so programmatic
# dependent launch overlaps one custom call's last kernel with the next one's first (a custom call
# captured into a command buffer becomes a child graph, whose edges wait for the whole node).
NO_GRAPH_COMPILER_OPTIONS = {"xla_gpu_enable_command_buffer": ""}


def noplan_subset(pt: Point) -> bool:
    """The small sub-grid where jax_mla_noplan is timed (it syncs inside every call)."""
    return pt.B <= 128 and pt.L <= 4096 and pt.page_size == 64 and pt.q_len == 1


def graph_subset(pt: Point) -> bool:
    """Where jax_mla_graph is timed: small batches, where launch overhead is a share of the time."""
    return pt.B <= 32


def method_applies(method: str, pt: Point, args) -> bool:
    if method == "jax_mla_noplan":
        return args.noplan_everywhere or noplan_subset(pt)
    if method in GRAPH_METHODS:
        return graph_subset(pt)
    return True


def estimate_cost_s(layout: Layout, methods: list[str], args) -> float:
    """Estimated seconds to measure a point (to split the grid into pieces, for --time-limit)."""
    floor_s = work(layout, model=args.floor_model)["floor_us"] * 1e-6
    n = max(1, cache_count(layout, args.mem_budget_gib * GIB, args.l2_bytes))
    cost = 3.0 + n * layout.cache_bytes / 20e9  # setup, random fill, reference check
    for m in methods:
        if not method_applies(m, layout.point, args):
            continue
        if m in JAX_MLA_PLANNED:
            cost += 2.0 + min(args.max_method_s, 10 * 2.5 * floor_s * args.layers) + 0.5
        elif m == "flashinfer":
            cost += len(args.fi_backends) * (1.5 + 2 * min(1.0, 15 * 2.5 * floor_s * args.layers))
        elif m == "flashinfer_fp8":  # two scale layouts, each at about three times bf16's time
            cost += 2 * len(args.fi_backends) * (2.0 + min(3.0, 15 * 7.5 * floor_s * args.layers))
        elif m == "xla_naive" and naive_temp_bytes(layout) <= args.naive_mem_gib * GIB:
            cost += 2.0 + min(args.max_method_s, 10 * 15 * floor_s * args.xla_layers)
        elif m == "jax_mla_xla":
            cost += 3.0 + min(args.max_call_s, 10 * 60 * floor_s * args.xla_layers)
        elif m == "jax_mla_step":
            cost += 2 * (6.0 + min(args.max_method_s, 10 * 2.5 * floor_s * args.step_layers))
    return cost


def xla_naive_decode(query, kv_cache, block_tables, seq_lens, *, softmax_scale):
    """MLA decode the way a JAX user writes it today: gather, einsum, masked softmax, einsum."""
    import jax
    import jax.numpy as jnp

    batch, q_len, _, head_dim = query.shape
    kv = kv_cache[block_tables].reshape(batch, -1, head_dim)  # [B, max_pages * page_size, 576]
    logits = jnp.einsum("bshd,btd->bsht", query, kv, preferred_element_type=jnp.float32)
    logits = logits * softmax_scale
    positions = jnp.arange(kv.shape[1])
    visible_end = seq_lens[:, None] - q_len + 1 + jnp.arange(q_len)[None, :]  # [B, q_len]
    mask = positions[None, None, :] < visible_end[:, :, None]
    logits = jnp.where(mask[:, :, None, :], logits, -jnp.inf)
    probs = jax.nn.softmax(logits, axis=-1).astype(query.dtype)
    out = jnp.einsum("bsht,btd->bshd", probs, kv[..., :KV_LORA_RANK],
                     preferred_element_type=jnp.float32)
    return out.astype(query.dtype)


def decode_with_plan(query, cache, tables, lens, plan, *, fail_closed: bool = True):
    """One layer: jax_mla.decode with backend "auto" and the step's plan (``fail_closed=False``:
    without the guard of bad values, to measure what it costs)."""
    import jax_mla

    return jax_mla.decode(query, cache, tables, lens, softmax_scale=SOFTMAX_SCALE, plan=plan,
                          fail_closed=fail_closed)


def layered(decode_one, layers: int, compiler_options: dict | None = None):
    """jit(f)(q, caches, tables, lens, plan) -> one output per layer; layer i reads caches[i]."""
    import jax

    def step(query, caches, tables, lens, plan):
        return tuple(decode_one(query, caches[i], tables, lens, plan) for i in range(layers))

    return jax.jit(step, compiler_options=compiler_options)


def scanned(decode_one, compiler_options: dict | None = None, make_plan=None):
    """jit(f)(q, caches, tables, lens, plan) -> outputs [layers, ...] of a ``lax.scan`` over the
    stacked caches [layers, ...], layer i reading caches[i]; with ``make_plan``, the plan
    ``make_plan(caches, tables, lens)`` is built once, before the scan, in place of ``plan``."""
    import jax

    def step(query, caches, tables, lens, plan):
        if make_plan is not None:
            plan = make_plan(caches, tables, lens)

        def layer(carry, cache):
            return carry, decode_one(query, cache, tables, lens, plan)
        return jax.lax.scan(layer, None, caches)[1]

    return jax.jit(step, compiler_options=compiler_options)


def device_planned(decode_one, layers: int, pt: Point, max_pages: int,
                   compiler_options: dict | None = None):
    """Like ``layered``, but the step builds its schedule on the GPU once and shares it."""
    import jax
    import jax_mla

    def step(query, caches, tables, lens, plan):
        del plan
        device = jax_mla.device_plan(lens, num_heads=pt.H, q_len=pt.q_len, max_pages=max_pages)
        return tuple(decode_one(query, caches[i], tables, lens, device) for i in range(layers))

    return jax.jit(step, compiler_options=compiler_options)


def guards_only(copies: int, num_pages: int, page_size: int, q_len: int):
    """jit(f)(tables, lens, plan) -> ``copies`` independent runs of decode's guard of bad values
    (jax_mla.guard), each on its own copy of the step's tables and lengths so that XLA cannot merge
    them, with the plan when one is given: what the guard adds to a step's GPU work, times copies."""
    import jax

    from jax_mla import guard, planning

    def step(tables, lens, plan):
        outs = []
        for i in range(copies):
            safe, guarded = guard.guard(tables[i], lens[i], plan, num_pages=num_pages,
                                        page_size=page_size, q_len=q_len,
                                        max_len=planning.MAX_KV_LEN)
            outs.append(safe if guarded is None else (safe, guarded.int_workspace))
        return outs

    return jax.jit(step)


def rotation_sets(caches: list, layers: int) -> list[tuple]:
    """Cache tuples for successive calls: call k, layer i reads caches[(k * layers + i) % n]."""
    n = len(caches)
    sets = n // math.gcd(layers, n)
    return [tuple(caches[(k * layers + i) % n] for i in range(layers)) for k in range(sets)]

