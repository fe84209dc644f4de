// The fp8 cache at 17-32 query rows with both MMAs' cache operands in registers
// (DecodeFp8SplitKernel; docs/fp8-cache.md, "17-32 rows: the split register-operand kernel").
//
// DecodeFp8RegsKernel's operands (raw stages, keys and V^T converted e4m3 -> f16 in registers, the
// group scales outside the operands, the f16 query in units of a power of two per row), but at
// N = 32 query rows a warpgroup's state for a whole block (scores per latent group, O^T over all
// 512 columns) does not fit beside the fragments, so the two consumer warpgroups share every block
// instead of taking alternate ones:
//  - warpgroup w scores the block over latent groups 2w and 2w + 1 and rope k steps 2w and 2w + 1
//    (S^T, M = 64 tokens, N = 32 rows), weighs its part with the tokens' group scales and the rows'
//    query scales, and the two add each other's part through shared memory (one named barrier a
//    block; the exchange buffers alternate with the block's parity). fp32 addition of two terms
//    commutes, so both hold the same scores, bit for bit, and run the same online softmax;
//  - warpgroup w writes P of its two groups and computes O^T for their 256 output columns, so a
//    segment ends without a merge;
//  - a ring of three raw 64-token stages, each released by the 256 threads that read it.
// Safety as DecodeKernel: rows of a block past the length or in a page not loaded are zeroed in
// the stage before any read, and their scores masked by select.
#pragma once

#include "decode_fp8_regs_kernel.cuh"

