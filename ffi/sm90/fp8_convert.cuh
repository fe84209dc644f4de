// The fp8 cache in DecodeKernel: e4m3 to bf16; staged rows converted into the bf16 tile
// (DequantiseRow: the 64-row tiles, and the transposed scores that LaunchOptions::fp8_registers = 0
// asks for in place of the register-operand kernels), up to 16 rows the keys into registers too
// (LoadKFragments, the query tile's columns permuted to match), and the transposed scores from
// them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "decode_params.h"
#include "fragment_layout.h"
#include "kv_blocks.cuh"
#include "mma.cuh"
#include "smem_layout.cuh"
#include "softmax.cuh"  // PackBf16x2

namespace jax_mla {
namespace sm90 {
namespace detail {

// Two e4m3 values (the low byte first) times a scale (`scale2`, the scale in both halves) as two
// bf16 (the first in the low half): every e4m3 value is a bf16 value, and the bf16 product with a
// power-of-two scale in range is exact.
__device__ __forceinline__ uint32_t E4m3x2ToBf16x2(uint32_t pair, __nv_bfloat162 scale2) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(pair),
                                                   __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  const uint32_t unscaled = PackBf16x2(f.x, f.y);
  const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&unscaled), scale2);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Sixteen e4m3 values times a scale (scale2 as in E4m3x2ToBf16x2) as sixteen bf16: the first eight
// in lo, the last eight in hi.
__device__ __forceinline__ void E4m3x16ToBf16(const uint4& raw, __nv_bfloat162 scale2, uint4& lo,
                                              uint4& hi) {
  auto cvt = [scale2](uint32_t pair) { return E4m3x2ToBf16x2(pair, scale2); };
  lo = make_uint4(cvt(raw.x), cvt(raw.x >> 16), cvt(raw.y), cvt(raw.y >> 16));
  hi = make_uint4(cvt(raw.z), cvt(raw.z >> 16), cvt(raw.w), cvt(raw.w >> 16));
}

// fp8 cache: converts one (row, part) of a staged token's raw cache row (row_bytes; `loaded`:
// whether it holds a token below the length) into the bf16 KV tile (docs/fp8-cache.md): latent
// group `part` (128 columns) times its scale (exact for the power-of-two scales write_kv writes)
// and rope units 2 part and 2 part + 1 (16 columns, copied); a row that was not loaded is zero.
// Callers give the eight threads of a 16-byte access phase eight consecutive rows of one part
// (conflict-free: the staged rows are 656 bytes, four banks, apart, and the tile's rows are
// swizzled). kUnitsInFlight latent units go at a time (loads, then conversions and stores), which
// bounds the registers it needs beside the output accumulators. The caller fences and
// synchronises the threads that wrote before the tile is read.
//  - 17-32 query rows (transposed scores; at up to 16 LoadKFragments keeps the K part in
//    registers, which do not fit beside 32 rows' accumulators): warpgroup wg reads latent groups
//    2 wg and 2 wg + 1 and rope columns [32 wg, 32 wg + 32) of the tile, in QK^T and in PV alike,
//    so its thread wg_tid converts row wg_tid % 64, part 2 wg + wg_tid / 64.
//  - 64-row tiles: warpgroup wg converts tokens [32 wg, 32 wg + 32) of the block, all columns (its
//    32-token stage), so its thread wg_tid converts row 32 wg + wg_tid % 32, part wg_tid / 32.
template <int kUnitsInFlight = 4>
__device__ __forceinline__ void DequantiseRow(const uint8_t* row_bytes, bool loaded, int part,
                                              uint8_t* tile, int row) {
  constexpr int kUnits = kFp8GroupSize / 16;  // 16-channel units of a group
  // Each row's 16-byte rope units are split over its kFp8ScaleGroups parts.
  constexpr int kRopeUnits = kRopeDim * 2 / 16 / kFp8ScaleGroups;
  static_assert(kRopeUnits == 2 && kUnits % kUnitsInFlight == 0, "two rope units, whole batches");
  // The group's columns start a chunk: unit u is chunk u / 4, column 16 (u % 4) of it.
  uint8_t* group_chunk = tile + part * (kFp8GroupSize / kChunkCols) * kChunkBytes;
  uint8_t* rope_chunk = tile + kNumVChunks * kChunkBytes;
  const float scale =
      loaded ? *reinterpret_cast<const float*>(row_bytes + kFp8ScalesOffset + 4 * part) : 0.f;
  const __nv_bfloat162 scale2 = __float2bfloat162_rn(scale);
#pragma unroll
  for (int u0 = 0; u0 < kUnits; u0 += kUnitsInFlight) {
    uint4 raw[kUnitsInFlight];
#pragma unroll
    for (int i = 0; i < kUnitsInFlight; ++i) {
      // e4m3 zero bytes are +0.
      raw[i] = loaded ? *reinterpret_cast<const uint4*>(row_bytes + part * kFp8GroupSize +
                                                        16 * (u0 + i))
                      : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int i = 0; i < kUnitsInFlight; ++i) {
      const int u = u0 + i;
      uint4 lo, hi;
      E4m3x16ToBf16(raw[i], scale2, lo, hi);
      uint8_t* dst = group_chunk + (u / 4) * kChunkBytes;
      *reinterpret_cast<uint4*>(dst + SwizzledOffset(row, 16 * (u % 4))) = lo;
      *reinterpret_cast<uint4*>(dst + SwizzledOffset(row, 16 * (u % 4) + 8)) = hi;
    }
  }
#pragma unroll
  for (int r = 0; r < kRopeUnits; ++r) {
    const int unit = part * kRopeUnits + r;
    const uint4 v = loaded ? *reinterpret_cast<const uint4*>(row_bytes + kFp8RopeOffset + 16 * unit)
                           : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(rope_chunk + SwizzledOffset(row, 8 * unit)) = v;
  }
}

// fp8 cache: puts the query tile's columns in the order of the register-sourced QK^T
// (PermutedQuery, fragment_layout.h). The consumer threads tid permute the rows x chunks of the
// tile in place, one (row, chunk) each at a time; the caller fences and synchronises them
// afterwards.
template <int kQChunkRows>
__device__ __forceinline__ void PermuteQueryColumns(uint8_t* q_tile, int tid) {
  for (int item = tid; item < kQChunkRows * kNumChunks; item += kConsumerThreads) {
    const int row = item % kQChunkRows;
    uint8_t* chunk = q_tile + (item / kQChunkRows) * kQChunkRows * kRowBytes;
    uint32_t in[32], out[32];
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      const uint4 v = *reinterpret_cast<const uint4*>(chunk + SwizzledOffset(row, 8 * u));
      in[4 * u] = v.x;
      in[4 * u + 1] = v.y;
      in[4 * u + 2] = v.z;
      in[4 * u + 3] = v.w;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
      for (int w = 0; w < 8; ++w) out[8 * j + w] = in[PermutedQuery::SourceWord(j, w)];
    }
#pragma unroll
    for (int u = 0; u < 8; ++u) {
      *reinterpret_cast<uint4*>(chunk + SwizzledOffset(row, 8 * u)) =
          make_uint4(out[4 * u], out[4 * u + 1], out[4 * u + 2], out[4 * u + 3]);
    }
  }
}

