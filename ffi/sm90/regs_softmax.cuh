// The register-operand kernels' online softmax over transposed scores with per-group cache scales:
// the block's row maxima and the groups' running scales, the reduction skipped where a block moves
// neither, P written once per latent group in f16, and the output's rescale.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "decode_params.h"
#include "fragment_layout.h"
#include "pipeline.cuh"
#include "regs_operands.cuh"
#include "smem_layout.cuh"
#include "softmax.cuh"

namespace jax_mla {
namespace sm90 {
namespace detail {

__device__ __forceinline__ void StMatrixX4Trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// 1 / x from the special-function unit: exact for powers of two (write_kv's scales), within an
// ulp otherwise; no division sequence.
__device__ __forceinline__ float ApproxRcp(float x) {
  float y;
  asm("rcp.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The largest of the warp's values, all >= 0 (non-negative floats order as their bit patterns),
// in one warp-wide reduction.
__device__ __forceinline__ float WarpMaxMagnitude(float x) {
  return __uint_as_float(__reduce_max_sync(0xffffffffu, __float_as_uint(x)));
}

// Row i (< 4) of a thread's transposed fragment and the element of token half h.
__device__ __forceinline__ int RegsElement(int i, int h) { return TransposedScores::Element(i, h); }

// Multiplies the thread's O^T values by their query row's factor (row_f[i], row RowT(i)) times
// their latent group's (group_f[t / 2] for tile t).
template <int kTiles, int kRowsT>
__device__ __forceinline__ void ScaleOutput(float (&o)[kTiles][2 * kRowsT],
                                            const float (&row_f)[kRowsT],
                                            const float (&group_f)[kTiles / 2]) {
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
#pragma unroll
    for (int i = 0; i < kRowsT; ++i) {
      const float f = row_f[i] * group_f[t / 2];
      o[t][RegsElement(i, 0)] *= f;
      o[t][RegsElement(i, 1)] *= f;
    }
  }
}

// Each latent group's running maximum |scale| r_g moved by the block's (the warps' maxima at
// reduce[w * kStride + kOffset + g]), its output's rescale factor gf (old over new, 1 when it
// stays) and 1 / r_g (0 while no scale was seen).
template <int kGroups, int kStride, int kOffset>
__device__ __forceinline__ void UpdateGroupScales(const float* reduce, float (&r_g)[kGroups],
                                                  float (&gf)[kGroups], float (&inv_r)[kGroups]) {
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    float r_blk = reduce[kOffset + g];
#pragma unroll
    for (int w = 1; w < 4; ++w) r_blk = fmaxf(r_blk, reduce[w * kStride + kOffset + g]);
    const float r_new = fmaxf(r_g[g], r_blk);
    const float inv = ApproxRcp(r_new);
    gf[g] = r_new > r_g[g] ? r_g[g] * inv : 1.f;
    r_g[g] = r_new;
    inv_r[g] = r_new > 0.f ? inv : 0.f;
  }
}

// The four group scales of each of the thread's tokens tok[h] of a staged block (sc[h][g]).
__device__ __forceinline__ void LoadTokenScales(const uint8_t* staged, const int (&tok)[2],
                                                float (&sc)[2][kFp8ScaleGroups]) {
  static_assert(kFp8ScaleGroups == 4, "one float4 of scales a row");
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float4 s4 =
        *reinterpret_cast<const float4*>(staged + tok[h] * kFp8RowBytes + kFp8ScalesOffset);
    sc[h][0] = s4.x;
    sc[h][1] = s4.y;
    sc[h][2] = s4.z;
    sc[h][3] = s4.w;
  }
}

// Whether a block leaves a warpgroup's softmax state as it is, as far as this thread sees: no score
// of its rows (st, masked; running maxima m_t) moves its row's running maximum (NextRowMax) and no
// scale of its tokens (sc) exceeds its group's running maximum r_g.
template <int kRowsT, int kGroups>
__device__ __forceinline__ bool KeepsSoftmaxState(const float (&st)[2 * kRowsT],
                                                  const float (&m_t)[kRowsT], float sl2,
                                                  const float (&sc)[2][kGroups],
                                                  const float (&r_g)[kGroups]) {
  bool keeps = true;
#pragma unroll
  for (int i = 0; i < kRowsT; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      keeps &= !MovesRowMax(m_t[i], st[RegsElement(i, h)], sl2);
    }
  }
#pragma unroll
  for (int g = 0; g < kGroups; ++g) keeps &= fmaxf(fabsf(sc[0][g]), fabsf(sc[1][g])) <= r_g[g];
  return keeps;
}

// A block's online softmax over warpgroup wg's Layout::kQChunkRows query rows: the rows' block
// maxima over the thread's tokens, the eight lanes sharing its rows and the warpgroup's warps
// (through reduce, with each group's largest |scale|), then the rows' running maxima and sums
// (UpdateRowsSoftmax: alpha, probabilities in place of st) and the groups' running scales (gf, and
// 1 / r_g in inv_r).
template <class Layout, int kRowsT, int kGroups>
__device__ __forceinline__ void ReduceBlockSoftmax(float* reduce, int wg, int warp_in_wg, int lane,
                                                   float sl2, float (&st)[2 * kRowsT],
                                                   const float (&sc)[2][kGroups],
                                                   float (&m_t)[kRowsT], float (&l_t)[kRowsT],
                                                   float (&r_g)[kGroups], float (&alpha)[kRowsT],
                                                   float (&gf)[kGroups], float (&inv_r)[kGroups]) {
  constexpr int kStride = Layout::kReduceStride;
  float mx[kRowsT];
#pragma unroll
  for (int i = 0; i < kRowsT; ++i) {
    mx[i] = fmaxf(st[RegsElement(i, 0)], st[RegsElement(i, 1)]);
#pragma unroll
    for (int d = 4; d < 32; d <<= 1) mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], d));
  }
  float smax[kGroups];
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    smax[g] = WarpMaxMagnitude(fmaxf(fabsf(sc[0][g]), fabsf(sc[1][g])));
  }
  if (lane < 4) {
#pragma unroll
    for (int i = 0; i < kRowsT; ++i) {
      reduce[warp_in_wg * kStride + TransposedScores::QueryRow(lane, i)] = mx[i];
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      reduce[warp_in_wg * kStride + Layout::kQChunkRows + g] = smax[g];
    }
  }
  WarpgroupSync(wg);
  UpdateRowsSoftmax<kRowsT, kStride>(reduce, lane, sl2, st, m_t, l_t, alpha);
  UpdateGroupScales<kGroups, kStride, Layout::kQChunkRows>(reduce, r_g, gf, inv_r);
}

