// The WGMMA instructions the decode kernels issue (CuTe's wrappers, operands from shared memory or
// A from registers), the QK^T k steps of a 576-wide row, and the PV products of a block.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>

#include <cute/arch/mma_sm90.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

#include "decode_params.h"
#include "smem_layout.cuh"

namespace jax_mla {
namespace sm90 {
namespace detail {

using QkMma = cute::SM90::GMMA::MMA_64x32x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K,
                                                             cute::SM90::GMMA::Major::K>;
using QkMma64 = cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K,
                                                               cute::SM90::GMMA::Major::K>;
// PV of the 64-row tiles on a warpgroup's 256 output columns, or 128 with column halves.
template <int kColumns>
using PvMma = decltype(cute::SM90::GMMA::ss_op_selector<
                       cute::bfloat16_t, cute::bfloat16_t, float,
                       cute::Shape<cute::_64, cute::Int<kColumns>, cute::_16>,
                       cute::SM90::GMMA::Major::K, cute::SM90::GMMA::Major::MN>());
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

// DecodeKernel's transposed scores: issues O^T[64 t : 64 t + 64 of warpgroup wg's columns, rows]
// += V^T P^T over the block's 64 tokens (V^T read MN-major from the KV tile at kv_addr, P^T from
// the P tile at p_addr): fences the accumulators and arrives; the caller commits and waits.
template <int kOTiles, int kOPerTile>
__device__ __forceinline__ void IssueTransposedPv(float (&o_tiles)[kOTiles][kOPerTile],
                                                  uint32_t kv_addr, uint32_t p_addr, int wg) {
  using PvT = TransposedMma<2 * kOPerTile, cute::SM90::GMMA::Major::MN>;
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
}

// The 64-row tiles: the WGMMAs of O[:, C col_block : C col_block + C] += P V over a block's
// kTokens tokens, C = 2 N output columns (a warpgroup's 64 x C accumulator o: 256 columns, or 128
// with column halves; V read MN-major from the KV tile at kv_addr, whose chunks hold kTokens rows;
// P at p_addr, K-major: 128-byte rows for 64 tokens, 64-byte rows for the seesaw's 32), inside the
// caller's arrive and commit (chained on an accumulator whose WGMMAs may still be in flight).
// kSkipPv (a timing experiment) issues none.
template <bool kSkipPv, int kTokens = kBlockN, int N>
__device__ __forceinline__ void PvMmas(float (&o)[N], uint32_t kv_addr, uint32_t p_addr,
                                       int col_block) {
  static_assert(kTokens == kBlockN || kTokens == kBlockN / 2, "64- or 32-token blocks");
  static_assert(N == 128 || N == 64, "256 or 128 output columns");
  constexpr int kTileChunkBytes = kTokens * kRowBytes;
  constexpr int kChunksPerBlock = 2 * N / kChunkCols;
  const uint64_t p_desc = kTokens == kBlockN ? KMajorDesc(p_addr) : KMajorDesc64B(p_addr);
  const uint64_t v_desc =
      MNMajorDesc<kTileChunkBytes>(kv_addr + col_block * kChunksPerBlock * kTileChunkBytes);
#pragma unroll
  for (int kk = 0; kk < (kSkipPv ? 0 : kTokens / 16); ++kk) {
    Gmma<PvMma<2 * N>>(DescAdd(p_desc, kk * 32), DescAdd(v_desc, kk * 16 * kRowBytes), o, true);
  }
}

// PvMmas after fencing the accumulator and arriving (no WGMMA of it in flight); the caller commits
// and waits.
template <bool kSkipPv, int kTokens = kBlockN, int N>
__device__ __forceinline__ void IssuePv(float (&o)[N], uint32_t kv_addr, uint32_t p_addr,
                                        int col_block) {
  FenceRegisters(o);
  cute::warpgroup_arrive();
  PvMmas<kSkipPv, kTokens>(o, kv_addr, p_addr, col_block);
}

}  // namespace detail
}  // namespace sm90
}  // namespace jax_mla
