// The register-operand kernels' operands (DecodeFp8RegsKernel, DecodeFp8SplitKernel): the raw e4m3
// rows of a staged block read by ldmatrix and converted to f16 A fragments in registers, for the
// scores (the keys, M = 64 tokens) and for PV (V^T, M = 64 latent columns); the query tile
// converted to f16 once per segment; the rows not loaded zeroed in the stage.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include <cute/arch/mma_sm90_gmma.hpp>

#include "decode_params.h"
#include "fragment_layout.h"
#include "kv_blocks.cuh"
#include "mma.cuh"
#include "pipeline.cuh"
#include "smem_layout.cuh"

namespace jax_mla {
namespace sm90 {
namespace detail {

__device__ __forceinline__ void LdMatrixX4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void LdMatrixX4Trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// The four e4m3 values of `word` as two f16 pairs, exact: lo from its low two bytes, hi from its
// high two (the lower byte of each in the pair's low half).
__device__ __forceinline__ void E4m3x4ToF16x2(uint32_t word, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(word));
}

__device__ __forceinline__ uint32_t PackF16x2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// ConvertQueryToF16's work for one thread: 32 latent columns (piece `piece` of 16) of row `row`.
template <class Layout>
__device__ __forceinline__ void ConvertQueryRowPiece(uint8_t* q_tile, float* row_scale, int row,
                                                     int piece) {
  uint8_t* chunk = q_tile + (piece / 2) * Layout::kQChunkBytes;
  const int unit0 = 4 * (piece % 2);
  uint4 raw[4];
  float v[32];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    raw[u] = *reinterpret_cast<const uint4*>(chunk + SwizzledOffset(row, 8 * (unit0 + u)));
    const uint32_t w[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      v[8 * u + 2 * j] = __uint_as_float(w[j] << 16);
      v[8 * u + 2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
    }
  }
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int d = 1; d < 16; d <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
  int e = 0;
  if (amax > 0.f && amax <= 3.4e38f) {
    int x;
    frexpf(amax, &x);  // amax in [2^(x - 1), 2^x)
    e = min(15 - x, 126);
  }
  const float up = ldexpf(1.f, e);
  if (piece == 0) row_scale[row] = ldexpf(1.f, -e);
#pragma unroll
  for (int s = 0; s < 2; ++s) {  // the piece's two k steps
    uint32_t out[8];
#pragma unroll
    for (int c = 0; c < 16; c += 2) {
      out[c / 2] = PackF16x2(v[16 * s + RegsOperands::QueryChannel(c)] * up,
                             v[16 * s + RegsOperands::QueryChannel(c + 1)] * up);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      *reinterpret_cast<uint4*>(chunk + SwizzledOffset(row, 8 * (unit0 + 2 * s + h))) =
          make_uint4(out[4 * h], out[4 * h + 1], out[4 * h + 2], out[4 * h + 3]);
    }
  }
}

// Converts the segment's query tile (Layout::kQChunkRows rows) in place: the latent columns of each
// row to f16 times the row's power of two 2^e (its largest magnitude then in [2^14, 2^15); 1 for a
// zero row), permuted within each 16-column k step by RegsOperands::QueryChannel; writes 2^-e to
// row_scale[row]. The 256 consumer threads take 32 columns of one row each, 16 rows a pass; the
// caller fences and synchronises them.
template <class Layout>
__device__ __forceinline__ void ConvertQueryToF16(uint8_t* q_tile, float* row_scale, int tid) {
  static_assert(Layout::kQChunkRows % (kConsumerThreads / 16) == 0, "whole passes of 16 rows");
#pragma unroll
  for (int row0 = 0; row0 < Layout::kQChunkRows; row0 += kConsumerThreads / 16) {
    ConvertQueryRowPiece<Layout>(q_tile, row_scale, row0 + tid / 16, tid % 16);
  }
}

// Zeroes the raw rows of a staged block that were not loaded or hold tokens past the length
// (all 656 bytes: e4m3 zero is +0, a zero scale and zero rope), so that nothing of them reaches
// the MMAs but zeros. The kThreads threads that read the stage (thread index t) take kThreads / 64
// of every row's 16-byte units each; the caller fences and synchronises them.
template <int kThreads>
__device__ __forceinline__ void ZeroUnloadedRawRows(uint8_t* staged, const BlockLoad& load, int t) {
  constexpr int kUnits = kFp8RowBytes / 16;  // 41
  constexpr int kPerRow = kThreads / kBlockN;
  static_assert(kPerRow * kBlockN == kThreads, "whole rows per thread group");
  const int row = t / kPerRow;
  if (load.RowLoaded(row)) return;
  uint8_t* dst = staged + row * kFp8RowBytes;
  for (int u = t % kPerRow; u < kUnits; u += kPerRow) {
    *reinterpret_cast<uint4*>(dst + 16 * u) = make_uint4(0, 0, 0, 0);
  }
}

// Fences the first kSteps A fragments of a register buffer for the WGMMAs that read them.
template <int kSteps>
__device__ __forceinline__ void FenceFragments(uint32_t (&f)[8][4]) {
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
#pragma unroll
    for (int i = 0; i < 4; ++i) cute::warpgroup_fence_operand(f[s][i]);
  }
}

// No change to a latent group's converted key fragments (ScoresFromRawRows' default).
struct KeepKeys {
  __device__ __forceinline__ void operator()(int, uint32_t (&)[8][4]) const {}
};

// This warpgroup's scores of one staged block, S^T (64 tokens x kN rows), unscaled: sg[g % kAccs]
// the sum over latent groups group0 + g (f16 MMAs on the raw e4m3 values, or on what fold(g, f)
// makes of group g's converted fragments f, against the f16 query), sr over rope k steps rope0 ..
// rope0 + kRopeSteps - 1 (bf16). The A fragments go through two register buffers, one latent group
// (eight k steps) each, so a group converts while the one before runs.
template <int kN, int kGroups, int kRopeSteps, int kQChunkBytes, int kAccs = kGroups,
          class Fold = KeepKeys>
__device__ __forceinline__ void ScoresFromRawRows(uint32_t staged_addr, uint32_t q_addr,
                                                  int warp_in_wg, int lane, int group0, int rope0,
                                                  float (&sg)[kAccs][kN / 2], float (&sr)[kN / 2],
                                                  Fold fold = {}) {
  using QkF16Rs = RsMma<cute::half_t, kN>;
  using QkBf16Rs = RsMma<cute::bfloat16_t, kN>;
  static_assert(kGroups >= 2 && kRopeSteps <= 8, "two fragment buffers, the rope in one");
  static_assert(kAccs == kGroups || kAccs == 1, "an accumulator per group, or one for all");
  const uint64_t q_desc = KMajorDesc(q_addr);
  // ldmatrix row addresses: lane l names token 16 w + 8 ((l / 8) % 2) + l % 8, 16-byte unit l / 16.
  const uint32_t row_addr =
      staged_addr + (16 * warp_in_wg + 8 * ((lane / 8) % 2) + lane % 8) * kFp8RowBytes +
      16 * (lane / 16);
  uint32_t frag[2][8][4];
#pragma unroll
  for (int a = 0; a < kAccs; ++a) FenceRegisters(sg[a]);
  FenceRegisters(sr);
#pragma unroll
  for (int g = 0; g < kGroups; ++g) {
    uint32_t (&f)[8][4] = frag[g % 2];
    if (g >= 2) cute::warpgroup_wait<1>();
#pragma unroll
    for (int pair = 0; pair < 4; ++pair) {
      uint32_t r[4];
      LdMatrixX4(row_addr + kFp8GroupSize * (group0 + g) + 32 * pair, r);
      // r[0], r[1]: tokens g, g + 8 of unit 2 pair; r[2], r[3] of unit 2 pair + 1.
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        E4m3x4ToF16x2(r[2 * s], f[2 * pair + s][0], f[2 * pair + s][2]);
        E4m3x4ToF16x2(r[2 * s + 1], f[2 * pair + s][1], f[2 * pair + s][3]);
      }
    }
    fold(g, f);
    FenceFragments<8>(f);
    cute::warpgroup_arrive();
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const int step = 8 * (group0 + g) + s;  // k step of the query tile (16 columns)
      GmmaRs<QkF16Rs>(f[s], DescAdd(q_desc, QkStepOffset<kQChunkBytes>(step)), sg[g % kAccs],
                      s != 0 || g >= kAccs);
    }
    cute::warpgroup_commit_batch();
  }
  // The rope: bf16 fragments straight from the rows (buffer kGroups % 2, free once group
  // kGroups - 2 is done).
  cute::warpgroup_wait<1>();
  uint32_t (&f)[8][4] = frag[kGroups % 2];
