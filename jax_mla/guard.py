"""Fail closed on bad values: requests whose page ids or lengths are bad read nothing.

``decode`` (``fail_closed=True``, the default) finds, with a few XLA ops over ``block_tables`` and
``seq_lens``, the requests whose values are usable: ``q_len <= seq_len <= max_pages * page_size``
and every block-table entry the request reads is a page of the cache (and, with a ``Plan``, the
length is the one the plan was built from). Every other request reads no token: its length
becomes 0 before any backend or planner sees it, and the works a ``Plan`` holds for it are
emptied, so its output is 0 and its lse -inf (on xla, fa3 and fa2; trtllm-gen reads nothing for
it, its output for a zero length is not verified on hardware). The ops depend only on the step's
tables, lengths and plan, so under ``jax.jit`` XLA computes them once per step however many
unrolled layers call ``decode`` (docs/bad-values.md). The sm90 kernel applies the same rule
itself (``Backend.fails_closed_in_kernel``), so it needs none of these ops.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from jax_mla import planning


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
    empty partial results gives the same. A work's request is its ``kv_indptr / max_pages``. One
    elementwise pass over the workspace's int32 words writes the result (a single fusion, no copy
    before an update): the kv_len, kv_start and kv_end entries of an emptied work become 0, every
    other word is kept.

    Args:
      plan: a Plan whose arrays passed ``Plan.check_arrays``.
      usable: bool [plan.batch].
    Returns:
      The plan with its int_workspace rewritten (uint8, same size).
    """
    layout, works = plan.layout, planning.MAX_TOTAL_WORKS
    words = lax.bitcast_convert_type(plan.int_workspace.reshape(-1, 4), jnp.int32)  # [N]
    indptr = layout.entry("kv_indptr") // 4
    request = jnp.clip(words[indptr:indptr + works] // plan.max_pages, 0, plan.batch - 1)
    keep_work = usable[request]  # bool [works]
    pieces, end = [], 0
    for start in sorted(layout.entry(field) // 4 for field in ("kv_len", "kv_start", "kv_end")):
        assert start >= end, "plan fields overlap"
        pieces += [jnp.ones(start - end, bool), keep_work]
        end = start + works
    pieces.append(jnp.ones(words.shape[0] - end, bool))
    keep = jnp.concatenate(pieces)  # bool [N]: False on the emptied works' three entries
    guarded = lax.bitcast_convert_type(jnp.where(keep, words, 0), jnp.uint8).reshape(-1)
    return dataclasses.replace(plan, int_workspace=guarded)


def guard(block_tables, seq_lens, plan, *, num_pages: int, page_size: int, q_len: int,
          max_len: int | None = None):
    """(seq_lens, plan) as the backends should see them: unusable requests neutralised.

    A request is unusable when ``usable_requests`` says so or, with a plan, when its length
    differs from the one the plan was built from.

    Args:
      block_tables: int32 [B, max_pages]; seq_lens: int32 [B].
      plan: None, or a ``Plan`` for B requests over a table ``max_pages`` wide
        (``PlanMismatchError`` otherwise).
      num_pages, page_size: the cache's first two dims; q_len: query tokens per request.
      max_len: the longest length the backend takes (``planning.MAX_KV_LEN`` for the fa3/fa2
        schedule), if below the table's capacity.
    Returns:
      int32 [B] lengths, 0 for unusable requests; ``plan`` with their works emptied.
    """
    if plan is not None and not isinstance(plan, planning.Plan):
        raise TypeError(f"the guard takes a jax_mla.Plan or None, got {type(plan).__name__} (the "
                        "sm90 kernel fails closed itself)")
    usable = usable_requests(block_tables, seq_lens, num_pages=num_pages, page_size=page_size,
                             q_len=q_len, max_len=max_len)
    if plan is not None:
        plan.check_for(seq_lens, block_tables, page_size)
        usable = usable & (plan.seq_lens == seq_lens)
        plan = guard_plan(plan, usable)
    return neutralised_lengths(seq_lens, usable), plan

