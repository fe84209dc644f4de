// Combine kernels of the SM90 decode: merge the partial outputs (fp32 or bf16) of split requests.
//
// CombineKernel: one warp per output row. A request with no KV blocks (length 0 after clamping)
// gets zeros and LSE -inf here; a request handled by one part was written whole by the decode
// kernel and is skipped. The splits are merged in part order: deterministic. Both kernels let the
// next kernel in the stream launch as soon as they start (programmatic dependent launch): its CTAs
// set up while the merge runs and wait for its results in their own GridDependencyWait.
//
// Each warp finds its request's splits before its own GridDependencyWait: the lengths and the
// schedule were written by kernels that had completed when the decode kernel, having waited for
// them, let the combine launch; only the partial results and the outputs need the decode to be
// done. Every warp with an output row then waits, also one with nothing to write (every CTA has
// one), so that a combine never completes before its decode: a next kernel's wait is on the
// combine.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <type_traits>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cutlass/arch/barrier.h>

#include "decode_params.h"
#include "producer.cuh"
#include "schedule.cuh"
#include "trace.cuh"

namespace jax_mla {
namespace sm90 {

// What a combine kernel needs to know of request b: its KV blocks n, the parts first..last that
// hold its splits (valid when n > 0), and the workspace's partial results.
struct SplitRequest {
  int n, first, last;
  const float* part_out;  // [slots, rows_pad, 512]: f32, or bf16 with bf16 partials
  const float* part_lse;  // f32 [slots, rows_pad]
  int rows_pad;

