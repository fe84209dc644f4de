"""DeepSeek's Multi-head Latent Attention block in JAX, decoding through ``jax_mla``.

Follows ``MLA`` in DeepSeek-V3's reference ``inference/model.py``: the q-LoRA query path (or a plain
``wq``), the ``wkv_a`` latent + RoPE key, RMSNorm on the latent, interleaved-pair RoPE with YaRN, and
the ``mscale``-corrected softmax scale. Two formulations of the same attention:

* non-absorbed ("naive"): every head gets ``k = [wkv_b(c_kv)_nope, k_pe]`` and ``v = wkv_b(c_kv)_v``.
  Used for prefill and as the decode check's reference.
* absorbed: ``q_nope @ W_UK`` turns the query into the latent space, so attention runs directly on the
  cached ``[c_kv, k_pe]`` rows (``jax_mla.decode``); ``W_UV`` and ``wo`` map the latent output back.

Weights use torch's ``[out_features, in_features]`` layout, as in the reference, so ``wkv_b`` splits
per head exactly like its ``wkv_b.view(n_heads, -1, kv_lora_rank)``. Weights and activations are
bf16; norms, RoPE and softmax run in float32, matmuls accumulate in float32.

A toy model around the block (random token embeddings, ``num_layers`` pre-norm residual attention
layers, a greedy output head) turns it into a decode loop.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np

import jax_mla


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """MLA hyper-parameters, named as in the reference's ``ModelArgs``."""

    name: str
    dim: int
    n_heads: int
    q_lora_rank: int  # 0: a single ``wq`` projection instead of ``wq_a`` -> RMSNorm -> ``wq_b``
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    max_seq_len: int = 4096 * 4
    original_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_factor: float = 40.0
    beta_fast: int = 32
    beta_slow: int = 1
    mscale: float = 1.0
    vocab_size: int = 1024  # the toy model's vocabulary, not the real one

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def yarn_mscale(self) -> float:
        """The attention temperature correction YaRN applies when extending the context."""
        if self.max_seq_len <= self.original_seq_len:
            return 1.0
        return 0.1 * self.mscale * math.log(self.rope_factor) + 1.0

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim ** -0.5 * self.yarn_mscale ** 2


CONFIGS = {
    "tiny": MLAConfig(name="tiny", dim=256, n_heads=16, q_lora_rank=128, qk_nope_head_dim=64,
                      v_head_dim=64),
    "v2-lite": MLAConfig(name="v2-lite", dim=2048, n_heads=16, q_lora_rank=0, mscale=0.707),
    "v3": MLAConfig(name="v3", dim=7168, n_heads=128, q_lora_rank=1536),
}


