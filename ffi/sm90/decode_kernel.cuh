// The SM90 (Hopper) MLA decode kernel: persistent split-KV over a GPU-built schedule.
//
// CTA = 2 consumer warpgroups + 1 producer warpgroup (384 threads), one CTA per SM; grid (parts, M
// tiles). Each CTA walks the (request, KV block) range that the schedule gives its part:
//  - one producer thread loads the 64-row query tile once per request segment and every 64-token
//    KV tile (64 x 576 bf16) as 64-column bulk-tensor pieces of one page (64 rows) or of two
//    pages of 32 into a 2-stage mbarrier pipeline; a stage goes back to the producer as soon as
//    both warpgroups' PV on it is done;
//  - QK^T: consumer warpgroup 0 computes the scores of all 64 tokens for all 64 rows (WGMMA
//    64x64x16, both operands in shared memory) and their online softmax, and writes the bf16
//    probabilities P over the block's rope chunk (which only QK^T reads) and each row's rescale
//    factor to shared memory;
//  - both warpgroups run PV over the 64 tokens for their own 256 output columns (WGMMA 64x256x16,
//    V read as the transposed view of the KV tile in place), warpgroup 1 after rescaling its half
//    of the output by warpgroup 0's factors;
//  - a request handled whole writes bf16 output and LSE; a split one writes its partial output
//    (bf16 in 64-row tiles, fp32 in the transposed kernels) and LSE to the workspace for the
//    combine kernel.
// Optionally (kCluster == 2) two CTAs holding consecutive M tiles share each KV tile by multicast.
// Up to 32 query rows the scores and PV are computed transposed (kScoreN). With the fp8 cache
// (kFp8) the producer stages raw cache rows that the consumers convert into one bf16 KV tile per
// block.
// Safety: only pages whose id is in range and that hold tokens below the (clamped) length are
// loaded from the cache (with pages of 64 the whole page, its tail included); the shared-memory
// rows of tokens at or beyond the length or of pages not loaded are zeroed (so 0 * NaN never
// enters PV) and their scores masked to -inf by select.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <utility>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "decode_params.h"
#include "fragment_layout.h"
#include "schedule.cuh"
#include "smem_layout.cuh"
#include "trace.cuh"

