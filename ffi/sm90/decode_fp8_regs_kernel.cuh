// The fp8 cache up to 16 query rows with both MMAs' cache operands in registers
// (DecodeFp8RegsKernel; docs/fp8-cache.md, "Up to 16 rows: the register-operand kernel").
//
// CTA = 2 consumer warpgroups + 1 producer warpgroup, one CTA per SM, the schedule, segments,
// producer and combine of DecodeKernel. What differs:
//  - the two consumer warpgroups take alternate KV blocks of the CTA's walk, each with its own
//    softmax state and output, so that two blocks are in flight per CTA; at the end of a segment
//    they merge (through shared memory) and each stores half of the output columns;
//  - a ring of four 64-token stages of raw cache rows, no bf16 tile: the scores' A operand (the
//    block's keys, M = 64 tokens) and PV's (V^T, M = 64 latent columns) are loaded from the raw
//    rows by ldmatrix (PV's transposed) and converted e4m3 -> f16 in registers, one instruction a
//    pair; the MMAs are f16 with fp32 accumulation;
//  - the group scales stay out of the operands: the scores keep one accumulator per latent group
//    (and one for the bf16 rope), summed with each token's scales in fp32; P is written once per
//    group, times the token's scale over the group's running maximum scale (R_g, a power of two for
//    write_kv's scales), and the output of group g is in units of R_g;
//  - the query's latent part is converted once per segment to f16 times a power of two per row
//    (its largest value lands in [2^14, 2^15)), its columns permuted within each 16-column k step
//    so that a lane's fragment is four consecutive bytes of a cache row; the rope stays bf16.
// Safety as DecodeKernel: rows of a block past the length or in a page not loaded are zeroed in
// the stage before any read (e4m3, scales and rope), and their scores masked by select.
#pragma once

#include <cuda_fp16.h>

#include "decode_kernel.cuh"

namespace jax_mla {
namespace sm90 {

// Shared memory of DecodeFp8RegsKernel, byte offsets from the 1024-aligned base: the query tile
// (16 rows, nine 128-byte-swizzled chunks: eight f16 latent, one bf16 rope), the ring of raw
// 64-token stages, each warpgroup's four P tiles (one per latent group, f16 [16 rows][64 tokens],
// K-major), each warpgroup's half of the merge region, the warpgroups' reduction buffers, the
// query rows' scales and the barriers. A warpgroup's P tiles and its merge half hold what it hands
// the other at the end of a segment (MergeSlot).
struct Fp8RegsSmemLayout {
  static constexpr bool kHalfStages = false;
  static constexpr bool kEveryThreadReleases = true;
  static constexpr int kReleasingThreads = kHalfStageReleasers;  // the warpgroup that read it
  static constexpr int kStageSlots = 4;
  static constexpr int kQChunkRows = 16;
  static constexpr int kQChunkBytes = kQChunkRows * kRowBytes;
  static constexpr int kQ = 0;
  static constexpr int kFp8Stages = kQ + kNumChunks * kQChunkBytes;
  static constexpr int kKv = kFp8Stages;  // no bf16 tile (ProduceTiles' bf16 branch names it)
  static constexpr int kPTileBytes = kQChunkRows * kRowBytes;
  static constexpr int kP = (kFp8Stages + kStageSlots * kFp8StageBytes + 1023) / 1024 * 1024;
  // Per warpgroup: f32 [4 warps][32] (16 row maxima or sums, then 4 group scale maxima).
  static constexpr int kReduceStride = 32;
  static constexpr int kReduceFloats = 4 * kReduceStride;
  static constexpr int kMerge = kP + kConsumerWarpgroups * kFp8ScaleGroups * kPTileBytes;
  // Per warpgroup: the end-of-segment merge's float4 slots (MergeSlot) beyond those its P tiles
  // hold, 128 float4 each.
  static constexpr int kMergeSlots = 10;
  static constexpr int kMergeSlotsInP = kFp8ScaleGroups * kPTileBytes / (128 * 16);
  static constexpr int kMergeHalfBytes = (kMergeSlots - kMergeSlotsInP) * 128 * 16;
  static constexpr int kReduce = kMerge + kConsumerWarpgroups * kMergeHalfBytes;
  static constexpr int kRowScale = kReduce + kConsumerWarpgroups * kReduceFloats * 4;
  static constexpr int kBarriers = (kRowScale + kQChunkRows * 4 + 7) / 8 * 8;
  static constexpr int kNumBarriers = 2 + 2 * kStageSlots;
  static constexpr int kUsed = kBarriers + kNumBarriers * 8;
  static constexpr int kBytes = kUsed + kSmemAlign;
  static_assert(kBytes <= kMaxSmemBytes, "exceeds the 227 KB per-block shared memory of SM90");
  static_assert(kFp8Stages % 1024 == 0 && kP % 1024 == 0,
                "swizzled tiles need 1024-byte alignment");
};

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

__device__ __forceinline__ void StMatrixX4Trans(uint32_t addr, const uint32_t (&r)[4]) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(addr),
               "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3])
               : "memory");
}

