"""Fail closed on bad values: requests whose page ids or lengths are bad read nothing.

``decode`` (``fail_closed=True``, the default) finds, with a few XLA ops over ``block_tables`` and
``seq_lens``, the requests whose values are usable: ``q_len <= seq_len <= max_pages * page_size``
and every block-table entry the request reads is a page of the cache (and, with a ``Plan``, the
length is the one the plan was built from). Every other request reads no token: its length becomes
0 before any backend or planner sees it, and the works a ``Plan`` holds for it are emptied, so its
output is 0 and its lse -inf on every backend. The ops depend only on the step's tables, lengths and
plan, so XLA computes them once per step however many layers call ``decode``
(docs/bad-values.md).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from jax_mla import planning

# Indices into plan_info (planning.schedule_layout) of the per-work arrays the guard reads and
# rewrites.
PLAN_KV_INDPTR, PLAN_KV_LEN, PLAN_KV_START, PLAN_KV_END = 3, 11, 13, 14


def pages_read(block_tables, seq_lens, page_size: int):
    """bool [B, max_pages]: the block-table entries each request reads, those below
    ``ceil(clamp(seq_len, 0, capacity) / page_size)``."""
    max_pages = block_tables.shape[1]
    used = -(-jnp.clip(seq_lens, 0, max_pages * page_size) // page_size)
    return jnp.arange(max_pages)[None, :] < used[:, None]


def usable_requests(block_tables, seq_lens, *, num_pages: int, page_size: int, q_len: int,
                    max_len: int | None = None):
    """bool [B]: the requests whose length lies in [q_len, max_pages * page_size] (and is at most
    ``max_len`` if given) and whose read block-table entries all lie in [0, num_pages).

    Args:
      block_tables: int32 [B, max_pages]; seq_lens: int32 [B].
    """
    capacity = block_tables.shape[1] * page_size
    if max_len is not None:
        capacity = min(capacity, max_len)
    foreign = pages_read(block_tables, seq_lens, page_size) & (
        (block_tables < 0) | (block_tables >= num_pages))
    return (seq_lens >= q_len) & (seq_lens <= capacity) & ~foreign.any(axis=1)


def neutralised_lengths(seq_lens, usable):
    """int32 [B]: ``seq_lens`` with the unusable requests' lengths set to 0 (they read nothing)."""
    return jnp.where(usable, seq_lens, 0)


def guard_plan(plan: planning.Plan, usable) -> planning.Plan:
    """``plan`` with every work of an unusable request emptied (kv range and length 0).

    FlashInfer's fa3/fa2 kernels read the cache only through the plan's works; an empty work writes
    out 0 and lse -inf for its rows (as MLAPlan's own works for a zero length do), and merging
    empty partial results gives the same. A work's request is its ``kv_indptr / max_pages``. The
    per-work arrays kv_len, q_start, kv_start and kv_end lie back to back, so one elementwise pass
    over them rewrites the three of them (q_start is kept).

    Args:
      usable: bool [plan.batch].
    """
    info, works = plan.layout.plan_info, planning.MAX_TOTAL_WORKS
    first = info[PLAN_KV_LEN] // 4
    if [info[i] // 4 - first for i in (PLAN_KV_START, PLAN_KV_END)] != [2 * works, 3 * works]:
        raise ValueError(f"unexpected plan layout {info}: kv_len, q_start, kv_start and kv_end "
                         "are not back to back")
    words = lax.bitcast_convert_type(plan.int_workspace.reshape(-1, 4), jnp.int32)
    region = lax.dynamic_slice(words, (first,), (4 * works,)).reshape(4, works)
    kv_indptr = lax.dynamic_slice(words, (info[PLAN_KV_INDPTR] // 4,), (works,))
    keep = usable[jnp.clip(kv_indptr // plan.max_pages, 0, plan.batch - 1)]  # [works]
    rewritten = jnp.arange(4)[:, None] != 1  # every array but q_start
    region = jnp.where(rewritten & ~keep[None, :], 0, region)
    words = lax.dynamic_update_slice(words, region.reshape(-1), (first,))
    guarded = lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)
    return dataclasses.replace(plan, int_workspace=guarded)


def guard(block_tables, seq_lens, plan, *, num_pages: int, page_size: int, q_len: int,
          max_len: int | None = None):
    """(seq_lens, plan) as the backends should see them: unusable requests neutralised.

    A request is unusable when ``usable_requests`` says so or, with a ``Plan``, when its length
    differs from the one the plan was built from. ``max_len``: the longest length the backend
    takes (``planning.MAX_KV_LEN`` for the fa3/fa2 schedule), if below the table's capacity.
    """
    usable = usable_requests(block_tables, seq_lens, num_pages=num_pages, page_size=page_size,
                             q_len=q_len, max_len=max_len)
    if isinstance(plan, planning.Plan):
        plan.check_arrays()
        plan.check_batch(seq_lens.shape[0], block_tables.shape[1])
        usable = usable & (plan.seq_lens == seq_lens)
        plan = guard_plan(plan, usable)
    return neutralised_lengths(seq_lens, usable), plan