def config_from_hf(source) -> MLAConfig:
    """The attention hyper-parameters of a DeepSeek-V2/V3 HuggingFace ``config.json``.

    Args:
      source: the file's path, or its contents as a dict.
    Reads ``hidden_size``, ``num_attention_heads``, ``q_lora_rank`` (null: a plain ``wq``), the MLA
    head dims, ``max_position_embeddings``, ``rope_theta`` and the YaRN ``rope_scaling``; the rest
    (layer count, vocabulary, MoE) is not this example's.
    """
    if isinstance(source, dict):
        hf, name = source, source.get("_name_or_path") or "config.json"
    else:
        with open(source) as f:
            hf = json.load(f)
        name = os.path.basename(os.path.dirname(os.path.abspath(source))) or str(source)
    if not isinstance(hf, dict):
        raise ValueError(f"{name}: a config.json holds an object, got {type(hf).__name__}")

    def number(key, kind=int, minimum=1, default=None, source=hf, where=""):
        """source[key], a finite ``kind`` of at least ``minimum`` (``default`` where absent, if
        given); ``where`` names ``source`` in the error."""
        if key not in source:
            if default is None:
                lacks = where or "not a DeepSeek MLA config, it"
                raise ValueError(f"{name}: {lacks} lacks {key!r}")
            return default
        value = source[key]
        if (isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int)
                or not math.isfinite(value) or value < minimum):
            raise ValueError(f"{name}: {where + ' ' if where else ''}{key} must be "
                             f"{'a finite number' if kind is float else 'an integer'} >= {minimum}, "
                             f"got {value!r}")
        return kind(value)

    fields = dict(dim=number("hidden_size"), n_heads=number("num_attention_heads"),
                  q_lora_rank=(0 if hf.get("q_lora_rank") is None
                               else number("q_lora_rank", minimum=0)),
                  kv_lora_rank=number("kv_lora_rank"), qk_nope_head_dim=number("qk_nope_head_dim"),
                  qk_rope_head_dim=number("qk_rope_head_dim"), v_head_dim=number("v_head_dim"),
                  max_seq_len=number("max_position_embeddings"),
                  rope_theta=number("rope_theta", float, default=10000.0))
    scaling = hf.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise ValueError(f"{name}: rope_scaling must be an object or null, got "
                         f"{type(scaling).__name__}")
    kind = scaling.get("type", scaling.get("rope_type"))
    if kind is None:  # plain RoPE: YaRN off
        fields["original_seq_len"] = fields["max_seq_len"]
    elif kind == "yarn":
        def yarn(key, kind=float, minimum=0, default=None):
            return number(key, kind, minimum, default, source=scaling,
                          where="rope_scaling of type yarn")

        # DeepSeek's reference applies one mscale to the softmax scale and none to RoPE, which is
        # HuggingFace's YaRN when its mscale and mscale_all_dim agree.
        mscale, mscale_all_dim = yarn("mscale", default=1.0), yarn("mscale_all_dim", default=0.0)
        if mscale != mscale_all_dim:
            raise ValueError(f"{name}: rope_scaling mscale {mscale} != mscale_all_dim "
                             f"{mscale_all_dim} is not supported")
        fields.update(rope_factor=yarn("factor", minimum=1),
                      mscale=mscale_all_dim,
                      original_seq_len=yarn("original_max_position_embeddings", int, minimum=1),
                      beta_fast=yarn("beta_fast", default=32),
                      beta_slow=yarn("beta_slow", default=1))
    else:
        raise ValueError(f"{name}: rope_scaling type {kind!r} is not supported (yarn or none)")
    return MLAConfig(name=name, **fields)


# ---------------------------------------------------------------------------------------------------
# Building blocks


