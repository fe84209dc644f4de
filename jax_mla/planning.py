"""FlashInfer's fa3/fa2 MLA work schedule: its fixed layout, and the two ways to build it.

FlashInfer's ``MLAPlan`` splits each request's kv range over the SMs' clusters and writes the work
lists into an int workspace. Where each array lives in that workspace (``plan_info``) depends only
on the SM count, ``q_len * num_heads`` and the output head dim; the contents depend on the lengths.
So the layout is static (a custom-call attribute) and the contents are a device array built once
per decode step and shared by every layer: on the host by ``plan`` (FlashInfer's ``MLAPlan``), or
on the GPU inside the jitted step by ``device_plan`` (``ffi/device_plan.cuh``). docs/gpu-schedule.md
describes both.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np

from jax_mla import validation

MAX_TOTAL_WORKS = 16384  # MLAPlan's fixed capacity of each per-work array
CTA_TILE_Q = 64
ALIGNMENT = 16
DEVICE_PLAN_MAX_CLUSTERS = 256  # kMaxClusters in ffi/schedule.cuh
MAX_KV_LEN = 1 << 22  # kMaxKvLen in ffi/lengths.h: the longest request the fa3/fa2 schedule takes
INT32_BYTES = 4


class PlanMismatchError(ValueError):
    """A plan does not describe the call it was given to (its batch, heads, q_len or table width)."""


# MLAPlanInfo's entries in order (ffi/plan_info.h): CTAs per cluster, clusters, the byte offsets of
# the schedule's arrays in the int workspace, and those of the partial results in the float one.
PLAN_INFO_FIELDS = (
    "cluster_size", "num_clusters", "q_indptr", "kv_indptr", "partial_indptr",
    "merge_packed_start", "merge_packed_end", "merge_partial_start", "merge_partial_end",
    "merge_partial_stride", "q_len", "kv_len", "q_start", "kv_start", "kv_end", "work_indptr",
    "partial_o", "partial_lse")


@dataclasses.dataclass(frozen=True)
class ScheduleLayout:
    """MLAPlanInfo's 18 entries plus the workspace sizes they imply."""

    plan_info: tuple[int, ...]
    int_workspace_bytes: int
    float_workspace_bytes: int

    def entry(self, field: str) -> int:
        """The plan_info entry named ``field`` (one of ``PLAN_INFO_FIELDS``)."""
        return self.plan_info[PLAN_INFO_FIELDS.index(field)]


