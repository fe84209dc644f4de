// The online softmax of both score layouts (64-row tiles: a thread's two rows; transposed
// scores: a thread's query rows over its tokens), the lazy rescale, the bf16 P stores, and the
// transposed path's exchange of partial scores and row statistics between the warpgroups.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "decode_params.h"
#include "fragment_layout.h"
#include "pipeline.cuh"
#include "smem_layout.cuh"

namespace jax_mla {
namespace sm90 {
namespace detail {

__device__ __forceinline__ float Exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// The running maximum (score units) a row keeps after a block whose own maximum is m_blk: the
// old one, m, unless m_blk exceeds it by more than kLazyRescaleLog2 in exp2 units. Most blocks then
// leave the output accumulator unscaled, and the probabilities stay below 2^kLazyRescaleLog2
// (bf16 and the fp32 sums hold them as well as any). -inf while the row has seen no token.
constexpr float kLazyRescaleLog2 = 8.f;

// Whether a block maximum m_blk moves the running maximum m (NextRowMax).
__device__ __forceinline__ bool MovesRowMax(float m, float m_blk, float scale_log2) {
  return (m_blk - m) * scale_log2 > kLazyRescaleLog2;
}

__device__ __forceinline__ float NextRowMax(float m, float m_blk, float scale_log2) {
  return MovesRowMax(m, m_blk, scale_log2) ? m_blk : m;
}

// Multiplies a warpgroup's 64 x (N / 2) accumulator fragment by its two rows' factors.
template <int N>
__device__ __forceinline__ void RescaleRows(float (&o)[N], float alpha0, float alpha1) {
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
    o[4 * j + 0] *= alpha0;
    o[4 * j + 1] *= alpha0;
    o[4 * j + 2] *= alpha1;
    o[4 * j + 3] *= alpha1;
  }
}

__device__ __forceinline__ uint32_t PackBf16x2(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

constexpr float kNegInf = -__builtin_huge_valf();

// A finished row's LSE in nats from its running maximum m (raw scores; scale_log2 = softmax_scale
// log2(e)) and its sum l of exp2 terms; -inf for a row that saw no token.
__device__ __forceinline__ float RowLse(float m, float l, float scale_log2) {
  constexpr float kLn2 = 0.6931471805599453f;
  return l > 0.f ? (m * scale_log2 + __log2f(l)) * kLn2 : kNegInf;
}

// 1 / l, the output's normaliser; 0 for a row that saw no token.
__device__ __forceinline__ float RowInverse(float l) { return l > 0.f ? 1.f / l : 0.f; }

// 64-row tiles: masks this thread's scores of rows r0 (elements 4 j + e) and r1 (4 j + 2 + e) in
// kGroups groups of eight tokens (element (j, e) is token tok0 + 8 j + e; half_ok(j): its page was
// loaded) to -inf past each row's causal limit, and returns the rows' maxima over the quad's lanes.
// visible: every token of the groups is loaded and within both limits (nothing to mask).
template <int kGroups, class HalfOk>
__device__ __forceinline__ void MaskRows(float (&s)[4 * kGroups], int tok0, HalfOk half_ok,
                                         int limit0, int limit1, bool visible, float& mx0,
                                         float& mx1) {
  mx0 = kNegInf;
  mx1 = kNegInf;
  if (visible) {
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      mx0 = fmaxf(mx0, fmaxf(s[4 * j], s[4 * j + 1]));
      mx1 = fmaxf(mx1, fmaxf(s[4 * j + 2], s[4 * j + 3]));
    }
  } else {
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tok = tok0 + 8 * j + e;
        const float a = (half_ok(j) && tok <= limit0) ? s[4 * j + e] : kNegInf;
        const float c = (half_ok(j) && tok <= limit1) ? s[4 * j + 2 + e] : kNegInf;
        s[4 * j + e] = a;
        s[4 * j + 2 + e] = c;
        mx0 = fmaxf(mx0, a);
        mx1 = fmaxf(mx1, c);
      }
    }
  }
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
  mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
  mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
}