namespace jax_mla {
namespace sm90 {

// Shared memory of DecodeFp8SplitKernel, byte offsets from the 1024-aligned base: the query tile
// (32 rows, nine 128-byte-swizzled chunks: eight f16 latent, one bf16 rope), the ring of raw
// 64-token stages, each warpgroup's two P tiles (f16 [32 rows][64 tokens], K-major), the score
// exchange (per block parity and warpgroup, one float4 slot of 128 threads per four scores), the
// warpgroups' reduction buffers, the query rows' scales and the barriers.
struct Fp8SplitSmemLayout {
  static constexpr bool kHalfStages = false;
  static constexpr bool kEveryThreadReleases = true;
  static constexpr int kReleasingThreads = kConsumerThreads;  // both warpgroups read each stage
  static constexpr int kStageSlots = 3;
  static constexpr int kQChunkRows = kFp8TransposedRows;
  static constexpr int kQChunkBytes = kQChunkRows * kRowBytes;
  static constexpr int kGroupsPerWarpgroup = kFp8ScaleGroups / kConsumerWarpgroups;
  static constexpr int kQ = 0;
  static constexpr int kFp8Stages = kQ + kNumChunks * kQChunkBytes;
  static constexpr int kKv = kFp8Stages;  // no bf16 tile (ProduceTiles' bf16 branch names it)
  static constexpr int kPTileBytes = kQChunkRows * kRowBytes;
  static constexpr int kP = (kFp8Stages + kStageSlots * kFp8StageBytes + 1023) / 1024 * 1024;
  static constexpr int kExchange = kP + kFp8ScaleGroups * kPTileBytes;
  static constexpr int kExchangeSlots = kQChunkRows / 8;  // float4 slots per thread and block
  static constexpr int kReduce = kExchange + 2 * kConsumerWarpgroups * kExchangeSlots * 128 * 16;
  // Per warpgroup: f32 [4 warps][64]: 32 row maxima or sums, then its groups' scale maxima.
  static constexpr int kReduceStride = 64;
  static constexpr int kReduceFloats = 4 * kReduceStride;
  static constexpr int kRowScale = kReduce + kConsumerWarpgroups * kReduceFloats * 4;
  static constexpr int kBarriers = (kRowScale + kQChunkRows * 4 + 7) / 8 * 8;
  static constexpr int kNumBarriers = 2 + 2 * kStageSlots;
  static constexpr int kUsed = kBarriers + kNumBarriers * 8;
  static constexpr int kBytes = kUsed + kSmemAlign;
  static_assert(kBytes <= kMaxSmemBytes, "exceeds the 227 KB per-block shared memory of SM90");
  static_assert(kFp8Stages % 1024 == 0 && kP % 1024 == 0,
                "swizzled tiles need 1024-byte alignment");
  static_assert(kGroupsPerWarpgroup == 2, "each warpgroup scores two latent groups");
};

namespace detail {

// Slot v (four scores a thread) of warpgroup w's part of the scores of a block of parity `parity`.
__device__ __forceinline__ float4* SplitScoreSlot(uint8_t* smem, int parity, int w, int v,
                                                  int wg_tid) {
  using Layout = Fp8SplitSmemLayout;
  return reinterpret_cast<float4*>(smem + Layout::kExchange) +
         ((parity * kConsumerWarpgroups + w) * Layout::kExchangeSlots + v) * 128 + wg_tid;
}

}  // namespace detail

// fp8 cache, 17-32 query rows (q_len * num_heads in (16, 32]), one M tile: see the top of this
// file.
__global__ void __launch_bounds__(kThreads, 1)
DecodeFp8SplitKernel(const __grid_constant__ CUtensorMap q_map,
                     const __grid_constant__ CUtensorMap kv_map,
                     const DecodeKernelArgs args) {
  using Layout = Fp8SplitSmemLayout;
  using namespace detail;
  RunRegsCta<Layout>(q_map, kv_map, args, [&](uint8_t* smem, const Pipeline& pipe,
                                              SegmentWalker& walker) {
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr int kN = Layout::kQChunkRows;
  constexpr int kRowsT = kN / 4;  // query rows per thread
  constexpr int kGroupsW = Layout::kGroupsPerWarpgroup;
  constexpr int kRopeStepsW = kRopeDim / 16 / kConsumerWarpgroups;
  constexpr int kStride = Layout::kReduceStride;
  const DecodeParams& p = args.p;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int part = blockIdx.x;
  const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);
  const int wg_tid = tid % 128;
  const int warp_in_wg = wg_tid / 32;
  const int group0 = kGroupsW * wg;  // this warpgroup's first latent group
  const float sl2 = args.scale_log2;
  const uint32_t q_addr = SmemAddr(smem + Layout::kQ);
  const uint32_t stages_addr = SmemAddr(smem + Layout::kFp8Stages);
  const uint32_t p_addr = SmemAddr(smem + Layout::kP + group0 * Layout::kPTileBytes);
  float* const reduce =
      reinterpret_cast<float*>(smem + Layout::kReduce) + wg * Layout::kReduceFloats;
  // A thread's tokens of a block (rows of S^T) and query rows (columns), as in DecodeKernel's
  // transposed path.
  const int tok[2] = {TransposedScores::Token(wg_tid, 0), TransposedScores::Token(wg_tid, 1)};
  auto RowT = [&](int i) { return TransposedScores::QueryRow(lane, i); };

  float o[2 * kGroupsW][kN / 2];
  Segment seg_info;
  int it = 0, seg = 0;
  while (walker.Next(seg_info)) {
    SM90_TRACE(kTraceSegment, seg_info.b);
    float r_g[kGroupsW];  // running maximum |scale| of this warpgroup's groups (0: none yet)
#pragma unroll
    for (int g = 0; g < kGroupsW; ++g) r_g[g] = 0.f;
#pragma unroll
    for (int t = 0; t < 2 * kGroupsW; ++t) {
#pragma unroll
      for (int e = 0; e < kN / 2; ++e) o[t][e] = 0.f;
    }
    float m_t[kRowsT], l_t[kRowsT], q_scale[kRowsT];
    int limit_t[kRowsT];
    StartRegsSegment<Layout>(pipe, smem, p, seg_info, seg, tid, lane, m_t, l_t, limit_t, q_scale);

    // A block's table entries are read while the block before it is computed.
    BlockLoad load{};
    if (seg_info.kv_begin < seg_info.kv_end) load = BlockLoad::Of(p, seg_info, seg_info.kv_begin);
    for (int k = seg_info.kv_begin; k < seg_info.kv_end; ++k, ++it) {
      BlockLoad next = load;
      if (k + 1 < seg_info.kv_end) next = BlockLoad::Of(p, seg_info, k + 1);
      const int stage = it % Layout::kStageSlots;
      uint8_t* const staged = smem + Layout::kFp8Stages + stage * kFp8StageBytes;
      const uint32_t staged_addr = stages_addr + stage * kFp8StageBytes;
      Barrier::wait(pipe.Full(stage), (it / Layout::kStageSlots) & 1);
      SM90_TRACE(kTraceBlockReady, k);
      if (!load.Complete()) {
        ZeroUnloadedRawRows<kConsumerThreads>(staged, load, tid);
        cutlass::arch::fence_view_async_shared();
        ConsumerSync();
      }
      float sc[2][kGroupsW];  // the thread's tokens' scales of this warpgroup's groups
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float4 s4 =
            *reinterpret_cast<const float4*>(staged + tok[h] * kFp8RowBytes + kFp8ScalesOffset);
        sc[h][0] = wg == 0 ? s4.x : s4.z;
        sc[h][1] = wg == 0 ? s4.y : s4.w;
      }
      float st[kN / 2];
      {
        float sg[kGroupsW][kN / 2], sr[kN / 2];
        ScoresFromRawRows<kN, kGroupsW, kRopeStepsW, Layout::kQChunkBytes>(
            staged_addr, q_addr, warp_in_wg, lane, group0, kRopeStepsW * wg, sg, sr);
        SM90_TRACE(kTraceScoresDone, k);
        // This warpgroup's part of each score, handed to the other through shared memory.
#pragma unroll
        for (int i = 0; i < kRowsT; ++i) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int e = RegsElement(i, h);
            float latent = 0.f;
#pragma unroll
            for (int g = 0; g < kGroupsW; ++g) latent = fmaf(sc[h][g], sg[g][e], latent);
            st[e] = fmaf(latent, q_scale[i], sr[e]);
          }
        }
      }
#pragma unroll
      for (int v = 0; v < Layout::kExchangeSlots; ++v) {
        *SplitScoreSlot(smem, it & 1, wg, v, wg_tid) =
            make_float4(st[4 * v], st[4 * v + 1], st[4 * v + 2], st[4 * v + 3]);
      }
      ConsumerSync();
#pragma unroll
      for (int v = 0; v < Layout::kExchangeSlots; ++v) {
        const float4 x = *SplitScoreSlot(smem, it & 1, wg ^ 1, v, wg_tid);
        st[4 * v] += x.x;
        st[4 * v + 1] += x.y;
        st[4 * v + 2] += x.z;
        st[4 * v + 3] += x.w;
      }

      // Masked by select; maxima over the thread's tokens, the eight lanes sharing its rows, then
      // the warpgroup's warps (with its groups' largest |scale| in the block).
      const int token_base = k * kBlockN;
      float mx[kRowsT];
#pragma unroll
      for (int i = 0; i < kRowsT; ++i) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int e = RegsElement(i, h);
          if (!(load.RowLoaded(tok[h]) && token_base + tok[h] <= limit_t[i])) st[e] = kNegInf;
        }
        mx[i] = fmaxf(st[RegsElement(i, 0)], st[RegsElement(i, 1)]);
#pragma unroll
        for (int d = 4; d < 32; d <<= 1) {
          mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], d));
        }
      }
      float smax[kGroupsW];
