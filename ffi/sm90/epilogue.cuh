// The decode kernels' epilogues: a segment's output and LSE, whole requests' in bf16 to `out` and
// `lse`, split ones' partials to the workspace for the combine kernel; the 64-row tiles' stores
// bounced through the P tile so that global stores are whole 16-byte pieces.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "decode_params.h"
#include "fragment_layout.h"
#include "pipeline.cuh"
#include "schedule.cuh"
#include "smem_layout.cuh"
#include "softmax.cuh"

namespace jax_mla {
namespace sm90 {
namespace detail {

// Transposed scores: writes a segment's results from this thread's O^T values (kOTiles tiles of 64
// of the warpgroup's columns x kScoreN query rows) and its rows' sums l and maxima m (query rows
// TransposedScores::QueryRow(lane, i)): bf16 out and LSE for a request handled whole, fp32
// partial out and LSE in the workspace for a split one. Rows >= rows are padding, not written.
template <int kScoreN, int kOTiles, int kOPerTile>
__device__ __forceinline__ void StoreTransposed(const DecodeParams& p, const Segment& seg,
                                                int part, int num_parts, int rows, int wg,
                                                int wg_tid, const float (&o)[kOTiles][kOPerTile],
                                                const float (&l)[kScoreN / 4],
                                                const float (&m)[kScoreN / 4], float scale_log2) {
  constexpr int kRowsT = kScoreN / 4;
  const int lane = wg_tid % 32;
  const int col_base = wg * (kLatentDim / kConsumerWarpgroups);
  // Lanes 0-3 of the warpgroup's first warp hold every query row once.
  const bool writes_lse = wg == 0 && wg_tid < 4;
  const WorkspaceLayout ws = MakeWorkspaceLayout(p.batch, p.q_len, p.num_heads, num_parts);
  uint8_t* wsb = static_cast<uint8_t*>(p.workspace);
  float* part_out = reinterpret_cast<float*>(wsb + ws.partial_out);
  float* part_lse = reinterpret_cast<float*>(wsb + ws.partial_lse);
  const size_t out_row0 = static_cast<size_t>(seg.b) * rows;
  const size_t slot_row0 = static_cast<size_t>(seg.b + part) * ws.rows_pad;
#pragma unroll
  for (int i = 0; i < kRowsT; ++i) {
    const int row = TransposedScores::QueryRow(lane, i);
    if (row >= rows) continue;
    const float inv = RowInverse(l[i]);
    const float lse = RowLse(m[i], l[i], scale_log2);
    if (seg.whole) {
      __nv_bfloat16* dst = static_cast<__nv_bfloat16*>(p.out) + (out_row0 + row) * kLatentDim;
      const float f = inv * p.output_scale;
#pragma unroll
      for (int t = 0; t < kOTiles; ++t) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          dst[col_base + t * kChunkCols + TransposedScores::Token(wg_tid, half)] =
              __float2bfloat16_rn(o[t][TransposedScores::Element(i, half)] * f);
        }
      }
      if (writes_lse) p.lse[out_row0 + row] = lse;
    } else {
      float* dst = part_out + (slot_row0 + row) * kLatentDim;
#pragma unroll
      for (int t = 0; t < kOTiles; ++t) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          dst[col_base + t * kChunkCols + TransposedScores::Token(wg_tid, half)] =
              o[t][TransposedScores::Element(i, half)] * inv;
        }
      }
      if (writes_lse) part_lse[slot_row0 + row] = lse;
    }
  }
}

// The epilogue of the 64-row tiles stores through a 1 KB slice of shared memory per warp (the P
// tile, dead between a segment's last PV and the next segment's first softmax): the warp writes a
// piece of 8 rows x 128 bytes from the accumulator layout, reads it back as 16 bytes of one row per
// lane and stores four whole 128-byte row segments per instruction (straight from the accumulator
// layout an instruction stores 16 or 32 bytes of each of eight rows). The 16-byte chunks of the
// piece's row r sit at chunk ^ r, so that its writes and reads are free of bank conflicts.
constexpr int kBounceBytes = 1024;  // per consumer warp: the P tile's 8 KB over 8 warps

__device__ __forceinline__ uint8_t* BounceChunk(uint8_t* bounce, int row, int chunk) {
  return bounce + row * 128 + ((chunk ^ row) * 16);
}

// Stores the warp's piece: piece row r (of 8) goes to row_dst(r) (nullptr: not stored).
template <class RowDst>
__device__ __forceinline__ void FlushPiece(uint8_t* bounce, int lane, RowDst row_dst) {
  __syncwarp();
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int r = lane / 8 + 4 * k, chunk = lane % 8;
    const uint4 v = *reinterpret_cast<const uint4*>(BounceChunk(bounce, r, chunk));
    uint8_t* dst = row_dst(r);
    if (dst != nullptr) *reinterpret_cast<uint4*>(dst + 16 * chunk) = v;
  }
  __syncwarp();
}

