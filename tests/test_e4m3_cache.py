"""The e4m3 cache (docs/fp8-cache.md, "The e4m3 cache"): float8_e4m3fn values times one kv_scale.
Writes, the scale's checks, decode on xla (any machine) and on fa3/fa2 (SM90), the backend rules
and the lowering of FlashInfer's fp8 module with the scale folded in."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from conftest import (Problem, check_accuracy, gpu_backends_here, gpu_blocker, lse_error,
                      make_problem, record_accuracy, request_head_error)
from test_fp8_cache import AGAINST_BF16
from test_sharding import assert_near, collectives, cpu_mesh, put

import jax_mla
from jax_mla import backends, e4m3_cache, gpu
from jax_mla.reference import reference_from_jax

# e4m3 NaN bytes for unused rows: 0x7F and 0xFF.
POISON_BYTES = (0x7F, 0xFF)
# Worst quantise-then-dequantise error of a normal e4m3 value over its magnitude: half a step of
# a mantissa of three bits.
ROUND_TRIP_ERROR = 2.0**-4


def e4m3_problem(problem: Problem, seed: int) -> tuple[Problem, Problem, float]:
    """(the problem with an e4m3 cache, the problem with the bf16 cache it was quantised from,
    kv_scale = max |cache| / 448). Unused rows (NaN in ``problem``) hold NaN bytes."""
    values = np.asarray(jnp.asarray(problem.kv_cache, jnp.bfloat16), np.float32)
    kv_scale = float(np.nanmax(np.abs(values))) / 448
    unused = np.isnan(values).any(axis=-1)
    quantised = np.asarray(e4m3_cache.quantize(jnp.asarray(np.nan_to_num(values)), kv_scale))
    raw = quantised.view(np.uint8).copy()
    raw[unused] = np.random.default_rng(seed).choice(POISON_BYTES, size=(unused.sum(), 1))
    e4m3 = jnp.asarray(raw.view(ml_dtypes.float8_e4m3fn))
    bf16 = jnp.asarray(values, jnp.bfloat16)
    return (dataclasses.replace(problem, kv_cache=e4m3),
            dataclasses.replace(problem, kv_cache=bf16), kv_scale)


def check_both(backend, problem, source, kv_scale, *, output_scale=1.0, **kwargs):
    """``backend`` on the e4m3 cache: against the torch reference on the same cache (its
    tolerances), and against the reference on the bf16 cache it came from (AGAINST_BF16)."""
    scales = dict(softmax_scale=problem.softmax_scale, output_scale=output_scale)
    out, lse = jax.jit(lambda *a: jax_mla.decode(*a, backend=backend, return_lse=True,
                                                 kv_scale=kv_scale, **scales, **kwargs))(
        *problem.arrays)
    assert out.dtype == problem.query.dtype and lse.dtype == jnp.float32
    ref_out, ref_lse = (t.numpy() for t in reference_from_jax(*problem.arrays, kv_scale=kv_scale,
                                                              **scales))
    check_accuracy(out, lse, ref_out, ref_lse, backend=backend)
    bf16_out, bf16_lse = (t.numpy() for t in reference_from_jax(*source.arrays, **scales))
    out = np.asarray(out, np.float64)
    errors = (request_head_error(out, bf16_out), lse_error(lse, bf16_lse),
              float(np.linalg.norm(out - bf16_out) / np.linalg.norm(bf16_out)))
    record_accuracy(f"{backend}-e4m3-vs-bf16", problem.query.dtype,
                    **dict(zip(("output", "lse", "l2"), errors)))
    assert all(e < bound for e, bound in zip(errors, AGAINST_BF16)), (errors, AGAINST_BF16)
    return out, lse


# ---- the format -------------------------------------------------------------------------------------

def test_allocate_the_e4m3_cache():
    cache = jax_mla.allocate_cache(3, 16, dtype=jnp.float8_e4m3fn)
    assert cache.shape == (3, 16, 576) and cache.dtype == jnp.float8_e4m3fn
    assert not np.asarray(cache, np.float32).any()
    view = jax_mla.torch_view(cache)
    assert view.data_ptr() == cache.unsafe_buffer_pointer() and view.dtype == torch.float8_e4m3fn
    del view


@pytest.mark.parametrize("kv_scale", [1.0, 0.01, 3e-5])
def test_write_kv_quantises_into_the_named_slots_only(kv_scale):
    rng = np.random.default_rng(5)
    before = rng.integers(0, 256, size=(6, 16, 576), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    slots = rng.choice(96, size=12, replace=False)
    padded = np.concatenate([slots, [-1, -50, 96]]).astype(np.int32)
    latent = rng.standard_normal((len(padded), 512)).astype(np.float32) * 448 * kv_scale / 4
    k_rope = rng.standard_normal((len(padded), 64)).astype(np.float32) * 448 * kv_scale / 4
    write = jax.jit(jax_mla.write_kv, static_argnames="kv_scale")
    updated = np.asarray(write(jnp.asarray(before), jnp.asarray(latent), jnp.asarray(k_rope),
                               jnp.asarray(padded), kv_scale=kv_scale))
    rows = np.concatenate([latent, k_rope], -1)[:len(slots)]
    expected = before.reshape(-1, 576).copy()
    expected[slots] = np.clip(rows / np.float32(kv_scale), -448, 448).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(updated.reshape(expected.shape).view(np.uint8),
                                  expected.view(np.uint8))
    read_back = updated.reshape(-1, 576)[slots].astype(np.float32) * kv_scale
    normal = np.abs(rows) >= 2.0**-6 * kv_scale
    assert (np.abs(read_back - rows) <= ROUND_TRIP_ERROR * np.abs(rows))[normal].all()


@pytest.mark.parametrize("cache_dtype, kv_scale", [(jnp.float8_e4m3fn, None),
                                                    (jnp.bfloat16, 0.5)])
def test_the_reference_takes_kv_scale_with_the_e4m3_cache_only(cache_dtype, kv_scale):
    query = jnp.zeros((1, 1, 1, 576), jnp.float32)
    cache = jnp.zeros((1, 16, 576), cache_dtype)
    with pytest.raises(TypeError, match=r"kv_scale is for an e4m3 cache \(float8_e4m3fn\) and "
                                        r"needed there"):
        reference_from_jax(query, cache, jnp.zeros((1, 1), jnp.int32), jnp.ones((1,), jnp.int32),
                           softmax_scale=0.1, kv_scale=kv_scale)


def test_values_beyond_448_times_the_scale_saturate():
    cache = jax_mla.write_kv(jax_mla.allocate_cache(1, 4, dtype=jnp.float8_e4m3fn),
                             jnp.full((2, 512), 1e4), jnp.full((2, 64), -1e4),
                             jnp.asarray([0, 1], jnp.int32), kv_scale=2.0)
    values = np.asarray(cache, np.float32)[0, :2]
    assert (values[:, :512] == 448).all() and (values[:, 512:] == -448).all()


def test_inf_and_nan_are_written_as_nan():
    """e4m3 has no inf: an inf is not saturated to a finite value but stored as NaN, like NaN."""
    latent = jnp.ones((2, 512)).at[0, 3].set(jnp.inf).at[1, 7].set(-jnp.inf).at[1, 9].set(jnp.nan)
    cache = jax_mla.write_kv(jax_mla.allocate_cache(1, 4, dtype=jnp.float8_e4m3fn), latent,
                             jnp.ones((2, 64)), jnp.asarray([0, 1], jnp.int32), kv_scale=0.5)
    values = np.asarray(cache, np.float32)[0, :2]
    assert np.isnan(values[0, 3]) and np.isnan(values[1, 7]) and np.isnan(values[1, 9])
    assert np.isnan(values).sum() == 3 and (values[0, :3] == 2).all()


CACHE = jnp.zeros((4, 8, 576), jnp.float8_e4m3fn)
LATENT, ROPE = jnp.zeros((3, 512), jnp.float32), jnp.zeros((3, 64), jnp.float32)
SCALE_ERRORS = [
    (dict(kv_scale=None), TypeError, r"kv_cache is an e4m3 cache \(float8_e4m3fn\): pass kv_scale"),
    (dict(kv_scale=0.0), ValueError, r"kv_scale must be finite and > 0, got 0.0"),
    (dict(kv_scale=-1.0), ValueError, r"kv_scale must be finite and > 0, got -1.0"),
    (dict(kv_scale=float("inf")), ValueError, r"kv_scale must be finite and > 0, got inf"),
    (dict(kv_scale=jnp.float32(0.5)), TypeError, r"kv_scale must be a Python float, got "),
    (dict(kv_scale=True), TypeError, r"kv_scale must be a Python float, got bool"),
    (dict(kv_cache=CACHE.astype(jnp.bfloat16), kv_scale=0.5), TypeError,
     r"kv_scale is for an e4m3 cache \(float8_e4m3fn\) only; kv_cache has dtype bfloat16, so pass "
     r"kv_scale=None, got 0.5"),
]


@pytest.mark.parametrize("overrides,error,message", SCALE_ERRORS)
def test_write_kv_checks_the_scale(overrides, error, message):
    args = dict(kv_cache=CACHE, latent=LATENT, k_rope=ROPE, slot_mapping=jnp.zeros(3, jnp.int32))
    args.update(overrides)
    with pytest.raises(error, match=message):
        jax_mla.write_kv(**args)


# ---- decode on xla ----------------------------------------------------------------------------------

GRID = [pytest.param(q_len, num_heads, page_size, dtype,
                     id=f"q{q_len}-h{num_heads}-p{page_size}-{jnp.dtype(dtype).name}")
        for (q_len, num_heads, page_size), dtype in zip(
            itertools.product([1, 2, 4], [16, 128], [1, 16, 64]),
            itertools.cycle([jnp.float32, jnp.bfloat16]))]


@pytest.mark.parametrize("q_len,num_heads,page_size,dtype", GRID)
def test_decode_on_the_e4m3_cache(q_len, num_heads, page_size, dtype):
    """Variable lengths, shuffled pages, garbage table padding, unused rows of NaN bytes."""
    seed = 31 * q_len + num_heads + page_size
    problem, source, kv_scale = e4m3_problem(make_problem(
        seed, batch=3, q_len=q_len, num_heads=num_heads, page_size=page_size, max_len=400,
        dtype=dtype), seed)
    out, _ = check_both("xla", problem, source, kv_scale, output_scale=0.7)
    assert not np.isnan(out).any(), "NaN leaked from poisoned cache rows"


def test_written_tokens_decode_like_the_bf16_cache():
    """allocate, write_kv (donated) and decode with checks=True, near the bf16 cache's decode."""
    rng = np.random.default_rng(4)
    tables = jnp.asarray([[4, 1, 5], [7, 0, 2]], jnp.int32)
    lengths = np.array([40, 9])
    slots = np.concatenate([np.asarray(tables[b])[np.arange(n) // 16] * 16 + np.arange(n) % 16
                            for b, n in enumerate(lengths)]).astype(np.int32)
    latent = jnp.asarray(rng.standard_normal((len(slots), 512)), jnp.float32)
    k_rope = jnp.asarray(rng.standard_normal((len(slots), 64)), jnp.float32)
    write = jax.jit(jax_mla.write_kv, donate_argnums=0, static_argnames="kv_scale")
    e4m3 = write(jax_mla.allocate_cache(8, 16, dtype=jnp.float8_e4m3fn), latent, k_rope,
                 jnp.asarray(slots), kv_scale=0.01)
    bf16 = write(jax_mla.allocate_cache(8, 16), latent, k_rope, jnp.asarray(slots))
    query = jnp.asarray(rng.standard_normal((2, 1, 16, 576)), jnp.bfloat16)
    seq_lens = jnp.asarray(lengths, jnp.int32)
    out = jax_mla.decode(query, e4m3, tables, seq_lens, softmax_scale=0.1, kv_scale=0.01,
                         checks=True)
    ref = jax_mla.decode(query, bf16, tables, seq_lens, softmax_scale=0.1)
    assert request_head_error(out, np.asarray(ref, np.float32)) < AGAINST_BF16[0]


def test_heads_and_batch_sharded_on_the_e4m3_cache():
    mesh = cpu_mesh((2, 2))
    problem, _, kv_scale = e4m3_problem(make_problem(12, batch=4, q_len=2, num_heads=16,
                                                     page_size=16, max_len=200), 12)
    query, kv_cache, block_tables, seq_lens = problem.arrays
    args = (put(mesh, query, "data", None, "tp", None), put(mesh, kv_cache),
            put(mesh, block_tables, "data"), put(mesh, seq_lens, "data"))
    fn = jax.jit(lambda *a: jax_mla.decode(*a, softmax_scale=0.1, return_lse=True,
                                           backend="xla", kv_scale=kv_scale))
    out, lse = fn(*args)
    assert collectives(fn, *args) == []
    unsharded_out, unsharded_lse = fn(*problem.arrays)
    assert_near(out, unsharded_out)
    assert_near(lse, unsharded_lse)


DECODE, _, DECODE_SCALE = e4m3_problem(make_problem(0, batch=2, q_len=1, num_heads=16,
                                                    page_size=16, max_len=40), 0)


@pytest.mark.parametrize("overrides,error,message", SCALE_ERRORS[:-1] + [
    (dict(kv_cache=DECODE.kv_cache.astype(jnp.float32), kv_scale=0.5), TypeError,
     r"kv_scale is for an e4m3 cache \(float8_e4m3fn\) only; kv_cache has dtype float32"),
    (dict(kv_cache=DECODE.kv_cache[..., :512]), ValueError,
     r"kv_cache's last dim must equal query's last dim 576"),
    (dict(kv_scale=1e30, output_scale=1e10), ValueError,
     r"output_scale \* kv_scale must be finite, got 1e\+40"),
    (dict(kv_scale=1e30, softmax_scale=1e10), ValueError,
     r"softmax_scale \* kv_scale must be finite and > 0, got 1e\+40"),
    (dict(kv_scale=1e300), ValueError, r"kv_scale must be finite and > 0, got 1e\+300"),
])
def test_decode_checks_the_scale(overrides, error, message):
    args = dict(query=DECODE.query, kv_cache=DECODE.kv_cache, block_tables=DECODE.block_tables,
                seq_lens=DECODE.seq_lens, kv_scale=DECODE_SCALE, softmax_scale=0.1)
    args.update(overrides)
    with pytest.raises(error, match=message):
        jax_mla.decode(args.pop("query"), args.pop("kv_cache"), args.pop("block_tables"),
                       args.pop("seq_lens"), **args)


# ---- backends ---------------------------------------------------------------------------------------

def test_trtllm_gen_fa3_fa2_and_xla_take_the_e4m3_cache():
    assert [b.name for b in backends.TABLE if backends.E4M3_CACHE in b.cache_formats] == [
        "trtllm-gen", "fa3", "fa2", "xla"]
    assert backends.cache_format_of(DECODE.kv_cache) == backends.E4M3_CACHE


@pytest.mark.parametrize("capability,expected",
                         [((9, 0), "fa3"), ((8, 0), "xla"), ((10, 0), "xla")])
def test_auto_runs_the_e4m3_cache_on_fa3_on_hopper_else_xla(monkeypatch, capability, expected):
    """fa3 takes the e4m3 cache on SM90; fa2 would on SM90 only, where fa3 comes first; trtllm-gen
    takes it only when named, until it has run on hardware; sm90 does not take it."""
    monkeypatch.setattr(gpu, "runtime_missing", lambda: None)
    monkeypatch.setattr(gpu, "capability", lambda device=None: capability)
    assert backends.resolve("auto", "gpu", jnp.bfloat16, backends.E4M3_CACHE) == expected
    assert backends.resolve("auto", "gpu", jnp.bfloat16) != "xla"
    assert [b.name for b in backends.TABLE if backends.E4M3_CACHE in b.named_only_formats] == [
        "trtllm-gen"]


def test_fa2_takes_the_e4m3_cache_on_sm90_only(monkeypatch):
    monkeypatch.setattr(gpu, "runtime_missing", lambda: None)
    monkeypatch.setattr(gpu, "capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"backend 'fa2' takes the e4m3 cache \(float8_e4m3fn\) "
                                         r"on SM90 \(FlashInfer's fp8 MLA\) only, not on this GPU "
                                         r"\(compute capability 8.0\)"):
        backends.resolve("fa2", "gpu", jnp.bfloat16, backends.E4M3_CACHE)
    monkeypatch.setattr(gpu, "capability", lambda device=None: (9, 0))
    assert backends.resolve("fa2", "gpu", jnp.bfloat16, backends.E4M3_CACHE) == "fa2"


def test_sm90_refuses_the_e4m3_cache(monkeypatch):
    monkeypatch.setattr(backends, "available_backends",
                        lambda platform=None: ["trtllm-gen", "fa3", "fa2", "sm90", "xla"])
    monkeypatch.setattr(gpu, "runtime_missing", lambda: "no GPU here")
    message = (r"backend 'sm90' takes caches of the query's dtype or the fp8 cache \(uint8\), got "
               r"the e4m3 cache \(float8_e4m3fn\) \(docs/fp8-cache.md\); backends that take it: "
               r"\['trtllm-gen', 'fa3', 'fa2', 'xla'\]")
    with pytest.raises(TypeError, match=message):
        backends.resolve("sm90", "gpu", jnp.bfloat16, backends.E4M3_CACHE)


def lower_on_a_stand_in_gpu(monkeypatch, backend: str, capability, q_len: int, **kwargs) -> str:
    """StableHLO text of a decode on the e4m3 cache through ``backend``, lowered for CUDA on any
    machine: the entry points, SM count and GPU that a real one would supply are stood in."""
    monkeypatch.setattr(gpu, "fa_entry_points",
                        lambda b, r, p, kv="bfloat16": (f"t.{b}.{kv}.run", f"t.{b}.{kv}.plan"))
    monkeypatch.setattr(gpu, "trtllm_entry_point", lambda: "t.trtllm")
    monkeypatch.setattr(gpu, "sm_count", lambda device=None: 132)
    monkeypatch.setattr(gpu, "register_targets", lambda: None)
    monkeypatch.setattr(gpu, "runtime_missing", lambda: None)
    monkeypatch.setattr(gpu, "capability", lambda device=None: capability)
    monkeypatch.setattr(backends, "platform_of", lambda *arrays: "gpu")
    monkeypatch.setattr(backends, "available_backends", lambda platform=None: [backend, "xla"])
    shapes = (jax.ShapeDtypeStruct((4, q_len, 16, 576), jnp.bfloat16),
              jax.ShapeDtypeStruct((64, 64, 576), jnp.float8_e4m3fn),
              jax.ShapeDtypeStruct((4, 8), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.int32))
    decode = jax.jit(lambda *a: jax_mla.decode(*a, softmax_scale=0.125, output_scale=2.0,
                                               kv_scale=0.25, backend=backend, **kwargs))
    return decode.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def test_fa_lowering_runs_the_fp8_module_with_the_scale_folded_in(monkeypatch):
    """The e4m3 cache reaches FlashInfer's fp8 module as it is (no conversion in the program), with
    softmax_scale * kv_scale as the kernel's scale and output_scale * kv_scale applied after it."""
    text = lower_on_a_stand_in_gpu(monkeypatch, "fa3", (9, 0), 1, fail_closed=False)
    call = next(line for line in text.splitlines() if "@jax_mla_fa_decode_self_plan(" in line)
    assert 'run_fn = "t.fa3.float8_e4m3fn.run"' in call
    assert "softmax_scale = 3.125000e-02" in call and "tensor<64x64x576xf8E4M3FN>" in call
    assert "stablehlo.convert" not in text.split("@jax_mla_fa_decode_self_plan")[0]
    assert "5.000000e-01" in text  # output_scale * kv_scale, multiplied after the kernel


def test_trtllm_gen_lowering_quantises_the_query_with_its_scale_on_the_device(monkeypatch):
    """trtllm-gen's fp8 MLA takes an e4m3 query: the program quantises it by max |query| / 448 and
    hands the kernel that scale times softmax_scale * kv_scale * log2(e) as a device float; the
    output scale (times kv_scale) stays an attribute."""
    text = lower_on_a_stand_in_gpu(monkeypatch, "trtllm-gen", (10, 0), 2)
    call = next(line for line in text.splitlines() if "@jax_mla_trtllm_decode_fp8(" in line)
    assert "tensor<4x2x16x576xf8E4M3FN>" in call and "tensor<64x64x576xf8E4M3FN>" in call
    assert "tensor<1xf32>" in call and "softmax_scale" not in call
    assert "output_scale = 5.000000e-01" in call and 'decode_fn = "t.trtllm"' in call
    assert "tensor<4x2x16x512xbf16>" in call and "@jax_mla_trtllm_decode(" not in text


def test_a_non_finite_query_value_leaves_the_e4m3_querys_scale_alone():
    """One request's inf is NaN in its own query; the scale comes from the finite values, so the
    other requests' queries are read as without it."""
    query = jnp.ones((2, 1, 1, 576)).at[0, 0, 0, 0].set(jnp.inf).at[0, 0, 0, 1].set(jnp.nan)
    values, scale_log2 = gpu.e4m3_query(query, 0.1)
    clean_values, clean_scale_log2 = gpu.e4m3_query(jnp.ones((2, 1, 1, 576)), 0.1)
    assert float(scale_log2[0]) == float(clean_scale_log2[0])
    values, clean_values = np.asarray(values, np.float32), np.asarray(clean_values, np.float32)
    assert np.isnan(values[0, 0, 0, :2]).all()
    np.testing.assert_array_equal(values[0, 0, 0, 2:], clean_values[0, 0, 0, 2:])
    np.testing.assert_array_equal(values[1], clean_values[1])


@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 3e3])
def test_the_e4m3_query_and_its_scale(magnitude):
    rng = np.random.default_rng(8)
    query = jnp.asarray(rng.standard_normal((2, 1, 4, 576)) * magnitude, jnp.bfloat16)
    values, scale_log2 = jax.jit(gpu.e4m3_query, static_argnums=1)(query, 0.1)
    scale = float(jnp.max(jnp.abs(query.astype(jnp.float32)))) / 448
    assert values.dtype == jnp.float8_e4m3fn and scale_log2.shape == (1,)
    assert float(scale_log2[0]) == pytest.approx(0.1 * scale * np.log2(np.e), rel=1e-6)
    read_back = np.asarray(values, np.float32) * scale
    exact = np.asarray(query, np.float32)
    normal = np.abs(exact) >= 2.0**-6 * scale
    assert float(np.abs(read_back).max()) == pytest.approx(float(np.abs(exact).max()), rel=1e-6)
    assert (np.abs(read_back - exact) <= ROUND_TRIP_ERROR * np.abs(exact))[normal].all()
    zeros, zero_scale = gpu.e4m3_query(jnp.zeros((1, 1, 1, 576), jnp.bfloat16), 0.1)
    assert not np.asarray(zeros, np.float32).any()
    assert float(zero_scale[0]) == pytest.approx(0.1 * np.log2(np.e))


