"""Every malformed call raises ValueError/TypeError at trace time, naming the argument."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_problem

import jax_mla
from jax_mla import backends, gpu, validation

P = make_problem(0, batch=2, q_len=1, num_heads=16, page_size=16, max_len=40)
Q, KV, BT, SL = P.arrays


def call(**overrides):
    args = dict(query=Q, kv_cache=KV, block_tables=BT, seq_lens=SL, softmax_scale=0.1)
    args.update(overrides)
    return jax_mla.decode(args.pop("query"), args.pop("kv_cache"), args.pop("block_tables"),
                          args.pop("seq_lens"), **args)


DECODE_ERRORS = [
    (dict(query=Q[0]), ValueError, r"query must have rank 4 .*got shape \(1, 16, 576\)"),
    (dict(kv_cache=KV[0]), ValueError, r"kv_cache must have rank 3"),
    (dict(block_tables=BT[0]), ValueError, r"block_tables must have rank 2"),
    (dict(seq_lens=SL[None]), ValueError, r"seq_lens must have rank 1"),
    (dict(kv_cache=KV[..., :520]), ValueError, r"kv_cache's last dim must equal query's last dim 576"),
    (dict(query=Q.astype(jnp.bfloat16)), TypeError, r"same dtype.*bfloat16.*float32"),
    (dict(query=Q.astype(jnp.int32), kv_cache=KV.astype(jnp.int32)), TypeError,
     r"query must have a floating dtype of at least 16 bits \(bfloat16, float16, float32\), got "
     r"int32"),
    (dict(query=Q.astype(jnp.float8_e5m2), kv_cache=KV.astype(jnp.float8_e5m2)), TypeError,
     r"query must have a floating dtype of at least 16 bits .*got float8_e5m2"),
    (dict(kv_cache=KV[:0]), ValueError,
     r"kv_cache's num_pages \(dim 0\) must be >= 1, got kv_cache shape \(0, 16, 576\)"),
    (dict(query=Q[..., :64], kv_cache=KV[..., :64]), ValueError,
     r"query's last dim must exceed the default rope_dim 64 \(kv_lora_rank defaults to it less 64; "
     r"pass kv_lora_rank= for another split\), got 64"),
    (dict(softmax_scale=10 ** 400), ValueError,
     r"softmax_scale must be finite in float64, got an int of 401 digits"),
    (dict(fail_closed="yes"), TypeError, r"fail_closed must be a bool, got str"),
    (dict(block_tables=BT.astype(jnp.int16)), TypeError, r"block_tables must have dtype int32, got int16"),
    (dict(seq_lens=SL.astype(jnp.uint32)), TypeError, r"seq_lens must have dtype int32, got uint32"),
    (dict(block_tables=BT[:1]), ValueError, r"block_tables must have shape \[batch=2, max_pages\]"),
    (dict(seq_lens=SL[:1]), ValueError, r"seq_lens must have shape \[batch=2\], got \(1,\)"),
    (dict(query=Q[:, :0]), ValueError, r"q_len \(dim 1\) must be >= 1"),
    (dict(kv_cache=KV[:, :0]), ValueError, r"page_size \(dim 1\) must be >= 1"),
    (dict(softmax_scale=float("nan")), ValueError, r"softmax_scale must be finite and > 0, got nan"),
    (dict(softmax_scale=float("inf")), ValueError, r"softmax_scale must be finite and > 0"),
    (dict(softmax_scale=0.0), ValueError, r"softmax_scale must be finite and > 0, got 0.0"),
    (dict(softmax_scale=-0.1), ValueError, r"softmax_scale must be finite and > 0, got -0.1"),
    (dict(softmax_scale=1e-50), ValueError, r"softmax_scale must be finite and > 0, got 1e-50"),
    (dict(softmax_scale=3e38), ValueError,
     r"softmax_scale must be at most 2.359e\+38 \(times log2\(e\) it must stay finite in float32\), "
     r"got 3e\+38"),
    (dict(softmax_scale="0.1"), TypeError, r"softmax_scale must be a Python float, got str"),
    (dict(softmax_scale=jnp.float32(0.1)), TypeError,
     r"softmax_scale must be a Python float, got ArrayImpl: it is compiled into the call"),
    (dict(output_scale=float("-inf")), ValueError, r"output_scale must be finite"),
    (dict(backend="flashmla"), ValueError, r"unknown backend 'flashmla'.*available here: \[.*'xla'\]"),
    (dict(backend="fa3"), ValueError, r"backend 'fa3' needs an NVIDIA GPU.*available here: \['xla'\]"),
    (dict(backend="trtllm-gen"), ValueError, r"'trtllm-gen' needs an NVIDIA GPU"),
    (dict(kv_lora_rank=576), ValueError, r"kv_lora_rank must be in \(0, 576\) for query's last dim "
                                         r"576"),
    (dict(return_lse=1), TypeError, r"return_lse must be a bool"),
    (dict(query=[[1.0]]), TypeError, r"query must be an array, got list"),
    (dict(plan=object()), TypeError, r"plan must be None, 'device' or a jax_mla.Plan"),
    (dict(plan="device", backend="xla"), ValueError,
     r"plan is only read by the fa3/fa2 backends; backend 'xla' takes plan=None, got str"),
    (dict(kv_lora_rank=512.0), TypeError, r"kv_lora_rank must be an int, got float"),
    (dict(kv_lora_rank=True), TypeError, r"kv_lora_rank must be an int, got bool"),
    (dict(kv_lora_rank=-1), ValueError, r"kv_lora_rank must be in \(0, 576\)"),
    (dict(kv_lora_rank=jnp.int32(512)), TypeError,
     r"kv_lora_rank must be an int, got ArrayImpl: it is compiled into the call"),
    (dict(query=Q[:, :, :0]), ValueError, r"query's num_heads \(dim 2\) must be >= 1, got query shape "
                                          r"\(2, 1, 0, 576\)"),
    (dict(block_tables=BT[:, :0]), ValueError,
     r"block_tables must have at least one page column, got \(2, 0\)"),
    (dict(backend=None), TypeError, r"backend must be a str \('auto' or one of \['trtllm-gen', 'fa3', "
                                    r"'fa2', 'sm90', 'xla'\]\), got NoneType"),
]


@pytest.mark.parametrize("overrides,error,message", DECODE_ERRORS,
                         ids=[f"decode-{i}" for i in range(len(DECODE_ERRORS))])
def test_decode_rejects(overrides, error, message):
    if jax.default_backend() != "cpu" and "needs an NVIDIA GPU" in message:
        pytest.skip("only meaningful on a CPU-only machine")
    with pytest.raises(error, match=message):
        call(**overrides)


def test_fa3_without_flashinfer_names_the_package(monkeypatch):
    """On a GPU whose environment lacks FlashInfer, asking for fa3 says what to install."""
    monkeypatch.setattr(backends, "platform_of", lambda *arrays: "gpu")
    monkeypatch.setattr(gpu, "library_path", lambda: Path("libjax_mla_ffi.so"))
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # find_spec reports it absent
    with pytest.raises(ValueError, match=r"backend 'fa3' is unavailable: flashinfer-python is not "
                                         r"installed \(pip install 'jax_mla\[cuda\]'\); available "
                                         r"here: \['xla'\]"):
        call(query=Q.astype(jnp.bfloat16), kv_cache=KV.astype(jnp.bfloat16), backend="fa3")


def test_trtllm_gen_refuses_a_device_plan(monkeypatch):
    monkeypatch.setattr(backends, "available_backends",
                        lambda platform=None: ["trtllm-gen", "fa3", "fa2", "xla"])
    with pytest.raises(ValueError, match=r"plan is only read by the fa3/fa2 backends; backend "
                                         r"'trtllm-gen' takes plan=None, got str"):
        call(query=Q.astype(jnp.bfloat16), kv_cache=KV.astype(jnp.bfloat16), backend="trtllm-gen",
             plan="device")


def test_errors_are_raised_at_trace_time():
    with pytest.raises(ValueError, match="block_tables must have shape"):
        jax.jit(lambda q, bt: call(query=q, block_tables=bt)).trace(Q, BT[:1])


CACHE = jnp.zeros((4, 8, 576), jnp.float32)
LATENT = jnp.zeros((3, 512), jnp.float32)
ROPE = jnp.zeros((3, 64), jnp.float32)
SLOTS = jnp.zeros((3,), jnp.int32)

WRITE_ERRORS = [
    (dict(kv_cache=CACHE[0]), ValueError, r"kv_cache must have rank 3"),
    (dict(latent=LATENT[0]), ValueError, r"latent must have rank 2"),
    (dict(k_rope=ROPE[:2]), ValueError, r"k_rope must have shape \[num_tokens=3, rope_dim\], got \(2, 64\)"),
    (dict(slot_mapping=SLOTS[:2]), ValueError, r"slot_mapping must have shape \[num_tokens=3\]"),
    (dict(slot_mapping=SLOTS.astype(jnp.int64 if jax.config.jax_enable_x64 else jnp.uint8)), TypeError,
     r"slot_mapping must have dtype int32"),
    (dict(latent=LATENT[:, :500]), ValueError,
     r"latent must be \[num_tokens, kv_lora_rank=512\] and k_rope \[num_tokens, rope_dim=64\] for "
     r"kv_cache's last dim 576 .*got latent \(3, 500\), k_rope \(3, 64\)$"),
    (dict(latent=ROPE, k_rope=LATENT), ValueError,
     r"got latent \(3, 64\), k_rope \(3, 512\); latent and k_rope look swapped"),
    (dict(latent=LATENT[:, :448], k_rope=jnp.zeros((3, 128))), ValueError,
     r"kv_lora_rank=512\] .* pass kv_lora_rank= for another split"),
    (dict(kv_lora_rank=448), ValueError, r"latent must be \[num_tokens, kv_lora_rank=448\] and k_rope "
                                         r"\[num_tokens, rope_dim=128\]"),
    (dict(kv_lora_rank=512.0), TypeError, r"kv_lora_rank must be an int, got float"),
    (dict(latent=LATENT.astype(jnp.int32)), TypeError, r"latent must have a floating dtype"),
    (dict(k_rope=ROPE.astype(jnp.float8_e4m3fn)), TypeError,
     r"k_rope must have a floating dtype of at least 16 bits .*got float8_e4m3fn"),
    (dict(kv_cache=CACHE.astype(jnp.float8_e5m2)), TypeError,
     r"kv_cache must have a floating dtype of at least 16 bits, uint8 for an fp8 cache or "
     r"float8_e4m3fn for an e4m3 cache .*got float8_e5m2"),
    (dict(kv_cache=CACHE[:, :0]), ValueError, r"kv_cache's page_size \(dim 1\) must be >= 1"),
    (dict(kv_cache=CACHE[:0]), ValueError, r"kv_cache's num_pages \(dim 0\) must be >= 1"),
    (dict(kv_cache=CACHE[..., :32], latent=LATENT[:, :16], k_rope=ROPE[:, :16]), ValueError,
     r"kv_cache's last dim must exceed the default rope_dim 64 .*got 32"),
]


@pytest.mark.parametrize("overrides,error,message", WRITE_ERRORS,
                         ids=[f"write-{i}" for i in range(len(WRITE_ERRORS))])
def test_write_kv_rejects(overrides, error, message):
    args = dict(kv_cache=CACHE, latent=LATENT, k_rope=ROPE, slot_mapping=SLOTS)
    args.update(overrides)
    with pytest.raises(error, match=message):
        jax_mla.write_kv(**args)


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(num_pages=0, page_size=16), ValueError, r"num_pages must be >= 1, got 0"),
    (dict(num_pages=4, page_size=1.5), TypeError, r"page_size must be an int, got float"),
    (dict(num_pages=4, page_size=16, dtype=jnp.int8), TypeError, r"dtype must be a floating dtype"),
    (dict(num_pages=4, page_size=16, device="cpu"), TypeError,
     r"device must be None, a jax.Device or a jax.sharding.Sharding, got 'cpu'"),
    (dict(num_pages=2**25, page_size=64), ValueError,
     r"^num_pages \* page_size must be < 2\*\*31 token slots \(slot_mapping is int32\), got "
     r"33554432 \* 64$"),
])
def test_allocate_cache_rejects(kwargs, error, message):
    with pytest.raises(error, match=message):
        jax_mla.allocate_cache(**kwargs)


def test_write_kv_takes_another_split_when_named():
    """A cache row of 576 channels takes a 448 + 128 split when kv_lora_rank says so: each part
    lands in its channels."""
    out = jax_mla.write_kv(CACHE, LATENT[:, :448] + 1, ROPE.repeat(2, axis=1) + 2, SLOTS.at[1].set(1),
                           kv_lora_rank=448)
    assert float(out[0, 1, 447]) == 1 and float(out[0, 1, 448]) == 2


def test_int32_limits_are_named_without_allocating():
    """Tables and written caches past int32 are refused at trace time (shapes only, no memory)."""
    def struct(shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype)

    with pytest.raises(ValueError, match=r"block_tables' capacity max_pages \* page_size must be "
                                         r"< 2\*\*31 tokens \(the lengths are int32\), got 32768 \* "
                                         r"65536 = 2147483648"):
        jax.eval_shape(lambda *a: jax_mla.decode(*a, softmax_scale=0.1), struct((1, 1, 4, 576)),
                       struct((4, 2**16, 576)), struct((1, 2**15), jnp.int32),
                       struct((1,), jnp.int32))
    with pytest.raises(ValueError, match=r"kv_cache's num_pages \* page_size must be < 2\*\*31 token "
                                         r"slots \(slot_mapping is int32\)"):
        jax.eval_shape(jax_mla.write_kv, struct((2**31, 16, 576)), struct((1, 512)),
                       struct((1, 64)), struct((1,), jnp.int32))


def test_the_largest_softmax_scale_is_taken_and_the_next_float32_is_not():
    largest = validation.MAX_SOFTMAX_SCALE
    assert np.isfinite(np.float32(largest) * np.float32(np.log2(np.e)))
    call(softmax_scale=largest)
    with pytest.raises(ValueError, match="softmax_scale must be at most"):
        call(softmax_scale=float(np.nextafter(np.float32(largest), np.float32(np.inf))))


def test_flags_may_be_numpy_bools():
    out, lse = call(return_lse=np.bool_(True), fail_closed=np.bool_(False), checks=np.bool_(False))
    assert out.shape == (2, 1, 16, 512) and lse.shape == (2, 1, 16)


def test_write_kv_takes_a_numpy_cache_as_decode_does():
    out = jax_mla.write_kv(np.zeros(CACHE.shape, np.float32), LATENT + 1, ROPE + 2, SLOTS)
    assert isinstance(out, jax.Array) and float(out[0, 0, 0]) == 1 and float(out[0, 0, 512]) == 2


@pytest.mark.parametrize("device", [jax.devices("cpu")[0], "cuda:0"])
def test_a_host_plan_names_a_device_that_is_not_a_gpu(device):
    with pytest.raises(ValueError, match=r"device must be a CUDA jax.Device \(e.g. "
                                         r"jax.devices\('gpu'\)\[0\]\), got "):
        jax_mla.plan(np.array([5]), num_heads=4, max_pages=3, device=device)


def test_integer_sizes_may_be_numpy_integers():
    cache = jax_mla.allocate_cache(np.int64(2), np.int32(16), kv_lora_rank=np.int64(512))
    assert cache.shape == (2, 16, 576)
    out = call(kv_lora_rank=np.int64(512))
    assert out.shape == (2, 1, 16, 512)


@pytest.mark.parametrize("seq_lens,kwargs,error,message", [
    ([3, 5], {}, TypeError, r"seq_lens must be an array, got list"),
    (jnp.ones((2, 2), jnp.int32), {}, ValueError, r"seq_lens must have rank 1 \(\[batch\]\)"),
    (jnp.ones((2,), jnp.float32), {}, TypeError, r"seq_lens must have dtype int32, got float32"),
    (jnp.ones((2,), jnp.int32), dict(num_heads=0), ValueError, r"num_heads must be >= 1, got 0"),
    (jnp.ones((0,), jnp.int32), {}, ValueError,
     r"seq_lens must hold at least one request, got shape \(0,\)"),
    (jnp.ones((2,), jnp.int32), dict(q_len=1.0), TypeError, r"q_len must be an int, got float"),
])
def test_device_plan_rejects(seq_lens, kwargs, error, message):
    """Checked before the GPU is asked for, so the same errors on every machine."""
    args = dict(num_heads=16, max_pages=4)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        jax_mla.device_plan(seq_lens, **args)


def test_backend_for_names_what_decode_runs_and_raises_what_it_raises():
    assert jax_mla.backend_for(Q, KV, BT) == "xla"
    structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (Q, KV, BT)]
    assert jax_mla.backend_for(*structs, backend="xla") == "xla"
    with pytest.raises(ValueError, match=r"plan is only read by the fa3/fa2 backends"):
        jax_mla.backend_for(Q, KV, BT, plan="device")
    with pytest.raises(ValueError, match=r"kv_cache's last dim must equal query's last dim 576"):
        jax_mla.backend_for(Q, KV[..., :520], BT)


def test_a_traced_size_is_named_as_static():
    """write_kv jitted without marking kv_lora_rank static: the error says what to do."""
    with pytest.raises(TypeError, match=r"kv_lora_rank must be an int, got .*Tracer: it is compiled "
                                         r"into the call, so pass a static value"):
        jax.jit(jax_mla.write_kv)(CACHE, LATENT, ROPE, SLOTS, kv_lora_rank=512)
