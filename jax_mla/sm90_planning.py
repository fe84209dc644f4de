"""The sm90 kernel's split-KV schedule as a value: built once per step, passed to every layer.

Without a plan the sm90 backend builds its schedule inside each ``decode`` call; XLA keeps one of
the identical calls of a step's unrolled layers, but under ``lax.scan`` over layers it runs the
call in every iteration. ``sm90_plan`` builds the schedule where the caller puts it (outside the
scanned function), and ``decode(..., plan=...)`` hands it to the kernel. The schedule
(``ffi/sm90/schedule.cuh``) depends only on the lengths, the block table's width and the page size,
not on the heads, q_len or the cache's format, so one plan serves every layer of a step.

The kernel reads a request's blocks from its length and finds the parts that hold them from the
schedule, so the two must agree: the kernel compares each length with the one the plan was built
from (``Sm90Plan.seq_lens``), and a request whose length differs reads nothing (out 0, lse -inf),
with or without ``decode``'s ``fail_closed``. That comparison, like the rest of failing closed,
happens inside the kernel, so a layer given a plan runs no XLA op besides its decode call.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jax_mla import backends, gpu, validation
from jax_mla.planning import PlanMismatchError


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class Sm90Plan:
    """A decode step's sm90 schedule, valid for one set of lengths, table width and page size.

    ``schedule`` (int32 [batch + 1], on the GPU) holds each request's first cost unit and the
    total (``ScheduleKernel``); ``seq_lens`` (int32 [batch]) the lengths it was built from. The
    rest is static metadata checked against each ``decode`` call. The kernel reads the schedule
    as ``sm90_plan`` built it: make plans with ``sm90_plan`` only.
    """

    schedule: jax.Array
    seq_lens: jax.Array
    batch: int
    max_pages: int
    page_size: int

    def tree_flatten(self):
        return (self.schedule, self.seq_lens), (self.batch, self.max_pages, self.page_size)

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(*children, *static)

    def check_for(self, seq_lens, block_tables, page_size: int) -> None:
        """Raise ``PlanMismatchError`` unless the plan's arrays have their shapes and dtypes and
        the plan is for a call's int32 ``seq_lens`` [B] over ``block_tables`` [B, max_pages] and
        a cache of ``page_size``."""
        for name, array, shape in (("schedule", self.schedule, (self.batch + 1,)),
                                   ("seq_lens", self.seq_lens, (self.batch,))):
            if tuple(array.shape) != shape or array.dtype != np.int32:
                raise PlanMismatchError(
                    f"plan.{name} must be int32 {list(shape)}, got {array.dtype} "
                    f"{list(array.shape)}; build sm90 plans with jax_mla.sm90_plan")
        expected = dict(batch=seq_lens.shape[0], max_pages=block_tables.shape[1],
                        page_size=page_size)
        actual = {name: getattr(self, name) for name in expected}
        if actual != expected:
            raise PlanMismatchError(
                f"the sm90 plan was built for {actual} but decode got {expected}; build the plan "
                "with the step's seq_lens, block-table width and the cache's page size")


def sm90_plan(seq_lens, *, max_pages: int, page_size: int) -> Sm90Plan:
    """Build the sm90 kernel's schedule on the GPU (inside ``jax.jit`` or eagerly).

    Build it once per decode step, outside a ``lax.scan`` over layers, and pass it to every
    layer's ``decode(..., plan=plan)``: the scan then runs only the decode kernels.

    Args:
      seq_lens: int32 [B] (traced is fine), the lengths the step passes to ``decode``.
      max_pages: width of the block table the step passes to ``decode``.
      page_size: the cache's page size, 32 or 64.
    Returns:
      An ``Sm90Plan`` whose schedule a custom call (CUDA-graph safe) fills on the GPU.
    Raises:
      TypeError for seq_lens not int32 or sizes not ints; ValueError for seq_lens not [B >= 1],
      where sm90 does not run (no Hopper GPU or no sm90 handler in the library), or for a page
      size or table capacity it does not take.
    """
    batch = validation.check_plan_lengths(seq_lens)
    max_pages, page_size = validation.check_sizes(max_pages=max_pages, page_size=page_size)
    gpu.check_sm90_table(batch, max_pages, page_size, page_size_of="")
    try:
        backends.resolve(backends.SM90, backends.platform_of(seq_lens))
    except ValueError as error:
        raise ValueError(f"jax_mla.sm90_plan builds the sm90 kernel's schedule: {error}") from None
    schedule = gpu.sm90_schedule(seq_lens, max_pages=max_pages, page_size=page_size)
    return Sm90Plan(schedule, seq_lens, batch, max_pages, page_size)
