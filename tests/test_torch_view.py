"""``jax_mla.torch_view``: zero-copy, read-only, and never in the way of donating the cache."""

from __future__ import annotations

import copy
import io
import pickle

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jax_mla
from jax_mla.cache_view import CacheView

READ_ONLY = (r"jax_mla\.torch_view is read-only: the cache belongs to JAX; write tokens with "
             r"jax_mla\.write_kv")


CPU = jax.devices("cpu")[0]  # these tests read views as CPU tensors; the GPU one is at the end


def filled_cache(device=CPU) -> jax.Array:
    """A bf16 cache [4, 16, 192] on ``device`` holding 0, 1, 2, ... (exact in bf16 up to 256, then
    rounded)."""
    shape = jax_mla.allocate_cache(4, 16, kv_lora_rank=128).shape
    values = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape).astype(jnp.bfloat16)
    return jax.device_put(values, device)


def as_float(array: jax.Array) -> np.ndarray:
    return np.array(array.astype(jnp.float32))


def donate(cache: jax.Array) -> jax.Array:
    return jax.jit(lambda c: c.at[0, 0, 0].set(1), donate_argnums=0)(cache)


@pytest.mark.parametrize("array,message", [
    (np.zeros((2, 3)), r"array must be a concrete jax.Array \(outside jax.jit\), got ndarray"),
    (None, r"array must be a concrete jax.Array \(outside jax.jit\), got NoneType"),
])
def test_the_view_takes_a_jax_array(array, message):
    with pytest.raises(TypeError, match=message):
        jax_mla.torch_view(array)


@pytest.mark.parametrize("dtype", [jnp.int4, jnp.uint4, jnp.float4_e2m1fn])
def test_the_view_refuses_sub_byte_dtypes(dtype):
    with pytest.raises(TypeError, match=rf"array's dtype must have 8 bits or more \(DLPack has no "
                                        rf"sub-byte elements\), got {jnp.dtype(dtype).name}"):
        jax_mla.torch_view(jnp.zeros((4,), dtype))


def test_the_view_is_taken_outside_jit():
    with pytest.raises(TypeError, match=r"array must be a concrete jax.Array \(outside jax.jit\), "
                                        r"got .*Tracer"):
        jax.jit(jax_mla.torch_view)(jnp.zeros(3))


def test_the_view_takes_an_array_on_one_device():
    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip("needs 2 CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count)")
    mesh = jax.sharding.Mesh(np.array(devices[:2]), ("d",))
    sharded = jax.device_put(jnp.zeros((4, 3)), jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("d")))
    with pytest.raises(ValueError, match=r"array must live on one device .*got an array on 2 "
                                         r"devices: take the view of one shard"):
        jax_mla.torch_view(sharded)


def test_the_view_shares_the_buffer():
    cache = filled_cache()
    view = jax_mla.torch_view(cache)
    assert isinstance(view, CacheView) and isinstance(view, torch.Tensor)
    assert view.data_ptr() == cache.unsafe_buffer_pointer()
    assert view[1].data_ptr() == cache.unsafe_buffer_pointer() + 16 * 192 * 2
    assert view.dtype == torch.bfloat16 and tuple(view.shape) == (4, 16, 192)
    assert view.device == torch.device("cpu") and view.stride() == (16 * 192, 192, 1)


def test_reads_match_the_array():
    cache = filled_cache()
    expected = as_float(cache)
    view = jax_mla.torch_view(cache)
    np.testing.assert_array_equal(view.float().numpy(), expected)
    np.testing.assert_array_equal(view[2, 3].float().numpy(), expected[2, 3])
    np.testing.assert_array_equal(view.permute(2, 0, 1)[5].float().numpy(), expected[..., 5])
    np.testing.assert_array_equal(view.view(-1)[100:110].float().numpy(), np.arange(100, 110))
    np.testing.assert_array_equal([t.float().numpy() for t in view.unbind(0)], expected)
    assert view.sum().item() == pytest.approx(expected.sum(), rel=1e-2)
    assert torch.equal(view, torch.from_numpy(expected).bfloat16())
    assert view[0, 0, :4].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert view.cpu().float()[3, 15, 191].item() == expected[3, 15, 191]
    assert "CacheView(tensor(" in repr(view[0, 0, :3])
    for result in (view.float(), view + 1, view.sum(), view.clone(), view.to(torch.float32)):
        assert type(result) is torch.Tensor and result.data_ptr() != cache.unsafe_buffer_pointer()