// A block's online softmax over warpgroup wg (all its threads call it), as ReduceBlockSoftmax
// computes it; when the block moves no row's running maximum and no group's running scale (most
// blocks, with the lazy rescale), without the reduction: the probabilities at the running maxima,
// alpha and gf 1 (0 for rows that have seen no token), the same values bit for bit.
template <class Layout, int kRowsT, int kGroups>
__device__ __forceinline__ void BlockSoftmax(float* reduce, int wg, int warp_in_wg, int lane,
                                             float sl2, float (&st)[2 * kRowsT],
                                             const float (&sc)[2][kGroups], float (&m_t)[kRowsT],
                                             float (&l_t)[kRowsT], float (&r_g)[kGroups],
                                             float (&alpha)[kRowsT], float (&gf)[kGroups],
                                             float (&inv_r)[kGroups]) {
  if (WarpgroupAny(wg, !KeepsSoftmaxState(st, m_t, sl2, sc, r_g))) {
    ReduceBlockSoftmax<Layout>(reduce, wg, warp_in_wg, lane, sl2, st, sc, m_t, l_t, r_g, alpha, gf,
                               inv_r);
    return;
  }
#pragma unroll
  for (int i = 0; i < kRowsT; ++i) ExpRow(i, m_t[i], sl2, st, m_t, l_t, alpha);
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    gf[g] = 1.f;
    inv_r[g] = r_g[g] > 0.f ? ApproxRcp(r_g[g]) : 0.f;
  }
}

// P_g[row][token] = p * scale_g(token) / R_g in f16 for kGroups groups (tile g at p_addr + g
// kPTileBytes, kN rows x 64 tokens), from the thread's probabilities st and its tokens' scales
// sc[h][g]: per group and 16 rows one stmatrix.trans (RegsPStore, fragment_layout.h).
template <int kN, int kGroups, int kPTileBytes>
__device__ __forceinline__ void StorePTiles(uint32_t p_addr, int warp_in_wg, int lane,
                                            const float (&st)[kN / 2],
                                            const float (&sc)[2][kGroups],
                                            const float (&inv_r)[kGroups]) {
  const int dst_tok = RegsPStore::StoreToken(warp_in_wg, lane);
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
#pragma unroll
    for (int q = 0; q < kN / 16; ++q) {
      uint32_t r[4];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float f = sc[h][g] * inv_r[g];
          const int i = RegsPStore::FirstRow(q, j);
          r[2 * j + h] = PackF16x2(st[RegsElement(i, h)] * f, st[RegsElement(i + 1, h)] * f);
        }
      }
      StMatrixX4Trans(p_addr + g * kPTileBytes +
                          SwizzledOffset(RegsPStore::StoreRow(lane, q), dst_tok),
                      r);
    }
  }
}

}  // namespace detail
}  // namespace sm90
}  // namespace jax_mla
