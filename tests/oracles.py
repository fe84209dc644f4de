"""Oracles that share no code or formula with jax_mla: float64 numpy, kv positions walked one by one.

``per_token_decode`` finds each cached token by its position (page ``table[p // page_size]``, row
``p % page_size``) and gives each query token the kv positions it may see by its own position in
the sequence, so it does not reuse the mask formula of ``jax_mla.xla_backend`` or of the torch
reference in ``jax_mla.reference``.
"""

from __future__ import annotations

import numpy as np


def as_float64(array) -> np.ndarray:
    return np.asarray(array).astype(np.float64)


def request_keys(kv_cache: np.ndarray, table_row, length: int) -> np.ndarray:
    """The rows of a request's first ``length`` tokens, in position order, one lookup per token."""
    page_size = kv_cache.shape[1]
    rows = [kv_cache[int(table_row[p // page_size]), p % page_size] for p in range(length)]
    return np.stack(rows) if rows else np.zeros((0, kv_cache.shape[2]))


def attend(query, keys, values, softmax_scale: float):
    """Softmax attention of query rows [H, D] over keys [n, D]: (out [H, R], lse [H])."""
    logits = query @ keys.T * softmax_scale
    peak = logits.max(axis=-1, keepdims=True)
    weights = np.exp(logits - peak)
    total = weights.sum(axis=-1, keepdims=True)
    return weights @ values / total, (peak + np.log(total))[:, 0]


def per_token_decode(query, kv_cache, block_tables, seq_lens, *, softmax_scale: float,
                     output_scale: float = 1.0, kv_lora_rank: int = 512):
    """MLA decode, one query token at a time.

    Request b's ``q_len`` new tokens are its last ones: new token i sits at kv position
    ``seq_len - q_len + i`` and sees every position up to and including its own.

    Returns (out float64 [B, q_len, H, kv_lora_rank], lse float64 [B, q_len, H]); a token with no
    position to see gets out 0 and lse -inf.
    """
    query, kv_cache = as_float64(query), as_float64(kv_cache)
    tables, lengths = np.asarray(block_tables), np.asarray(seq_lens)
    batch, q_len, num_heads, _ = query.shape
    out = np.zeros((batch, q_len, num_heads, kv_lora_rank))
    lse = np.full((batch, q_len, num_heads), -np.inf)
    for b in range(batch):
        seq_len = int(lengths[b])
        keys = request_keys(kv_cache, tables[b], seq_len)
        for i in range(q_len):
            own_position = seq_len - q_len + i
            seen = keys[:own_position + 1] if own_position >= 0 else keys[:0]
            if len(seen) == 0:
                continue
            row_out, row_lse = attend(query[b, i], seen, seen[:, :kv_lora_rank], softmax_scale)
            out[b, i] = row_out * output_scale
            lse[b, i] = row_lse
    return out, lse
