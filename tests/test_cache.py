"""Paged-cache writes, allocation and DLPack interop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import make_problem, relative_error

import jax_mla
from jax_mla.reference import reference_from_jax


def random_tokens(rng, num_tokens, kv_lora_rank=512, rope_dim=64, dtype=jnp.float32):
    latent = jnp.asarray(rng.standard_normal((num_tokens, kv_lora_rank)), dtype)
    k_rope = jnp.asarray(rng.standard_normal((num_tokens, rope_dim)), dtype)
    return latent, k_rope


@pytest.mark.parametrize("page_size,kv_lora_rank", [(1, 512), (16, 512), (64, 256)])
def test_write_kv_round_trip(page_size, kv_lora_rank):
    rng = np.random.default_rng(page_size)
    cache = jax_mla.allocate_cache(8, page_size, kv_lora_rank=kv_lora_rank, dtype=jnp.float32)
    assert cache.shape == (8, page_size, kv_lora_rank + 64)
    before = np.asarray(rng.standard_normal(cache.shape), np.float32)
    cache = jnp.asarray(before)
    slots = rng.choice(8 * page_size, size=min(10, 8 * page_size), replace=False)
    padded = np.concatenate([slots, [-1, -100]]).astype(np.int32)
    latent, k_rope = random_tokens(rng, len(padded), kv_lora_rank)
    updated = np.asarray(jax.jit(jax_mla.write_kv)(cache, latent, k_rope, jnp.asarray(padded)))
    expected = before.reshape(-1, before.shape[-1]).copy()
    rows = np.concatenate([np.asarray(latent), np.asarray(k_rope)], axis=-1)
    expected[slots] = rows[:len(slots)]  # padding rows (negative slots) are skipped
    np.testing.assert_array_equal(updated.reshape(expected.shape), expected)


def test_write_kv_casts_to_the_cache_dtype():
    rng = np.random.default_rng(0)
    cache = jax_mla.allocate_cache(2, 4)
    assert cache.dtype == jnp.bfloat16
    latent, k_rope = random_tokens(rng, 2)
    updated = jax_mla.write_kv(cache, latent, k_rope, jnp.asarray([5, 0], jnp.int32))
    assert updated.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(updated[1, 1, :512]), np.asarray(latent[0], jnp.bfloat16))


def test_write_kv_donated_updates_in_place():
    """Donated, the compiled write aliases the cache and copies none of it."""
    rng = np.random.default_rng(1)
    cache = jax.device_put(jnp.zeros((64, 16, 576), jnp.float32))
    latent, k_rope = random_tokens(rng, 4)
    slots = jnp.asarray([3, 77, -1, 500], jnp.int32)
    write = jax.jit(jax_mla.write_kv, donate_argnums=0)
    hlo = write.lower(cache, latent, k_rope, slots).compile().as_text()
    assert "input_output_alias" in hlo
    assert " copy(" not in hlo and "copy-start" not in hlo, "the compiled write copies the cache"
    pointer = cache.unsafe_buffer_pointer()
    updated = write(cache, latent, k_rope, slots)
    assert cache.is_deleted()
    assert updated.unsafe_buffer_pointer() == pointer
    np.testing.assert_array_equal(np.asarray(updated[77 // 16, 77 % 16, :512]), np.asarray(latent[1]))


def test_written_cache_decodes_like_the_reference():
    """write_kv then decode: tokens written one step at a time are attended to."""
    rng = np.random.default_rng(2)
    page_size, num_heads = 16, 16
    cache = jax_mla.allocate_cache(6, page_size, dtype=jnp.float32)
    table = np.array([[4, 1, 5]], np.int32)
    seq_len = 37
    positions = np.arange(seq_len)
    slots = table[0, positions // page_size] * page_size + positions % page_size
    latent, k_rope = random_tokens(rng, seq_len)
    cache = jax.jit(jax_mla.write_kv, donate_argnums=0)(cache, latent, k_rope, jnp.asarray(slots, jnp.int32))
    query = jnp.asarray(rng.standard_normal((1, 1, num_heads, 576)), jnp.float32)
    args = (query, cache, jnp.asarray(table), jnp.asarray([seq_len], jnp.int32))
    out = jax_mla.decode(*args, softmax_scale=0.1)
    ref, _ = reference_from_jax(*args, softmax_scale=0.1)
    assert relative_error(out, ref.numpy()) < 1e-5


def test_torch_view_is_zero_copy():
    problem = make_problem(0, batch=2, q_len=1, num_heads=16, page_size=16, dtype=jnp.bfloat16)
    view = jax_mla.torch_view(problem.kv_cache)
    assert view.data_ptr() == problem.kv_cache.unsafe_buffer_pointer()
    assert view.dtype == torch.bfloat16 and tuple(view.shape) == problem.kv_cache.shape
    del view  # a live export would block donating the cache
    donated = jax.jit(lambda c: c + 1, donate_argnums=0)(problem.kv_cache)
    assert problem.kv_cache.is_deleted() and donated.shape == problem.kv_cache.shape