namespace jax_mla {
namespace sm90 {

struct DecodeKernelArgs {
  DecodeParams p;
  int num_parts;
  int q_box_rows;       // rows per query bulk-tensor box: min(64, q_len * num_heads)
  uint64_t kv_cache_hint;
  float scale_log2;     // softmax_scale * log2(e)
  bool bf16_partials;   // split requests' partial outputs in bf16 (the combines' kBf16Partials)
  bool fp8_rows_by_map; // the fp8 cache's rows staged through kv_map (EncodeFp8RowMap), not by
                        // plain bulk copies
};

namespace detail {

using QkMma = cute::SM90::GMMA::MMA_64x32x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K,
                                                             cute::SM90::GMMA::Major::K>;
using QkMma64 = cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K,
                                                               cute::SM90::GMMA::Major::K>;
using PvMma = cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K,
                                                              cute::SM90::GMMA::Major::MN>;
// The transposed products, m64 x kN x k16 with B K-major and N = the query rows (16 or 32), as
// CuTe selects them: S^T = K Q^T (A = the KV tile, K-major) and O^T = V^T P^T (A = V^T, the KV tile
// read MN-major), both operands in shared memory (TransposedMma); with A from registers and
// elements of type Element (RsMma: the fp8 cache's keys and V^T, f16, and the rope's bf16).
template <int kN>
using MmaTile = cute::Shape<cute::_64, cute::Int<kN>, cute::_16>;
template <int kN, cute::SM90::GMMA::Major kMajorA>
using TransposedMma =
    decltype(cute::SM90::GMMA::ss_op_selector<cute::bfloat16_t, cute::bfloat16_t, float,
                                              MmaTile<kN>, kMajorA, cute::SM90::GMMA::Major::K>());
template <class Element, int kN>
using RsMma =
    decltype(cute::SM90::GMMA::rs_op_selector<Element, Element, float, MmaTile<kN>>());

template <class Mma, int N, size_t... I>
__device__ __forceinline__ void MmaImpl(uint64_t desc_a, uint64_t desc_b, float (&d)[N],
                                        cute::SM90::GMMA::ScaleOut scale,
                                        std::index_sequence<I...>) {
  Mma::fma(desc_a, desc_b, d[I]..., scale);
}

template <class Op, int N>
__device__ __forceinline__ void Gmma(uint64_t desc_a, uint64_t desc_b, float (&d)[N],
                                    bool accumulate) {
  MmaImpl<Op>(desc_a, desc_b, d,
               accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero,
               std::make_index_sequence<N>{});
}

template <int N>
__device__ __forceinline__ void FenceRegisters(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) cute::warpgroup_fence_operand(d[i]);
}

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

// Multiplies a warpgroup's 64 x 256 accumulator fragment by its two rows' factors.
__device__ __forceinline__ void RescaleRows(float (&o)[128], float alpha0, float alpha1) {
#pragma unroll
  for (int j = 0; j < 32; ++j) {
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
// (published[q kRowsT + i], RowStats' layout).
template <int kRowsT>
__device__ __forceinline__ float RowValue(int wg, int i, const float (&own)[kRowsT / 2],
                                          const float* published, int q) {
  return TransposedScores::Owns(wg, i, kRowsT)
             ? own[TransposedScores::OwnedIndex(i, kRowsT)]
             : published[q * kRowsT + TransposedScores::OwnedRow(wg ^ 1, 0, kRowsT) +
                         TransposedScores::OwnedIndex(i, kRowsT)];
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

// Request b's block-table entry for the page that holds token0, as read (not yet checked).
__device__ __forceinline__ int TableEntry(const DecodeParams& p, int b, int token0) {
  return p.block_tables[static_cast<long long>(b) * p.max_pages + (token0 >> PageShift(p))];
}

// Whether a block-table entry names a page of the cache.
__device__ __forceinline__ bool PageInRange(const DecodeParams& p, int page) {
  return page >= 0 && page < p.num_pages;
}

// Cache row of the 32 tokens starting at token0 (a multiple of 32) of request b, or -1 when they
// are beyond the length or their page id is out of range.
__device__ __forceinline__ int KvRow(const DecodeParams& p, int b, int token0, int len) {
  if (token0 >= len) return -1;
  const int page = TableEntry(p, b, token0);
  if (!PageInRange(p, page)) return -1;
  return page * p.page_size + (token0 & (p.page_size - 1));
}

constexpr int kConsumerBarrier = 1;  // named barrier id shared by the two consumer warpgroups
constexpr int kWarpgroupBarrier = 4;  // + warpgroup: its own four warps

__device__ __forceinline__ uint32_t ClusterCtaRank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// All threads of all CTAs of the cluster (not warp-aligned: callers may have diverged).
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// The QK^T k steps (16 columns each) of the 576-wide rows; transposed scores split them evenly
// between the consumer warpgroups.
constexpr int kQkStepsPerChunk = kChunkCols / 16;
constexpr int kQkSteps = kNumChunks * kQkStepsPerChunk;
constexpr int kQkStepsPerWarpgroup = kQkSteps / kConsumerWarpgroups;
static_assert(kQkSteps % kConsumerWarpgroups == 0, "QK^T steps split evenly");

// Byte offset of QK^T k step g inside a 576-wide tile of kTileChunkBytes chunks (its chunk, then 32
// bytes per step).
template <int kTileChunkBytes = kChunkBytes>
__device__ __forceinline__ uint32_t QkStepOffset(int g) {
  return (g / kQkStepsPerChunk) * kTileChunkBytes + (g % kQkStepsPerChunk) * 32;
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

// Per-row values one warpgroup publishes for the other (its owned rows' rescale factors each
// block, their sums and maxima at a segment's end): f32 [3][4][kScoreN / 4], array a's entry of
// query row TransposedScores::QueryRow(q, i) at a * kScoreN + q * kScoreN / 4 + i (q = lane % 4).
template <int kScoreN, bool kFp8>
__device__ __forceinline__ float* RowStats(uint8_t* smem) {
  static_assert(3 * kScoreN * 4 <= 128 * 16, "the row statistics fit in one slot");
  return reinterpret_cast<float*>(
      ExchangeSlot<kScoreN, kFp8>(smem, kConsumerWarpgroups * kExchangeSlotsPerWarpgroup<kScoreN>));
}

// A named barrier that is also a compiler barrier for memory: CUTLASS's NamedBarrier::sync has no
// memory clobber, so without the empty asm statements around it the compiler may move shared-memory
// loads and stores across it.
__device__ __forceinline__ void NamedSync(int threads, int id) {
  asm volatile("" ::: "memory");
  cutlass::arch::NamedBarrier::sync(threads, id);
  asm volatile("" ::: "memory");
}

__device__ __forceinline__ void ConsumerSync() { NamedSync(kConsumerThreads, kConsumerBarrier); }

__device__ __forceinline__ void WarpgroupSync(int wg) { NamedSync(128, kWarpgroupBarrier + wg); }

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
  constexpr float kLn2 = 0.6931471805599453f;
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
    const float inv = l[i] > 0.f ? 1.f / l[i] : 0.f;
    const float lse = l[i] > 0.f ? (m[i] * scale_log2 + __log2f(l[i])) * kLn2 : kNegInf;
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

// The pipeline's barriers in shared memory: the query tile's pair, then for each slot (a KV stage,
// or with half stages a 32-token stage) "full" (the producer's pieces landed) and "empty" (its
// consumer warpgroups, of every CTA that multicasts into it, released it). When a bf16 stage is
// released in two parts (DecodeKernel's kSplitRelease), Full/Empty guard its chunks from
// kWg0VChunks on and V0Full/V0Empty warpgroup 0's V chunks [0, kWg0VChunks).
struct Pipeline {
  uint64_t* base;
  uint64_t* v0;

  template <class Layout>
  __device__ __forceinline__ static Pipeline At(uint8_t* smem) {
    uint64_t* base = reinterpret_cast<uint64_t*>(smem + Layout::kBarriers);
    return {base, base + 2 + 2 * Layout::kStageSlots};
  }
  __device__ __forceinline__ uint64_t* QFull() const { return base; }
  __device__ __forceinline__ uint64_t* QEmpty() const { return base + 1; }
  __device__ __forceinline__ uint64_t* Full(int slot) const { return base + 2 + 2 * slot; }
  __device__ __forceinline__ uint64_t* Empty(int slot) const { return base + 3 + 2 * slot; }
  __device__ __forceinline__ uint64_t* V0Full(int stage) const { return v0 + 2 * stage; }
  __device__ __forceinline__ uint64_t* V0Empty(int stage) const { return v0 + 1 + 2 * stage; }
};

// Warpgroup 0's V columns (its 256 output columns) are the stage's first chunks.
constexpr int kWg0VChunks = kNumVChunks / kConsumerWarpgroups;

// Arrives on an empty barrier in every CTA that multicasts into the stage it guards.
template <int kCluster>
__device__ __forceinline__ void ReleaseBarrier(uint64_t* empty) {
  if (kCluster == 1) {
    cutlass::arch::ClusterBarrier::arrive(empty);
  } else {
#pragma unroll
    for (int r = 0; r < kCluster; ++r) cutlass::arch::ClusterBarrier::arrive(empty, r, 1u);
  }
}

// Hands a KV stage (with kSplitRelease: its chunks from kWg0VChunks on) back to the producer of
// every CTA that multicasts into it (called by one thread of each consumer warpgroup that releases
// it, or with half stages by every thread of the one that read it).
template <int kCluster>
__device__ __forceinline__ void ReleaseStage(const Pipeline& pipe, int stage) {
  ReleaseBarrier<kCluster>(pipe.Empty(stage));
}

// fp8 cache, 64-row tiles: the ring slot of half h of the it-th block a CTA loads, and how many
// times the ring went round before it (the parity of its barriers' phase).
struct HalfSlot {
  int index;
  int round;

  template <class Layout>
  __device__ __forceinline__ static HalfSlot Of(int it, int h) {
    const int q = 2 * it + h;
    return {q % Layout::kStageSlots, q / Layout::kStageSlots};
  }
};

// The block table entries of the two 32-token halves of a segment's KV block k as read (-1 for a
// half past the length), not yet checked: a kernel reads them a block ahead and checks them
// (BlockLoad::Of) where it needs them, so that nothing waits for the read before.
struct BlockPages {
  int page[2];

  __device__ __forceinline__ static BlockPages Read(const DecodeParams& p, const Segment& seg,
                                                    int k) {
    BlockPages v;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int token0 = k * kBlockN + h * kHalfN;
      v.page[h] = token0 < seg.len ? TableEntry(p, seg.b, token0) : -1;
    }
    return v;
  }
};

// What of a 64-token KV block was loaded: tokens [0, n_valid) are below the length, and the
// 32-token halves whose page id is in range (half_ok[h]); the rest of the stage holds stale data.
struct BlockLoad {
  int n_valid;
  bool half_ok[2];

  __device__ __forceinline__ static BlockLoad Of(const DecodeParams& p, const Segment& seg, int k) {
    return Of(p, seg, k, BlockPages::Read(p, seg, k));
  }
  // The same from block k's table entries read before (BlockPages::Read).
  __device__ __forceinline__ static BlockLoad Of(const DecodeParams& p, const Segment& seg, int k,
                                                 const BlockPages& pages) {
    BlockLoad v;
    v.n_valid = min(kBlockN, seg.len - k * kBlockN);
#pragma unroll
    for (int h = 0; h < 2; ++h) v.half_ok[h] = PageInRange(p, pages.page[h]);
    return v;
  }
  __device__ __forceinline__ bool Complete() const {
    return n_valid == kBlockN && half_ok[0] && half_ok[1];
  }
  __device__ __forceinline__ bool RowLoaded(int row) const {
    return row < n_valid && (row < kHalfN ? half_ok[0] : half_ok[1]);
  }
};

// Zeroes the V columns (chunks 0 .. kNumVChunks - 1) of the rows of a stage that were not loaded
// (or hold tokens past the length), so 0 * NaN can never enter PV. The consumer threads tid share
// the work, a few per row; the caller fences and synchronises them afterwards.
__device__ __forceinline__ void ZeroUnloadedRows(uint8_t* stage_base, const BlockLoad& load,
                                                 int tid) {
  constexpr int kThreadsPerRow = kConsumerThreads / kBlockN;
  constexpr int kChunksPerThread = kNumVChunks / kThreadsPerRow;
  static_assert(kThreadsPerRow * kBlockN == kConsumerThreads &&
                    kChunksPerThread * kThreadsPerRow == kNumVChunks,
                "rows and chunks split evenly over the threads");
  const int row = tid / kThreadsPerRow;
  if (load.RowLoaded(row)) return;
  uint8_t* dst = stage_base + (tid % kThreadsPerRow) * kChunksPerThread * kChunkBytes +
                 row * kRowBytes;
#pragma unroll
  for (int c = 0; c < kChunksPerThread; ++c) {
#pragma unroll
    for (int unit = 0; unit < kRowBytes / 16; ++unit) {
      *reinterpret_cast<uint4*>(dst + c * kChunkBytes + unit * 16) = make_uint4(0, 0, 0, 0);
    }
  }
}

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

template <class Mma, int N, size_t... I>
__device__ __forceinline__ void MmaRsImpl(const uint32_t (&a)[4], uint64_t desc_b, float (&d)[N],
                                          cute::SM90::GMMA::ScaleOut scale,
                                          std::index_sequence<I...>) {
  Mma::fma(a[0], a[1], a[2], a[3], desc_b, d[I]..., scale);
}

// A WGMMA with A from registers.
template <class Op, int N>
__device__ __forceinline__ void GmmaRs(const uint32_t (&a)[4], uint64_t desc_b, float (&d)[N],
                                      bool accumulate) {
  MmaRsImpl<Op>(a, desc_b, d,
                accumulate ? cute::SM90::GMMA::ScaleOut::One : cute::SM90::GMMA::ScaleOut::Zero,
                std::make_index_sequence<N>{});
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

// fp8 cache, 17-32 query rows: this warpgroup's partial S^T (64 tokens x kScoreN rows, kStN values
// per thread) over the columns DequantiseRow wrote for it (latent groups 2 wg, 2 wg + 1 and half
// the rope), both operands in shared memory.
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

// Zeroes the query tile's rows that the bulk copy never writes (q_len * num_heads < 64; they stay
// zero for the whole kernel), initialises the pipeline barriers and synchronises the CTA (the
// cluster when kCluster > 1: the peer multicasts into this CTA's stages and arrives on its
// barriers). kSplitRelease: each stage is released in two parts, warpgroup 0's V chunks by
// warpgroup 0 and the rest by warpgroup 1 (Pipeline).
template <int kCluster, class Layout, bool kSplitRelease = false>
__device__ __forceinline__ void SetUpCta(uint8_t* smem, int q_box_rows, int tid) {
  using Barrier = cutlass::arch::ClusterBarrier;
  const Pipeline pipe = Pipeline::At<Layout>(smem);
  if (tid < kConsumerThreads && q_box_rows < Layout::kQChunkRows) {
    const int units = (Layout::kQChunkRows - q_box_rows) * kNumChunks * (kRowBytes / 16);
    for (int i = tid; i < units; i += kConsumerThreads) {
      const int row = q_box_rows + i / (kNumChunks * 8);
      const int chunk = (i / 8) % kNumChunks;
      const int unit = i % 8;
      *reinterpret_cast<uint4*>(smem + Layout::kQ + chunk * Layout::kQChunkBytes +
                                row * kRowBytes + unit * 16) = make_uint4(0, 0, 0, 0);
    }
    cutlass::arch::fence_view_async_shared();
  }
  if (tid == kConsumerThreads) {
    for (int s = 0; s < Layout::kStageSlots; ++s) {
      Barrier::init(pipe.Full(s), 1);
      // A half stage (or any stage of a layout so marked) goes back once every thread that read
      // it released it.
      const int releasers = Layout::kEveryThreadReleases ? Layout::kReleasingThreads
                            : kSplitRelease         ? 1
                                                    : kConsumerWarpgroups;
      Barrier::init(pipe.Empty(s), releasers * kCluster);
      if (kSplitRelease) {
        Barrier::init(pipe.V0Full(s), 1);
        Barrier::init(pipe.V0Empty(s), kCluster);
      }
    }
    Barrier::init(pipe.QFull(), 1);
    Barrier::init(pipe.QEmpty(), kConsumerWarpgroups);
    cutlass::arch::fence_barrier_init();
  }
  if (kCluster > 1) {
    ClusterSync();
  } else {
    __syncthreads();
  }
}

// Bulk copy (not a tensor copy) of `bytes` contiguous bytes from global to this CTA's shared
// memory, completing on `full`, with an L2 cache hint.
__device__ __forceinline__ void BulkCopyG2S(void* dst, const void* src, uint32_t bytes,
                                            uint64_t* full, uint64_t cache_hint) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;"
      :
      : "r"(SmemAddr(dst)), "l"(src), "r"(bytes), "r"(SmemAddr(full)), "l"(cache_hint)
      : "memory");
}

// Stages kHalfN contiguous fp8 cache rows from `row` on into `dst` (128-byte aligned), completing
// on `full`: by a bulk-tensor copy through kv_map where args asks for it, else by a plain bulk
// copy.
__device__ __forceinline__ void StageFp8Rows(const CUtensorMap& kv_map,
                                             const DecodeKernelArgs& args, uint8_t* dst, int row,
                                             uint64_t* full) {
  if (args.fp8_rows_by_map) {
    cute::SM90_TMA_LOAD_2D::copy(&kv_map, full, args.kv_cache_hint, dst, 0, row);
    return;
  }
  BulkCopyG2S(dst, static_cast<const uint8_t*>(args.p.kv_cache) +
                       static_cast<size_t>(row) * kFp8RowBytes,
              kFp8HalfStageBytes, full, args.kv_cache_hint);
}

// With at most this many requests per call, the bf16 cache's 64-row tiles ask L2 for each
// part's first KV blocks before the dependency wait (PrefetchFirstKvBlocks); with more, a part's
// first blocks are a small share of its work and the search for its first request is longer.
// The transposed and fp8 kernels do not (docs/sm90-kernel.md, "Measurements", says why).
constexpr int kPrefetchMaxBatch = 16;

// Before the dependency wait, while earlier kernels in the stream may still be writing the
// inputs: asks L2 for the KV rows of this part's first kStages blocks (ForEachPrefetchHalf says
// which, and why they stay inside the cache), so that their loads after the wait find them there.
// Its reads go through L2 (ld.global.cg), so that no L1 line of them is left for the reads after
// the wait.
__device__ __forceinline__ void PrefetchFirstKvBlocks(const DecodeParams& p, int num_parts,
                                                      int part, int mtile, int m_tiles) {
  constexpr int kRowBytesInCache = kHeadDim * 2;  // the bf16 cache
  ForEachPrefetchHalf(
      p, num_parts, part, mtile, m_tiles, 2 * kStages,
      [](const int32_t* x) { return __ldcg(x); },
      [&](int row, int tokens) {
        const uint32_t bytes = tokens * kRowBytesInCache;
        const char* rows = static_cast<const char*>(p.kv_cache) +
                           static_cast<size_t>(row) * kRowBytesInCache;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(rows), "r"(bytes)
                     : "memory");
      });
}

// The producer thread: for each segment of the part, the query tile (once both consumer
// warpgroups released the previous one), then each KV block into the next stage (once its
// consumers released it; with kSplitRelease each of the stage's two parts once its warpgroup
// released it), as one bulk-tensor box per page and 64-column chunk, or with the fp8 cache as
// one copy of each half's 32 contiguous cache rows (StageFp8Rows; with half stages, each half
// into the next slot of the ring, once the warpgroup that read it before released it); halves
// that are past the length or whose page id is out of range are not loaded and not counted. With
// kCluster == 2 this CTA issues every other piece, multicast into both CTAs of the cluster.
template <int kCluster, bool kFp8, class Layout, bool kNoLoad = false, bool kSplitRelease = false>
__device__ __forceinline__ void ProduceTiles(const CUtensorMap& q_map, const CUtensorMap& kv_map,
                                             const DecodeKernelArgs& args, uint8_t* smem,
                                             SegmentWalker& walker, int mtile, uint32_t cta_rank) {
  using Barrier = cutlass::arch::ClusterBarrier;
  using TxBarrier = cutlass::arch::ClusterTransactionBarrier;
  const DecodeParams& p = args.p;
  const Pipeline pipe = Pipeline::At<Layout>(smem);
  uint64_t* q_full = pipe.QFull();
  const int rows = p.q_len * p.num_heads;
  const uint32_t q_bytes = kNumChunks * args.q_box_rows * kRowBytes;
  Segment seg_info;
  int it = 0, seg = 0;
  while (walker.Next(seg_info)) {
    if (seg > 0) Barrier::wait(pipe.QEmpty(), (seg - 1) & 1);
    TxBarrier::arrive_and_expect_tx(q_full, q_bytes);
    const int q_row = seg_info.b * rows + mtile * kBlockM;
#pragma unroll 1
    for (int c = 0; c < kNumChunks; ++c) {
      cute::SM90_TMA_LOAD_2D::copy(&q_map, q_full,
                                   static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL),
                                   smem + Layout::kQ + c * Layout::kQChunkBytes, c * kChunkCols,
                                   q_row);
    }
    for (int k = seg_info.kv_begin; k < seg_info.kv_end; ++k, ++it) {
      const int stage = it % Layout::kStageSlots;
      const int round = it / Layout::kStageSlots;
      uint64_t* full = pipe.Full(stage);
      // The block table is read before waiting for the stage, so the read overlaps the wait.
      int kv_rows[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        kv_rows[h] = KvRow(p, seg_info.b, k * kBlockN + h * kHalfN, seg_info.len);
      }
      if constexpr (Layout::kHalfStages) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const HalfSlot slot = HalfSlot::Of<Layout>(it, h);
          if (slot.round > 0) Barrier::wait(pipe.Empty(slot.index), (slot.round - 1) & 1);
          uint64_t* half_full = pipe.Full(slot.index);
          TxBarrier::arrive_and_expect_tx(half_full, kv_rows[h] >= 0 ? kFp8HalfStageBytes : 0);
          if (kv_rows[h] < 0) continue;
          StageFp8Rows(kv_map, args, smem + Layout::kFp8Stages + slot.index * kFp8HalfStageBytes,
                       kv_rows[h], half_full);
        }
        continue;
      }
      if (round > 0) Barrier::wait(pipe.Empty(stage), (round - 1) & 1);
      if constexpr (kFp8) {
        TxBarrier::arrive_and_expect_tx(
            full, ((kv_rows[0] >= 0) + (kv_rows[1] >= 0)) * kFp8HalfStageBytes);
        uint8_t* stage_base = smem + Layout::kFp8Stages + stage * kFp8StageBytes;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (kv_rows[h] < 0) continue;
          StageFp8Rows(kv_map, args, stage_base + h * kFp8HalfStageBytes, kv_rows[h], full);
        }
        continue;
      }
      // One box per page of the block and chunk: a 64-row box for pages of 64 (the page's tail
      // past the length included: it lies inside the page, and the consumers zero and mask it),
      // two 32-row boxes for pages of 32 (the map's box rows follow the page size). A barrier
      // expects the bytes of the boxes issued under it.
      uint8_t* stage_base = smem + Layout::kKv + stage * kTileBytes;
      const int boxes = p.page_size == kBlockN ? 1 : 2;
      const uint32_t bytes_per_chunk =
          ((kv_rows[0] >= 0) + (boxes > 1 && kv_rows[1] >= 0)) * (kChunkBytes / boxes);
      auto load_chunks = [&](int c_begin, int c_end, uint64_t* barrier) {
        TxBarrier::arrive_and_expect_tx(barrier, kNoLoad ? 0 : (c_end - c_begin) * bytes_per_chunk);
#pragma unroll
        for (int h = 0; h < (kNoLoad ? 0 : 2); ++h) {
          const int kv_row = kv_rows[h];
          if (h >= boxes || kv_row < 0) continue;
#pragma unroll 1
          for (int c = c_begin; c < c_end; ++c) {
            uint8_t* dst = stage_base + c * kChunkBytes + h * kHalfN * kRowBytes;
            if (kCluster == 1) {
              cute::SM90_TMA_LOAD_2D::copy(&kv_map, barrier, args.kv_cache_hint, dst,
                                           c * kChunkCols, kv_row);
            } else if ((h * kNumChunks + c) % kCluster == static_cast<int>(cta_rank)) {
              cute::SM90_TMA_LOAD_MULTICAST_2D::copy(&kv_map, barrier,
                                                     static_cast<uint16_t>((1 << kCluster) - 1),
                                                     args.kv_cache_hint, dst, c * kChunkCols,
                                                     kv_row);
            }
          }
        }
      };
      if constexpr (kSplitRelease) {
        // Warpgroup 1 releases its part of a stage one block before warpgroup 0 releases its V.
        load_chunks(kWg0VChunks, kNumChunks, full);
        if (round > 0) Barrier::wait(pipe.V0Empty(stage), (round - 1) & 1);
        load_chunks(0, kWg0VChunks, pipe.V0Full(stage));
      } else {
        load_chunks(0, kNumChunks, full);
      }
    }
    ++seg;
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
// P tile. m0, m1 are the rows' maxima (in score units), l0, l1 this warpgroup's row sums over its
// quad.
__device__ __forceinline__ void StorePlain(const DecodeParams& p, const Segment& seg, int part,
                                           int num_parts, int rows, int wg, int lane, int r0,
                                           int gr0, int gr1, const float (&o)[128], float l0,
                                           float l1, float m0, float m1, float scale_log2,
                                           bool bf16_partials, float* row_sum, uint8_t* bounce) {
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
  constexpr float kLn2 = 0.6931471805599453f;
  const float inv0 = sum0 > 0.f ? 1.f / sum0 : 0.f;
  const float inv1 = sum1 > 0.f ? 1.f / sum1 : 0.f;
  const float lse0 = sum0 > 0.f ? (m0 * scale_log2 + __log2f(sum0)) * kLn2 : kNegInf;
  const float lse1 = sum1 > 0.f ? (m1 * scale_log2 + __log2f(sum1)) * kLn2 : kNegInf;
  const int col0 = wg * (kLatentDim / 2);
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
    if (wg == 0 && (lane & 3) == 0) {
      if (gr0 < rows) lse_out[row_base + gr0] = lse0;
      if (gr1 < rows) lse_out[row_base + gr1] = lse1;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float f = (h == 0 ? inv0 : inv1) * scale;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        // Columns [64 c, 64 c + 64) of the warpgroup's 256: eight-column groups 8 c .. 8 c + 7,
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
    if (wg == 0 && (lane & 3) == 0) {
      if (gr0 < rows) part_lse[slot_row + gr0] = lse0;
      if (gr1 < rows) part_lse[slot_row + gr1] = lse1;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float f = h == 0 ? inv0 : inv1;
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        // Columns [32 c, 32 c + 32) of the warpgroup's 256: groups 4 c .. 4 c + 3, 32 bytes of
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

// kEarlyRelease: a stage is handed back to the producer as soon as its PV is done (one wait per
// block); otherwise only once the next block's QK^T has been issued (PV overlaps that issue, but
// the refill of a stage then starts only after the next block has landed).
// kSkip (timing experiments only; results are wrong when non-zero): bit 0 skips the QK^T MMAs,
// bit 1 the PV MMAs, bit 2 the softmax arithmetic and the row-max exchange, bit 5 the KV loads (the
// producer completes each stage with no bytes: the consumers compute on what the stage held).
// kCluster == 2: the two CTAs of a cluster are consecutive M tiles of the same part, so
// they walk the same KV blocks: each issues half of every KV tile's pieces, multicast into both
// CTAs' shared memory, and a stage is refilled only once the consumers of both CTAs released it.
// kScoreN (16 or 32; 0: off), for q_len * num_heads <= kScoreN: the scores are computed
// transposed, S^T = K Q^T (M = the block's 64 tokens, N = kScoreN query rows), which avoids
// computing 64 - q_len * num_heads padded query rows in QK^T. Each consumer warpgroup contracts
// half of the 576 columns; it owns half of each thread's query rows (TransposedScores::OwnedRow),
// adds the other's partial S^T of those (shared memory), runs their softmax (maxima and sums over
// tokens reduced across its own four warps through its own shared buffer), writes their P and
// publishes their rescale factors, sums and maxima for the other (RowStats). PV is transposed
// too, O^T += V^T P^T (M = 64 of the warpgroup's 256 columns, four tiles; N = kScoreN rows), so
// the padded rows cost nothing there either and a thread's output rows are its query rows.
// 64-row tiles (kWg0Scores below): warpgroup 0 alone computes QK^T (N = 64, all 576 columns) and
// the softmax; its rows' rescale factors go to warpgroup 1 through shared memory (the half of
// row_max of the block's parity), P over the KV tile's rope chunk, so that one barrier per block
// hands both over and nothing warpgroup 0 writes for a block meets warpgroup 1's reads of the
// block before.
// Every path rescales the output only when a row's running maximum grows by more than
// 2^kLazyRescaleLog2 (NextRowMax).
// kSplitRelease (64-row tiles of the bf16 cache): warpgroup 0 leaves its PV in flight
// under the next block's QK^T, so a stage goes back to the producer in two parts: warpgroup 1
// releases the chunks from kWg0VChunks on (its V, and the rope chunk that holds P) once its PV is
// done, warpgroup 0 its V chunks once the next QK^T is issued and its PV is done; warpgroup 0's PV
// reads its own copy of P (the P tile), since the rope chunk may be refilled under it. With
// kCluster == 2 each part's release arrives on both CTAs' barriers, as a whole stage's does.
// kFp8: the cache is the fp8 cache. The producer stages raw cache rows; at each block the consumers
// convert them into the one bf16 KV tile, which QK^T and PV read.
// The latent values go into the tile times their group's scale, exact for the power-of-two scales
// write_kv writes (docs/fp8-cache.md); the rest is the bf16 cache's path.
//  - Transposed scores: each warpgroup converts the columns it reads in QK^T and PV (its two latent
//    groups and half the rope, ScoresFp8*), and both hand the stage back. Up to 16 query rows
//    (kScoreN 16) each thread also keeps its tokens' converted values as QK^T A fragments in
//    registers (LoadKFragments) and QK^T runs from them against the column-permuted query tile;
//    with 32 rows QK^T reads the tile (DequantiseRow).
//  - 64-row tiles (kScoreN 0): once both warpgroups' PV of the block before is done, warpgroup w
//    converts half w of the block (32 tokens, all columns) from its 32-token stage (HalfSlot);
//    once both halves are in the tile, warpgroup 0 scores the block as in the bf16 cache's 64-row
//    tiles (kWg0Scores), with P over the tile's rope chunk.
template <bool kEarlyRelease, int kSkip = 0, int kCluster = 1, int kScoreN = 0, bool kFp8 = false,
          bool kSplitRelease = false>
__global__ void __launch_bounds__(kThreads, 1)
DecodeKernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap kv_map,
             const DecodeKernelArgs args) {
  static_assert(kScoreN == 0 || (kEarlyRelease && kSkip == 0 && kCluster == 1),
                "transposed scores need early release, no experiment and no cluster");
  static_assert(!kFp8 || (kEarlyRelease && kSkip == 0 && kCluster == 1),
                "the fp8 cache needs early release, no experiment and no cluster");
  static_assert(!kFp8 || kScoreN == 0 || kScoreN <= kFp8TransposedRows,
                "the fp8 cache's transposed scores fit its query tile");
  using Layout = KernelSmemLayout<kFp8, kScoreN>;
  // 64-row tiles: warpgroup 0 computes the scores and the softmax of the whole block, both
  // warpgroups PV.
  constexpr bool kWg0Scores = kScoreN == 0 && kEarlyRelease;
  static_assert(kScoreN > 0 || Layout::kPTileBytes >= kConsumerThreads / 32 * detail::kBounceBytes,
                "each consumer warp's epilogue bounce slice fits the P tile");
  static_assert(!kSplitRelease || (kWg0Scores && !kFp8),
                "a stage is released in two parts only by the bf16 cache's 64-row tiles");
  static_assert(4 * kScoreN <= kConsumerWarpgroups * kBlockM,
                "a warpgroup's exchange buffer, f32 [4][kScoreN], must fit its 64 x 2 floats");
  using namespace detail;
  using Barrier = cutlass::arch::ClusterBarrier;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = SmemAddr(smem_raw);
  uint8_t* smem = smem_raw + ((kSmemAlign - (raw_addr & (kSmemAlign - 1))) & (kSmemAlign - 1));
  const Pipeline pipe = Pipeline::At<Layout>(smem);

  const DecodeParams& p = args.p;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int rows = p.q_len * p.num_heads;
  const int m_tiles = NumMTiles(p.q_len, p.num_heads);
  const int mtile = blockIdx.x % m_tiles;
  const int part = blockIdx.x / m_tiles;

  SetUpCta<kCluster, Layout, kSplitRelease>(smem, args.q_box_rows, tid);
  const uint32_t cta_rank = kCluster > 1 ? ClusterCtaRank() : 0;

  if (warp >= kConsumerThreads / 32) {
    // ---------------------------------------------------------------- producer warpgroup
    if constexpr (!kFp8 && kScoreN == 0) {
      if (p.batch <= kPrefetchMaxBatch && warp == kConsumerThreads / 32 + 1 && lane == 0) {
        PrefetchFirstKvBlocks(p, args.num_parts, part, mtile, m_tiles);
      }
    }
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    // Everything below reads inputs that earlier kernels in the stream may write.
    GridDependencyWait();
    GridDependencyLaunchDependents();
    if (warp == kConsumerThreads / 32 && lane == 0) {
      SegmentWalker walker(ScheduleView::Load(p, args.num_parts), part, p.seq_lens, p.max_pages,
                           p.page_size);
      ProduceTiles<kCluster, kFp8, Layout, (kSkip & 32) != 0, kSplitRelease>(
          q_map, kv_map, args, smem, walker, mtile, cta_rank);
    }
  } else {
  // ------------------------------------------------------------------ consumer warpgroups
  GridDependencyWait();
  GridDependencyLaunchDependents();
  SM90_TRACE(kTraceStart, 0);
  cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
  SegmentWalker walker(ScheduleView::Load(p, args.num_parts), part, p.seq_lens, p.max_pages,
                       p.page_size);
  Segment seg_info;
  // Warp-uniform as far as the compiler knows (broadcast from lane 0), so that the WGMMA
  // descriptors built from it stay in uniform registers.
  const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);
  const int wg_tid = tid % 128;
  const int r0 = Fragment::Row(wg_tid, 0);
  const int r1 = Fragment::Row(wg_tid, 1);
  const int gr0 = mtile * kBlockM + r0;
  const int gr1 = mtile * kBlockM + r1;
  const int quad_col = Fragment::Col(lane, 0, 0);
  float* row_max = reinterpret_cast<float*>(smem + Layout::kRowMax);
  float* row_sum = reinterpret_cast<float*>(smem + Layout::kRowSum);
  uint8_t* p_tile = smem + Layout::kP;
  const uint32_t q_addr = SmemAddr(smem + Layout::kQ);
  const uint32_t kv_addr0 = SmemAddr(smem + Layout::kKv);
  const uint32_t p_addr = SmemAddr(p_tile);
  const float sl2 = args.scale_log2;

  // Output accumulator of this warpgroup's 256 columns: O, 64 rows x 256 fp32 in one tile; with
  // transposed scores O^T, four tiles of 64 columns x kScoreN rows (fragment_layout.h).
  constexpr int kOTiles = kScoreN > 0 ? kNumVChunks / kConsumerWarpgroups : 1;
  constexpr int kOPerTile = kScoreN > 0 ? kScoreN / 2 : kLatentDim / kConsumerWarpgroups / 2;
  float o_tiles[kOTiles][kOPerTile];
  float (&o)[kOPerTile] = o_tiles[0];
  float s_acc[kBlockM * kHalfN / 128];            // 64 x 32 fp32 over 128 threads
  int it = 0, seg = 0;
  // Transposed scores (kScoreN > 0): a consumer thread holds tokens tok_a and tok_b of the block
  // for the query rows RowT(i), i < kRowsT; st is its part of S^T (64 x kScoreN)
  // (fragment_layout.h).
  constexpr int kRowsT = kScoreN > 0 ? kScoreN / 4 : 1;
  constexpr int kStN = kScoreN > 0 ? kScoreN / 2 : 1;
  // Warpgroup wg owns kOwnRowsT of a thread's rows (TransposedScores::OwnedRow): it completes
  // their scores (so, 2 kOwnRowsT values), runs their softmax (m_o, l_o) and writes their P; the
  // other warpgroup's rows' factors and statistics it reads from RowStats.
  constexpr int kOwnRowsT = kScoreN > 0 ? kRowsT / 2 : 1;
  constexpr int kOwnN = 2 * kOwnRowsT;
  static_assert(kScoreN % 16 == 0, "each warpgroup's values of a thread fill whole float4s");
  using QkT = TransposedMma<kScoreN == 16 ? 16 : 32, cute::SM90::GMMA::Major::K>;
  using PvT = TransposedMma<kScoreN == 16 ? 16 : 32, cute::SM90::GMMA::Major::MN>;
  using QkRs = RsMma<cute::bfloat16_t, kScoreN == 16 ? 16 : 32>;
  const int warp_in_wg = wg_tid / 32;
  const int tok_a = TransposedScores::Token(wg_tid, 0);
  const int tok_b = TransposedScores::Token(wg_tid, 1);
  auto RowT = [&](int i) { return TransposedScores::QueryRow(lane, i); };
  float st[kStN], so[kOwnN], m_o[kOwnRowsT], l_o[kOwnRowsT];
  int limit_o[kOwnRowsT];
  const int own_first = kScoreN > 0 ? TransposedScores::OwnedRow(wg, 0, kRowsT) : 0;
  float* const row_stats = kScoreN > 0 ? RowStats<kScoreN, kFp8>(smem) : nullptr;
  const int stats_q = lane % 4;
  // This warpgroup's exchange buffer for reductions across its warps: f32 [4][kScoreN].
  float* wg_exchange =
      reinterpret_cast<float*>(smem + (wg == 0 ? Layout::kRowMax : Layout::kRowSum));
  // fp8 cache, 64-row tiles: the (row, part) this thread converts (DequantiseRow).
  const int half_row = wg * kHalfN + wg_tid % kHalfN;
  const int half_part = wg_tid / kHalfN;
  // kSplitRelease: the stage whose V chunks warpgroup 0's PV, still in flight, reads (-1: none).
  int v0_pending = -1;

  while (walker.Next(seg_info)) {
    SM90_TRACE(kTraceSegment, seg_info.b);
    // Query token of row r is r / num_heads; it sees kv positions [0, len - q_len + token].
    const int limit0 = gr0 < rows ? seg_info.len - p.q_len + gr0 / p.num_heads : -1;
    const int limit1 = gr1 < rows ? seg_info.len - p.q_len + gr1 / p.num_heads : -1;
    float m0 = kNegInf, m1 = kNegInf, l0 = 0.f, l1 = 0.f;
#pragma unroll
    for (int t = 0; t < kOTiles; ++t) {
#pragma unroll
      for (int i = 0; i < kOPerTile; ++i) o_tiles[t][i] = 0.f;
    }
#pragma unroll
    for (int k = 0; k < kOwnRowsT; ++k) {
      const int row = RowT(own_first + k);
      limit_o[k] = row < rows ? seg_info.len - p.q_len + row / p.num_heads : -1;
      m_o[k] = kNegInf;
      l_o[k] = 0.f;
    }

    Barrier::wait(pipe.QFull(), seg & 1);
    SM90_TRACE(kTraceQuery, 0);
    if constexpr (kFp8 && kScoreN == 16) {
      PermuteQueryColumns<Layout::kQChunkRows>(smem + Layout::kQ, tid);
      cutlass::arch::fence_view_async_shared();
      ConsumerSync();
    }

    // A block's table entries are read while the block before it is computed, so that no
    // dependent global load sits between a block's start and its stage's wait.
    BlockLoad load{};
    if (seg_info.kv_begin < seg_info.kv_end) load = BlockLoad::Of(p, seg_info, seg_info.kv_begin);
    for (int k = seg_info.kv_begin; k < seg_info.kv_end; ++k, ++it) {
      const int stage = it % kStages;  // with half stages (kFp8, kScoreN 0) see HalfSlot
      BlockPages next = {{-1, -1}};
      if (k + 1 < seg_info.kv_end) next = BlockPages::Read(p, seg_info, k + 1);
      if (!Layout::kHalfStages) Barrier::wait(pipe.Full(stage), (it / kStages) & 1);
      // With kSplitRelease warpgroup 1 reads warpgroup 0's V chunks only to zero unloaded rows.
      if (kSplitRelease && (wg == 0 || !load.Complete())) {
        Barrier::wait(pipe.V0Full(stage), (it / kStages) & 1);
      }
      SM90_TRACE(kTraceBlockReady, k);
      const uint32_t kv_addr = kv_addr0 + (kFp8 ? 0 : stage * kTileBytes);
      const int token_base = k * kBlockN;
      const bool half_ok0 = load.half_ok[0];
      const bool half_ok1 = load.half_ok[1];
      KFragments frag;  // fp8 cache, up to 16 rows: the block's keys as QK^T's A operand
      if constexpr (kFp8 && kScoreN == 0) {
        // Both warpgroups' PV of the previous block are done with the bf16 tile. Warpgroup wg
        // converts half wg of the block (its own QK^T's tokens) from that half's stage, and each
        // thread hands the stage back after its reads; the fence orders the stage's reads before
        // its refill (async proxy) and the tile's writes before QK^T's WGMMAs.
        ConsumerSync();
        const HalfSlot slot = HalfSlot::Of<Layout>(it, wg);
        Barrier::wait(pipe.Full(slot.index), slot.round & 1);
        DequantiseRow(smem + Layout::kFp8Stages + slot.index * kFp8HalfStageBytes +
                          (wg_tid % kHalfN) * kFp8RowBytes,
                      load.RowLoaded(half_row), half_part, smem + Layout::kKv, half_row);
        cutlass::arch::fence_view_async_shared();
        ReleaseStage<kCluster>(pipe, slot.index);
        ConsumerSync();  // warpgroup 0's QK^T reads both halves
      } else if constexpr (kFp8) {
        // The warpgroup's PV of the previous block is done with its columns of the bf16 tile. Its
        // new values are fenced for the WGMMAs before the warpgroup barrier where QK^T reads them
        // (32 rows), else by the fence before PV.
        const uint8_t* staged = smem + Layout::kFp8Stages + stage * kFp8StageBytes;
        WarpgroupSync(wg);
        if constexpr (kScoreN == 16) {
          LoadKFragments(staged, smem + Layout::kKv, load, wg, wg_tid, frag);
        } else {
          const int row = wg_tid % kBlockN;
          const int part = 2 * wg + wg_tid / kBlockN;
          DequantiseRow<8>(staged + row * kFp8RowBytes, load.RowLoaded(row), part,
                           smem + Layout::kKv, row);
        }
        if constexpr (kScoreN != 16) cutlass::arch::fence_view_async_shared();
        WarpgroupSync(wg);
        if (wg_tid == 0) ReleaseStage<kCluster>(pipe, stage);
      } else if (!load.Complete()) {
        ZeroUnloadedRows(smem + Layout::kKv + stage * kTileBytes, load, tid);
        cutlass::arch::fence_view_async_shared();
        ConsumerSync();
      }
      // kWg0Scores: P of the block goes over the rope chunk of its KV tile (the stage's, or the
      // fp8 cache's one bf16 tile's; only warpgroup 0's QK^T reads it), and the rows' factors into
      // the half of row_max of the block's parity, so that what warpgroup 0 writes for a block
      // never meets warpgroup 1's reads of the block before.
      uint8_t* const p_block = kWg0Scores ? smem + Layout::kKv + (kFp8 ? 0 : stage * kTileBytes) +
                                                kNumVChunks * kChunkBytes
                                          : p_tile;

      float alpha_o[kOwnRowsT];  // transposed scores: the owned rows' rescale factors
      if constexpr (kScoreN > 0) {
        // S^T = K Q^T for the block's 64 tokens: warpgroup w contracts its half of the 576
        // columns (with the fp8 cache: its two latent groups and half the rope), hands the other
        // warpgroup its partial sums of that one's rows and adds the other's of its own (shared
        // memory).
        if constexpr (kFp8 && kScoreN == 16) {
          ScoresFp8Registers<QkRs, Layout::kQChunkBytes>(frag, q_addr, wg, st);
        } else if constexpr (kFp8) {
          ScoresFp8Smem<QkT, Layout::kQChunkBytes>(kv_addr, q_addr, wg, st);
        } else {
          FenceRegisters(st);
          cute::warpgroup_arrive();
          const uint64_t kv_desc = KMajorDesc(kv_addr), q_desc = KMajorDesc(q_addr);
#pragma unroll
          for (int s = 0; s < kQkStepsPerWarpgroup; ++s) {
            const int g = wg * kQkStepsPerWarpgroup + s;
            Gmma<QkT>(DescAdd(kv_desc, QkStepOffset(g)),
                      DescAdd(q_desc, QkStepOffset<Layout::kQChunkBytes>(g)), st, s != 0);
          }
          cute::warpgroup_commit_batch();
          cute::warpgroup_wait<0>();
          FenceRegisters(st);
        }
        SM90_TRACE(kTraceScoresDone, k);
        if (k == seg_info.kv_end - 1 && wg_tid == 0) Barrier::arrive(pipe.QEmpty());
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
        // Masked online softmax of the owned rows over tokens: maxima over the thread's two
        // tokens, the eight lanes sharing its query rows, then the warpgroup's four warps.
        const bool half_ok = tok_a < kHalfN ? half_ok0 : half_ok1;
        const int ta = token_base + tok_a, tb = token_base + tok_b;
        float mx[kOwnRowsT];
#pragma unroll
        for (int k = 0; k < kOwnRowsT; ++k) {
          const int ea = TransposedScores::Element(k, 0), eb = TransposedScores::Element(k, 1);
          const float a = (half_ok && ta <= limit_o[k]) ? so[ea] : kNegInf;
          const float b = (half_ok && tb <= limit_o[k]) ? so[eb] : kNegInf;
          so[ea] = a;
          so[eb] = b;
          mx[k] = fmaxf(a, b);
#pragma unroll
          for (int d = 4; d < 32; d <<= 1) {
            mx[k] = fmaxf(mx[k], __shfl_xor_sync(0xffffffffu, mx[k], d));
          }
        }
        if (lane < 4) {
#pragma unroll
          for (int k = 0; k < kOwnRowsT; ++k) {
            wg_exchange[warp_in_wg * kScoreN + RowT(own_first + k)] = mx[k];
          }
        }
        WarpgroupSync(wg);
        UpdateRowsSoftmax<kOwnRowsT, kScoreN>(wg_exchange, lane, sl2, so, m_o, l_o, alpha_o,
                                              own_first);
        // The owned rows' factors for the other warpgroup, which reads them after the barrier
        // before PV; the next block writes them only after its exchange barrier, which the other
        // warpgroup reaches only after reading these.
        if (warp_in_wg == 0 && lane < 4) {
#pragma unroll
          for (int k = 0; k < kOwnRowsT; ++k) {
            row_stats[stats_q * kRowsT + own_first + k] = alpha_o[k];
          }
        }
        // Both warpgroups are past the previous block's PV (each waited for its own at the end of
        // that block, kEarlyRelease, before the exchange barrier above): P can be rewritten.
#pragma unroll
        for (int k = 0; k < kOwnRowsT; ++k) {
          const int row = RowT(own_first + k);
          *reinterpret_cast<__nv_bfloat16*>(p_tile + SwizzledOffset(row, tok_a)) =
              __float2bfloat16_rn(so[TransposedScores::Element(k, 0)]);
          *reinterpret_cast<__nv_bfloat16*>(p_tile + SwizzledOffset(row, tok_b)) =
              __float2bfloat16_rn(so[TransposedScores::Element(k, 1)]);
        }
      } else if constexpr (kWg0Scores) {
        // Warpgroup 0 computes the block's scores S = Q K^T (all 64 tokens, N = 64) and its
        // softmax, writes P and the rows' rescale factors; warpgroup 1 waits for them, rescales its
        // half of O, and both run PV.
        float* row_alpha = row_max + (it & 1) * kBlockM;  // f32 [64]: the block's row factors
        if (wg == 0) {
          float s_full[kBlockM * kBlockN / 128];
          FenceRegisters(s_full);
          cute::warpgroup_arrive();
          if (kSkip & 1) {
#pragma unroll
            for (int i = 0; i < 32; ++i) s_full[i] = 0.f;
          }
          const uint64_t q_desc = KMajorDesc(q_addr), k_desc = KMajorDesc(kv_addr);
#pragma unroll
          for (int g = 0; g < ((kSkip & 1) ? 0 : kQkSteps); ++g) {
            Gmma<QkMma64>(DescAdd(q_desc, QkStepOffset(g)), DescAdd(k_desc, QkStepOffset(g)),
                          s_full, g != 0);
          }
          cute::warpgroup_commit_batch();
          if (kSplitRelease && v0_pending >= 0) {
            // The previous block's PV, issued before this QK^T, is done with its V chunks.
            cute::warpgroup_wait<1>();
            if (wg_tid == 0) ReleaseBarrier<kCluster>(pipe.V0Empty(v0_pending));
            v0_pending = -1;
          }
          cute::warpgroup_wait<0>();
          FenceRegisters(s_full);
          FenceRegisters(o);
          SM90_TRACE(kTraceScoresDone, k);
          if (k == seg_info.kv_end - 1 && wg_tid == 0) Barrier::arrive(pipe.QEmpty());
          // Masked online softmax of rows r0 (elements 4 j + e) and r1 (4 j + 2 + e); element
          // (j, e) is token 8 j + quad_col + e of the block.
          float alpha0 = 1.f, alpha1 = 1.f;
          float sum0 = 0.f, sum1 = 0.f;
          uint32_t p_packed[2][8];  // P of rows r0, r1 x tokens 0-31 and 32-63, bf16 pairs
          if (kSkip & 4) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              p_packed[j / 4][2 * (j % 4)] = PackBf16x2(s_full[4 * j], s_full[4 * j + 1]);
              p_packed[j / 4][2 * (j % 4) + 1] =
                  PackBf16x2(s_full[4 * j + 2], s_full[4 * j + 3]);
            }
            sum0 = sum1 = 1.f;
            m0 = m1 = 0.f;
          } else {
            float mx0, mx1;
            const bool visible = half_ok0 && half_ok1 &&
                                 token_base + kBlockN - 1 <= min(limit0, limit1);
            MaskRows<kBlockN / 8>(s_full, token_base + quad_col,
                                  [&](int j) { return j < kHalfN / 8 ? half_ok0 : half_ok1; },
                                  limit0, limit1, visible, mx0, mx1);
            SoftmaxRows<kBlockN / 8>(s_full, mx0, mx1, sl2, m0, m1, alpha0, alpha1, sum0, sum1,
                                     p_packed);
          }
          StoreWarpTile16x32(p_block, r0 - lane / 4, 0, lane, p_packed[0]);
          StoreWarpTile16x32(p_block, r0 - lane / 4, kHalfN, lane, p_packed[1]);
          if (kSplitRelease) {
            // Warpgroup 0's own copy of P: its PV is still reading it after warpgroup 1 has
            // released the rope chunk.
            StoreWarpTile16x32(p_tile, r0 - lane / 4, 0, lane, p_packed[0]);
            StoreWarpTile16x32(p_tile, r0 - lane / 4, kHalfN, lane, p_packed[1]);
          }
          if ((lane & 3) == 0) {
            row_alpha[r0] = alpha0;
            row_alpha[r1] = alpha1;
          }
          l0 = l0 * alpha0 + sum0;
          l1 = l1 * alpha1 + sum1;
          if (__any_sync(0xffffffffu, alpha0 != 1.f || alpha1 != 1.f)) {
            RescaleRows(o, alpha0, alpha1);
          }
        } else if (k == seg_info.kv_end - 1 && wg_tid == 0) {
          Barrier::arrive(pipe.QEmpty());  // warpgroup 1 never reads the query tile
        }
        cutlass::arch::fence_view_async_shared();
        ConsumerSync();
        if (wg == 1) {
          const float alpha0 = row_alpha[r0], alpha1 = row_alpha[r1];
          // No PV of warpgroup 1 is in flight here; the wait tells ptxas so (with kSplitRelease
          // warpgroup 0's is, on a path it cannot tell apart).
          if (kSplitRelease) cute::warpgroup_wait<0>();
          FenceRegisters(o);
          if (__any_sync(0xffffffffu, alpha0 != 1.f || alpha1 != 1.f)) {
            RescaleRows(o, alpha0, alpha1);
          }
        }
      } else {
      // S = Q K^T for this warpgroup's 32 tokens.
      FenceRegisters(s_acc);
      cute::warpgroup_arrive();
      if (kSkip & 1) {
#pragma unroll
        for (int i = 0; i < 16; ++i) s_acc[i] = 0.f;
      }
      const uint64_t q_desc = KMajorDesc(q_addr);
      const uint64_t k_desc = KMajorDesc(kv_addr + wg * kHalfN * kRowBytes);
#pragma unroll
      for (int c = 0; c < ((kSkip & 1) ? 0 : kNumChunks); ++c) {
#pragma unroll
        for (int kk = 0; kk < kChunkCols / 16; ++kk) {
          const uint32_t offset = c * kChunkBytes + kk * 32;
          Gmma<QkMma>(DescAdd(q_desc, offset), DescAdd(k_desc, offset), s_acc, (c | kk) != 0);
        }
      }
      cute::warpgroup_commit_batch();
      if (!kEarlyRelease && k > seg_info.kv_begin) {
        // The previous block's PV is done: its stage can be refilled.
        cute::warpgroup_wait<1>();
        if (wg_tid == 0) ReleaseStage<kCluster>(pipe, (it + kStages - 1) % kStages);
      }
      cute::warpgroup_wait<0>();
      FenceRegisters(s_acc);
      FenceRegisters(o);
      SM90_TRACE(kTraceScoresDone, k);
      if (k == seg_info.kv_end - 1 && wg_tid == 0) Barrier::arrive(pipe.QEmpty());

      // Masked online softmax; row maxima shared between the two warpgroups.
      if (kSkip & 4) {
#pragma unroll
        for (int j = 0; j < kHalfN / 8; ++j) {
          const int col = wg * kHalfN + 8 * j + quad_col;
          *reinterpret_cast<uint32_t*>(p_tile + SwizzledOffset(r0, col)) =
              PackBf16x2(s_acc[4 * j], s_acc[4 * j + 1]);
          *reinterpret_cast<uint32_t*>(p_tile + SwizzledOffset(r1, col)) =
              PackBf16x2(s_acc[4 * j + 2], s_acc[4 * j + 3]);
        }
        l0 = 1.f;
        l1 = 1.f;
        m0 = 0.f;
        m1 = 0.f;
      } else {
      const bool half_ok = wg == 0 ? half_ok0 : half_ok1;
      float mx0, mx1;
      const int half_base = token_base + wg * kHalfN;
      MaskRows<kHalfN / 8>(s_acc, half_base + quad_col, [&](int) { return half_ok; }, limit0,
                           limit1, half_ok && half_base + kHalfN - 1 <= min(limit0, limit1), mx0,
                           mx1);
      if ((lane & 3) == 0) {
        row_max[wg * kBlockM + r0] = mx0;
        row_max[wg * kBlockM + r1] = mx1;
      }
      ConsumerSync();
      mx0 = fmaxf(mx0, row_max[(wg ^ 1) * kBlockM + r0]);
      mx1 = fmaxf(mx1, row_max[(wg ^ 1) * kBlockM + r1]);
      float alpha0, alpha1, sum0, sum1;
      uint32_t p_packed[1][8];  // P of rows r0, r1 x the thread's tokens, bf16 pairs
      SoftmaxRows<kHalfN / 8>(s_acc, mx0, mx1, sl2, m0, m1, alpha0, alpha1, sum0, sum1, p_packed);
      StoreWarpTile16x32(p_tile, r0 - lane / 4, wg * kHalfN, lane, p_packed[0]);
      l0 = l0 * alpha0 + sum0;
      l1 = l1 * alpha1 + sum1;
      if (__any_sync(0xffffffffu, alpha0 != 1.f || alpha1 != 1.f)) RescaleRows(o, alpha0, alpha1);
      }
      }  // kScoreN == 0
      if constexpr (!kWg0Scores) {
        cutlass::arch::fence_view_async_shared();
        ConsumerSync();
      }
      SM90_TRACE(kTracePStored, k);

      if constexpr (kScoreN > 0) {
        // O^T's columns are query rows laid out as S^T's: this thread's rows are its own, half of
        // them owned by the other warpgroup, whose factors it published before the barrier.
        float alpha[kRowsT];
        bool rescale = false;
#pragma unroll
        for (int i = 0; i < kRowsT; ++i) {
          alpha[i] = RowValue<kRowsT>(wg, i, alpha_o, row_stats, stats_q);
          rescale |= alpha[i] != 1.f;
        }
#pragma unroll
        for (int t = 0; t < kOTiles; ++t) FenceRegisters(o_tiles[t]);
        if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
          for (int t = 0; t < kOTiles; ++t) {
#pragma unroll
            for (int i = 0; i < kRowsT; ++i) {
              o_tiles[t][TransposedScores::Element(i, 0)] *= alpha[i];
              o_tiles[t][TransposedScores::Element(i, 1)] *= alpha[i];
            }
          }
        }
        // O^T[64 t : 64 t + 64 of this warpgroup's columns, rows] += V^T P^T over the 64 tokens.
#pragma unroll
        for (int t = 0; t < kOTiles; ++t) FenceRegisters(o_tiles[t]);
        cute::warpgroup_arrive();
        const uint64_t v_desc = MNMajorDesc(kv_addr + wg * kOTiles * kChunkBytes);
        const uint64_t p_desc = KMajorDesc(p_addr);
#pragma unroll
        for (int kk = 0; kk < kBlockN / 16; ++kk) {
#pragma unroll
          for (int t = 0; t < kOTiles; ++t) {
            Gmma<PvT>(DescAdd(v_desc, t * kChunkBytes + kk * 16 * kRowBytes),
                      DescAdd(p_desc, kk * 32), o_tiles[t], true);
          }
        }
      } else {
      // O[:, 256 wg : 256 wg + 256] += P V over the 64 tokens of the tile.
      FenceRegisters(o);
      cute::warpgroup_arrive();
      const uint64_t p_desc = KMajorDesc(SmemAddr(kSplitRelease && wg == 0 ? p_tile : p_block));
      const uint64_t v_desc = MNMajorDesc(kv_addr + wg * (kNumVChunks / 2) * kChunkBytes);
#pragma unroll
      for (int kk = 0; kk < ((kSkip & 2) ? 0 : kBlockN / 16); ++kk) {
        Gmma<PvMma>(DescAdd(p_desc, kk * 32), DescAdd(v_desc, kk * 16 * kRowBytes), o, true);
      }
      }  // kScoreN == 0
      cute::warpgroup_commit_batch();
      if (kSplitRelease && wg == 0) {
        v0_pending = stage;  // its PV runs on under the next block's QK^T
      } else if (kEarlyRelease) {
        cute::warpgroup_wait<0>();
        if (!kFp8 && wg_tid == 0) ReleaseStage<kCluster>(pipe, stage);
      }
      SM90_TRACE(kTraceBlockDone, k);
      load = BlockLoad::Of(p, seg_info, k + 1, next);
    }
    cute::warpgroup_wait<0>();
    if (kSplitRelease && v0_pending >= 0) {
      if (wg_tid == 0) ReleaseBarrier<kCluster>(pipe.V0Empty(v0_pending));
      v0_pending = -1;
    }
#pragma unroll
    for (int t = 0; t < kOTiles; ++t) FenceRegisters(o_tiles[t]);
    if (!kEarlyRelease && wg_tid == 0) ReleaseStage<kCluster>(pipe, (it + kStages - 1) % kStages);
    SM90_TRACE(kTraceStoreBegin, seg_info.whole);

    if constexpr (kScoreN > 0) {
      // Each warpgroup's owned rows' sums and maxima, published for the other.
      float l_own[kOwnRowsT];
      SumRowsOverWarpgroup<kOwnRowsT, kScoreN>(l_o, wg_exchange, warp_in_wg, lane, wg, l_own,
                                               own_first);
      float* const sums = row_stats + kScoreN;
      float* const maxima = row_stats + 2 * kScoreN;
      if (warp_in_wg == 0 && lane < 4) {
#pragma unroll
        for (int k = 0; k < kOwnRowsT; ++k) {
          sums[stats_q * kRowsT + own_first + k] = l_own[k];
          maxima[stats_q * kRowsT + own_first + k] = m_o[k];
        }
      }
      ConsumerSync();  // also frees this warpgroup's exchange buffer for the next segment
      float l[kRowsT], m[kRowsT];
#pragma unroll
      for (int i = 0; i < kRowsT; ++i) {
        l[i] = RowValue<kRowsT>(wg, i, l_own, sums, stats_q);
        m[i] = RowValue<kRowsT>(wg, i, m_o, maxima, stats_q);
      }
      StoreTransposed<kScoreN>(p, seg_info, part, args.num_parts, rows, wg, wg_tid, o_tiles, l,
                               m, sl2);
    } else {
    StorePlain(p, seg_info, part, args.num_parts, rows, wg, lane, r0, gr0, gr1, o, l0, l1, m0, m1,
               sl2, args.bf16_partials, row_sum, p_tile + warp * kBounceBytes);
    }  // kScoreN == 0
    SM90_TRACE(kTraceStoreEnd, 0);
    ++seg;
  }
  SM90_TRACE(kTraceEnd, 0);
  }
  // The peer may still multicast into this CTA or arrive on its barriers until it is done.
  if (kCluster > 1) ClusterSync();
}

}  // namespace sm90
}  // namespace jax_mla