// The four e4m3 values of `word` as two f16 pairs, exact: lo from its low two bytes, hi from its
// high two (the lower byte of each in the pair's low half).
__device__ __forceinline__ void E4m3x4ToF16x2(uint32_t word, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .b16 l, h;\n mov.b32 {l, h}, %2;\n cvt.rn.f16x2.e4m3x2 %0, l;\n"
      " cvt.rn.f16x2.e4m3x2 %1, h;\n}"
      : "=r"(lo), "=r"(hi)
      : "r"(word));
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

__device__ __forceinline__ uint32_t PackF16x2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The consumer warpgroups' hand-over of values written just after a warpgroup barrier (each
// thread's writes, then the other warpgroup's reads): ConsumerSync, twice. One orders them as well,
// but compute-sanitizer's racecheck reports such pairs as hazards after one barrier and not after
// two (docs/fp8-cache.md: the runs and what the second costs).
__device__ __forceinline__ void ConsumerHandover() {
  ConsumerSync();
  ConsumerSync();
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

// The end-of-segment merge's float4 slots of warpgroup w's thread wg_tid: 0-7 the output tiles it
// hands over (slot 2 t + v: elements 4 v .. 4 v + 3 of the t-th), then its rows' maxima and sums;
// slots 0-3 in its own P tiles, the rest in its merge half.
constexpr int kMergeMaxSlot = 8;
constexpr int kMergeSumSlot = 9;
static_assert(Fp8RegsSmemLayout::kMergeSlots == 10, "eight output slots, maxima and sums");

__device__ __forceinline__ float4* MergeSlot(uint8_t* smem, int w, int slot, int wg_tid) {
  using Layout = Fp8RegsSmemLayout;
  float4* const p_tiles = reinterpret_cast<float4*>(
      smem + Layout::kP + w * kFp8ScaleGroups * Layout::kPTileBytes);
  float4* const half =
      reinterpret_cast<float4*>(smem + Layout::kMerge + w * Layout::kMergeHalfBytes);
  return slot < Layout::kMergeSlotsInP ? p_tiles + slot * 128 + wg_tid
                                       : half + (slot - Layout::kMergeSlotsInP) * 128 + wg_tid;
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

// The CTA of a register-operand kernel with shared-memory layout Layout: the producer warpgroup's
// one thread stages the query tiles and raw blocks of the part's walk (ProduceTiles), and the
// consumer threads run consume(smem, pipe, walker) with the part's own walker.
template <class Layout, class Consume>
__device__ __forceinline__ void RunRegsCta(const CUtensorMap& q_map, const CUtensorMap& kv_map,
                                           const DecodeKernelArgs& args, Consume consume) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = SmemAddr(smem_raw);
  uint8_t* smem = smem_raw + ((kSmemAlign - (raw_addr & (kSmemAlign - 1))) & (kSmemAlign - 1));
  const DecodeParams& p = args.p;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int part = blockIdx.x;
  SetUpCta<1, Layout>(smem, args.q_box_rows, tid);
  if (warp >= kConsumerThreads / 32) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    GridDependencyWait();
    GridDependencyLaunchDependents();
    if (warp == kConsumerThreads / 32 && tid % 32 == 0) {
      SegmentWalker walker(ScheduleView::Load(p, args.num_parts), part, p.seq_lens, p.max_pages,
                           p.page_size);
      ProduceTiles<1, true, Layout>(q_map, kv_map, args, smem, walker, 0, 0);
    }
    return;
  }
  GridDependencyWait();
  GridDependencyLaunchDependents();
  cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
  SM90_TRACE(kTraceStart, 0);
  SegmentWalker walker(ScheduleView::Load(p, args.num_parts), part, p.seq_lens, p.max_pages,
                       p.page_size);
  consume(smem, Pipeline::At<Layout>(smem), walker);
  SM90_TRACE(kTraceEnd, 0);
}

