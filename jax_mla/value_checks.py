"""``decode(..., checks=True)``: device-side checks of the values that shape checks cannot see.

The checks are XLA ops (``jax.experimental.checkify.check``) that run before any backend, so they
work for every backend and on every platform, and with ``checks=False`` nothing of them is traced.
Called eagerly, a failed check raises at once; inside ``jax.jit`` the caller functionalises the
checks with ``checkify.checkify`` and reads the error from its result (docs/bad-values.md)::

    err, out = checkify.checkify(jax.jit(step))(*args)
    err.throw()
"""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import checkify

from jax_mla import guard


def check_values(query, kv_cache, block_tables, seq_lens, plan=None, pools: int = 1,
                 fa_max_len: int | None = None) -> None:
    """Check ``decode``'s values; each failed check names the argument, the request and the value.

    Args:
      query: [B, q_len, H, D], B >= 1; kv_cache: [num_pages, page_size, D]; block_tables: int32
        [B, max_pages]; seq_lens: int32 [B] (already shape-checked; JAX or NumPy arrays); plan:
        None or the ``jax_mla.Plan`` or ``jax_mla.Sm90Plan`` passed to ``decode``, whose lengths
        must be ``seq_lens``; pools: how many per-shard page pools kv_cache holds
        (docs/sharding.md), each request's ids local to its pool of ``num_pages / pools`` pages;
        fa_max_len: None, or ``planning.MAX_KV_LEN`` where fa3 or fa2 may run the call (the
        longest request their schedule takes).
    Raises:
      checkify.JaxRuntimeError (a ValueError) when called eagerly and a check fails. Staged by
      ``jax.jit`` without ``checkify.checkify`` around it, lowering fails with JAX's ValueError
      "Cannot abstractly evaluate a checkify.check which was not functionalized".
    """
    query, block_tables, seq_lens = (jnp.asarray(x) for x in (query, block_tables, seq_lens))
    _check_lengths(seq_lens, query.shape[1], block_tables.shape[1] * kv_cache.shape[1], fa_max_len)
    _check_page_ids(block_tables, seq_lens, kv_cache.shape[0], kv_cache.shape[1], pools)
    _check_finite_query(query)
    if plan is not None:
        plan.check_for(seq_lens, block_tables, kv_cache.shape[1])
        _check_none(plan.seq_lens != seq_lens, seq_lens,
                    "seq_lens[{0}] = {1} but the plan was built for length {2}: build the plan "
                    "from this step's seq_lens", plan.seq_lens)


def _check_lengths(seq_lens, q_len: int, capacity: int, fa_max_len: int | None) -> None:
    _check_none(seq_lens < q_len, seq_lens,
                f"seq_lens[{{0}}] = {{1}} is below q_len = {q_len}: a length counts the request's "
                "new tokens")
    _check_none(seq_lens > capacity, seq_lens,
                f"seq_lens[{{0}}] = {{1}} exceeds the block table's capacity max_pages * page_size "
                f"= {capacity}")
    if fa_max_len is not None and fa_max_len < capacity:
        _check_none(seq_lens > fa_max_len, seq_lens,
                    f"seq_lens[{{0}}] = {{1}} exceeds {fa_max_len}, the longest request fa3 and fa2 "
                    "take (jax_mla.planning.MAX_KV_LEN)")


def _check_page_ids(block_tables, seq_lens, num_pages: int, page_size: int, pools: int) -> None:
    """Only the entries a request reads: those below ceil(seq_len / page_size)."""
    read = guard.pages_read(block_tables, seq_lens, page_size)
    pages = num_pages // pools
    out_of_range = (block_tables < 0) | (block_tables >= pages)
    where, why = ("kv_cache", "") if pools == 1 else (
        "its pool", f": kv_cache's {num_pages} pages are sharded into {pools} pools")
    _check_none(read & out_of_range, block_tables,
                f"block_tables[{{0}}, {{1}}] = {{2}} is not a page of {where} (ids are in "
                f"[0, {pages}){why}) but request {{0}} reads it (page {{1}} of its length)")


def _check_finite_query(query) -> None:
    _check_none(~jnp.isfinite(query), query,
                "query[{0}, {1}, {2}, {3}] = {4} is not finite (request {0}, query token {1}, "
                "head {2}, channel {3})")


def _check_none(bad, values, message: str, *more_values) -> None:
    """``checkify.check`` that no entry of ``bad`` is set; ``message`` is formatted with the first
    bad entry's index (one field per dim of ``bad``) followed by its entry of ``values`` and of
    each of ``more_values``."""
    flat = bad.reshape(-1)
    first = jnp.argmax(flat)
    index = jnp.unravel_index(first, bad.shape)
    entries = [v.reshape(-1)[first] for v in (values, *more_values)]
    checkify.check(~flat[first], message, *index, *entries)