  __device__ __forceinline__ static SplitRequest Load(const DecodeParams& p,
                                                     const ScheduleView& view, int num_parts,
                                                     int b) {
    SplitRequest r;
    r.n = NumKvBlocks(RequestLengths::Of(p).Get(b));
    r.first = r.last = 0;
    if (r.n > 0) {
      r.first = view.PartOf(b, 0);
      r.last = view.PartOf(b, r.n - 1);
    }
    const WorkspaceLayout ws = MakeWorkspaceLayout(p.batch, p.q_len, p.num_heads, num_parts);
    const uint8_t* wsb = static_cast<const uint8_t*>(p.workspace);
    r.part_out = reinterpret_cast<const float*>(wsb + ws.partial_out);
    r.part_lse = reinterpret_cast<const float*>(wsb + ws.partial_lse);
    r.rows_pad = ws.rows_pad;
    return r;
  }
  // Workspace row of (this request b, part s, output row).
  __device__ __forceinline__ size_t SlotRow(int b, int s, int row) const {
    return static_cast<size_t>(b + s) * rows_pad + row;
  }
};

// Row `row` of request b gets zeros and LSE -inf (one warp).
__device__ __forceinline__ void WriteEmptyRow(const DecodeParams& p, int rows, int b, int row,
                                              int lane) {
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) +
                       (static_cast<size_t>(b) * rows + row) * kLatentDim;
#pragma unroll
  for (int g = 0; g < kLatentDim / 128; ++g) {
    *reinterpret_cast<uint2*>(out + g * 128 + lane * 4) = make_uint2(0, 0);
  }
  if (lane == 0) p.lse[static_cast<size_t>(b) * rows + row] = -__builtin_huge_valf();
}

// ScheduleView::FindRequest(x) by one whole warp: each round reads 32 evenly spaced prefix
// entries at once (two rounds up to 1,024 requests) instead of one per step of a binary search.
__device__ __forceinline__ int FindRequestInWarp(const ScheduleView& view, int x, int lane) {
  int lo = 0, hi = view.batch;  // prefix[lo] <= x; the answer lies in [lo, hi)
  while (hi - lo > 1) {
    const int step = (hi - lo + 31) / 32;
    const int idx = lo + lane * step;
    const uint32_t le = __ballot_sync(0xffffffffu, idx < hi && view.prefix[idx] <= x);
    lo += (31 - __clz(le)) * step;  // prefix is non-decreasing: the lanes with le come first
    hi = min(lo + step, hi);
  }
  return lo;
}

// Whether CombineKernel's grid indexes the part boundaries (at most parts - 1 requests are split,
// one at each boundary) rather than the requests: where the requests outnumber the boundaries by
// more than four to one, so that most blocks of a grid by request would only find their request
// whole (docs/sm90-kernel.md, "What a request segment costs").
__host__ __device__ __forceinline__ bool CombineByBoundary(int batch, int num_parts) {
  return batch > 4 * (num_parts - 1);
}

// CombineKernel's grid rows: one per request, or (CombineByBoundary) one per part boundary and
// one per 32 requests, whose blocks write the empty ones.
__host__ __device__ __forceinline__ int CombineGridRows(int batch, int num_parts) {
  return CombineByBoundary(batch, num_parts) ? num_parts - 1 + CeilDivInt(batch, 32) : batch;
}

// Four consecutive columns of a partial output row, as the decode stored them (kBf16Partials:
// DecodeKernelArgs::bf16_partials).
struct alignas(8) Bf16x4 {
  __nv_bfloat162 lo, hi;
};
template <bool kBf16Partials>
using PartialCols = std::conditional_t<kBf16Partials, Bf16x4, float4>;

__device__ __forceinline__ float4 Widen(const float4& v) { return v; }
__device__ __forceinline__ float4 Widen(const Bf16x4& v) {
  const float2 lo = __bfloat1622float2(v.lo), hi = __bfloat1622float2(v.hi);
  return make_float4(lo.x, lo.y, hi.x, hi.y);
}

// Grid (ceil(rows / kCombineRowsPerBlock), CombineGridRows(batch, parts)). By request, block y
// merges request y if it is split and writes it if it is empty. By boundary, block y < parts - 1
// merges the request that ScheduleView::FirstSplitAt names for boundary y, if any (the request
// holding the boundary's unit, found by FindRequestInWarp), and block parts - 1 + g writes
// the empty requests among 32 g .. 32 g + 31: a grid of about parts blocks where one per request
// would make most of them skip. kBf16Partials: the partial outputs are bf16, else fp32.
template <bool kBf16Partials>
__global__ void __launch_bounds__(kCombineRowsPerBlock * 32)
CombineKernel(const DecodeParams p, int num_parts) {
  SM90_TRACE_KERNEL(kTracedCombine, kKernelEntry);
  SM90_TRACE_KERNEL_EXIT_SCOPE(kTracedCombine);
  GridDependencyLaunchDependents();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int rows = p.q_len * p.num_heads;
  const int row = blockIdx.x * kCombineRowsPerBlock + warp;
  if (row >= rows) return;  // not the block's first warp, which waits below
  const int y = blockIdx.y;
  const bool by_boundary = CombineByBoundary(p.batch, num_parts);
  const int boundaries = num_parts - 1;
  if (by_boundary && y >= boundaries) {
    const int b0 = (y - boundaries) * 32;
    const bool empty = b0 + lane < p.batch && RequestLengths::Of(p).Get(b0 + lane) == 0;
    const uint32_t empties = __ballot_sync(0xffffffffu, empty);
    GridDependencyWait();
    SM90_TRACE_KERNEL(kTracedCombine, kKernelWaited);
    for (uint32_t mask = empties; mask != 0; mask &= mask - 1) {
      WriteEmptyRow(p, rows, b0 + __ffs(mask) - 1, row, lane);
    }
    return;
  }
  const ScheduleView view = ScheduleView::Load(p, num_parts);
  // The request: block row y, or by boundary the request whose first split ends at boundary y
  // (-1: none).
  int b = y;
  if (by_boundary) {
    const long long unit = view.BoundaryUnit(y);
    b = unit < view.Total() ? FindRequestInWarp(view, static_cast<int>(unit), lane) : -1;
    if (b >= 0 && !view.FirstSplitAt(b, y)) b = -1;
  }
  SplitRequest req{};
  if (b >= 0) req = SplitRequest::Load(p, view, num_parts, b);
  GridDependencyWait();
  SM90_TRACE_KERNEL(kTracedCombine, kKernelWaited);
  if (b < 0) return;
  const int first = req.first, last = req.last;
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) +
                       (static_cast<size_t>(b) * rows + row) * kLatentDim;
  float* lse_out = p.lse + static_cast<size_t>(b) * rows + row;
  constexpr float kNegInf = -__builtin_huge_valf();
  constexpr int kColsPerLane = kLatentDim / 32;  // 16, as 4 groups of 4 columns

