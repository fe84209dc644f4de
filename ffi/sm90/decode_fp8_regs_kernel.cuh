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

#include "decode_kernel.cuh"
#include "regs_cta.cuh"
#include "regs_operands.cuh"
#include "regs_softmax.cuh"

namespace jax_mla {
namespace sm90 {

// Shared memory of DecodeFp8RegsKernel, byte offsets from the 1024-aligned base: the query tile
// of 16 rows and a ring of four raw stages (RegsSmemLayoutBase), each warpgroup's four P tiles (one
// per latent group), each warpgroup's half of the merge region, the warpgroups' reduction buffers,
// the query rows' scales and the barriers. A warpgroup's P tiles and its merge half hold what it
// hands the other at the end of a segment (MergeSlot).
struct Fp8RegsSmemLayout : RegsSmemLayoutBase<4, 16> {
  static constexpr int kReleasingThreads = kHalfStageReleasers;  // the warpgroup that read it
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
    const bool saw_foreign_page = ThreadSeesForeignPage(p, seg_info, tid);
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
    if (SegmentReadsForeignPage(p, saw_foreign_page)) {
      Zero(keep);
      Zero(l_all);
    }
    StoreRegsTiles(args, seg_info, part, wg, wg_tid, lane, keep, l_all, m_all);
    SM90_TRACE(kTraceStoreEnd, 0);
    ++seg;
  }
  });
}

}  // namespace sm90
}  // namespace jax_mla