// A segment's start for the consumer threads: each of the thread's query rows (RowT(i) for lane)
// gets its causal limit (-1 for padding rows), running maximum -inf and sum 0; once the query
// tile landed it is converted (ConvertQueryToF16) and the rows' query scales read.
template <class Layout, int kRowsT>
__device__ __forceinline__ void StartRegsSegment(const Pipeline& pipe, uint8_t* smem,
                                                 const DecodeParams& p, const Segment& seg_info,
                                                 int seg, int tid, int lane, float (&m_t)[kRowsT],
                                                 float (&l_t)[kRowsT], int (&limit_t)[kRowsT],
                                                 float (&q_scale)[kRowsT]) {
  const int rows = p.q_len * p.num_heads;
  float* const row_scale = reinterpret_cast<float*>(smem + Layout::kRowScale);
#pragma unroll
  for (int i = 0; i < kRowsT; ++i) {
    const int row = TransposedScores::QueryRow(lane, i);
    limit_t[i] = row < rows ? seg_info.len - p.q_len + row / p.num_heads : -1;
    m_t[i] = kNegInf;
    l_t[i] = 0.f;
  }
  cutlass::arch::ClusterBarrier::wait(pipe.QFull(), seg & 1);
  SM90_TRACE(kTraceQuery, 0);
  ConvertQueryToF16<Layout>(smem + Layout::kQ, row_scale, tid);
  cutlass::arch::fence_view_async_shared();
  ConsumerSync();
#pragma unroll
  for (int i = 0; i < kRowsT; ++i) q_scale[i] = row_scale[TransposedScores::QueryRow(lane, i)];
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

// Whether x holds for any thread of warpgroup wg (all its threads call it: a warpgroup barrier).
__device__ __forceinline__ bool WarpgroupAny(int wg, bool x) {
  uint32_t any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n"
      " bar.red.or.pred q, %2, 128, p;\n selp.u32 %0, 1, 0, q;\n}"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(x)), "r"(kWarpgroupBarrier + wg)
      : "memory");
  return any != 0;
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