  auto write_empty = [&]() { WriteEmptyRow(p, rows, b, row, lane); };

  if (req.n == 0) {
    write_empty();
    return;
  }
  if (first == last) return;

  float max_lse = kNegInf;
#pragma unroll 4
  for (int s = first; s <= last; ++s) {
    max_lse = fmaxf(max_lse, req.part_lse[req.SlotRow(b, s, row)]);
  }
  if (max_lse == kNegInf) {
    write_empty();
    return;
  }
  float sum = 0.f;
#pragma unroll 4
  for (int s = first; s <= last; ++s) {
    sum += __expf(req.part_lse[req.SlotRow(b, s, row)] - max_lse);
  }
  const float lse = max_lse + __logf(sum);
  float acc[kColsPerLane];
#pragma unroll
  for (int i = 0; i < kColsPerLane; ++i) acc[i] = 0.f;
#pragma unroll 4
  for (int s = first; s <= last; ++s) {
    const size_t slot_row = req.SlotRow(b, s, row);
    const float w = __expf(req.part_lse[slot_row] - lse);
    const auto* src = reinterpret_cast<const PartialCols<kBf16Partials>*>(req.part_out) +
                      slot_row * (kLatentDim / 4);
#pragma unroll
    for (int g = 0; g < kColsPerLane / 4; ++g) {
      const float4 v = Widen(src[g * 32 + lane]);
      acc[4 * g + 0] = fmaf(w, v.x, acc[4 * g + 0]);
      acc[4 * g + 1] = fmaf(w, v.y, acc[4 * g + 1]);
      acc[4 * g + 2] = fmaf(w, v.z, acc[4 * g + 2]);
      acc[4 * g + 3] = fmaf(w, v.w, acc[4 * g + 3]);
    }
  }
#pragma unroll
  for (int g = 0; g < kColsPerLane / 4; ++g) {
    __nv_bfloat162 lo = __floats2bfloat162_rn(acc[4 * g] * p.output_scale,
                                              acc[4 * g + 1] * p.output_scale);
    __nv_bfloat162 hi = __floats2bfloat162_rn(acc[4 * g + 2] * p.output_scale,
                                              acc[4 * g + 3] * p.output_scale);
    uint2 v;
    v.x = *reinterpret_cast<uint32_t*>(&lo);
    v.y = *reinterpret_cast<uint32_t*>(&hi);
    *reinterpret_cast<uint2*>(out + g * 128 + lane * 4) = v;
  }
  if (lane == 0) *lse_out = lse;
}

// One warp's view of the LSEs of output row `row` of request b's splits first..last: lane j holds
// those of splits first + j + 32 g for g < kCombineLseGroups, all read at once (kNegInf past last),
// so that the reductions wait for one round trip to memory instead of one per 32 splits; splits
// beyond them (more parts than an SM90 GPU has SMs) are read where they are needed.
struct RowSplitLses {
  const float* lse0;  // the LSE of split first; split s's is at lse0 + (s - first) * stride
  size_t stride;
  int count, lane;    // count: last - first + 1
  float held[kCombineLseGroups];