#pragma unroll
      for (int g = 0; g < kGroupsW; ++g) {
        smax[g] = WarpMaxMagnitude(fmaxf(fabsf(sc[0][g]), fabsf(sc[1][g])));
      }
      if (lane < 4) {
#pragma unroll
        for (int i = 0; i < kRowsT; ++i) reduce[warp_in_wg * kStride + RowT(i)] = mx[i];
      }
      if (lane == 0) {
#pragma unroll
        for (int g = 0; g < kGroupsW; ++g) reduce[warp_in_wg * kStride + kN + g] = smax[g];
      }
      WarpgroupSync(wg);
      float alpha[kRowsT];
      UpdateRowsSoftmax<kRowsT, kStride>(reduce, lane, sl2, st, m_t, l_t, alpha);
      float gf[kGroupsW], inv_r[kGroupsW];
      UpdateGroupScales<kGroupsW, kStride, kN>(reduce, r_g, gf, inv_r);
      bool rescale = false;
#pragma unroll
      for (int i = 0; i < kRowsT; ++i) rescale |= alpha[i] != 1.f;
#pragma unroll
      for (int g = 0; g < kGroupsW; ++g) rescale |= gf[g] != 1.f;
      if (__any_sync(0xffffffffu, rescale)) {
        ScaleOutput(o, alpha, gf);
      }
      StorePTiles<kN, kGroupsW, Layout::kPTileBytes>(p_addr, warp_in_wg, lane, st, sc, inv_r);
      cutlass::arch::fence_view_async_shared();
      WarpgroupSync(wg);
      SM90_TRACE(kTracePStored, k);
      PvFromRawRows<kN, kGroupsW, Layout::kPTileBytes>(
          staged_addr, p_addr, warp_in_wg, lane, group0, o,
          [&] { Barrier::arrive(pipe.Empty(stage)); });
      SM90_TRACE(kTraceBlockDone, k);
      load = next;
    }
    if (wg_tid == 0) Barrier::arrive(pipe.QEmpty());

    // Both warpgroups hold the same row sums and maxima; each stores its groups' four tiles
    // (group g's output in units of its running maximum scale R_g).
    float l[kRowsT];
    SumRowsOverWarpgroup<kRowsT, kStride>(l_t, reduce, warp_in_wg, lane, wg, l);
    float keep[2 * kGroupsW][kN / 2];
#pragma unroll
    for (int t = 0; t < 2 * kGroupsW; ++t) {
#pragma unroll
      for (int e = 0; e < kN / 2; ++e) keep[t][e] = o[t][e] * r_g[t / 2];
    }
    SM90_TRACE(kTraceStoreBegin, seg_info.whole);
    StoreRegsTiles(args, seg_info, part, wg, wg_tid, lane, keep, l, m_t);
    SM90_TRACE(kTraceStoreEnd, 0);
    ++seg;
  }
  });
}

}  // namespace sm90
}  // namespace jax_mla