// Stores a segment's results from warpgroup wg's four 64-column output tiles 4 wg .. 4 wg + 3
// (keep[t][RegsElement(i, h)]: query row RowT(i), column RegsOperands::OutputColumn(wg_tid, h) of
// tile t, in output units but for 1 / l) and its rows' sums l and maxima m: bf16 out and LSE for a
// request handled whole, fp32 partial out and LSE in the workspace for a split one. Rows past the
// problem's are padding, not written; lanes 0-3 of warpgroup 0's first warp write the LSE.
template <int kRowsT>
__device__ __forceinline__ void StoreRegsTiles(const DecodeKernelArgs& args,
                                               const Segment& seg_info, int part, int wg,
                                               int wg_tid, int lane,
                                               const float (&keep)[4][2 * kRowsT],
                                               const float (&l)[kRowsT], const float (&m)[kRowsT]) {
  constexpr float kLn2 = 0.6931471805599453f;
  const DecodeParams& p = args.p;
  const int rows = p.q_len * p.num_heads;
  const float sl2 = args.scale_log2;
  const WorkspaceLayout ws = MakeWorkspaceLayout(p.batch, p.q_len, p.num_heads, args.num_parts);
  uint8_t* const wsb = static_cast<uint8_t*>(p.workspace);
  float* const part_out = reinterpret_cast<float*>(wsb + ws.partial_out);
  float* const part_lse = reinterpret_cast<float*>(wsb + ws.partial_lse);
  const size_t out_row0 = static_cast<size_t>(seg_info.b) * rows;
  const size_t slot_row0 = static_cast<size_t>(seg_info.b + part) * ws.rows_pad;
  const bool writes_lse = wg == 0 && wg_tid < 4;
#pragma unroll
  for (int i = 0; i < kRowsT; ++i) {
    const int row = TransposedScores::QueryRow(lane, i);
    if (row >= rows) continue;
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    const float lse = l[i] > 0.f ? (m[i] * sl2 + __log2f(l[i])) * kLn2 : kNegInf;
    const int ea = RegsElement(i, 0), eb = RegsElement(i, 1);
#pragma unroll
    for (int tt = 0; tt < 4; ++tt) {
      const int col = 64 * (4 * wg + tt) + RegsOperands::OutputColumn(wg_tid, 0);
      if (seg_info.whole) {
        const float f = inv * p.output_scale;
        __nv_bfloat162 v = __floats2bfloat162_rn(keep[tt][ea] * f, keep[tt][eb] * f);
        *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(p.out) +
                                           (out_row0 + row) * kLatentDim + col) = v;
      } else {
        *reinterpret_cast<float2*>(part_out + (slot_row0 + row) * kLatentDim + col) =
            make_float2(keep[tt][ea] * inv, keep[tt][eb] * inv);
      }
    }
    if (writes_lse) {
      if (seg_info.whole) {
        p.lse[out_row0 + row] = lse;
      } else {
        part_lse[slot_row0 + row] = lse;
      }
    }
  }
}

}  // namespace detail

// The latent groups whose V^T bytes the 16-row kernel reads into registers right after a block's
// scores (0 .. kEarlyVGroups - 1); its PV reads the others from the stage first and releases it
// then, so that the stage is refilled under the rest of PV.
constexpr int kEarlyVGroups = 2;
static_assert(kEarlyVGroups > 0 && kEarlyVGroups < kFp8ScaleGroups,
              "PV reads at least one group from the stage, and releases it after the last");

