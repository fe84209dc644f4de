"""Paged-cache writes, allocation and DLPack interop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import make_problem, request_head_error, tolerances
from oracles import attend

import jax_mla
from jax_mla import cache as cache_module
from jax_mla import fp8_cache


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


@pytest.mark.parametrize("dtype", [jnp.float32, "fp8"])
def test_write_kv_donated_updates_in_place(dtype):
    """Donated, the compiled write aliases the cache (the uint8 rows of an fp8 cache too) and copies
    none of it."""
    rng = np.random.default_rng(1)
    cache = jax.device_put(jax_mla.allocate_cache(64, 16, dtype=dtype))
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
    row = (fp8_cache.quantize_rows(latent, k_rope) if dtype == "fp8"
           else jnp.concatenate([latent, k_rope], axis=-1))
    np.testing.assert_array_equal(np.asarray(updated[77 // 16, 77 % 16]), np.asarray(row[1]))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, "fp8"])
def test_allocate_cache_makes_each_shard_on_its_device(dtype):
    """Given a sharding, the cache is made sharded (each device holds only its pages), zeroed,
    eagerly and inside jax.jit; given a device, on that device."""
    devices = jax.devices()
    if len(devices) < 4:
        pytest.skip("needs four devices (conftest forces four host devices on the CPU)")
    mesh = jax.sharding.Mesh(np.array(devices[2:4]), ("pool",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("pool", None, None))
    for cache in (jax_mla.allocate_cache(8, 16, dtype=dtype, device=sharding),
                  jax.jit(lambda: jax_mla.allocate_cache(8, 16, dtype=dtype, device=sharding))()):
        assert cache.sharding.is_equivalent_to(sharding, cache.ndim)
        assert {shard.device: shard.data.shape[0] for shard in cache.addressable_shards} == {
            devices[2]: 4, devices[3]: 4}
        assert not np.asarray(cache, np.float32).any()
    single = jax_mla.allocate_cache(2, 16, dtype=dtype, device=devices[1])
    assert single.devices() == {devices[1]}


def test_allocate_cache_on_a_device_compiles_once_per_shape():
    """A cache per layer on one sharding compiles its zeroing program once."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    jax_mla.allocate_cache(3, 16, device=sharding)
    programs = cache_module._zeros_program.cache_info().currsize
    for _ in range(3):
        assert not np.asarray(jax_mla.allocate_cache(3, 16, device=jax.devices()[0]),
                              np.float32).any()
    assert cache_module._zeros_program.cache_info().currsize == programs
    assert cache_module._zeros_program(  # the compiled program itself is reused, not only its wrapper
        (3, 16, 576), jnp.dtype(jnp.bfloat16), sharding)._cache_size() == 1


def test_written_tokens_sit_at_their_positions_and_decode_like_dense_attention():
    """Prefill then three decode steps through write_kv (a padding slot in each): every token is
    found at page ``table[p // page_size]``, row ``p % page_size`` of its request, no other row
    changes, and decode equals attention over the tokens the test kept in order (not the cache)."""
    rng = np.random.default_rng(2)
    page_size, num_heads, scale = 16, 16, 0.1
    tables = np.array([[4, 1, 5, 9], [7, 0, 11, 2]], np.int32)  # pages 3, 6, 8, 10 stay unused
    cache = jax_mla.allocate_cache(12, page_size, dtype=jnp.float32)
    write = jax.jit(jax_mla.write_kv, donate_argnums=0)
    tokens = [[], []]  # each request's (latent, k_rope) rows in position order

    def step(new_tokens):
        nonlocal cache
        slots, latents, ropes = [-1], [np.zeros(512)], [np.zeros(64)]  # a padding entry first
        for b, count in enumerate(new_tokens):
            for _ in range(count):
                position = len(tokens[b])
                slots.append(tables[b, position // page_size] * page_size + position % page_size)
                latents.append(rng.standard_normal(512))
                ropes.append(rng.standard_normal(64))
                tokens[b].append(np.concatenate([latents[-1], ropes[-1]]))
        before = np.asarray(cache)
        cache = write(cache, jnp.asarray(np.stack(latents), jnp.float32),
                      jnp.asarray(np.stack(ropes), jnp.float32), jnp.asarray(slots, jnp.int32))
        after = np.asarray(cache)
        expected = before.copy()
        for b in range(2):
            for position, row in enumerate(tokens[b]):
                expected[tables[b, position // page_size], position % page_size] = row
        np.testing.assert_array_equal(after, expected.astype(np.float32))
        assert np.count_nonzero((after != before).any(axis=-1)) == sum(new_tokens)

    for new_tokens in ([37, 5], [1, 1], [1, 1], [1, 1]):
        step(new_tokens)
        lengths = [len(t) for t in tokens]
        query = rng.standard_normal((2, 1, num_heads, 576))
        out = jax_mla.decode(jnp.asarray(query, jnp.float32), cache, jnp.asarray(tables),
                             jnp.asarray(lengths, jnp.int32), softmax_scale=scale)
        for b in range(2):
            keys = np.stack(tokens[b])
            want, _ = attend(query[b, 0], keys, keys[:, :512], scale)
            assert request_head_error(out[b:b + 1], want[None, None]) < tolerances("xla", jnp.float32)[0]


def test_torch_view_is_zero_copy():
    problem = make_problem(0, batch=2, q_len=1, num_heads=16, page_size=16, dtype=jnp.bfloat16)
    view = jax_mla.torch_view(problem.kv_cache)
    assert view.data_ptr() == problem.kv_cache.unsafe_buffer_pointer()
    assert view.dtype == torch.bfloat16 and tuple(view.shape) == problem.kv_cache.shape
    donated = jax.jit(lambda c: c + 1, donate_argnums=0)(problem.kv_cache)  # the view is alive
    assert problem.kv_cache.is_deleted() and donated.shape == problem.kv_cache.shape
    with pytest.raises(RuntimeError, match="donated or deleted"):
        view.float()