// Transposed scores' online softmax of the thread's query row i (< kRowsT) once its running
// maximum moves to m_new: the rescale factor alpha[i] and the block's probabilities exp2 in place of
// the row's scores st (TransposedScores::Element), added to its running sum.
template <int kRowsT>
__device__ __forceinline__ void ExpRow(int i, float m_new, float sl2, float (&st)[2 * kRowsT],
                                       float (&m_t)[kRowsT], float (&l_t)[kRowsT],
                                       float (&alpha)[kRowsT]) {
  const float mu = m_new == kNegInf ? 0.f : m_new;
  alpha[i] = Exp2((m_t[i] - mu) * sl2);
  m_t[i] = m_new;
  const float nb = -mu * sl2;
  const int ea = TransposedScores::Element(i, 0), eb = TransposedScores::Element(i, 1);
  st[ea] = Exp2(fmaf(st[ea], sl2, nb));
  st[eb] = Exp2(fmaf(st[eb], sl2, nb));
  l_t[i] = l_t[i] * alpha[i] + st[ea] + st[eb];
}

// Transposed scores: element x (< kN / 2) of the values of the thread's query rows that
// warpgroup wg owns (TransposedScores::OwnedRow), out of all its kN values st.
template <int kN>
__device__ __forceinline__ float OwnedValue(const float (&st)[kN], int wg, int x) {
  return wg == 0 ? st[x] : st[kN / 2 + x];
}

// Transposed scores: the value of the thread's query row i (< kRowsT) from its owned rows' own[k]
// if warpgroup wg owns it, else from what the other warpgroup published for its lane group q
// (published[q kRowsT + i], RowStats' layout: the owner writes row OwnedRow(owner, k) there).
template <int kRowsT>
__device__ __forceinline__ float RowValue(int wg, int i, const float (&own)[kRowsT / 2],
                                          const float* published, int q) {
  return TransposedScores::Owns(wg, i, kRowsT) ? own[TransposedScores::OwnedIndex(i, kRowsT)]
                                               : published[q * kRowsT + i];
}

// Transposed scores' online softmax of kRowsT of the thread's query rows (its rows first_row_t
// .. first_row_t + kRowsT - 1): each one's block maximum from the warpgroup's four warps' maxima
// (reduce[w * kStride + row]), the running maximum moved (NextRowMax), the rescale factor alpha
// and the block's probabilities exp2 in place of its scores st (TransposedScores::Element),
// added to the running sums.
template <int kRowsT, int kStride>
__device__ __forceinline__ void UpdateRowsSoftmax(const float* reduce, int lane, float sl2,
                                                  float (&st)[2 * kRowsT], float (&m_t)[kRowsT],
                                                  float (&l_t)[kRowsT], float (&alpha)[kRowsT],
                                                  int first_row_t = 0) {
#pragma unroll
  for (int i = 0; i < kRowsT; ++i) {
    const int row = TransposedScores::QueryRow(lane, first_row_t + i);
    float m_blk = reduce[row];
#pragma unroll
    for (int w = 1; w < 4; ++w) m_blk = fmaxf(m_blk, reduce[w * kStride + row]);
    ExpRow(i, NextRowMax(m_t[i], m_blk, sl2), sl2, st, m_t, l_t, alpha);
  }
}

// 64-row tiles: the online softmax of rows r0 and r1 (the scores s as in MaskRows) whose block
// maxima are mx0 and mx1: moves the running maxima m0, m1 (NextRowMax), returns the rows' rescale
// factors and the sums of the probabilities, and packs these as bf16 pairs for
// StoreWarpTile16x32 (packed[j / 4][2 (j % 4)]: row r0, [.. + 1]: row r1, of group j).
template <int kGroups>
__device__ __forceinline__ void SoftmaxRows(const float (&s)[4 * kGroups], float mx0, float mx1,
                                            float scale_log2, float& m0, float& m1,
                                            float& alpha0, float& alpha1, float& sum0,
                                            float& sum1, uint32_t (&packed)[kGroups / 4][8]) {
  const float m_new0 = NextRowMax(m0, mx0, scale_log2);
  const float m_new1 = NextRowMax(m1, mx1, scale_log2);
  const float mu0 = m_new0 == kNegInf ? 0.f : m_new0;
  const float mu1 = m_new1 == kNegInf ? 0.f : m_new1;
  alpha0 = Exp2((m0 - mu0) * scale_log2);
  alpha1 = Exp2((m1 - mu1) * scale_log2);
  m0 = m_new0;
  m1 = m_new1;
  const float nb0 = -mu0 * scale_log2;
  const float nb1 = -mu1 * scale_log2;
  sum0 = 0.f;
  sum1 = 0.f;
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    const float p00 = Exp2(fmaf(s[4 * j + 0], scale_log2, nb0));
    const float p01 = Exp2(fmaf(s[4 * j + 1], scale_log2, nb0));
    const float p10 = Exp2(fmaf(s[4 * j + 2], scale_log2, nb1));
    const float p11 = Exp2(fmaf(s[4 * j + 3], scale_log2, nb1));
    sum0 += p00 + p01;
    sum1 += p10 + p11;
    packed[j / 4][2 * (j % 4)] = PackBf16x2(p00, p01);
    packed[j / 4][2 * (j % 4) + 1] = PackBf16x2(p10, p11);
  }
}

