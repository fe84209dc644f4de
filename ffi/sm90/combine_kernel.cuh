// Combine kernel of the SM90 decode: merges the fp32 partial outputs of split requests.
//
// One warp per output row (grid: row groups x requests). A request with no KV blocks (length 0
// after clamping) gets zeros and LSE -inf here; a request handled by one part was written whole
// by the decode kernel and is skipped. The splits are merged in part order: deterministic.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "decode_params.h"
#include "schedule.cuh"

namespace jax_mla {
namespace sm90 {

__global__ void __launch_bounds__(kCombineRowsPerBlock * 32)
CombineKernel(const DecodeParams p, int num_parts) {
  GridDependencyWait();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = blockIdx.y;
  const int rows = p.q_len * p.num_heads;
  const int row = blockIdx.x * kCombineRowsPerBlock + warp;
  if (row >= rows) return;
  const int len = EffectiveLength(p.seq_lens[b], p.max_pages, p.page_size);
  const int n = NumKvBlocks(len);
  __nv_bfloat16* out = static_cast<__nv_bfloat16*>(p.out) +
                       (static_cast<size_t>(b) * rows + row) * kLatentDim;
  float* lse_out = p.lse + static_cast<size_t>(b) * rows + row;
  constexpr float kNegInf = -__builtin_huge_valf();
  constexpr int kColsPerLane = kLatentDim / 32;  // 16, as 4 groups of 4 columns

  auto write_empty = [&]() {
#pragma unroll
    for (int g = 0; g < kColsPerLane / 4; ++g) {
      uint2 z = make_uint2(0, 0);
      *reinterpret_cast<uint2*>(out + g * 128 + lane * 4) = z;
    }
    if (lane == 0) *lse_out = kNegInf;
  };

  if (n == 0) {
    write_empty();
    return;
  }
  const ScheduleView view = ScheduleView::Load(p, num_parts);
  const int first = view.PartOf(b, 0);
  const int last = view.PartOf(b, n - 1);
  if (first == last) return;

  const WorkspaceLayout ws = MakeWorkspaceLayout(p.batch, p.q_len, p.num_heads, num_parts);
  const uint8_t* wsb = static_cast<const uint8_t*>(p.workspace);
  const float* part_out = reinterpret_cast<const float*>(wsb + ws.partial_out);
  const float* part_lse = reinterpret_cast<const float*>(wsb + ws.partial_lse);

  float max_lse = kNegInf;
#pragma unroll 4
  for (int s = first; s <= last; ++s) {
    max_lse = fmaxf(max_lse, part_lse[static_cast<size_t>(b + s) * ws.rows_pad + row]);
  }
  if (max_lse == kNegInf) {
    write_empty();
    return;
  }
  float sum = 0.f;
#pragma unroll 4
  for (int s = first; s <= last; ++s) {
    sum += __expf(part_lse[static_cast<size_t>(b + s) * ws.rows_pad + row] - max_lse);
  }
  const float lse = max_lse + __logf(sum);
  float acc[kColsPerLane];
#pragma unroll
  for (int i = 0; i < kColsPerLane; ++i) acc[i] = 0.f;
#pragma unroll 4
  for (int s = first; s <= last; ++s) {
    const size_t slot_row = static_cast<size_t>(b + s) * ws.rows_pad + row;
    const float w = __expf(part_lse[slot_row] - lse);
    const float* src = part_out + slot_row * kLatentDim;
#pragma unroll
    for (int g = 0; g < kColsPerLane / 4; ++g) {
      const float4 v = *reinterpret_cast<const float4*>(src + g * 128 + lane * 4);
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

}  // namespace sm90
}  // namespace jax_mla