@pytest.mark.parametrize("mutate", [
    lambda v: v.add_(1),
    lambda v: v.zero_(),
    lambda v: v.__setitem__((0, 0), 7.0),
    lambda v: v.__setitem__(torch.tensor([1]), 7.0),
    lambda v: v.copy_(torch.ones(v.shape)),
    lambda v: v.fill_(2.0),
    lambda v: torch.add(torch.ones(v.shape, dtype=v.dtype), 1, out=v),
    lambda v: v[0].zero_(),
    lambda v: v.view(-1).__setitem__(3, 1.0),
    lambda v: v.permute(2, 0, 1).mul_(2),
    lambda v: v.select(0, 1).copy_(torch.zeros(16, 192)),
    lambda v: v.unbind(0)[2].neg_(),
    lambda v: torch.empty(0, dtype=v.dtype).set_(v),
], ids=["add_", "zero_", "setitem", "setitem-index", "copy_", "fill_", "out=", "view[0].zero_",
        "view(-1)[3]=", "permute.mul_", "select.copy_", "unbind.neg_", "set_"])
def test_mutation_is_refused_and_the_cache_is_unchanged(mutate):
    cache = filled_cache()
    before = as_float(cache)
    view = jax_mla.torch_view(cache)
    with pytest.raises(RuntimeError, match=READ_ONLY):
        mutate(view)
    np.testing.assert_array_equal(as_float(cache), before)
    np.testing.assert_array_equal(view.float().numpy(), before)


NO_BUFFER = (r"^jax_mla\.torch_view holds no buffer of its own to export, share or store: hand the "
             r"JAX array itself to DLPack consumers \(it exports zero-copy\), or copy the view with "
             r"\.clone\(\)$")


@pytest.mark.parametrize("export", [
    lambda v: torch.from_dlpack(v),
    lambda v: np.from_dlpack(v),
    lambda v: jax.dlpack.from_dlpack(v),
    lambda v: v[1].__dlpack__(),
    lambda v: v.share_memory_(),
    lambda v: v.untyped_storage(),
], ids=["torch.from_dlpack", "np.from_dlpack", "jax.from_dlpack", "view[1].__dlpack__",
        "share_memory_", "untyped_storage"])
def test_exports_of_the_buffer_are_refused(export):
    """The view holds no buffer (only the JAX array): handing it on would hand out an empty one."""
    view = jax_mla.torch_view(filled_cache())
    with pytest.raises(TypeError, match=NO_BUFFER):
        export(view)
    assert not view.is_shared()


def test_a_raw_address_read_of_the_view_raises():
    """torch.utils.dlpack.to_dlpack reads the tensor's own address in C++, past the methods above."""
    with pytest.raises(RuntimeError, match="Cannot access data pointer"):
        torch.utils.dlpack.to_dlpack(jax_mla.torch_view(filled_cache()))


@pytest.mark.parametrize("copy_view", [
    lambda v: copy.deepcopy(v),
    lambda v: pickle.loads(pickle.dumps(v)),
    lambda v: torch.load(_saved(v)),
], ids=["deepcopy", "pickle", "torch.save"])
def test_copies_of_the_view_hold_its_values(copy_view):
    cache = filled_cache()
    view = jax_mla.torch_view(cache)[1:3].permute(2, 0, 1)
    copied = copy_view(view)
    assert type(copied) is torch.Tensor and copied.data_ptr() != cache.unsafe_buffer_pointer()
    np.testing.assert_array_equal(copied.float().numpy(), as_float(cache)[1:3].transpose(2, 0, 1))
    donate(cache)
    assert cache.is_deleted()