  __device__ __forceinline__ static RowSplitLses Load(const SplitRequest& req, int b, int row,
                                                      int lane) {
    RowSplitLses r;
    r.lse0 = req.part_lse + req.SlotRow(b, req.first, row);
    r.stride = req.rows_pad;
    r.count = req.last - req.first + 1;
    r.lane = lane;
#pragma unroll
    for (int g = 0; g < kCombineLseGroups; ++g) r.held[g] = r.Read(32 * g + lane);
    return r;
  }
  __device__ __forceinline__ float Read(int i) const {
    return i < count ? lse0[i * stride] : -__builtin_huge_valf();
  }
  // This lane's LSE of split first + 32 g + lane (kNegInf past last).
  __device__ __forceinline__ float Get(int g) const {
    if (g >= kCombineLseGroups) return Read(32 * g + lane);
    float v = held[0];
#pragma unroll
    for (int i = 1; i < kCombineLseGroups; ++i) v = g == i ? held[i] : v;
    return v;
  }
  // The row's LSE over all its splits, the same on every lane, reduced across the warp in a fixed
  // order; kNegInf where every split is empty.
  __device__ __forceinline__ float Merged() const {
    const int groups = (count - 1) / 32 + 1;
    float max_lse = held[0];
    for (int g = 1; g < groups; ++g) {
      if (32 * g + lane < count) max_lse = fmaxf(max_lse, Get(g));
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
      max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, d));
    }
    if (max_lse == -__builtin_huge_valf()) return max_lse;
    float sum = __expf(held[0] - max_lse);
    for (int g = 1; g < groups; ++g) {
      if (32 * g + lane < count) sum += __expf(Get(g) - max_lse);
    }
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
    return max_lse + __logf(sum);
  }
  // Lane j's weight of split first + 32 g + j in the merge: exp(its LSE - the merged LSE).
  __device__ __forceinline__ float Weight(int g, float merged) const {
    return __expf(Get(g) - merged);
  }
};

// Where one warp of a wide combine writes its 128 columns (4 a lane, from col0) of output row
// `row` of request b, and that row's LSE (once per row).
struct WideRowOutput {
  __nv_bfloat16* out;
  float* lse;
  bool writes_lse;

  __device__ __forceinline__ static WideRowOutput At(const DecodeParams& p, int rows, int b,
                                                     int row, int col0, bool writes_lse) {
    const size_t out_row = static_cast<size_t>(b) * rows + row;
    return {static_cast<__nv_bfloat16*>(p.out) + out_row * kLatentDim + col0, p.lse + out_row,
            writes_lse};
  }
  __device__ __forceinline__ void Write(float4 v, float row_lse) const {
    *reinterpret_cast<Bf16x4*>(out) =
        Bf16x4{__floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w)};
    if (writes_lse) *lse = row_lse;
  }
  // The merged columns times `scale` (DecodeParams::output_scale).
  __device__ __forceinline__ void Write(float4 acc, float scale, float row_lse) const {
    Write(make_float4(acc.x * scale, acc.y * scale, acc.z * scale, acc.w * scale), row_lse);
  }
  __device__ __forceinline__ void WriteEmpty() const {
    Write(make_float4(0.f, 0.f, 0.f, 0.f), -__builtin_huge_valf());
  }
};

__device__ __forceinline__ void MultiplyAdd(float w, const float4& x, float4& acc) {
  acc.x = fmaf(w, x.x, acc.x);
  acc.y = fmaf(w, x.y, acc.y);
  acc.z = fmaf(w, x.z, acc.z);
  acc.w = fmaf(w, x.w, acc.w);
}