// Plain path (64 query rows x 256 columns per warpgroup): adds the two warpgroups' row sums in a
// fixed order (so both get the same, bit for bit) and writes a segment's results from this
// thread's rows r0 and r1 = r0 + 8 of the M tile (query rows gr0, gr1; rows >= rows are padding):
// bf16 out x output_scale and LSE for a request handled whole; partial out (fp32, or bf16 with
// bf16_partials) and LSE in the workspace for a split one, through the warp's bounce slice of the
// P tile. o holds output columns [2 N col_block, 2 N col_block + 2 N): 256 columns, or 128 with
// column halves; the LSE is written where writes_lse. m0, m1 are the rows' maxima (in score
// units), l0, l1 this warpgroup's row sums over its quad.
template <int N>
__device__ __forceinline__ void StorePlain(const DecodeParams& p, const Segment& seg, int part,
                                           int num_parts, int rows, int wg, int col_block,
                                           bool writes_lse, int lane, int r0, int gr0, int gr1,
                                           const float (&o)[N], float l0, float l1, float m0,
                                           float m1, float scale_log2, bool bf16_partials,
                                           float* row_sum, uint8_t* bounce) {
  static_assert(N == 128 || N == 64, "a warpgroup's 256 or 128 columns");
  const int r1 = r0 + 8;
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  if ((lane & 3) == 0) {
    row_sum[wg * kBlockM + r0] = l0;
    row_sum[wg * kBlockM + r1] = l1;
  }
  ConsumerSync();
  const float sum0 = row_sum[r0] + row_sum[kBlockM + r0];
  const float sum1 = row_sum[r1] + row_sum[kBlockM + r1];
  const float inv0 = RowInverse(sum0);
  const float inv1 = RowInverse(sum1);
  const float lse0 = RowLse(m0, sum0, scale_log2);
  const float lse1 = RowLse(m1, sum1, scale_log2);
  const int col0 = col_block * 2 * N;
  // Query row of piece row r of the warp's rows half h (rows r0 - lane / 4 + 8 h + r).
  const int warp_row0 = gr0 - lane / 4;
  const int quad = lane % 4;

  const WorkspaceLayout ws = MakeWorkspaceLayout(p.batch, p.q_len, p.num_heads, num_parts);
  uint8_t* wsb = static_cast<uint8_t*>(p.workspace);
  float* part_lse = reinterpret_cast<float*>(wsb + ws.partial_lse);
  const size_t slot_row = static_cast<size_t>(seg.b + part) * ws.rows_pad;
  if (seg.whole || bf16_partials) {
    __nv_bfloat16* out = seg.whole ? static_cast<__nv_bfloat16*>(p.out)
                                   : reinterpret_cast<__nv_bfloat16*>(wsb + ws.partial_out);
    float* lse_out = seg.whole ? p.lse : part_lse;
    const size_t row_base = seg.whole ? static_cast<size_t>(seg.b) * rows : slot_row;
    const float scale = seg.whole ? p.output_scale : 1.f;
    if (writes_lse && (lane & 3) == 0) {
      if (gr0 < rows) lse_out[row_base + gr0] = lse0;
      if (gr1 < rows) lse_out[row_base + gr1] = lse1;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float f = (h == 0 ? inv0 : inv1) * scale;
#pragma unroll
      for (int c = 0; c < N / 32; ++c) {
        // Columns [64 c, 64 c + 64) of the warpgroup's: eight-column groups 8 c .. 8 c + 7,
        // each an 8 x 8 bf16 matrix that stmatrix writes as one 16-byte chunk per piece row.
#pragma unroll
        for (int t = 0; t < 2; ++t) {
          uint32_t v[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int j = 8 * c + 4 * t + i;
            v[i] = PackBf16x2(o[4 * j + 2 * h] * f, o[4 * j + 2 * h + 1] * f);
          }
          const uint32_t addr = SmemAddr(BounceChunk(bounce, lane % 8, 4 * t + lane / 8));
          asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n"
                       :
                       : "r"(addr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3])
                       : "memory");
        }
        FlushPiece(bounce, lane, [&](int r) -> uint8_t* {
          const int row = warp_row0 + 8 * h + r;
          return row < rows ? reinterpret_cast<uint8_t*>(out + (row_base + row) * kLatentDim +
                                                         col0 + 64 * c)
                            : nullptr;
        });
      }
    }
  } else {
    float* part_out = reinterpret_cast<float*>(wsb + ws.partial_out);
    if (writes_lse && (lane & 3) == 0) {
      if (gr0 < rows) part_lse[slot_row + gr0] = lse0;
      if (gr1 < rows) part_lse[slot_row + gr1] = lse1;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float f = h == 0 ? inv0 : inv1;
#pragma unroll
      for (int c = 0; c < N / 16; ++c) {
        // Columns [32 c, 32 c + 32) of the warpgroup's: groups 4 c .. 4 c + 3, 32 bytes of
        // float32 each per row; this lane's pair sits in chunk 2 i + quad / 2.
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int j = 4 * c + i;
          *reinterpret_cast<float2*>(BounceChunk(bounce, lane / 4, 2 * i + quad / 2) +
                                     8 * (quad % 2)) =
              make_float2(o[4 * j + 2 * h] * f, o[4 * j + 2 * h + 1] * f);
        }
        FlushPiece(bounce, lane, [&](int r) -> uint8_t* {
          const int row = warp_row0 + 8 * h + r;
          return row < rows ? reinterpret_cast<uint8_t*>(part_out + (slot_row + row) * kLatentDim +
                                                         col0 + 32 * c)
                            : nullptr;
        });
      }
    }
  }
  // The next segment's first softmax writes the P tile.
  ConsumerSync();
}

}  // namespace detail
}  // namespace sm90
}  // namespace jax_mla