// fp8 cache, up to 16 query rows (q_len * num_heads <= 16), one M tile: see the top of this file.
__global__ void __launch_bounds__(kThreads, 1)
DecodeFp8RegsKernel(const __grid_constant__ CUtensorMap q_map,
                    const __grid_constant__ CUtensorMap kv_map, const DecodeKernelArgs args) {
  using Layout = Fp8RegsSmemLayout;
  using namespace detail;
  RunRegsCta<Layout>(q_map, kv_map, args, [&](uint8_t* smem, const Pipeline& pipe,
                                              SegmentWalker& walker) {
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kRowsT = 4;  // query rows per thread
  constexpr int kStride = Layout::kReduceStride;
  const DecodeParams& p = args.p;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int part = blockIdx.x;
  const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);
  const int wg_tid = tid % 128;
  const int warp_in_wg = wg_tid / 32;
  const float sl2 = args.scale_log2;
  const uint32_t q_addr = SmemAddr(smem + Layout::kQ);
  const uint32_t stages_addr = SmemAddr(smem + Layout::kFp8Stages);
  const uint32_t p_addr =
      SmemAddr(smem + Layout::kP + wg * kFp8ScaleGroups * Layout::kPTileBytes);
  float* const reduce =
      reinterpret_cast<float*>(smem + Layout::kReduce) + wg * Layout::kReduceFloats;
  // A thread's tokens of a block (rows of S^T), as in DecodeKernel's transposed path.
  const int tok[2] = {TransposedScores::Token(wg_tid, 0), TransposedScores::Token(wg_tid, 1)};

  float o[8][8];
  Segment seg_info;
  int it = 0, seg = 0;
  while (walker.Next(seg_info)) {
    SM90_TRACE(kTraceSegment, seg_info.b);
    float r_g[kFp8ScaleGroups];  // running maximum |scale| of each group (0: none yet)
#pragma unroll
    for (int g = 0; g < kFp8ScaleGroups; ++g) r_g[g] = 0.f;
#pragma unroll
    for (int t = 0; t < 8; ++t) {
#pragma unroll
      for (int e = 0; e < 8; ++e) o[t][e] = 0.f;
    }
    float m_t[kRowsT], l_t[kRowsT], q_scale[kRowsT];
    int limit_t[kRowsT];
    StartRegsSegment<Layout>(pipe, smem, p, seg_info, seg, tid, lane, m_t, l_t, limit_t, q_scale);

    // This warpgroup's blocks are every other one of the CTA's walk (`it` counts the walk's blocks
    // over segments); a block's table entries are read while the block before it is computed.
    const int k0 = seg_info.kv_begin + ((wg - it) & 1);
    BlockLoad load{};
    if (k0 < seg_info.kv_end) load = BlockLoad::Of(p, seg_info, k0);
    for (int k = k0; k < seg_info.kv_end; k += 2) {
      const int it_k = it + (k - seg_info.kv_begin);
      BlockPages next = {{-1, -1}};
      if (k + 2 < seg_info.kv_end) next = BlockPages::Read(p, seg_info, k + 2);
      const int stage = it_k % Layout::kStageSlots;
      uint8_t* const staged = smem + Layout::kFp8Stages + stage * kFp8StageBytes;
      const uint32_t staged_addr = stages_addr + stage * kFp8StageBytes;
      Barrier::wait(pipe.Full(stage), (it_k / Layout::kStageSlots) & 1);
      SM90_TRACE(kTraceBlockReady, k);
      if (!load.Complete()) {
        ZeroUnloadedRawRows<128>(staged, load, wg_tid);
        cutlass::arch::fence_view_async_shared();
        WarpgroupSync(wg);
      }
      float sc[2][kFp8ScaleGroups];
      LoadTokenScales(staged, tok, sc);
      float sg[kFp8ScaleGroups][8], sr[8];
      ScoresFromRawRows<16, kFp8ScaleGroups, 4, Layout::kQChunkBytes>(
          staged_addr, q_addr, warp_in_wg, lane, 0, 0, sg, sr);
      SM90_TRACE(kTraceScoresDone, k);

      // Scores, masked by select.
      const int token_base = k * kBlockN;
      float st[8];
#pragma unroll
      for (int i = 0; i < kRowsT; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int e = RegsElement(i, h);
          float latent = 0.f;
#pragma unroll
          for (int g = 0; g < kFp8ScaleGroups; ++g) latent = fmaf(sc[h][g], sg[g][e], latent);
          const float s = fmaf(latent, q_scale[i], sr[e]);
          st[e] = (load.RowLoaded(tok[h]) && token_base + tok[h] <= limit_t[i]) ? s : kNegInf;
        }
      }
      uint32_t v_raw[kEarlyVGroups][16];
#pragma unroll
      for (int g = 0; g < kEarlyVGroups; ++g) {
        LoadVGroupRaw(staged_addr, warp_in_wg, lane, g, v_raw[g]);
      }
      float alpha[kRowsT], gf[kFp8ScaleGroups], inv_r[kFp8ScaleGroups];
      BlockSoftmax<Layout>(reduce, wg, warp_in_wg, lane, sl2, st, sc, m_t, l_t, r_g, alpha, gf,
                           inv_r);
      bool rescale = false;
#pragma unroll
      for (int i = 0; i < kRowsT; ++i) rescale |= alpha[i] != 1.f;
#pragma unroll
      for (int g = 0; g < kFp8ScaleGroups; ++g) rescale |= gf[g] != 1.f;
      if (__any_sync(0xffffffffu, rescale)) ScaleOutput(o, alpha, gf);
      StorePTiles<16, kFp8ScaleGroups, Layout::kPTileBytes>(p_addr, warp_in_wg, lane, st, sc,
                                                            inv_r);
      cutlass::arch::fence_view_async_shared();
      WarpgroupSync(wg);
      SM90_TRACE(kTracePStored, k);
      PvFromRaw<16, kFp8ScaleGroups, Layout::kPTileBytes, kEarlyVGroups>(
          p_addr, o,
          [&](int g, uint32_t (&raw)[16]) {
            if (g >= kEarlyVGroups) {
              LoadVGroupRaw(staged_addr, warp_in_wg, lane, g, raw);
            } else {
#pragma unroll
              for (int i = 0; i < 16; ++i) raw[i] = v_raw[g][i];
            }
          },
          [&](int g) {
            if (g == kFp8ScaleGroups - 1) Barrier::arrive(pipe.Empty(stage));
          });
      SM90_TRACE(kTraceBlockDone, k);
      load = BlockLoad::Of(p, seg_info, k + 2, next);
    }
    it += seg_info.kv_end - seg_info.kv_begin;
    if (wg_tid == 0) Barrier::arrive(pipe.QEmpty());

    float l[kRowsT];
    SumRowsOverWarpgroup<kRowsT, kStride>(l_t, reduce, warp_in_wg, lane, wg, l);
    // Merge the two warpgroups in one exchange, each thread with its partner in the other (the same
    // rows): each writes its rows' maxima and sums and the four output tiles the other keeps
    // (warpgroup w keeps tiles 4 w .. 4 w + 3), times their groups' running maximum scales, then
    // reads its partner's.
    float keep[4][8], give[4][8];  // selected without indexing o by wg
#pragma unroll
    for (int tt = 0; tt < 4; ++tt) {
      const float r_keep = wg == 0 ? r_g[tt / 2] : r_g[2 + tt / 2];
      const float r_give = wg == 0 ? r_g[2 + tt / 2] : r_g[tt / 2];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        keep[tt][e] = (wg == 0 ? o[tt][e] : o[4 + tt][e]) * r_keep;
        give[tt][e] = (wg == 0 ? o[4 + tt][e] : o[tt][e]) * r_give;
      }
    }
#pragma unroll
    for (int slot = 0; slot < 8; ++slot) {
      const float* const x = &give[slot / 2][4 * (slot % 2)];
      *MergeSlot(smem, wg, slot, wg_tid) = make_float4(x[0], x[1], x[2], x[3]);
    }
    *MergeSlot(smem, wg, kMergeMaxSlot, wg_tid) = make_float4(m_t[0], m_t[1], m_t[2], m_t[3]);
    *MergeSlot(smem, wg, kMergeSumSlot, wg_tid) = make_float4(l[0], l[1], l[2], l[3]);
    ConsumerHandover();
    const float4 m4 = *MergeSlot(smem, wg ^ 1, kMergeMaxSlot, wg_tid);
    const float4 l4 = *MergeSlot(smem, wg ^ 1, kMergeSumSlot, wg_tid);
    const float m_other[kRowsT] = {m4.x, m4.y, m4.z, m4.w};
    const float l_other[kRowsT] = {l4.x, l4.y, l4.z, l4.w};
    float m_all[kRowsT], l_all[kRowsT], f_me[kRowsT], f_other[kRowsT];
#pragma unroll
    for (int i = 0; i < kRowsT; ++i) {
      const float m = fmaxf(m_t[i], m_other[i]);
      const float mu = m == kNegInf ? 0.f : m;
      f_me[i] = m_t[i] == kNegInf ? 0.f : Exp2((m_t[i] - mu) * sl2);
      f_other[i] = m_other[i] == kNegInf ? 0.f : Exp2((m_other[i] - mu) * sl2);
      l_all[i] = l[i] * f_me[i] + l_other[i] * f_other[i];
      m_all[i] = m;
    }
#pragma unroll
    for (int slot = 0; slot < 8; ++slot) {
      const float4 x4 = *MergeSlot(smem, wg ^ 1, slot, wg_tid);
      const float x[4] = {x4.x, x4.y, x4.z, x4.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int e = 4 * (slot % 2) + j;
        const int i = 2 * (slot % 2) + j % 2;  // RegsElement(i, h) == e
        keep[slot / 2][e] = keep[slot / 2][e] * f_me[i] + x[j] * f_other[i];
      }
    }
    SM90_TRACE(kTraceStoreBegin, seg_info.whole);
    StoreRegsTiles(args, seg_info, part, wg, wg_tid, lane, keep, l_all, m_all);
    SM90_TRACE(kTraceStoreEnd, 0);
    ++seg;
  }
  });
}

}  // namespace sm90
}  // namespace jax_mla