// The same merge with kCombineWarpsPerRow warps per output row, each owning 512 / that many
// columns (4 per lane), for requests split over many parts (few requests: B = 1 splits one request
// over up to all parts). The splits' LSEs are read by the lanes in parallel (RowSplitLses) and
// reduced across the warp in a fixed order; the outputs are accumulated in part order, each lane
// loading kRowsInFlight partial rows at a time, the first ones before the LSEs are reduced.
// Deterministic; grid: (ceil(rows / kCombineWideRowsPerBlock), batch) blocks of
// kCombineWideThreads threads (kCombineWarpsPerRow warps a row). kBf16Partials: the partial
// outputs are bf16 (the decode's DecodeKernelArgs::bf16_partials), else fp32.
template <int kRowsInFlight, bool kBf16Partials>
__global__ void __launch_bounds__(kCombineWideThreads)
CombineKernelWide(const DecodeParams p, int num_parts) {
  static_assert(32 % kRowsInFlight == 0, "a batch of 32 splits is whole loads");
  SM90_TRACE_KERNEL(kTracedCombine, kKernelEntry);
  SM90_TRACE_KERNEL_EXIT_SCOPE(kTracedCombine);
  GridDependencyLaunchDependents();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = blockIdx.y;
  const int rows = p.q_len * p.num_heads;
  const int row = blockIdx.x * kCombineWideRowsPerBlock + warp / kCombineWarpsPerRow;
  if (row >= rows) return;  // not the block's first warp, which waits below
  constexpr int kCols = kLatentDim / kCombineWarpsPerRow;  // 128: 4 per lane
  static_assert(kCols == 4 * 32, "one float4 of columns per lane");
  const int col0 = (warp % kCombineWarpsPerRow) * kCols + lane * 4;
  const SplitRequest req = SplitRequest::Load(p, ScheduleView::Load(p, num_parts), num_parts, b);
  GridDependencyWait();
  SM90_TRACE_KERNEL(kTracedCombine, kKernelWaited);
  const int first = req.first, last = req.last;
  const WideRowOutput output =
      WideRowOutput::At(p, rows, b, row, col0, warp % kCombineWarpsPerRow == 0 && lane == 0);

  if (req.n == 0) {
    output.WriteEmpty();
    return;
  }
  if (first == last) return;
  auto slot_row = [=](int s) { return req.SlotRow(b, s, row); };
  // This lane's columns of the partial rows of splits s0 .. s0 + kRowsInFlight - 1 (up to last),
  // as stored (bf16 ones are widened where they are accumulated).
  const auto* part_out = reinterpret_cast<const PartialCols<kBf16Partials>*>(req.part_out);
  PartialCols<kBf16Partials> v[kRowsInFlight];
  auto load_rows = [&](int s0) {
#pragma unroll
    for (int i = 0; i < kRowsInFlight; ++i) {
      if (s0 + i <= last) v[i] = part_out[(slot_row(s0 + i) * kLatentDim + col0) / 4];
    }
  };
  load_rows(first);
  const RowSplitLses lses = RowSplitLses::Load(req, b, row, lane);
  const float lse = lses.Merged();
  SM90_TRACE_KERNEL_AFTER(kTracedCombine, kKernelStep1, lse);
  if (lse == -__builtin_huge_valf()) {
    output.WriteEmpty();
    return;
  }

  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int base = first; base <= last; base += 32) {
    const float w_lane = lses.Weight((base - first) / 32, lse);  // lane j: split base + j
    for (int sub = 0; sub < 32 && base + sub <= last; sub += kRowsInFlight) {
      if (base + sub != first) load_rows(base + sub);
#pragma unroll
      for (int i = 0; i < kRowsInFlight; ++i) {
        if (base + sub + i <= last) {
          MultiplyAdd(__shfl_sync(0xffffffffu, w_lane, sub + i), Widen(v[i]), acc);
        }
      }
    }
    if (base == first) {
      SM90_TRACE_KERNEL_AFTER(kTracedCombine, kKernelStep2, acc.x + acc.y + acc.z + acc.w);
    }
  }
  output.Write(acc, p.output_scale, lse);
}