// fp8 cache: a warpgroup's QK^T A operand for one block, in registers (the permuted column order
// of PermutedQuery). The warpgroup contracts latent groups 2 wg and 2 wg + 1 (16 k steps:
// latent[4 s + j] is k step j of its chunk s) and rope k steps 2 wg, 2 wg + 1 (rope[j]); registers
// 0 and 2 hold token Token(wg_tid, 0), 1 and 3 token Token(wg_tid, 1).
struct KFragments {
  uint32_t latent[16][4];
  uint32_t rope[2][4];
};

// fp8 cache: reads this thread's two tokens of the staged block (their 16 bytes of each of the
// warpgroup's latent chunks, their scales of its two groups, and 16 bytes of the rope), converts
// the e4m3 latent values times their scale to bf16 (exact for power-of-two scales) into the A
// fragments, and stores the same latent values into the bf16 tile, where PV reads them. Tokens
// that were not loaded (or lie past the length) are zero in both.
__device__ __forceinline__ void LoadKFragments(const uint8_t* staged, uint8_t* tile,
                                               const BlockLoad& load, int wg, int wg_tid,
                                               KFragments& frag) {
  // The thread's 16 latent channels of each chunk: the four k steps' fragments, in order.
  const int channel0 = PermutedQuery::FragmentChannel(wg_tid, 0);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = TransposedScores::Token(wg_tid, h);
    const bool loaded = load.RowLoaded(row);
    const uint8_t* src = staged + row * kFp8RowBytes;
    // The scales of the warpgroup's groups 2 wg and 2 wg + 1.
    float2 scales = make_float2(0.f, 0.f);
    if (loaded) scales = *reinterpret_cast<const float2*>(src + kFp8ScalesOffset + 8 * wg);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      const int chunk = 4 * wg + s;
      const __nv_bfloat162 scale2 = __float2bfloat162_rn(s < 2 ? scales.x : scales.y);
      uint4 raw = make_uint4(0, 0, 0, 0);
      if (loaded) {
        raw = *reinterpret_cast<const uint4*>(src + chunk * kChunkCols + channel0);
      }
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        frag.latent[4 * s + j][h] = E4m3x2ToBf16x2(words[j], scale2);
        frag.latent[4 * s + j][2 + h] = E4m3x2ToBf16x2(words[j] >> 16, scale2);
      }
      uint8_t* dst = tile + chunk * kChunkBytes;
      *reinterpret_cast<uint4*>(dst + SwizzledOffset(row, channel0)) =
          make_uint4(frag.latent[4 * s][h], frag.latent[4 * s][2 + h],
                     frag.latent[4 * s + 1][h], frag.latent[4 * s + 1][2 + h]);
      *reinterpret_cast<uint4*>(dst + SwizzledOffset(row, channel0 + 8)) =
          make_uint4(frag.latent[4 * s + 2][h], frag.latent[4 * s + 2][2 + h],
                     frag.latent[4 * s + 3][h], frag.latent[4 * s + 3][2 + h]);
    }
    // Rope k steps 2 wg and 2 wg + 1 of the permuted rope chunk: eight consecutive channels.
    static_assert(kRopeDim == kChunkCols && kConsumerWarpgroups == 2, "one rope chunk, two halves");
    uint4 rope = make_uint4(0, 0, 0, 0);
    if (loaded) {
      rope = *reinterpret_cast<const uint4*>(
          src + kFp8RopeOffset + 2 * PermutedQuery::FragmentChannel(wg_tid, 2 * wg));
    }
    frag.rope[0][h] = rope.x;
    frag.rope[0][2 + h] = rope.y;
    frag.rope[1][h] = rope.z;
    frag.rope[1][2 + h] = rope.w;
  }
}