def rms_norm(x: jax.Array, weight: jax.Array, eps: float = 1e-6) -> jax.Array:
    """RMSNorm over the last axis in float32; returns ``x.dtype``."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def linear(x: jax.Array, weight: jax.Array) -> jax.Array:
    """``x @ weight.T``: x [..., in], weight [out, in] -> [..., out] in ``x.dtype``.

    bf16 matmuls accumulate in float32 on both the CPU and the GPU backends; asking for a float32
    result instead (``preferred_element_type``) is not implemented for some layouts by XLA:CPU.
    """
    return jnp.einsum("...i,oi->...o", x, weight)


def rope_frequencies(cfg: MLAConfig) -> np.ndarray:
    """float32 [qk_rope_head_dim // 2] rotation frequencies, YaRN-corrected (``precompute_freqs_cis``).

    Dimensions that rotate fewer than ``beta_slow`` times over ``original_seq_len`` are interpolated by
    ``rope_factor``, those rotating more than ``beta_fast`` times are kept, with a linear ramp between.
    """
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    if cfg.max_seq_len <= cfg.original_seq_len:
        return freqs.astype(np.float32)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(cfg.original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    smooth = 1 - ramp
    return (freqs / cfg.rope_factor * (1 - smooth) + freqs * smooth).astype(np.float32)


def apply_rotary_emb(x: jax.Array, positions: jax.Array, freqs: np.ndarray) -> jax.Array:
    """Rotate adjacent channel pairs ``(x[2i], x[2i+1])`` by ``position * freqs[i]``.

    Args:
      x: [B, S, rope] or [B, S, H, rope].
      positions: int32 [B, S], each token's absolute position.
      freqs: float32 [rope // 2] from ``rope_frequencies``.
    Returns:
      ``x`` rotated, same shape and dtype (the rotation itself runs in float32).
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs)  # [B, S, rope/2]
    if x.ndim == 4:
        angles = angles[:, :, None, :]
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    real, imag = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([real * cos - imag * sin, real * sin + imag * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


def slot_mapping(block_tables: jax.Array, positions: jax.Array, page_size: int) -> jax.Array:
    """int32 cache slots ``page * page_size + offset`` of tokens at ``positions`` [B, S]."""
    pages = jnp.take_along_axis(block_tables, positions // page_size, axis=1)
    return (pages * page_size + positions % page_size).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------------
# Parameters


def _gaussian(rng: np.random.Generator, shape, std: float, dtype) -> jax.Array:
    return jnp.asarray((rng.standard_normal(shape, dtype=np.float32) * std).astype(dtype))


def _weight(rng: np.random.Generator, out_features: int, in_features: int, dtype) -> jax.Array:
    """[out, in] Gaussian with std ``in**-0.5``, so unit-RMS inputs give unit-RMS outputs."""
    return _gaussian(rng, (out_features, in_features), in_features ** -0.5, dtype)


def init_attention(rng: np.random.Generator, cfg: MLAConfig, dtype=jnp.bfloat16) -> dict:
    """One MLA block's weights (torch layout [out, in]); norms start at one, like the reference."""
    heads = cfg.n_heads
    params = {
        "wkv_a": _weight(rng, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.dim, dtype),
        "kv_norm": jnp.ones((cfg.kv_lora_rank,), dtype),
        "wkv_b": _weight(rng, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, dtype),
        "wo": _weight(rng, cfg.dim, heads * cfg.v_head_dim, dtype),
    }
    if cfg.q_lora_rank > 0:
        params["wq_a"] = _weight(rng, cfg.q_lora_rank, cfg.dim, dtype)
        params["q_norm"] = jnp.ones((cfg.q_lora_rank,), dtype)
        params["wq_b"] = _weight(rng, heads * cfg.qk_head_dim, cfg.q_lora_rank, dtype)
    else:
        params["wq"] = _weight(rng, heads * cfg.qk_head_dim, cfg.dim, dtype)
    return params


def init_model(seed: int, cfg: MLAConfig, num_layers: int, dtype=jnp.bfloat16) -> dict:
    """Seeded random weights: token embeddings and an output head [vocab, dim] (unit-RMS rows), and
    per layer a pre-attention norm and an MLA block; then the final norm.

    Drawn with numpy on the host: no per-shape compilation, and the same weights on every platform.
    """
    rng = np.random.default_rng(seed)
    return {
        "embed": _gaussian(rng, (cfg.vocab_size, cfg.dim), 1.0, dtype),
        "layers": [{"attn_norm": jnp.ones((cfg.dim,), dtype), "attn": init_attention(rng, cfg, dtype)}
                   for _ in range(num_layers)],
        "final_norm": jnp.ones((cfg.dim,), dtype),
        "head": _gaussian(rng, (cfg.vocab_size, cfg.dim), 1.0, dtype),
    }


# ---------------------------------------------------------------------------------------------------
# Projections shared by both formulations


def project_query(p: dict, cfg: MLAConfig, x: jax.Array, positions: jax.Array):
    """x [B, S, dim] -> (q_nope [B, S, H, qk_nope], q_pe [B, S, H, qk_rope] rotated)."""
    if cfg.q_lora_rank > 0:
        q = linear(rms_norm(linear(x, p["wq_a"]), p["q_norm"]), p["wq_b"])
    else:
        q = linear(x, p["wq"])
    q = q.reshape(*x.shape[:2], cfg.n_heads, cfg.qk_head_dim)
    q_nope, q_pe = jnp.split(q, [cfg.qk_nope_head_dim], axis=-1)
    return q_nope, apply_rotary_emb(q_pe, positions, rope_frequencies(cfg))


def project_kv(p: dict, cfg: MLAConfig, x: jax.Array, positions: jax.Array):
    """x [B, S, dim] -> (c_kv [B, S, kv_lora_rank] normalised, k_pe [B, S, qk_rope] rotated).

    These are exactly the rows an MLA cache holds: one latent and one shared RoPE key per token.
    """
    c_kv, k_pe = jnp.split(linear(x, p["wkv_a"]), [cfg.kv_lora_rank], axis=-1)
    return rms_norm(c_kv, p["kv_norm"]), apply_rotary_emb(k_pe, positions, rope_frequencies(cfg))


def absorbed_weights(p: dict, cfg: MLAConfig):
    """``wkv_b`` split per head: (W_UK [H, qk_nope, kv_lora_rank], W_UV [H, v_head, kv_lora_rank])."""
    wkv_b = p["wkv_b"].reshape(cfg.n_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return wkv_b[:, :cfg.qk_nope_head_dim], wkv_b[:, cfg.qk_nope_head_dim:]


# ---------------------------------------------------------------------------------------------------
# The two formulations


def attention_naive(p: dict, cfg: MLAConfig, q_nope, q_pe, c_kv, k_pe, visible) -> jax.Array:
    """Non-absorbed MLA: per-head keys and values expanded from the latent by ``wkv_b``.

    Args:
      q_nope: [B, S, H, qk_nope]; q_pe: [B, S, H, qk_rope] (rotated).
      c_kv: [B, T, kv_lora_rank] (normalised); k_pe: [B, T, qk_rope] (rotated).
      visible: bool [B, S, T], which keys each query sees; every row needs at least one.
    Returns:
      [B, S, dim] in ``q_nope.dtype``. Scores are float32 (the reference rounds them to bf16 first):
      as a check's reference this should be the more precise side.
    """
    batch, length = c_kv.shape[:2]
    kv = linear(c_kv, p["wkv_b"]).reshape(batch, length, cfg.n_heads, -1)
    k_nope, v = jnp.split(kv, [cfg.qk_nope_head_dim], axis=-1)
    k_pe = jnp.broadcast_to(k_pe[:, :, None, :], (*k_nope.shape[:3], cfg.qk_rope_head_dim))
    q = jnp.concatenate([q_nope, q_pe], axis=-1)
    k = jnp.concatenate([k_nope, k_pe.astype(k_nope.dtype)], axis=-1)
    scores = jnp.einsum("bshd,bthd->bsht", q.astype(jnp.float32), k.astype(jnp.float32),
                        precision=jax.lax.Precision.HIGHEST)
    scores = jnp.where(visible[:, :, None, :], scores * cfg.softmax_scale, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    out = jnp.einsum("bsht,bthd->bshd", probs, v)
    return linear(out.reshape(*out.shape[:2], -1), p["wo"])


def mla_prefill(p: dict, cfg: MLAConfig, x, kv_cache, block_tables, prompt_lens):
    """Causal non-absorbed attention over padded prompts, writing their rows to the paged cache.

    Args:
      x: [B, P, dim], prompts padded to P tokens; kv_cache: [num_pages, page_size, kv_lora_rank +
        qk_rope], or jax_mla's fp8 cache, which ``write_kv`` quantises into; block_tables: int32
        [B, max_pages]; prompt_lens: int32 [B], each in [1, P].
    Returns:
      (out [B, P, dim] (rows past a prompt are padding), the updated cache, rows [B, P, kv_lora_rank +
      qk_rope]: every token's ``[c_kv, k_pe]``).
    """
    batch, length = x.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    q_nope, q_pe = project_query(p, cfg, x, positions)
    c_kv, k_pe = project_kv(p, cfg, x, positions)
    in_prompt = positions < prompt_lens[:, None]  # [B, P]
    slots = jnp.where(in_prompt, slot_mapping(block_tables, positions, kv_cache.shape[1]), -1)
    kv_cache = jax_mla.write_kv(kv_cache, c_kv.reshape(batch * length, -1),
                                k_pe.reshape(batch * length, -1), slots.reshape(-1),
                                kv_lora_rank=cfg.kv_lora_rank)
    causal = positions[:, None, :] <= positions[:, :, None]  # [B, P(query), P(key)]
    out = attention_naive(p, cfg, q_nope, q_pe, c_kv, k_pe, causal & in_prompt[:, None, :])
    return out, kv_cache, jnp.concatenate([c_kv, k_pe], axis=-1)


def mla_decode(p: dict, cfg: MLAConfig, x, kv_cache, block_tables, positions, plan=None, *,
               backend: str = "auto", softmax_scale: float | None = None, head_sharding=None):
    """One absorbed decode step: write the new token's row, attend in the latent space via jax_mla.

    Args:
      x: [B, 1, dim], the new tokens; kv_cache: [num_pages, page_size, kv_lora_rank + qk_rope], or
        jax_mla's fp8 cache (uint8 rows, docs/fp8-cache.md);
      block_tables: int32 [B, max_pages], covering position ``positions[b]``; positions: int32 [B],
        each new token's position (= tokens already cached for the request).
      plan: the step's ``jax_mla.Plan`` for the fa3/fa2 backends, or None.
      softmax_scale: overrides ``cfg.softmax_scale`` (only to show that the check catches a wrong one).
      head_sharding: a ``NamedSharding`` splitting the query's heads (dim 2) over a tensor-parallel
        mesh axis; jax_mla then runs the kernel per device on its heads (plan for the local count).
    Returns:
      (out [B, 1, dim] in ``x.dtype``, the updated cache).
    """
    batch = x.shape[0]
    token_positions = positions[:, None]  # [B, 1]
    q_nope, q_pe = project_query(p, cfg, x, token_positions)
    c_kv, k_pe = project_kv(p, cfg, x, token_positions)
    slots = slot_mapping(block_tables, token_positions, kv_cache.shape[1]).reshape(batch)
    kv_cache = jax_mla.write_kv(kv_cache, c_kv.reshape(batch, -1), k_pe.reshape(batch, -1), slots,
                                kv_lora_rank=cfg.kv_lora_rank)

    w_uk, w_uv = absorbed_weights(p, cfg)
    q_latent = jnp.einsum("bshd,hdc->bshc", q_nope, w_uk)
    query = jnp.concatenate([q_latent, q_pe], axis=-1)  # [B, 1, H, kv_lora_rank + qk_rope]
    if head_sharding is not None:
        query = jax.lax.with_sharding_constraint(query, head_sharding)
    scale = cfg.softmax_scale if softmax_scale is None else softmax_scale
    latent_out = jax_mla.decode(query, kv_cache, block_tables, positions + 1, softmax_scale=scale,
                                backend=backend, kv_lora_rank=cfg.kv_lora_rank, plan=plan)
    out = jnp.einsum("bshc,hdc->bshd", latent_out, w_uv)
    return linear(out.reshape(batch, 1, -1), p["wo"]), kv_cache


def mla_reference(p: dict, cfg: MLAConfig, x, history, positions):
    """The decode step recomputed non-absorbed over a dense history, independent of jax_mla.

    Args:
      x: [B, 1, dim]; history: [B, max_len, kv_lora_rank + qk_rope], rows ``[c_kv, k_pe]`` of every
        earlier token (later rows are ignored); positions: int32 [B], the new tokens' positions.
    Returns:
      (out [B, 1, dim], history with the new tokens' rows stored at ``positions``).
    """
    token_positions = positions[:, None]
    q_nope, q_pe = project_query(p, cfg, x, token_positions)
    c_kv, k_pe = project_kv(p, cfg, x, token_positions)
    rows = jnp.concatenate([c_kv, k_pe], axis=-1)[:, 0].astype(history.dtype)
    history = history.at[jnp.arange(x.shape[0]), positions].set(rows)
    visible = jnp.arange(history.shape[1])[None, None, :] <= token_positions[:, :, None]  # [B, 1, T]
    out = attention_naive(p, cfg, q_nope, q_pe, history[..., :cfg.kv_lora_rank],
                          history[..., cfg.kv_lora_rank:], visible)
    return out, history


# ---------------------------------------------------------------------------------------------------
# The toy model: embeddings, pre-norm residual attention layers, greedy head


def greedy_next(params: dict, hidden: jax.Array) -> jax.Array:
    """hidden [B, dim] -> int32 [B], the argmax of the output head's logits."""
    logits = linear(rms_norm(hidden, params["final_norm"]), params["head"])
    return jnp.argmax(logits.astype(jnp.float32), axis=-1).astype(jnp.int32)


def prefill(params, caches, block_tables, tokens, prompt_lens, *, cfg: MLAConfig):
    """Run the prompts through every layer, filling each layer's paged cache.

    Args:
      caches: one [num_pages, page_size, kv_lora_rank + qk_rope] cache (or fp8 cache) per layer;
        tokens: int32 [B, P], padded prompts; prompt_lens: int32 [B].
    Returns:
      (caches, first decode tokens int32 [B], per-layer rows [B, P, kv_lora_rank + qk_rope]).
    """
    hidden = params["embed"][tokens]
    new_caches, layer_rows = [], []
    for layer, cache in zip(params["layers"], caches):
        out, cache, rows = mla_prefill(layer["attn"], cfg, rms_norm(hidden, layer["attn_norm"]), cache,
                                       block_tables, prompt_lens)
        hidden = hidden + out
        new_caches.append(cache)
        layer_rows.append(rows)
    last = hidden[jnp.arange(tokens.shape[0]), prompt_lens - 1]
    return new_caches, greedy_next(params, last), layer_rows


def decode_step(params, caches, block_tables, tokens, positions, plan=None, *, cfg: MLAConfig,
                backend: str, head_sharding=None):
    """One whole decode step through every layer's absorbed attention.

    Args:
      caches: per-layer paged caches (donate them: they are updated in place); tokens: int32 [B];
      positions: int32 [B], where each token goes; plan: the fa3/fa2 ``jax_mla.Plan`` for this
      step's lengths, shared by every layer, or None; head_sharding: see ``mla_decode``.
    Returns:
      (caches, next tokens int32 [B], attention inputs [L, B, 1, dim], attention outputs
      [L, B, 1, dim]) -- the last two for checking each layer against ``mla_reference``.
    """
    hidden = params["embed"][tokens][:, None, :]
    new_caches, inputs, outputs = [], [], []
    for layer, cache in zip(params["layers"], caches):
        x = rms_norm(hidden, layer["attn_norm"])
        out, cache = mla_decode(layer["attn"], cfg, x, cache, block_tables, positions, plan,
                                backend=backend, head_sharding=head_sharding)
        hidden = hidden + out
        new_caches.append(cache)
        inputs.append(x)
        outputs.append(out)
    return new_caches, greedy_next(params, hidden[:, 0]), jnp.stack(inputs), jnp.stack(outputs)


def reference_step(params, histories, attn_inputs, positions, *, cfg: MLAConfig):
    """Every layer's ``mla_reference`` on the inputs ``decode_step`` gave it.

    Returns (updated histories, outputs [L, B, 1, dim]).
    """
    new_histories, outputs = [], []
    for layer, history, x in zip(params["layers"], histories, attn_inputs):
        out, history = mla_reference(layer["attn"], cfg, x, history, positions)
        new_histories.append(history)
        outputs.append(out)
    return new_histories, jnp.stack(outputs)