#pragma unroll
  for (int j = 0; j < kRopeSteps; ++j) {
    LdMatrixX4(row_addr + kFp8RopeOffset + 32 * (rope0 + j), f[j]);
  }
  FenceFragments<kRopeSteps>(f);
  cute::warpgroup_arrive();
#pragma unroll
  for (int j = 0; j < kRopeSteps; ++j) {
    const int step = kLatentDim / 16 + rope0 + j;
    GmmaRs<QkBf16Rs>(f[j], DescAdd(q_desc, QkStepOffset<kQChunkBytes>(step)), sr, j != 0);
  }
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int a = 0; a < kAccs; ++a) FenceRegisters(sg[a]);
  FenceRegisters(sr);
}

// V^T's raw e4m3 bytes of latent group `group` for one warpgroup thread: four ldmatrix.trans of
// the staged rows (lane l names token l of a 32-token half, the warp's 16 bytes), raw[4 (2 m +
// half) + i] register i of 64-column tile m of the group and token half `half`.
__device__ __forceinline__ void LoadVGroupRaw(uint32_t staged_addr, int warp_in_wg, int lane,
                                              int group, uint32_t (&raw)[16]) {
  const uint32_t row_addr = staged_addr + lane * kFp8RowBytes + 16 * warp_in_wg;
#pragma unroll
  for (int m = 0; m < 2; ++m) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      uint32_t r[4];
      LdMatrixX4Trans(row_addr + half * 32 * kFp8RowBytes + 64 * (2 * group + m), r);
#pragma unroll
      for (int i = 0; i < 4; ++i) raw[4 * (2 * m + half) + i] = r[i];
    }
  }
}