# ---- decode on fa3 and fa2 (SM90) -------------------------------------------------------------------

def fa_params():
    runnable = gpu_backends_here()
    params = []
    for name in (backends.FA3, backends.FA2):
        marks = [pytest.mark.gpu]
        if name not in runnable or gpu.capability() != (9, 0):
            why = gpu_blocker() or f"needs an SM90 GPU that runs {name} ({runnable=})"
            marks.append(pytest.mark.skip(reason=f"{name} on the e4m3 cache: {why}"))
        params.append(pytest.param(name, id=name, marks=marks))
    return params


@pytest.mark.parametrize("backend", fa_params())
@pytest.mark.parametrize("plan_kind", ["none", "host", "device"])
@pytest.mark.parametrize("q_len,num_heads,page_size", [(1, 16, 64), (2, 128, 16), (4, 16, 1),
                                                       (1, 128, 32)])
def test_flashinfer_on_the_e4m3_cache(backend, plan_kind, q_len, num_heads, page_size):
    """FlashInfer's fp8 kernels through jax_mla, planned in the call, on the host or on the GPU:
    the bf16 kernels' tolerances against the reference on the same cache."""
    seed = 7 * q_len + num_heads + page_size
    problem, source, kv_scale = e4m3_problem(make_problem(
        seed, batch=5, q_len=q_len, num_heads=num_heads, page_size=page_size, max_len=900,
        dtype=jnp.bfloat16), seed)
    if plan_kind == "host":
        plan = jax_mla.plan(np.asarray(problem.seq_lens), num_heads=num_heads, q_len=q_len,
                            max_pages=problem.block_tables.shape[1])
    else:
        plan = "device" if plan_kind == "device" else None
    out, _ = check_both(backend, problem, source, kv_scale, output_scale=0.5, plan=plan)
    assert not np.isnan(out).any()


@pytest.mark.gpu
def test_auto_runs_fa3_on_the_e4m3_cache():
    """On an H200, "auto" on the e4m3 cache is fa3, bit for bit (sm90 does not take this cache)."""
    if backends.FA3 not in gpu_backends_here() or gpu.capability() != (9, 0):
        pytest.skip(f"needs an SM90 GPU that runs fa3: {gpu_blocker() or gpu_backends_here()}")
    problem, _, kv_scale = e4m3_problem(make_problem(
        5, batch=33, q_len=1, num_heads=16, page_size=64, max_len=700, dtype=jnp.bfloat16), 5)
    outputs = [np.asarray(jax.jit(lambda *a, b=name: jax_mla.decode(
        *a, softmax_scale=problem.softmax_scale, kv_scale=kv_scale, backend=b))(*problem.arrays))
        for name in ("auto", backends.FA3)]
    np.testing.assert_array_equal(outputs[0], outputs[1])