def _saved(tensor: torch.Tensor) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    buffer.seek(0)
    return buffer


def test_a_live_view_does_not_block_donation():
    cache = filled_cache()
    expected = as_float(cache)
    view = jax_mla.torch_view(cache)
    assert view.float()[0, 0, 1].item() == 1.0
    out = donate(cache)
    assert cache.is_deleted()
    for use in (lambda: view.float(), lambda: view[0], lambda: view.data_ptr()):
        with pytest.raises(RuntimeError, match="donated or deleted; take a new view"):
            use()
    expected[0, 0, 0] = 1
    new_view = jax_mla.torch_view(out)
    assert new_view.data_ptr() == out.unsafe_buffer_pointer()
    np.testing.assert_array_equal(new_view.float().numpy(), expected)


def test_a_live_derived_view_does_not_block_donation():
    cache = filled_cache()
    row = jax_mla.torch_view(cache)[1].permute(1, 0)
    np.testing.assert_array_equal(row.float().numpy(), as_float(cache)[1].T)
    donate(cache)
    assert cache.is_deleted()
    with pytest.raises(RuntimeError, match="donated"):
        row.sum()


def test_a_failed_op_kept_with_its_traceback_does_not_block_donation():
    cache = filled_cache()
    view = jax_mla.torch_view(cache)
    with pytest.raises(RuntimeError, match="must match the size") as failure:
        torch.add(view[0], torch.ones(5))
    assert failure.value.__traceback__ is not None
    donate(cache)
    assert cache.is_deleted()


def test_an_undeclared_alias_is_copied():
    cache = filled_cache()
    flat = torch.ops.aten._unsafe_view(jax_mla.torch_view(cache), [4 * 16 * 192])
    assert type(flat) is torch.Tensor and flat.data_ptr() != cache.unsafe_buffer_pointer()
    np.testing.assert_array_equal(flat.float().numpy(), as_float(cache).reshape(-1))
    donate(cache)
    assert cache.is_deleted()


def test_a_view_of_the_fp8_cache():
    cache = jax_mla.allocate_cache(2, 16, dtype="fp8", device=CPU)
    cache = jax.jit(lambda c: c.at[1, 2, :4].set(jnp.arange(4, dtype=jnp.uint8) + 7))(cache)
    view = jax_mla.torch_view(cache)
    assert view.dtype == torch.uint8 and tuple(view.shape) == (2, 16, 656)
    assert view.data_ptr() == cache.unsafe_buffer_pointer()
    np.testing.assert_array_equal(view.numpy(), np.asarray(cache))
    assert view[1, 2, :5].tolist() == [7, 8, 9, 10, 0]
    copy = view.numpy()
    copy[0, 0, 0] = 99
    assert int(cache[0, 0, 0]) == 0
    with pytest.raises(RuntimeError, match=READ_ONLY):
        view[1, 2].zero_()
    assert view[1, 2, :5].tolist() == [7, 8, 9, 10, 0]


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU")
def test_a_view_of_a_gpu_cache():
    """On CUDA: the same buffer, reads through copies to the host, writes refused, and donation
    with a live view (each op synchronises torch's stream before it drops its export)."""
    cache = filled_cache(jax.devices("gpu")[0])
    expected = as_float(cache)
    view = jax_mla.torch_view(cache)
    assert view.device.type == "cuda" and view.data_ptr() == cache.unsafe_buffer_pointer()
    np.testing.assert_array_equal(view[2].float().cpu().numpy(), expected[2])
    assert (view.float() * 2).sum().item() == pytest.approx(2 * expected.sum(), rel=1e-2)
    with pytest.raises(RuntimeError, match=READ_ONLY):
        view[1].mul_(3)
    np.testing.assert_array_equal(as_float(cache), expected)
    out = donate(cache)
    assert cache.is_deleted()
    assert jax_mla.torch_view(out).data_ptr() == out.unsafe_buffer_pointer()
    with pytest.raises(RuntimeError, match="donated"):
        view.sum()
