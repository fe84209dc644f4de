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

#include "decode_params.h"
#include "schedule.cuh"

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

// The same merge with kCombineWarpsPerRow warps per output row, each owning 512 / that many
// columns (4 per lane), for requests split over many parts (few requests: B = 1 splits one request
// over up to all parts). The splits' LSEs are read by the lanes in parallel (lane j: splits j,
// j + 32, ...), all at once, and reduced across the warp in a fixed order; the outputs are
// accumulated in part order, each lane loading kRowsInFlight partial rows at a time, the first
// ones before the LSEs are reduced. 32 rows in flight take more registers than several CTAs per
// SM leave: for grids that fit the SMs in one wave of one CTA each (LaunchDecode).
// Deterministic; grid:
// (ceil(rows / kCombineWideRowsPerBlock), batch) blocks of kCombineWideRowsPerBlock *
// kCombineWarpsPerRow warps. kBf16Partials: the partial outputs are bf16 (the decode's
// DecodeKernelArgs::bf16_partials), else fp32.
template <int kRowsInFlight, bool kBf16Partials>
__global__ void __launch_bounds__(kCombineWideRowsPerBlock * kCombineWarpsPerRow * 32)
CombineKernelWide(const DecodeParams p, int num_parts) {
  static_assert(32 % kRowsInFlight == 0, "a batch of 32 splits is whole loads");
  GridDependencyLaunchDependents();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = blockIdx.y;
  const int rows = p.q_len * p.num_heads;
  const int row = blockIdx.x * kCombineWideRowsPerBlock + warp / kCombineWarpsPerRow;
  if (row >= rows) return;  // not the block's first warp, which waits below
  constexpr int kCols = kLatentDim / kCombineWarpsPerRow;  // 128: 4 per lane
  static_assert(kCols == 4 * 32, "one float4 of columns per lane");
  const int col0 = (warp % kCombineWarpsPerRow) * kCols + lane * 4;
  const bool writes_lse = warp % kCombineWarpsPerRow == 0 && lane == 0;
  const SplitRequest req = SplitRequest::Load(p, ScheduleView::Load(p, num_parts), num_parts, b);
  GridDependencyWait();
  const int first = req.first, last = req.last;
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) +
                       (static_cast<size_t>(b) * rows + row) * kLatentDim + col0;
  float* lse_out = p.lse + static_cast<size_t>(b) * rows + row;
  constexpr float kNegInf = -__builtin_huge_valf();

  auto write = [&](float4 v, float lse) {
    *reinterpret_cast<Bf16x4*>(out) =
        Bf16x4{__floats2bfloat162_rn(v.x, v.y), __floats2bfloat162_rn(v.z, v.w)};
    if (writes_lse) *lse_out = lse;
  };
  const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);

  if (req.n == 0) {
    write(zero, kNegInf);
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

  // Lane j's LSEs of splits first + j + 32 g, g < kCombineLseGroups, all read at once (kNegInf
  // past last), so that the reductions and the weights below wait for one round trip to memory
  // instead of one per 32 splits; splits beyond them (more parts than an SM90 GPU has SMs) are
  // read where they are needed.
  float lse_g[kCombineLseGroups];
#pragma unroll
  for (int g = 0; g < kCombineLseGroups; ++g) {
    const int s = first + 32 * g + lane;
    lse_g[g] = s <= last ? req.part_lse[slot_row(s)] : kNegInf;
  }
  auto lane_lse = [&](int g) {  // this lane's LSE of split first + 32 g + lane (kNegInf past last)
    const int s = first + 32 * g + lane;
    if (g >= kCombineLseGroups) return s <= last ? req.part_lse[slot_row(s)] : kNegInf;
    float v = lse_g[0];
#pragma unroll
    for (int i = 1; i < kCombineLseGroups; ++i) v = g == i ? lse_g[i] : v;
    return v;
  };
  const int groups = (last - first) / 32 + 1;
  float max_lse = lse_g[0];
  for (int g = 1; g < groups; ++g) {
    if (first + 32 * g + lane <= last) max_lse = fmaxf(max_lse, lane_lse(g));
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, d));
  if (max_lse == kNegInf) {
    write(zero, kNegInf);
    return;
  }
  float sum = __expf(lse_g[0] - max_lse);
  for (int g = 1; g < groups; ++g) {
    if (first + 32 * g + lane <= last) sum += __expf(lane_lse(g) - max_lse);
  }
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
  const float lse = max_lse + __logf(sum);

  float4 acc = zero;
  for (int base = first; base <= last; base += 32) {
    // Lane j holds the weight of split base + j.
    const float lse_lane = lane_lse((base - first) / 32);
    const float w_lane = __expf(lse_lane - lse);
    for (int sub = 0; sub < 32 && base + sub <= last; sub += kRowsInFlight) {
      if (base + sub != first) load_rows(base + sub);
#pragma unroll
      for (int i = 0; i < kRowsInFlight; ++i) {
        if (base + sub + i <= last) {
          const float w = __shfl_sync(0xffffffffu, w_lane, sub + i);
          const float4 x = Widen(v[i]);
          acc.x = fmaf(w, x.x, acc.x);
          acc.y = fmaf(w, x.y, acc.y);
          acc.z = fmaf(w, x.z, acc.z);
          acc.w = fmaf(w, x.w, acc.w);
        }
      }
    }
  }
  const float f = p.output_scale;
  write(make_float4(acc.x * f, acc.y * f, acc.z * f, acc.w * f), lse);
}

}  // namespace sm90
}  // namespace jax_mla