class _Allocator:
    """FlashInfer's AlignedAllocator in count-only form: offsets of successive aligned blocks."""

    def __init__(self):
        self.end = 0

    def alloc(self, size: int) -> int:
        start = -(-self.end // ALIGNMENT) * ALIGNMENT
        self.end = start + size
        return start


@functools.cache
def schedule_layout(num_sm: int, q_len: int, num_heads: int, head_dim_o: int) -> ScheduleLayout:
    """The plan_info and workspace sizes that ``MLAPlan`` produces for this problem shape."""
    cluster_size = 2 if q_len * num_heads > 64 else 1
    num_clusters = num_sm // cluster_size
    ints = _Allocator()
    works, per_sm = INT32_BYTES * MAX_TOTAL_WORKS, INT32_BYTES * num_sm
    q_indptr, kv_indptr, partial_indptr = (ints.alloc(works) for _ in range(3))
    merge_offsets = [ints.alloc(per_sm) for _ in range(5)]
    per_work = [ints.alloc(works) for _ in range(6)]  # q_len kv_len q_start kv_start kv_end work_indptr
    floats = _Allocator()
    rows = 2 * num_clusters * cluster_size * CTA_TILE_Q
    partial_o = floats.alloc(rows * 2 * head_dim_o)  # bf16/fp16 partial outputs
    partial_lse = floats.alloc(rows * 4)
    plan_info = (cluster_size, num_clusters, q_indptr, kv_indptr, partial_indptr, *merge_offsets,
                 *per_work, partial_o, partial_lse)
    return ScheduleLayout(plan_info, ints.end, floats.end)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """A decode step's fa3/fa2 work schedule, valid for one set of lengths and problem shape.

    ``int_workspace`` (uint8 [layout.int_workspace_bytes], on the GPU) is the schedule and
    ``seq_lens`` (int32 [batch]) the lengths it was built from: ``decode(..., fail_closed=True)``
    compares them with its own on the device and gives a request whose length differs nothing to
    read (jax_mla.guard). The rest is static metadata checked against each ``decode`` call.
    """

    int_workspace: jax.Array
    seq_lens: jax.Array
    batch: int
    q_len: int
    num_heads: int
    max_pages: int
    kv_lora_rank: int
    layout: ScheduleLayout

    def tree_flatten(self):
        static = (self.batch, self.q_len, self.num_heads, self.max_pages, self.kv_lora_rank,
                  self.layout)
        return (self.int_workspace, self.seq_lens), static

    @classmethod
    def tree_unflatten(cls, static, children):
        return cls(*children, *static)

    def check_arrays(self) -> None:
        """Raise ``PlanMismatchError`` unless the arrays have the shapes and dtypes that the
        plan's layout and batch imply."""
        workspace, expected_bytes = self.int_workspace, self.layout.int_workspace_bytes
        if tuple(workspace.shape) != (expected_bytes,) or workspace.dtype != np.uint8:
            raise PlanMismatchError(
                f"plan.int_workspace must be uint8 [{expected_bytes}] for this schedule layout, got "
                f"{workspace.dtype} {list(workspace.shape)}; build plans with jax_mla.plan or "
                "jax_mla.device_plan")
        if tuple(self.seq_lens.shape) != (self.batch,) or self.seq_lens.dtype != np.int32:
            raise PlanMismatchError(
                f"plan.seq_lens must be int32 [{self.batch}], the lengths the plan was built from, "
                f"got {self.seq_lens.dtype} {list(self.seq_lens.shape)}; build plans with "
                "jax_mla.plan or jax_mla.device_plan")

    def check_for(self, seq_lens, block_tables, page_size: int) -> None:
        """Raise ``PlanMismatchError`` unless the arrays pass ``check_arrays`` and the plan is for
        a call's int32 ``seq_lens`` [B] over ``block_tables`` [B, max_pages]. ``page_size`` is
        unused (the schedule counts tokens, whatever the page size); it is taken so that every
        plan kind is checked alike (``Sm90Plan.check_for``)."""
        del page_size
        self.check_arrays()
        batch, max_pages = seq_lens.shape[0], block_tables.shape[1]
        if (self.batch, self.max_pages) != (batch, max_pages):
            raise PlanMismatchError(
                f"plan was built for batch {self.batch} and max_pages {self.max_pages} but decode "
                f"got batch {batch} and max_pages {max_pages}; build the plan with the step's "
                "seq_lens and block-table width")


@functools.cache
def _host_scratch(num_bytes: int) -> np.ndarray:
    return np.zeros(num_bytes, np.uint8)


def plan(seq_lens, *, num_heads: int, max_pages: int, q_len: int = 1, kv_lora_rank: int = 512,
         rope_dim: int = 64, device=None) -> Plan:
    """Build the fa3/fa2 work schedule for one decode step on the host.

    Args:
      seq_lens: host int array [B] (numpy or list), each request's kv length including its q_len
        new tokens; the same values the step passes to ``decode``.
      num_heads: query heads per device (the local count under tensor parallelism).
      max_pages: width of the block table the step passes to ``decode``.
      q_len: query tokens per request.
      kv_lora_rank, rope_dim: the latent's and the rope's channels in a cache row.
      device: the GPU the schedule is committed to; by default it goes to JAX's default device
        uncommitted, like the step's other arrays, so it adds no placement of its own.
    Returns:
      A ``Plan`` to pass as ``decode(..., plan=plan)`` to every layer of the step.
    """
    from jax_mla import backends, gpu

    if isinstance(seq_lens, jax.core.Tracer):
        raise TypeError("seq_lens must be host values (numpy), not a traced array: plan outside jit")
    lengths = np.asarray(seq_lens)
    if lengths.ndim != 1 or lengths.size == 0 or not np.issubdtype(lengths.dtype, np.integer):
        raise ValueError(f"seq_lens must be a non-empty 1-D integer array, got shape {lengths.shape} "
                         f"dtype {lengths.dtype}")
    num_heads, max_pages, q_len, kv_lora_rank, rope_dim = validation.check_sizes(
        num_heads=num_heads, max_pages=max_pages, q_len=q_len, kv_lora_rank=kv_lora_rank,
        rope_dim=rope_dim)
    if lengths.min() < q_len:
        raise ValueError(f"every seq_lens entry must be >= q_len={q_len} (it counts the new tokens), "
                         f"got min {int(lengths.min())}")
    if lengths.max() > MAX_KV_LEN:
        raise ValueError(f"every seq_lens entry must be <= {MAX_KV_LEN}, the longest request the "
                         f"fa3/fa2 schedule takes, got max {int(lengths.max())}")
    num_sms = gpu_sm_count("jax_mla.plan", device)
    fa_backends = [b for b in backends.available_backends("gpu")
                   if backends.BY_NAME[b].reads_plan == backends.FA_PLAN]
    if not fa_backends:
        raise ValueError(f"jax_mla.plan needs a GPU that runs fa3 or fa2; available here: "
                         f"{backends.available_backends()}")
    layout = schedule_layout(num_sms, q_len, num_heads, kv_lora_rank)
    lengths = lengths.astype(np.int32)
    batch = lengths.size
    check_works_fit(batch, q_len, num_heads, layout)
    staging = np.zeros(layout.int_workspace_bytes, np.uint8)
    planner = gpu.fa_plan_function(fa_backends[0], kv_lora_rank, rope_dim)
    plan_info, staged_bytes = planner(
        _host_scratch(layout.float_workspace_bytes), staging, staging,
        np.arange(batch + 1, dtype=np.int32) * q_len,
        np.arange(batch + 1, dtype=np.int32) * max_pages,
        lengths, num_heads, kv_lora_rank, q_len > 1)
    if tuple(plan_info) != layout.plan_info or int(staged_bytes) != layout.int_workspace_bytes:
        raise RuntimeError(f"FlashInfer's plan layout {tuple(plan_info)} differs from jax_mla's "
                           f"{layout.plan_info}: FlashInfer version mismatch")
    return Plan(jax.device_put(staging, device), jax.device_put(lengths, device), batch, q_len,
                num_heads, max_pages, kv_lora_rank, layout)


def max_batch_for_works(q_len: int, num_heads: int, num_clusters: int, cluster_size: int) -> int:
    """The largest batch whose schedule fits MLAPlan's 16384 works for any lengths up to
    ``MAX_KV_LEN``: each query tile gives at most one short chunk, and the full-length chunks
    number at most the clusters; and all tile tokens over the clusters (the planners' int chunk
    size) stay below 2^31, which bounds the batch on GPUs with fewer than 33 clusters."""
    tiles = -(-q_len * num_heads // (cluster_size * CTA_TILE_Q))
    by_works = (MAX_TOTAL_WORKS - num_clusters) // tiles
    by_chunk_size = (2**31 - 1) * num_clusters // (tiles * MAX_KV_LEN)
    return min(by_works, by_chunk_size)


def check_works_fit(batch: int, q_len: int, num_heads: int, layout: ScheduleLayout) -> None:
    """Raise ``ValueError`` unless every fa3/fa2 schedule of ``batch`` requests fits FlashInfer's
    16384 works; shared by ``plan``, ``device_plan`` and the self-planning path, whatever the lengths."""
    cluster_size, num_clusters = layout.plan_info[:2]
    limit = max_batch_for_works(q_len, num_heads, num_clusters, cluster_size)
    if batch > limit:
        raise ValueError(f"batch {batch} x q_len {q_len} x {num_heads} heads may exceed FlashInfer's "
                         f"{MAX_TOTAL_WORKS} scheduled works; split the batch into calls of at most "
                         f"{limit} requests")


def gpu_sm_count(caller: str, device=None) -> int:
    """The SM count of ``device`` (default: the first CUDA device), or a ``ValueError`` saying that
    ``caller`` builds the schedule on a CUDA GPU and this process has none."""
    from jax_mla import gpu

    try:
        return gpu.sm_count(device)
    except RuntimeError as error:  # jax.devices("gpu") where JAX has no CUDA backend
        raise ValueError(f"{caller} builds the fa3/fa2 schedule on a CUDA GPU; this process has none "
                         f"(platform {jax.default_backend()})") from error


def device_plan(seq_lens, *, num_heads: int, max_pages: int, q_len: int = 1,
                kv_lora_rank: int = 512) -> Plan:
    """Build the fa3/fa2 work schedule on the GPU, inside ``jax.jit``, from device ``seq_lens``.

    Args:
      seq_lens: int32 [B] (traced is fine), the lengths the step passes to ``decode``.
      num_heads: query heads per device (the local count under tensor parallelism).
      max_pages: width of the block table the step passes to ``decode``.
      q_len: query tokens per request.
      kv_lora_rank: channels of the latent (the cache's row less its rope).
    Returns:
      A ``Plan`` whose ``int_workspace`` a custom call (CUDA-graph safe) fills on the GPU. It
      honours MLAPlan's invariants but balances the work its own way (docs/gpu-schedule.md).
    Raises:
      ValueError where this process has no CUDA GPU: the plan is fa3's and fa2's, and the other
      backends take ``plan=None`` (sm90 builds its own schedule on the GPU).
    """
    from jax_mla import gpu

    batch = validation.check_plan_lengths(seq_lens)
    num_heads, max_pages, q_len, kv_lora_rank = validation.check_sizes(
        num_heads=num_heads, max_pages=max_pages, q_len=q_len, kv_lora_rank=kv_lora_rank)
    num_sms = gpu_sm_count("jax_mla.device_plan")
    layout = schedule_layout(num_sms, q_len, num_heads, kv_lora_rank)
    num_clusters = layout.plan_info[1]
    if num_clusters > DEVICE_PLAN_MAX_CLUSTERS:
        raise ValueError(f"the GPU planner handles at most {DEVICE_PLAN_MAX_CLUSTERS} clusters, this "
                         f"GPU has {num_clusters} ({num_sms} SMs); use jax_mla.plan")
    check_works_fit(batch, q_len, num_heads, layout)
    int_workspace = gpu.device_plan_call(seq_lens, q_len=q_len, num_heads=num_heads,
                                         max_pages=max_pages, num_sms=num_sms, layout=layout)
    return Plan(int_workspace, seq_lens, batch, q_len, num_heads, max_pages, kv_lora_rank, layout)
