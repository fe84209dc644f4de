"""The fp8 cache (docs/fp8-cache.md): byte layout, quantisation error, writes, and decode on xla."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import (check_accuracy, fp8_problem, lse_error, make_problem, record_accuracy,
                      request_head_error, scaled_up)
from test_sharding import assert_near, collectives, cpu_mesh, decode_fn, put

import jax_mla
from jax_mla import backends, fp8_cache, gpu, xla_backend
from jax_mla.reference import dequantize_fp8, reference_from_jax

# Worst quantise-then-dequantise error of a 128-channel group over its max |x|: the max lands in
# (224, 448] times its power-of-two scale, where half an e4m3 step is at most 2^-4 of it
# (docs/fp8-cache.md, "Quantisation").
GROUP_ERROR = 2.0**-4
# The fp8 cache's decode against the bf16 cache it was quantised from: (output error per
# request/head, lse error in nats, relative L2 error of the output), about 2x the worst that
# `python tests/measure_accuracy.py 60 --fp8` measured (docs/fp8-cache.md, "Error").
AGAINST_BF16 = (0.7, 0.8, 0.1)

GRID = [pytest.param(q_len, num_heads, page_size, dtype,
                     id=f"q{q_len}-h{num_heads}-p{page_size}-{jnp.dtype(dtype).name}")
        for (q_len, num_heads, page_size), dtype in zip(
            itertools.product([1, 2, 3, 4], [16, 128], [1, 16, 64]),
            itertools.cycle([jnp.float32, jnp.bfloat16]))]


# ---- the format -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_lora_rank,offsets", [(512, (512, 528, 656)), (256, (256, 264, 392))])
def test_row_layout(kv_lora_rank, offsets):
    row = fp8_cache.layout(kv_lora_rank)
    assert (row.scales_offset, row.rope_offset, row.row_bytes) == offsets
    assert row.num_groups == kv_lora_rank // 128 and row.head_dim == kv_lora_rank + 64
    assert fp8_cache.layout_of_rows(row.row_bytes) == row


def test_a_deepseek_row_is_at_most_0_57_of_a_bf16_row():
    assert fp8_cache.layout(512).row_bytes / (2 * 576) == pytest.approx(0.569, abs=1e-3)


def test_layout_rejects_widths_without_whole_groups():
    with pytest.raises(ValueError, match=r"an fp8 cache needs kv_lora_rank to be a multiple of 128 "
                                         r"\(one scale per 128 latent channels\), got 500"):
        fp8_cache.layout(500)
    with pytest.raises(ValueError, match=r"600 bytes is not an fp8 cache row with rope_dim 64"):
        fp8_cache.layout_of_rows(600)


def hand_built_row() -> tuple[np.ndarray, np.ndarray]:
    """(a 392-byte row for (256, 64) written byte by byte, the float32 values it holds)."""
    latent = np.zeros(256, np.uint8)
    latent[:4] = [0x38, 0xB8, 0x7E, 0x01]  # e4m3 1.0, -1.0, 448, 2^-9 (the smallest subnormal)
    latent[128:131] = [0x40, 0x3C, 0x7E]  # 2.0, 1.5, 448
    scales = [0x00, 0x00, 0x00, 0x3F, 0x00, 0x00, 0x00, 0x40]  # float32 0.5, 2.0, little-endian
    rope = np.zeros(128, np.uint8)
    rope[:4] = [0x80, 0x3F, 0x20, 0xC0]  # bfloat16 1.0, -2.5
    values = np.zeros(320, np.float32)
    values[:4] = [0.5, -0.5, 224.0, 2.0**-10]
    values[128:131] = [4.0, 3.0, 896.0]
    values[256:258] = [1.0, -2.5]
    return np.concatenate([latent, np.array(scales, np.uint8), rope]), values


def test_a_hand_built_row_decodes_to_its_values_and_quantises_back():
    row, values = hand_built_row()
    np.testing.assert_array_equal(np.asarray(fp8_cache.dequantize_rows(jnp.asarray(row[None]))),
                                  values[None])
    np.testing.assert_array_equal(dequantize_fp8(torch.from_numpy(row[None]), 256).numpy(),
                                  values[None])
    pages = torch.from_numpy(np.stack([row, row])[None])  # a cache of one page of two tokens
    np.testing.assert_array_equal(dequantize_fp8(pages, 256).numpy(), np.stack([values] * 2)[None])
    quantised = fp8_cache.quantize_rows(jnp.asarray(values[None, :256]), jnp.asarray(values[None, 256:]))
    np.testing.assert_array_equal(np.asarray(quantised), row[None])


def test_quantisation_follows_the_rule_within_the_group_error():
    """Scales are the smallest power of two s with max |x| <= 448 s (1 for an all-zero group),
    latents round to nearest e4m3, rope to bf16; each group's error is at most GROUP_ERROR of its
    max |x|, whatever its magnitude."""
    rng = np.random.default_rng(0)
    magnitudes = 10.0 ** rng.uniform(-6, 6, size=(64, 4, 1))
    latent = (rng.standard_normal((64, 4, 128)) * magnitudes).astype(np.float32)
    latent[3, 1] = 0.0
    rope = rng.standard_normal((64, 64)).astype(np.float32)
    rows = fp8_cache.quantize_rows(jnp.asarray(latent.reshape(64, 512)), jnp.asarray(rope))
    got_latent, got_rope = (np.asarray(x) for x in fp8_cache.dequantize(rows))

    raw = np.asarray(rows)
    scales = raw[:, 512:528].copy().view(np.float32)
    amax = np.abs(latent).max(axis=-1)
    safe_amax = np.where(amax > 0, amax, 448).astype(np.float64)
    expected_scales = np.where(amax > 0, 2.0 ** np.ceil(np.log2(safe_amax / 448)), 1)
    np.testing.assert_array_equal(scales, expected_scales.astype(np.float32))
    fill = (amax / scales)[amax > 0]
    assert fill.min() > 224 and fill.max() <= 448, (fill.min(), fill.max())
    expected_bytes = (latent / expected_scales[..., None]).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(raw[:, :512], expected_bytes.view(np.uint8).reshape(64, 512))
    np.testing.assert_array_equal(got_rope, rope.astype(ml_dtypes.bfloat16).astype(np.float32))

    error = np.abs(got_latent.reshape(latent.shape) - latent).max(axis=-1)
    group_error = error / np.where(amax > 0, amax, 1)
    assert group_error.max() <= GROUP_ERROR, group_error.max()
    assert group_error.max() > 0.8 * 16 / 448  # the bound is reached: rounding, not truncation
    np.testing.assert_array_equal(got_latent.reshape(latent.shape)[3, 1], 0.0)


def test_group_scales_at_the_boundaries():
    """448 * 2^k takes 2^k, the next float32 up takes 2^(k + 1); zero takes 1; magnitudes too small
    for a normal float32 scale take 2^-126."""
    amax = np.array([448.0, np.nextafter(np.float32(448), np.float32(1e9)), 448 * 2.0**-20,
                     np.nextafter(np.float32(448 * 2.0**-20), np.float32(0)), 1.0, 0.0, 1e-37,
                     3e38], np.float32)
    expected = np.array([1.0, 2.0, 2.0**-20, 2.0**-20, 2.0**-8, 1.0, 2.0**-126, 2.0**120],
                        np.float32)
    np.testing.assert_array_equal(np.asarray(fp8_cache.group_scales(jnp.asarray(amax))), expected)


def test_a_group_holding_inf_or_nan_reads_back_as_nan():
    """Its scale is the non-finite value itself, so the whole group dequantises to NaN (never to
    finite values, which an exponent of 0 from frexp(inf) made of them); other groups keep theirs."""
    latent = np.full((2, 512), 96.0, np.float32)
    latent[0, 3], latent[1, 200] = np.inf, np.nan
    rows = fp8_cache.quantize_rows(jnp.asarray(latent), jnp.zeros((2, 64)))
    got = np.asarray(fp8_cache.dequantize(rows)[0])
    assert np.isnan(got[0, :128]).all() and np.isnan(got[1, 128:256]).all()
    np.testing.assert_array_equal(got[0, 128:], 96.0)
    np.testing.assert_array_equal(got[1, :128], 96.0)
    np.testing.assert_array_equal(got[1, 256:], 96.0)


# ---- allocation and writes ----------------------------------------------------------------------------

def test_write_kv_of_no_tokens_returns_the_fp8_cache_unchanged():
    cache = jax_mla.allocate_cache(4, 16, dtype="fp8").at[1, 2, 3].set(7)
    written = jax_mla.write_kv(cache, jnp.zeros((0, 512)), jnp.zeros((0, 64)),
                               jnp.zeros((0,), jnp.int32))
    np.testing.assert_array_equal(np.asarray(written), np.asarray(cache))


@pytest.mark.parametrize("kv_lora_rank,row_bytes", [(512, 656), (256, 392)])
def test_allocate_the_fp8_cache(kv_lora_rank, row_bytes):
    cache = jax_mla.allocate_cache(3, 16, kv_lora_rank=kv_lora_rank, dtype="fp8")
    assert cache.shape == (3, 16, row_bytes) and cache.dtype == jnp.uint8
    assert not np.asarray(cache).any()
    view = jax_mla.torch_view(cache)
    assert view.data_ptr() == cache.unsafe_buffer_pointer() and view.dtype == torch.uint8
    del view


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(dtype=jnp.float8_e5m2), TypeError,
     r"dtype must be a floating dtype of 16 bits or more \(bfloat16, float16, float32\), "
     r"float8_e4m3fn for the e4m3 cache with one scale, or 'fp8' for the fp8 cache with per-group "
     r"scales \(docs/fp8-cache.md\), got float8_e5m2"),
    (dict(dtype="float8"), TypeError, r"or 'fp8' for the fp8 cache .*got 'float8'"),
    (dict(dtype=jnp.uint8), TypeError, r"or 'fp8' for the fp8 cache .*got uint8"),
    (dict(dtype="fp8", kv_lora_rank=200), ValueError,
     r"an fp8 cache needs kv_lora_rank to be a multiple of 128"),
])
def test_allocate_cache_rejects(kwargs, error, message):
    with pytest.raises(error, match=message):
        jax_mla.allocate_cache(2, 16, **kwargs)


def random_tokens(rng, num_tokens, kv_lora_rank=512):
    return (jnp.asarray(rng.standard_normal((num_tokens, kv_lora_rank)), jnp.float32),
            jnp.asarray(rng.standard_normal((num_tokens, 64)), jnp.float32))


@pytest.mark.parametrize("page_size,kv_lora_rank", [(1, 512), (16, 512), (64, 256)])
def test_write_kv_quantises_into_the_named_slots_only(page_size, kv_lora_rank):
    rng = np.random.default_rng(page_size)
    row_bytes = fp8_cache.layout(kv_lora_rank).row_bytes
    before = rng.integers(0, 256, size=(8, page_size, row_bytes), dtype=np.uint8)
    slots = rng.choice(8 * page_size, size=min(10, 8 * page_size), replace=False)
    padded = np.concatenate([slots, [-1, -100, 8 * page_size]]).astype(np.int32)
    latent, k_rope = random_tokens(rng, len(padded), kv_lora_rank)
    updated = np.asarray(jax.jit(jax_mla.write_kv)(jnp.asarray(before), latent, k_rope,
                                                   jnp.asarray(padded)))
    expected = before.reshape(-1, row_bytes).copy()
    expected[slots] = np.asarray(fp8_cache.quantize_rows(latent, k_rope))[:len(slots)]
    np.testing.assert_array_equal(updated.reshape(expected.shape), expected)


CACHE = jnp.zeros((4, 8, 656), jnp.uint8)
LATENT, ROPE = jnp.zeros((3, 512), jnp.float32), jnp.zeros((3, 64), jnp.float32)


@pytest.mark.parametrize("overrides,error,message", [
    (dict(kv_cache=CACHE[..., :600]), ValueError,
     r"kv_cache is an fp8 cache \(uint8\), so its last dim must be 656 bytes per token for "
     r"kv_lora_rank 512 \(latent's last dim\) and rope_dim 64 \(k_rope's last dim\) "
     r"\(docs/fp8-cache.md\), got kv_cache shape \(4, 8, 600\)"),
    (dict(latent=LATENT[:, :500]), ValueError, r"needs kv_lora_rank to be a multiple of 128 .*, got 500"),
    (dict(kv_cache=CACHE.astype(jnp.int16)), TypeError,
     r"kv_cache must have a floating dtype of at least 16 bits, uint8 for an fp8 cache or "
     r"float8_e4m3fn for an e4m3 cache \(docs/fp8-cache.md\), got int16"),
    (dict(kv_cache=CACHE[..., :528], k_rope=ROPE[:, :0]), ValueError,
     r"latent and k_rope must each have a last dim >= 1 \(kv_lora_rank and rope_dim\), got latent "
     r"\(3, 512\), k_rope \(3, 0\)"),
    (dict(kv_lora_rank=256), ValueError,
     r"latent's last dim must be kv_lora_rank=256, got latent \(3, 512\), k_rope \(3, 64\)"),
])
def test_write_kv_rejects(overrides, error, message):
    args = dict(kv_cache=CACHE, latent=LATENT, k_rope=ROPE, slot_mapping=jnp.zeros(3, jnp.int32))
    args.update(overrides)
    with pytest.raises(error, match=message):
        jax_mla.write_kv(**args)


# ---- decode -----------------------------------------------------------------------------------------

def check_fp8_decode(problem, seed, *, kv_lora_rank=None, output_scale=1.0):
    """xla on the fp8 cache against the torch reference on the same cache (the query dtype's xla
    tolerance), and against the reference on the bf16 cache it came from (AGAINST_BF16)."""
    quantised, source = fp8_problem(problem, seed)
    kwargs = dict(softmax_scale=problem.softmax_scale, output_scale=output_scale,
                  kv_lora_rank=kv_lora_rank)
    out, lse = jax.jit(lambda *a: jax_mla.decode(*a, backend="xla", return_lse=True, **kwargs))(
        *quantised.arrays)
    assert out.dtype == problem.query.dtype and lse.dtype == jnp.float32
    assert not np.isnan(np.asarray(out, np.float32)).any(), "NaN leaked from poisoned cache rows"
    ref_out, ref_lse = (t.numpy() for t in reference_from_jax(*quantised.arrays, **kwargs))
    check_accuracy(out, lse, ref_out, ref_lse, backend="xla-fp8")
    bf16_out, bf16_lse = (t.numpy() for t in reference_from_jax(*source.arrays, **kwargs))
    out = np.asarray(out, np.float64)
    errors = (request_head_error(out, bf16_out), lse_error(lse, bf16_lse),
              float(np.linalg.norm(out - bf16_out) / np.linalg.norm(bf16_out)))
    record_accuracy("fp8-vs-bf16", problem.query.dtype,
                    **dict(zip(("output", "lse", "l2"), errors)))
    assert all(e < bound for e, bound in zip(errors, AGAINST_BF16)), (errors, AGAINST_BF16)


@pytest.mark.parametrize("q_len,num_heads,page_size,dtype", GRID)
def test_decode_on_the_fp8_cache(q_len, num_heads, page_size, dtype):
    """Variable lengths (one of q_len, one a page multiple), shuffled pages, garbage table padding,
    unused rows of NaN bytes."""
    seed = hash((q_len, num_heads, page_size)) % 2**31
    problem = make_problem(seed, batch=3, q_len=q_len, num_heads=num_heads, page_size=page_size,
                           dtype=dtype)
    check_fp8_decode(problem, seed)


def test_decode_on_the_fp8_cache_with_large_group_scales():
    """Rows 2^14 times larger (scaled_up): group scales of 2^7 and 2^8 instead of about 2^-7."""
    problem = scaled_up(make_problem(4, batch=3, q_len=2, num_heads=16, page_size=64))
    check_fp8_decode(problem, 4)


def test_decode_on_the_fp8_cache_small_latent_rank_and_output_scale():
    problem = make_problem(2, batch=3, q_len=2, num_heads=16, page_size=32, kv_lora_rank=256)
    check_fp8_decode(problem, 2, kv_lora_rank=256, output_scale=0.37)


@pytest.mark.parametrize("page_size", [16, 200])
def test_decode_on_the_fp8_cache_across_chunk_boundaries(page_size):
    chunk = page_size * max(1, xla_backend.CHUNK_TOKENS // page_size)
    problem = make_problem(page_size, batch=5, q_len=3, num_heads=16, page_size=page_size,
                           seq_lens=[chunk - 1, chunk, chunk + 1, 2 * chunk + 1, 3])
    check_fp8_decode(problem, page_size)


def test_written_tokens_decode_like_the_reference_on_the_dequantised_cache():
    """allocate, write_kv (donated), decode with checks=True: against the reference on the same
    cache, and near decode over a float32 cache written with the same tokens."""
    rng = np.random.default_rng(3)
    tables = jnp.asarray([[4, 1, 5], [7, 0, 2]], jnp.int32)
    lengths = np.array([40, 9])
    slots = np.concatenate([np.asarray(tables[b])[np.arange(n) // 16] * 16 + np.arange(n) % 16
                            for b, n in enumerate(lengths)]).astype(np.int32)
    latent, k_rope = random_tokens(rng, len(slots))
    write = jax.jit(jax_mla.write_kv, donate_argnums=0)
    caches = [write(jax_mla.allocate_cache(8, 16, dtype=dtype), latent, k_rope, jnp.asarray(slots))
              for dtype in ("fp8", jnp.float32)]
    query = jnp.asarray(rng.standard_normal((2, 1, 16, 576)), jnp.float32)
    seq_lens = jnp.asarray(lengths, jnp.int32)
    out_fp8, out_f32 = (jax_mla.decode(query, cache, tables, seq_lens, softmax_scale=0.1,
                                       checks=True) for cache in caches)
    ref, _ = reference_from_jax(query, caches[0], tables, seq_lens, softmax_scale=0.1)
    assert request_head_error(out_fp8, ref.numpy()) < 3e-5
    assert request_head_error(out_fp8, out_f32) < AGAINST_BF16[0]


def test_heads_and_batch_sharded_on_the_fp8_cache():
    """Query heads over "tp" and batch over "data", the uint8 cache replicated: one kernel per
    device, no collectives, the unsharded result."""
    mesh = cpu_mesh((2, 2))
    quantised, _ = fp8_problem(make_problem(10, batch=4, q_len=2, num_heads=16, page_size=16,
                                            max_len=200), 10)
    query, kv_cache, block_tables, seq_lens = quantised.arrays
    args = (put(mesh, query, "data", None, "tp", None), put(mesh, kv_cache),
            put(mesh, block_tables, "data"), put(mesh, seq_lens, "data"))
    fn = decode_fn("xla")
    out, lse = fn(*args)
    assert collectives(fn, *args) == []
    unsharded_out, unsharded_lse = fn(*quantised.arrays)
    assert_near(out, unsharded_out)
    assert_near(lse, unsharded_lse)


DECODE = make_problem(0, batch=2, q_len=1, num_heads=16, page_size=16, max_len=40)
FP8, _ = fp8_problem(DECODE, 0)


@pytest.mark.parametrize("overrides,error,message", [
    (dict(kv_cache=FP8.kv_cache[..., :576]), ValueError,
     r"kv_cache is an fp8 cache \(uint8\), so its last dim must be 656 bytes per token for query's "
     r"head dim 576 \(kv_lora_rank 512 \+ rope_dim 64\) \(docs/fp8-cache.md\), got kv_cache shape "
     r"\(\d+, 16, 576\)"),
    (dict(kv_lora_rank=448), ValueError, r"an fp8 cache needs kv_lora_rank to be a multiple of "
                                          r"128 .*, got 448"),
    (dict(kv_cache=FP8.kv_cache.astype(jnp.int8)), TypeError,
     r"kv_cache must have a floating dtype of at least 16 bits, uint8 for an fp8 cache"),
    (dict(query=DECODE.query.astype(jnp.int32)), TypeError, r"query must have a floating dtype"),
    (dict(query=DECODE.query.astype(jnp.float8_e4m3fn)), TypeError,
     r"query must have a floating dtype of at least 16 bits .*got float8_e4m3fn"),
])
def test_decode_rejects(overrides, error, message):
    args = dict(query=FP8.query, kv_cache=FP8.kv_cache, block_tables=FP8.block_tables,
                seq_lens=FP8.seq_lens)
    args.update(overrides)
    with pytest.raises(error, match=message):
        jax_mla.decode(args.pop("query"), args.pop("kv_cache"), args.pop("block_tables"),
                       args.pop("seq_lens"), softmax_scale=0.1, **args)


# ---- backends ---------------------------------------------------------------------------------------

def test_xla_and_sm90_take_the_fp8_cache():
    assert [b.name for b in backends.TABLE if backends.FP8_CACHE in b.cache_formats] == ["sm90", "xla"]
    assert all(backends.FLOAT_CACHE in b.cache_formats for b in backends.TABLE)


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (10, 0)])
def test_auto_picks_xla_for_the_fp8_cache(monkeypatch, capability):
    """Before the arrays are split; on Hopper each device may then take sm90 (tests/test_sm90.py)."""
    monkeypatch.setattr(gpu, "runtime_missing", lambda: None)
    monkeypatch.setattr(gpu, "capability", lambda device=None: capability)
    assert backends.resolve("auto", "gpu", jnp.bfloat16, backends.FP8_CACHE) == "xla"
    assert backends.resolve("auto", "gpu", jnp.bfloat16) != "xla"


def test_auto_on_cpu_runs_xla_on_the_fp8_cache():
    auto = jax_mla.decode(*FP8.arrays, softmax_scale=0.1)
    xla = jax_mla.decode(*FP8.arrays, softmax_scale=0.1, backend="xla")
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(xla))


@pytest.mark.parametrize("backend", ["trtllm-gen", "fa3", "fa2"])
def test_flashinfer_backends_refuse_the_fp8_cache(monkeypatch, backend):
    monkeypatch.setattr(backends, "available_backends",
                        lambda platform=None: ["trtllm-gen", "fa3", "fa2", "sm90", "xla"])
    message = (rf"backend '{backend}' takes caches of the query's dtype( or the e4m3 cache "
               r"\(float8_e4m3fn\))?, got the fp8 cache \(uint8\) \(docs/fp8-cache.md\); "
               r"backends that take it: \['sm90', 'xla'\]")
    with pytest.raises(TypeError, match=message):
        backends.resolve(backend, "gpu", jnp.bfloat16, backends.FP8_CACHE)
    query = FP8.query.astype(jnp.bfloat16)
    with pytest.raises(TypeError, match=message):
        jax_mla.decode(query, *FP8.arrays[1:], softmax_scale=0.1, backend=backend)