// A latent group's V^T A fragments (row r < 8 of a warp's 16 is latent column 2r of its 16, row
// r + 8 column 2r + 1), f[4 m + k step], converted from its raw bytes (LoadVGroupRaw).
__device__ __forceinline__ void VFragmentsFromRaw(const uint32_t (&raw)[16], uint32_t (&f)[8][4]) {
#pragma unroll
  for (int m = 0; m < 2; ++m) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // raw[4 (2 m + half) + 2 s + j]: k step 2 half + s, tokens 8 j .. 8 j + 7 of it; bytes
      // (column 2r, token 2q), (2r + 1, 2q), (2r, 2q + 1), (2r + 1, 2q + 1) -> pairs by column.
#pragma unroll
      for (int s = 0; s < 2; ++s) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          uint32_t(&frag)[4] = f[4 * m + 2 * half + s];
          E4m3x4ToF16x2(__byte_perm(raw[4 * (2 * m + half) + 2 * s + j], 0, 0x3120), frag[2 * j],
                        frag[2 * j + 1]);
        }
      }
    }
  }
}

// O^T[64 t : 64 t + 64] += V^T P_g^T for the 2 kGroups 64-column output tiles t of kGroups latent
// groups (tile t of group t / 2), taken in the order kFirstGroup, kFirstGroup + 1, ... (mod
// kGroups): A = V^T converted from the raw bytes that raw_of(g, raw) gives for group g
// (LoadVGroupRaw), B = P tile g at p_addr (kPTileBytes apart); converted(g) runs once group g's
// fragments are converted.
template <int kN, int kGroups, int kPTileBytes, int kFirstGroup = 0, class RawOf, class Converted>
__device__ __forceinline__ void PvFromRaw(uint32_t p_addr, float (&o)[2 * kGroups][kN / 2],
                                          RawOf raw_of, Converted converted) {
  using PvF16Rs = RsMma<cute::half_t, kN>;
  uint32_t frag[2][8][4];  // per buffer: [tile of the group][k step]
#pragma unroll
  for (int t = 0; t < 2 * kGroups; ++t) FenceRegisters(o[t]);
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    const int g = (kFirstGroup + j) % kGroups;
    uint32_t (&f)[8][4] = frag[j % 2];
    if (j >= 2) cute::warpgroup_wait<1>();
    uint32_t raw[16];
    raw_of(g, raw);
    VFragmentsFromRaw(raw, f);
    converted(g);
    FenceFragments<8>(f);
    cute::warpgroup_arrive();
    const uint64_t p_desc = KMajorDesc(p_addr + g * kPTileBytes);
#pragma unroll
    for (int m = 0; m < 2; ++m) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        GmmaRs<PvF16Rs>(f[4 * m + kk], DescAdd(p_desc, kk * 32), o[2 * g + m], true);
      }
    }
    cute::warpgroup_commit_batch();
  }
  cute::warpgroup_wait<0>();
#pragma unroll
  for (int t = 0; t < 2 * kGroups; ++t) FenceRegisters(o[t]);
}

// PvFromRaw with V^T read from the staged rows group by group; `release` runs once the stage's
// last values are in registers.
template <int kN, int kGroups, int kPTileBytes, class Release>
__device__ __forceinline__ void PvFromRawRows(uint32_t staged_addr, uint32_t p_addr,
                                              int warp_in_wg, int lane, int group0,
                                              float (&o)[2 * kGroups][kN / 2], Release release) {
  PvFromRaw<kN, kGroups, kPTileBytes>(
      p_addr, o,
      [&](int g, uint32_t (&raw)[16]) {
        LoadVGroupRaw(staged_addr, warp_in_wg, lane, group0 + g, raw);
      },
      [&](int g) {
        if (g == kGroups - 1) release();
      });
}

}  // namespace detail
}  // namespace sm90
}  // namespace jax_mla