// A warp's 16 rows x 32 columns of a 64 x 32 WGMMA accumulator (fragment_layout.h), packed as bf16
// pairs (packed[2 j + h]: rows Fragment::Row(., h), columns of eight-column group j), stored into a
// 128-byte-swizzled bf16 chunk at rows [row0, row0 + 16) and columns [col0, col0 + 32) with two
// stmatrix (each 8 x 8 matrix is one 16-byte row segment per lane address).
__device__ __forceinline__ void StoreWarpTile16x32(uint8_t* chunk, int row0, int col0, int lane,
                                                   const uint32_t (&packed)[8]) {
#pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int m = lane / 8;  // the matrix this lane addresses: group 2 c + m / 2, half m % 2
    const uint32_t addr =
        SmemAddr(chunk + SwizzledOffset(row0 + 8 * (m % 2) + lane % 8, col0 + 8 * (2 * c + m / 2)));
    asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr),
                 "r"(packed[4 * c]), "r"(packed[4 * c + 1]), "r"(packed[4 * c + 2]),
                 "r"(packed[4 * c + 3])
                 : "memory");
  }
}

// Transposed scores' exchange area: slots of 128 threads x 16 bytes, thread-contiguous
// (conflict-free float4 accesses). With the bf16 cache the slots live in the query tile's rows
// kScoreN..63, which the scores never read (the bulk copy writes at most kScoreN rows); with the
// fp8 cache in their own area. Slots [0, 2 kExchangeSlotsPerWarpgroup) carry partial S^T
// (ScoreExchangeSlot), the next one the rows' statistics (RowStats).
template <int kScoreN>
constexpr int kExchangeSlotsPerWarpgroup = kScoreN / 4 / 4;

template <int kScoreN, bool kFp8>
__device__ __forceinline__ uint8_t* ExchangeSlot(uint8_t* smem, int slot) {
  using Layout = KernelSmemLayout<kFp8, kScoreN>;
  constexpr int kSlotBytes = 128 * 16;
  constexpr int kSlots = kConsumerWarpgroups * kExchangeSlotsPerWarpgroup<kScoreN> + 1;
  if constexpr (kFp8) {
    static_assert(kSlots * kSlotBytes <= kFp8ExchangeBytes, "the exchange slots fit in their area");
    return smem + Layout::kExchange + slot * kSlotBytes;
  } else {
    constexpr int kSlotsPerChunk = (kBlockM - kScoreN) * kRowBytes / kSlotBytes;
    static_assert(kSlotsPerChunk >= 1 && kSlots <= kSlotsPerChunk * kNumChunks,
                  "the exchange slots fit in the query tile's unused rows");
    return smem + Layout::kQ + (slot / kSlotsPerChunk) * kChunkBytes + kScoreN * kRowBytes +
           (slot % kSlotsPerChunk) * kSlotBytes;
  }
}

// Slot v (four floats per thread) of the partial S^T that warpgroup wg hands the other: the other
// warpgroup's rows' sums over wg's half of the 576 columns.
template <int kScoreN, bool kFp8>
__device__ __forceinline__ float4* ScoreExchangeSlot(uint8_t* smem, int wg, int v, int wg_tid) {
  return reinterpret_cast<float4*>(
      ExchangeSlot<kScoreN, kFp8>(smem, wg * kExchangeSlotsPerWarpgroup<kScoreN> + v) +
      wg_tid * 16);
}