// fp8 cache, up to 16 query rows: this warpgroup's partial S^T (64 tokens x kScoreN rows, kStN
// values per thread) over its columns (latent groups 2 wg, 2 wg + 1 and half the rope) from its A
// fragments and the permuted query tile.
template <class QkRs, int kQChunkBytes, int kStN>
__device__ __forceinline__ void ScoresFp8Registers(KFragments& frag, uint32_t q_addr, int wg,
                                                   float (&st)[kStN]) {
  constexpr int kRopeStep0 = kNumVChunks * kQkStepsPerChunk;
  const uint64_t q_desc = KMajorDesc(q_addr);
  FenceRegisters(st);
#pragma unroll
  for (int k = 0; k < 16; ++k) {
#pragma unroll
    for (int r = 0; r < 4; ++r) cute::warpgroup_fence_operand(frag.latent[k][r]);
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
#pragma unroll
    for (int r = 0; r < 4; ++r) cute::warpgroup_fence_operand(frag.rope[k][r]);
  }
  cute::warpgroup_arrive();
#pragma unroll
  for (int k = 0; k < 16; ++k) {
    const int g = 16 * wg + k;  // chunk 4 wg + k / 4, its k step k % 4
    GmmaRs<QkRs>(frag.latent[k], DescAdd(q_desc, QkStepOffset<kQChunkBytes>(g)), st, k != 0);
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int g = kRopeStep0 + 2 * wg + k;
    GmmaRs<QkRs>(frag.rope[k], DescAdd(q_desc, QkStepOffset<kQChunkBytes>(g)), st, true);
  }
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
  FenceRegisters(st);
}

// fp8 cache, 17-32 query rows in DecodeKernel (LaunchOptions::fp8_registers = 0): this warpgroup's
// partial S^T (64 tokens x kScoreN rows, kStN values per thread) over the columns DequantiseRow
// wrote for it (latent groups 2 wg, 2 wg + 1 and half the rope), both operands in shared memory.
template <class QkT, int kQChunkBytes, int kStN>
__device__ __forceinline__ void ScoresFp8Smem(uint32_t kv_addr, uint32_t q_addr, int wg,
                                              float (&st)[kStN]) {
  constexpr int kLatentSteps = 2 * kFp8GroupSize / 16;
  constexpr int kRopeSteps = kRopeDim / kConsumerWarpgroups / 16;
  const uint64_t kv_desc = KMajorDesc(kv_addr), q_desc = KMajorDesc(q_addr);
  FenceRegisters(st);
  cute::warpgroup_arrive();
#pragma unroll
  for (int j = 0; j < kLatentSteps + kRopeSteps; ++j) {
    const int g = j < kLatentSteps ? wg * kLatentSteps + j
                                   : kLatentDim / 16 + wg * kRopeSteps + (j - kLatentSteps);
    Gmma<QkT>(DescAdd(kv_desc, QkStepOffset(g)), DescAdd(q_desc, QkStepOffset<kQChunkBytes>(g)),
              st, j != 0);
  }
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
  FenceRegisters(st);
}

}  // namespace detail
}  // namespace sm90
}  // namespace jax_mla