// How CombineKernelStaged divides the output rows among its blocks: kRowsPerBlock whole rows
// each, whose partials of one split are contiguous in the workspace and fill one kStagedSlotBytes
// slot (two bf16 rows or one fp32 row).
template <bool kBf16Partials>
struct StagedShape {
  static constexpr int kRowBytes = kLatentDim * (kBf16Partials ? 2 : 4);
  static constexpr int kRowsPerBlock = kStagedSlotBytes / kRowBytes;
  static constexpr int kConsumerWarps = kRowsPerBlock * kCombineWarpsPerRow;
  static constexpr int kThreads = (kConsumerWarps + 1) * 32;  // and the producer warp
  static constexpr int kSlots = kStagedGroups * kStagedGroupSplits;
  static constexpr int kSmemBytes = kSlots * kStagedSlotBytes + 2 * kStagedGroups * 8;
  static_assert(kRowsPerBlock * kRowBytes == kStagedSlotBytes, "a slot is whole rows");
  static_assert(kLatentDim == kCombineWarpsPerRow * 128, "4 columns a lane");

  __host__ __device__ static constexpr int GridX(int rows) {
    return (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  }
};

// The wide merge (4 columns a lane, the splits in part order: CombineKernelWide's arithmetic in
// the same order, so the same bytes) with the splits' partial rows staged in shared memory by bulk
// asynchronous copies rather than loaded by each lane: the copy engine brings a block's splits in
// at a higher rate than its warps' own loads reach (benchmarks/combine_read_probe.cu). A producer
// warp (the last) copies the block's rows of each split (StagedShape), kStagedGroupSplits to a
// group, into a ring of kStagedGroups groups of slots, its lanes issuing 32 copies at a time; each
// group completes on its `full` mbarrier and is handed back on its `empty` one once every consumer
// warp has read it. The consumer warps read the LSEs and reduce them meanwhile. Grid:
// (StagedShape::GridX(rows), batch) blocks of StagedShape::kThreads threads and
// StagedShape::kSmemBytes of dynamic shared memory. kBf16Partials: the partial outputs are bf16
// (the decode's DecodeKernelArgs::bf16_partials), else fp32.
template <bool kBf16Partials>
__global__ void __launch_bounds__(StagedShape<kBf16Partials>::kThreads)
CombineKernelStaged(const DecodeParams p, int num_parts) {
  using Shape = StagedShape<kBf16Partials>;
  using Ring = StagedRing;
  static_assert(32 % kStagedGroupSplits == 0,
                "a group's weights are those of one 32-split batch; a warp issues whole groups");
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  SM90_TRACE_KERNEL(kTracedCombine, kKernelEntry);
  SM90_TRACE_KERNEL_EXIT_SCOPE(kTracedCombine);
  GridDependencyLaunchDependents();
  extern __shared__ __align__(128) uint8_t staged[];  // [kSlots][kStagedSlotBytes], barriers
  uint64_t* full = reinterpret_cast<uint64_t*>(staged + Shape::kSlots * kStagedSlotBytes);
  uint64_t* empty = full + kStagedGroups;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = blockIdx.y;
  const int rows = p.q_len * p.num_heads;
  const int row0 = blockIdx.x * Shape::kRowsPerBlock;
  if (threadIdx.x == 0) {
    for (int g = 0; g < kStagedGroups; ++g) {
      Barrier::init(&full[g], kStagedGroupSplits);
      Barrier::init(&empty[g], Shape::kConsumerWarps);
    }
    cutlass::arch::fence_barrier_init();
  }
  const SplitRequest req = SplitRequest::Load(p, ScheduleView::Load(p, num_parts), num_parts, b);
  __syncthreads();
  GridDependencyWait();
  SM90_TRACE_KERNEL(kTracedCombine, kKernelWaited);
  const int first = req.first, last = req.last;
  if (warp == Shape::kConsumerWarps) {
    // ------------------------------------------------------------------ producer warp
    // Each slot's lane arrives on its group's `full` with the slot's bytes (a group of fewer
    // splits: the rest arrive with none).
    if (req.n == 0 || first == last) return;
    const uint8_t* part_out = reinterpret_cast<const uint8_t*>(req.part_out);
    for (int k0 = 0; first + k0 * kStagedGroupSplits <= last; k0 += Ring::kGroupsPerIssue) {
      const int k = Ring::IssuedGroup(k0, lane), s = first + Ring::IssuedSplit(k0, lane);
      if (first + k * kStagedGroupSplits > last) continue;  // no such group
      if (Ring::WaitsForEmpty(k)) Barrier::wait(&empty[Ring::Group(k)], Ring::EmptyParity(k));
      Barrier::arrive_and_expect_tx(&full[Ring::Group(k)], s <= last ? kStagedSlotBytes : 0);
      if (s <= last) {
        detail::BulkCopyG2S(staged + Ring::Slot(k, lane % kStagedGroupSplits) * kStagedSlotBytes,
                            part_out + req.SlotRow(b, s, row0) * Shape::kRowBytes,
                            kStagedSlotBytes, &full[Ring::Group(k)],
                            static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_FIRST));
      }
    }
    return;
  }
  // -------------------------------------------------------------------- consumer warps
  const int row = row0 + warp / kCombineWarpsPerRow;  // rows_pad > row: the slot holds it
  const int col0 = (warp % kCombineWarpsPerRow) * 128 + lane * 4;
  const WideRowOutput output =
      WideRowOutput::At(p, rows, b, row, col0, warp % kCombineWarpsPerRow == 0 && lane == 0);
  if (req.n == 0) {
    if (row < rows) output.WriteEmpty();
    return;
  }
  if (first == last) return;
  // A padding row's warp (row >= rows) reads the last row's LSEs, which the decode wrote, and
  // drops what it merges.
  const RowSplitLses lses = RowSplitLses::Load(req, b, min(row, rows - 1), lane);
  const float lse = lses.Merged();
  SM90_TRACE_KERNEL_AFTER(kTracedCombine, kKernelStep1, lse);
  // This lane's 4 columns in a slot.
  const uint8_t* mine = staged + (warp / kCombineWarpsPerRow) * Shape::kRowBytes +
                        col0 * static_cast<int>(sizeof(PartialCols<kBf16Partials>)) / 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float w_lane = 0.f;  // lane j: the weight of split first + 32 (k / 4) + j
  for (int k = 0; first + k * kStagedGroupSplits <= last; ++k) {
    const int g = Ring::Group(k), s0 = first + k * kStagedGroupSplits;
    if ((s0 - first) % 32 == 0) w_lane = lses.Weight((s0 - first) / 32, lse);
    Barrier::wait(&full[g], Ring::FullParity(k));
    // CUTLASS's wait and arrive are no compiler barriers: the slot's plain loads stay between them.
    asm volatile("" ::: "memory");
    PartialCols<kBf16Partials> v[kStagedGroupSplits];
#pragma unroll
    for (int i = 0; i < kStagedGroupSplits; ++i) {
      v[i] = *reinterpret_cast<const PartialCols<kBf16Partials>*>(
          mine + Ring::Slot(k, i) * kStagedSlotBytes);
    }
    __syncwarp();
    asm volatile("" ::: "memory");
    if (lane == 0) Barrier::arrive(&empty[g]);
#pragma unroll
    for (int i = 0; i < kStagedGroupSplits; ++i) {
      if (s0 + i <= last) {
        MultiplyAdd(__shfl_sync(0xffffffffu, w_lane, (s0 - first + i) % 32), Widen(v[i]), acc);
      }
    }
    if (k == 0) {
      SM90_TRACE_KERNEL_AFTER(kTracedCombine, kKernelStep2, acc.x + acc.y + acc.z + acc.w);
    }
  }
  if (row >= rows) return;
  if (lse == -__builtin_huge_valf()) {
    output.WriteEmpty();
    return;
  }
  output.Write(acc, p.output_scale, lse);
}

}  // namespace sm90
}  // namespace jax_mla