// Transposed scores: hands the other warpgroup this thread's partial S^T of that one's rows
// (st, over warpgroup wg's half of the columns) and returns in `so` its own rows' complete
// scores, its partial sums plus the other's, written before and read after one consumer barrier
// (every consumer thread calls it). The caller relies on that barrier, and the slots are
// rewritten by the next block's call only after the consumer barrier that follows its P stores.
template <int kScoreN, bool kFp8, int kStN, int kOwnN>
__device__ __forceinline__ void ExchangePartialScores(uint8_t* smem, int wg, int wg_tid,
                                                      const float (&st)[kStN],
                                                      float (&so)[kOwnN]) {
  static_assert(kStN == kScoreN / 2 && kOwnN == kStN / 2, "a thread's values of its query rows");
  static_assert(kScoreN % 16 == 0, "each warpgroup's values of a thread fill whole float4s");
#pragma unroll
  for (int v = 0; v < kOwnN / 4; ++v) {
    *ScoreExchangeSlot<kScoreN, kFp8>(smem, wg, v, wg_tid) =
        make_float4(OwnedValue(st, wg ^ 1, 4 * v), OwnedValue(st, wg ^ 1, 4 * v + 1),
                    OwnedValue(st, wg ^ 1, 4 * v + 2), OwnedValue(st, wg ^ 1, 4 * v + 3));
  }
  ConsumerSync();
#pragma unroll
  for (int v = 0; v < kOwnN / 4; ++v) {
    const float4 other = *ScoreExchangeSlot<kScoreN, kFp8>(smem, wg ^ 1, v, wg_tid);
    so[4 * v] = OwnedValue(st, wg, 4 * v) + other.x;
    so[4 * v + 1] = OwnedValue(st, wg, 4 * v + 1) + other.y;
    so[4 * v + 2] = OwnedValue(st, wg, 4 * v + 2) + other.z;
    so[4 * v + 3] = OwnedValue(st, wg, 4 * v + 3) + other.w;
  }
}

// Per-row values one warpgroup publishes for the other (its owned rows' rescale factors each
// block, their sums and maxima at a segment's end): f32 [3][4][kScoreN / 4], array a's entry of
// query row TransposedScores::QueryRow(q, i) at a * kScoreN + q * kScoreN / 4 + i (q = lane % 4).
template <int kScoreN, bool kFp8>
__device__ __forceinline__ float* RowStats(uint8_t* smem) {
  static_assert(3 * kScoreN * 4 <= 128 * 16, "the row statistics fit in one slot");
  return reinterpret_cast<float*>(
      ExchangeSlot<kScoreN, kFp8>(smem, kConsumerWarpgroups * kExchangeSlotsPerWarpgroup<kScoreN>));
}

// Transposed scores: kRowsT of the thread's query rows' (its rows first_row_t .. first_row_t +
// kRowsT - 1) sums over the segment's tokens, its own (l_t) over the eight lanes sharing the
// rows, then the warpgroup's four warps in order (through reduce[w * kStride + row]).
template <int kRowsT, int kStride>
__device__ __forceinline__ void SumRowsOverWarpgroup(const float (&l_t)[kRowsT], float* reduce,
                                                     int warp_in_wg, int lane, int wg,
                                                     float (&l)[kRowsT], int first_row_t = 0) {
#pragma unroll
  for (int i = 0; i < kRowsT; ++i) {
    l[i] = l_t[i];
#pragma unroll
    for (int d = 4; d < 32; d <<= 1) l[i] += __shfl_xor_sync(0xffffffffu, l[i], d);
  }
  if (lane < 4) {
#pragma unroll
    for (int i = 0; i < kRowsT; ++i) {
      reduce[warp_in_wg * kStride + TransposedScores::QueryRow(lane, first_row_t + i)] = l[i];
    }
  }
  WarpgroupSync(wg);
#pragma unroll
  for (int i = 0; i < kRowsT; ++i) {
    const int row = TransposedScores::QueryRow(lane, first_row_t + i);
    l[i] = ((reduce[row] + reduce[kStride + row]) + reduce[2 * kStride + row]) +
           reduce[3 * kStride + row];
  }
}

}  // namespace detail
}  // namespace sm90
}  // namespace jax_mla
