"""``CacheView``: the zero-copy, read-only torch view of a JAX array behind ``jax_mla.torch_view``.

A ``CacheView`` is a torch wrapper subclass that holds the JAX array, not its buffer. Each torch op
on it exports the buffer through DLPack (zero-copy), runs the op and drops the export, so between
ops nothing pins the buffer and ``jax.jit(..., donate_argnums=0)(cache)`` donates it. Ops that would
write to a view raise; view ops (``select``, ``view``, ``permute``, ``unbind``, ...) return derived
``CacheView``s that replay the op on each use; every other result is an ordinary torch tensor.
Importing this module imports torch; ``jax_mla.torch_view`` imports it on first use.
"""

from __future__ import annotations

import jax
import torch
from torch.utils._pytree import tree_flatten, tree_map

READ_ONLY = ("jax_mla.torch_view is read-only: the cache belongs to JAX; write tokens with "
             "jax_mla.write_kv")
NO_BUFFER = ("jax_mla.torch_view holds no buffer of its own to export, share or store: hand the JAX "
             "array itself to DLPack consumers (it exports zero-copy), or copy the view with .clone()")


class CacheView(torch.Tensor):
    """A torch tensor over a JAX array's buffer, exported only for the duration of each op.

    ``_array`` is the JAX array; ``_recipe`` is ``None`` for the array itself, or ``(func, args,
    kwargs, pick)`` for a view derived by the aliasing aten op ``func`` (``pick`` indexes its output
    when it returns several tensors). Using a view after the array was donated or deleted raises.
    """

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, array: jax.Array, recipe=None):
        view = _materialise_from(array, recipe)
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls, view.shape, strides=view.stride(), storage_offset=view.storage_offset(),
            dtype=view.dtype, device=view.device, requires_grad=False)
        wrapper._array, wrapper._recipe = array, recipe
        # The wrapper's own storage is empty: code that reads its address directly (for example
        # torch.utils.dlpack.to_dlpack) then raises instead of handing out a null pointer.
        torch._C._set_throw_on_mutable_data_ptr(wrapper)
        return wrapper

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _refuse_writes(func._schema, func, args, kwargs)
        views = [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, CacheView)]
        real = out = None  # the exports; cleared in `finally` so no traceback keeps them alive
        try:
            real = tree_map(_materialise, (args, kwargs))
            out = func(*real[0], **real[1])
            for device in {view.device for view in views if view.is_cuda}:
                torch.cuda.current_stream(device).synchronize()
            buffers = {view._array.unsafe_buffer_pointer() for view in views}
            return _wrap_results(cls, func, out, args, kwargs, buffers)
        except Exception as error:  # the frames below hold the exports: a kept error would pin them
            raise error.with_traceback(None)
        finally:
            real = out = None

    def _materialise(self) -> torch.Tensor:
        return _materialise_from(self._array, self._recipe)

    def data_ptr(self) -> int:
        """The address of the view's first element in the JAX array's buffer."""
        return self._materialise().data_ptr()

    def numpy(self, *, force: bool = False):
        """A copy of the view as a numpy array (torch's dtypes: bf16 has no numpy dtype)."""
        return self._materialise().numpy(force=force).copy()

    def tolist(self) -> list:
        """The view's values as nested Python lists."""
        return self._materialise().tolist()

    def __dlpack__(self, *args, **kwargs):
        raise TypeError(NO_BUFFER)

    def untyped_storage(self):
        raise TypeError(NO_BUFFER)

    def share_memory_(self):
        raise TypeError(NO_BUFFER)

    def is_shared(self) -> bool:
        return False

    def __reduce_ex__(self, protocol):
        """Pickled (and ``torch.save``d) as a plain tensor holding a copy of the view's values."""
        return self._materialise().clone().__reduce_ex__(protocol)

    def __deepcopy__(self, memo) -> torch.Tensor:
        """A plain tensor holding a copy of the view's values."""
        return self._materialise().clone()

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"CacheView({self._materialise()!r})"


def _materialise_from(array: jax.Array, recipe) -> torch.Tensor:
    """The torch tensor ``recipe`` derives from a fresh DLPack export of ``array``."""
    if array.is_deleted():
        raise RuntimeError("this jax_mla.torch_view's cache was donated or deleted; take a new "
                           "view of the cache the step returned")
    if recipe is None:
        return torch.from_dlpack(array)
    func, args, kwargs, pick = recipe
    out = func(*tree_map(_materialise, args), **tree_map(_materialise, kwargs))
    for index in pick:
        out = out[index]
    return out


def _refuse_writes(schema, func, args, kwargs) -> None:
    """Raise ``RuntimeError(READ_ONLY)`` if ``func`` writes to a ``CacheView`` argument (in place,
    ``out=``, or ``set_``)."""
    for i, arg in enumerate(schema.arguments):
        writes = arg.alias_info is not None and arg.alias_info.is_write
        if ((writes or func.overloadpacket is torch.ops.aten.set_)
                and any(isinstance(x, CacheView) for x in _leaves(schema, i, args, kwargs))):
            raise RuntimeError(READ_ONLY)


def _wrap_results(cls, func, out, args, kwargs, buffers):
    """``func``'s results as the caller sees them: a view of a ``CacheView`` argument becomes a
    derived ``CacheView`` (a recipe, not a tensor); a result sharing the cache's memory without the
    schema saying so (aten._unsafe_view) is copied; everything else is returned as is."""
    schema = func._schema
    several = len(schema.returns) > 1
    results = []
    for r, ret in enumerate(schema.returns):
        value, parent = out[r] if several else out, _aliased(schema, ret, args, kwargs)
        pick = (r,) if several else ()
        if isinstance(parent, CacheView) and isinstance(value, (list, tuple)):
            value = [cls(parent._array, (func, args, kwargs, pick + (j,))) for j in range(len(value))]
        elif isinstance(parent, CacheView):
            value = cls(parent._array, (func, args, kwargs, pick))
        else:
            value = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor)
                             and t.untyped_storage().data_ptr() in buffers else t, value)
        results.append(value)
    return tuple(results) if several else (results[0] if results else out)


def _materialise(leaf):
    return leaf._materialise() if isinstance(leaf, CacheView) else leaf


def _leaves(schema, i, args, kwargs) -> list:
    """The values passed for the ``i``th argument of ``schema``, a list flattened."""
    arg = schema.arguments[i]
    value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
    return tree_flatten(value)[0]


def _aliased(schema, ret, args, kwargs):
    """The argument that return ``ret`` is a view of (by the schema's alias sets), or ``None``."""
    if ret.alias_info is None:
        return None
    # A list return ``Tensor(a)[]`` shows an empty set here; its argument is ``Tensor(a -> *)``.
    wanted = ret.alias_info.before_set or {"*"}
    for i, arg in enumerate(schema.arguments):
        info = arg.alias_info
        if info is not None and (info.before_set | info.after_set) & wanted:
            leaves = _leaves(schema, i, args, kwargs)
            return leaves[0] if len(leaves) == 1 else None
    return None
