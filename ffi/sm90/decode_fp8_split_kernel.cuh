// The fp8 cache at 17-32 query rows with both MMAs' cache operands in registers
// (DecodeFp8SplitKernel; docs/fp8-cache.md, "17-32 rows: the split register-operand kernel").
//
// DecodeFp8RegsKernel's operands (raw stages, keys and V^T converted e4m3 -> f16 in registers, the
// f16 query in units of a power of two per row), but at N = 32 query rows a warpgroup's state for
// a whole block does not fit beside the fragments, so the two consumer warpgroups split the work of
// every block by role and by output columns:
//  - warpgroup 0 scores the blocks (S^T, M = 64 tokens, N = 32 rows), one block ahead of
//    warpgroup 1: its key fragments carry each token's group scales relative to the token's
//    largest one (exact powers of two for write_kv's scales), so one accumulator takes all four
//    latent groups; it hands the scores over through shared memory;
//  - warpgroup 1 runs the online softmax of the block warpgroup 0 scored before, writes P for the
//    four latent groups and the rows' and groups' rescale factors;
//  - each computes O^T for two latent groups' 256 output columns (warpgroup w groups 2w, 2w + 1),
//    warpgroup 0 between scoring two blocks, so a segment ends without a merge;
//  - scores, P tiles and factors are double-buffered by block parity, each buffer guarded by a
//    pair of full / empty barriers between the warpgroups; a ring of three raw 64-token stages,
//    each released by the 256 threads that read it.
// Safety as DecodeKernel: rows of a block past the length or in a page not loaded are zeroed in
// the stage before any read, and their scores masked by select.
#pragma once

#include "decode_kernel.cuh"
#include "regs_cta.cuh"
#include "regs_operands.cuh"
#include "regs_softmax.cuh"

namespace jax_mla {
namespace sm90 {

// Shared memory of DecodeFp8SplitKernel, byte offsets from the 1024-aligned base: the query tile
// of 32 rows and a ring of three raw stages (RegsSmemLayoutBase), two buffers of the four P tiles,
// two of the scores (one float4 slot of 128 threads per four scores), two of the factors (per row
// alpha, per group the output's rescale), warpgroup 1's reduction buffer, the rows' sums and
// maxima and warpgroup 0's groups' running maximum scales at a segment's end, the query rows'
// scales and the barriers (the pipeline's, then the four pairs between the warpgroups).
struct Fp8SplitSmemLayout : RegsSmemLayoutBase<3, kFp8TransposedRows> {
  static constexpr int kReleasingThreads = kConsumerThreads;  // both warpgroups read each stage
  static constexpr int kScores = kP + 2 * kFp8ScaleGroups * kPTileBytes;
  static constexpr int kScoreSlots = kQChunkRows / 8;  // float4 slots per thread and block
  static constexpr int kFactors = kScores + 2 * kScoreSlots * 128 * 16;
  static constexpr int kFactorFloats = kQChunkRows + kFp8ScaleGroups;  // alpha, gf
  // Warpgroup 1's f32 [4 warps][64]: 32 row maxima or sums, then the groups' scale maxima.
  static constexpr int kReduceStride = 64;
  static constexpr int kReduce = kFactors + 2 * kFactorFloats * 4;
  // A segment's end: l[32], m[32], then R_0 and R_1 for warpgroup 0.
  static constexpr int kRowStats = kReduce + 4 * kReduceStride * 4;
  static constexpr int kRowScale = kRowStats + (2 * kQChunkRows + 4) * 4;
  static constexpr int kBarriers = (kRowScale + kQChunkRows * 4 + 7) / 8 * 8;
  static constexpr int kPipeBarriers = 2 + 2 * kStageSlots;
  static constexpr int kNumBarriers = kPipeBarriers + 8;
  static constexpr int kUsed = kBarriers + kNumBarriers * 8;
  static constexpr int kBytes = kUsed + kSmemAlign;
  static_assert(kBytes <= kMaxSmemBytes, "exceeds the 227 KB per-block shared memory of SM90");
  static_assert(kFp8Stages % 1024 == 0 && kP % 1024 == 0 && kPTileBytes % 1024 == 0,
                "swizzled tiles need 1024-byte alignment");
  static_assert(kFp8ScaleGroups == 2 * kConsumerWarpgroups, "each warpgroup's PV has two groups");
};

namespace detail {

// The barriers between the warpgroups, per buffer b (block parity): scores full (warpgroup 0's
// threads arrive) and empty (warpgroup 1's), P and factors full (warpgroup 1's) and empty
// (warpgroup 0's, once its PV is done with them). Every thread arrives after its own accesses,
// which is what racecheck follows.
struct SplitHandoff {
  uint64_t* base;
  __device__ __forceinline__ static SplitHandoff At(uint8_t* smem) {
    using Layout = Fp8SplitSmemLayout;
    return {reinterpret_cast<uint64_t*>(smem + Layout::kBarriers) + Layout::kPipeBarriers};
  }
  __device__ __forceinline__ uint64_t* ScoresFull(int b) const { return base + b; }
  __device__ __forceinline__ uint64_t* ScoresEmpty(int b) const { return base + 2 + b; }
  __device__ __forceinline__ uint64_t* PFull(int b) const { return base + 4 + b; }
  __device__ __forceinline__ uint64_t* PEmpty(int b) const { return base + 6 + b; }
  __device__ __forceinline__ void Init() const {
    for (int i = 0; i < 8; ++i) cutlass::arch::ClusterBarrier::init(base + i, 128);
  }
};

// Slot v (four scores a thread) of the scores of a block of parity b.
__device__ __forceinline__ float4* SplitScoreSlot(uint8_t* smem, int b, int v, int wg_tid) {
  using Layout = Fp8SplitSmemLayout;
  return reinterpret_cast<float4*>(smem + Layout::kScores) +
         (b * Layout::kScoreSlots + v) * 128 + wg_tid;
}

// The factors of a block of parity b: alpha[32] (per query row) and gf[4] (per latent group), the
// output's rescale.
__device__ __forceinline__ float* SplitFactors(uint8_t* smem, int b) {
  using Layout = Fp8SplitSmemLayout;
  return reinterpret_cast<float*>(smem + Layout::kFactors) + b * Layout::kFactorFloats;
}


// Key fragments carrying each token's group scales relative to its largest (ScoresFromRawRows'
// fold): group g's fragments of the thread's token h (registers h and h + 2 of each k step) times
// factor[g][h] (f16x2, both halves the same).
struct FoldGroupScales {
  const uint32_t (&factor)[kFp8ScaleGroups][2];
  __device__ __forceinline__ void operator()(int g, uint32_t (&f)[8][4]) const {
#pragma unroll
    for (int s = 0; s < 8; ++s) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const __half2 x = __hmul2(*reinterpret_cast<const __half2*>(&f[s][r]),
                                  *reinterpret_cast<const __half2*>(&factor[g][r % 2]));
        f[s][r] = *reinterpret_cast<const uint32_t*>(&x);
      }
    }
  }
};

// The fold of a staged block's key fragments for the thread's tokens tok[h]: r_tok[h] the token's
// largest |scale| over the latent groups (0 for a zeroed row) and factor[g][h] its group g's scale
// over that, as an f16 pair.
__device__ __forceinline__ void FoldFactors(const uint8_t* staged, const int (&tok)[2],
                                            uint32_t (&factor)[kFp8ScaleGroups][2],
                                            float (&r_tok)[2]) {
  float sc[2][kFp8ScaleGroups];
  LoadTokenScales(staged, tok, sc);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float r =
        fmaxf(fmaxf(fabsf(sc[h][0]), fabsf(sc[h][1])), fmaxf(fabsf(sc[h][2]), fabsf(sc[h][3])));
    const float inv = r > 0.f ? ApproxRcp(r) : 0.f;
    r_tok[h] = r;
#pragma unroll
    for (int g = 0; g < kFp8ScaleGroups; ++g) {
      const __half2 f = __float2half2_rn(sc[h][g] * inv);
      factor[g][h] = *reinterpret_cast<const uint32_t*>(&f);
    }
  }
}

// One warpgroup's PV of a block: its O^T tiles (latent groups group0, group0 + 1) rescaled by the
// block's factors (alpha of the thread's query rows times its groups' gf), then V^T P_g^T added
// from the staged rows and the block's P tiles at p_addr; `release` once the stage is read.
template <int kRowsT, class Release>
__device__ __forceinline__ void SplitPv(uint32_t staged_addr, uint32_t p_addr, const float* factors,
                                        int group0, int warp_in_wg, int lane,
                                        float (&o)[4][2 * kRowsT], Release release) {
  using Layout = Fp8SplitSmemLayout;
  constexpr int kN = Layout::kQChunkRows;
  float alpha[kRowsT], gf[2];
  bool rescale = false;
#pragma unroll
  for (int i = 0; i < kRowsT; ++i) {
    alpha[i] = factors[TransposedScores::QueryRow(lane, i)];
    rescale |= alpha[i] != 1.f;
  }
#pragma unroll
  for (int g = 0; g < 2; ++g) {
    gf[g] = factors[kN + group0 + g];
    rescale |= gf[g] != 1.f;
  }
  if (__any_sync(0xffffffffu, rescale)) ScaleOutput(o, alpha, gf);
  PvFromRawRows<kN, 2, Layout::kPTileBytes>(staged_addr, p_addr + group0 * Layout::kPTileBytes,
                                            warp_in_wg, lane, group0, o, release);
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
  constexpr int kStride = Layout::kReduceStride;
  constexpr int kPBufferBytes = kFp8ScaleGroups * Layout::kPTileBytes;
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
  const uint32_t p_addr = SmemAddr(smem + Layout::kP);
  float* const reduce = reinterpret_cast<float*>(smem + Layout::kReduce);
  float* const row_stats = reinterpret_cast<float*>(smem + Layout::kRowStats);
  const SplitHandoff handoff = SplitHandoff::At(smem);
  // A thread's tokens of a block (rows of S^T) and query rows (columns), as in DecodeKernel's
  // transposed path.
  const int tok[2] = {TransposedScores::Token(wg_tid, 0), TransposedScores::Token(wg_tid, 1)};
  auto RowT = [&](int i) { return TransposedScores::QueryRow(lane, i); };
  auto Staged = [&](int it_k) {
    return smem + Layout::kFp8Stages + (it_k % Layout::kStageSlots) * kFp8StageBytes;
  };
  auto StagedAddr = [&](int it_k) {
    return stages_addr + (it_k % Layout::kStageSlots) * kFp8StageBytes;
  };
  auto StageFull = [&](int it_k) {
    Barrier::wait(pipe.Full(it_k % Layout::kStageSlots), (it_k / Layout::kStageSlots) & 1);
  };
  auto Release = [&](int it_k) {
    return [&pipe, it_k] { Barrier::arrive(pipe.Empty(it_k % Layout::kStageSlots)); };
  };
  if (tid == 0) {
    handoff.Init();
    cutlass::arch::fence_barrier_init();
  }
  ConsumerSync();

  float o[4][kN / 2];  // this warpgroup's two latent groups' output tiles
  Segment seg_info;
  int it = 0, seg = 0;
  while (walker.Next(seg_info)) {
    SM90_TRACE(kTraceSegment, seg_info.b);
#pragma unroll
    for (int t = 0; t < 4; ++t) {
#pragma unroll
      for (int e = 0; e < kN / 2; ++e) o[t][e] = 0.f;
    }
    float m_t[kRowsT], l_t[kRowsT], q_scale[kRowsT];
    int limit_t[kRowsT];
    const bool saw_foreign_page = ThreadSeesForeignPage(p, seg_info, tid);
    StartRegsSegment<Layout>(pipe, smem, p, seg_info, seg, tid, lane, m_t, l_t, limit_t, q_scale);
    const int n_blocks = seg_info.kv_end - seg_info.kv_begin;
    float l[kRowsT], r_out[2];  // the rows' sums, this warpgroup's groups' running maximum scales

    if (wg == 0) {
      // Scores of block j, then PV of block j - 1 (whose P warpgroup 1 wrote meanwhile).
      BlockLoad load{};
      if (n_blocks > 0) load = BlockLoad::Of(p, seg_info, seg_info.kv_begin);
      for (int j = 0; j <= n_blocks; ++j) {
        if (j < n_blocks) {
          const int it_k = it + j;
          BlockLoad next = load;
          if (j + 1 < n_blocks) next = BlockLoad::Of(p, seg_info, seg_info.kv_begin + j + 1);
          uint8_t* const staged = Staged(it_k);
          StageFull(it_k);
          SM90_TRACE(kTraceBlockReady, seg_info.kv_begin + j);
          if (!load.Complete()) {
            ZeroUnloadedRawRows<128>(staged, load, wg_tid);
            cutlass::arch::fence_view_async_shared();
            WarpgroupSync(wg);
          }
          uint32_t factor[kFp8ScaleGroups][2];
          float r_tok[2];
          FoldFactors(staged, tok, factor, r_tok);
          float s_latent[1][kN / 2], s_rope[kN / 2];
          ScoresFromRawRows<kN, kFp8ScaleGroups, kRopeDim / 16, Layout::kQChunkBytes, 1>(
              StagedAddr(it_k), q_addr, warp_in_wg, lane, 0, 0, s_latent, s_rope,
              FoldGroupScales{factor});
          if (j + 1 == n_blocks && wg_tid == 0) Barrier::arrive(pipe.QEmpty());
          SM90_TRACE(kTraceScoresDone, seg_info.kv_begin + j);
          const int b = it_k & 1;
          Barrier::wait(handoff.ScoresEmpty(b), ((it_k >> 1) & 1) ^ 1);
#pragma unroll
          for (int v = 0; v < Layout::kScoreSlots; ++v) {
            float x[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
              // Element 4 v + u: query row i, token half h (TransposedScores::Element).
              const int e = 4 * v + u;
              const int i = 2 * (e / 4) + e % 2, h = (e / 2) % 2;
              x[u] = fmaf(s_latent[0][e] * r_tok[h], q_scale[i], s_rope[e]);
            }
            *SplitScoreSlot(smem, b, v, wg_tid) = make_float4(x[0], x[1], x[2], x[3]);
          }
          Barrier::arrive(handoff.ScoresFull(b));
          load = next;
        }
        if (j > 0) {
          const int it_k = it + j - 1;
          const int b = it_k & 1;
          Barrier::wait(handoff.PFull(b), (it_k >> 1) & 1);
          SM90_TRACE(kTracePStored, seg_info.kv_begin + j - 1);
          SplitPv<kRowsT>(StagedAddr(it_k), p_addr + b * kPBufferBytes, SplitFactors(smem, b),
                          0, warp_in_wg, lane, o, Release(it_k));
          Barrier::arrive(handoff.PEmpty(b));
          SM90_TRACE(kTraceBlockDone, seg_info.kv_begin + j - 1);
        }
      }
      if (n_blocks == 0 && wg_tid == 0) Barrier::arrive(pipe.QEmpty());
    } else {
      // Softmax of block j (its scores from warpgroup 0), P and factors, then its PV.
      float r_g[kFp8ScaleGroups];  // running maximum |scale| of each group (0: none yet)
#pragma unroll
      for (int g = 0; g < kFp8ScaleGroups; ++g) r_g[g] = 0.f;
      for (int j = 0; j < n_blocks; ++j) {
        const int it_k = it + j;
        const int k = seg_info.kv_begin + j;
        const int b = it_k & 1;
        const BlockLoad load = BlockLoad::Of(p, seg_info, k);
        uint8_t* const staged = Staged(it_k);
        StageFull(it_k);
        SM90_TRACE(kTraceBlockReady, k);
        Barrier::wait(handoff.ScoresFull(b), (it_k >> 1) & 1);
        float st[kN / 2];
#pragma unroll
        for (int v = 0; v < Layout::kScoreSlots; ++v) {
          const float4 x = *SplitScoreSlot(smem, b, v, wg_tid);
          st[4 * v] = x.x;
          st[4 * v + 1] = x.y;
          st[4 * v + 2] = x.z;
          st[4 * v + 3] = x.w;
        }
        Barrier::arrive(handoff.ScoresEmpty(b));
        SM90_TRACE(kTraceScoresDone, k);
        float sc[2][kFp8ScaleGroups];  // the thread's tokens' scales
        LoadTokenScales(staged, tok, sc);
        // Masked by select.
        const int token_base = k * kBlockN;
#pragma unroll
        for (int i = 0; i < kRowsT; ++i) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int e = RegsElement(i, h);
            if (!(load.RowLoaded(tok[h]) && token_base + tok[h] <= limit_t[i])) st[e] = kNegInf;
          }
        }
        float alpha[kRowsT], gf[kFp8ScaleGroups], inv_r[kFp8ScaleGroups];
        BlockSoftmax<Layout>(reduce, wg, warp_in_wg, lane, sl2, st, sc, m_t, l_t, r_g, alpha, gf,
                             inv_r);
        Barrier::wait(handoff.PEmpty(b), ((it_k >> 1) & 1) ^ 1);
        StorePTiles<kN, kFp8ScaleGroups, Layout::kPTileBytes>(p_addr + b * kPBufferBytes,
                                                               warp_in_wg, lane, st, sc, inv_r);
        float* const factors = SplitFactors(smem, b);
        if (warp_in_wg == 0 && lane < 4) {
#pragma unroll
          for (int i = 0; i < kRowsT; ++i) factors[RowT(i)] = alpha[i];
        }
        if (wg_tid == 0) {
#pragma unroll
          for (int g = 0; g < kFp8ScaleGroups; ++g) factors[kN + g] = gf[g];
        }
        cutlass::arch::fence_view_async_shared();
        Barrier::arrive(handoff.PFull(b));
        Barrier::wait(handoff.PFull(b), (it_k >> 1) & 1);
        SM90_TRACE(kTracePStored, k);
        SplitPv<kRowsT>(StagedAddr(it_k), p_addr + b * kPBufferBytes, factors, 2, warp_in_wg,
                        lane, o, Release(it_k));
        SM90_TRACE(kTraceBlockDone, k);
      }
      if (wg_tid == 0) Barrier::arrive(pipe.QEmpty());
      SumRowsOverWarpgroup<kRowsT, kStride>(l_t, reduce, warp_in_wg, lane, wg, l);
      if (warp_in_wg == 0 && lane < 4) {
#pragma unroll
        for (int i = 0; i < kRowsT; ++i) {
          row_stats[RowT(i)] = l[i];
          row_stats[kN + RowT(i)] = m_t[i];
        }
      }
      if (wg_tid == 0) {
        row_stats[2 * kN] = r_g[0];
        row_stats[2 * kN + 1] = r_g[1];
      }
      r_out[0] = r_g[2];
      r_out[1] = r_g[3];
    }
    // Warpgroup 0 takes the rows' sums and maxima and its groups' scales from warpgroup 1.
    ConsumerHandover();
    if (wg == 0) {
#pragma unroll
      for (int i = 0; i < kRowsT; ++i) {
        l[i] = row_stats[RowT(i)];
        m_t[i] = row_stats[kN + RowT(i)];
      }
      r_out[0] = row_stats[2 * kN];
      r_out[1] = row_stats[2 * kN + 1];
    }

    // Each warpgroup stores its groups' four tiles (group g's output in units of its running
    // maximum scale R_g).
    float keep[4][kN / 2];
#pragma unroll
    for (int t = 0; t < 4; ++t) {
#pragma unroll
      for (int e = 0; e < kN / 2; ++e) keep[t][e] = o[t][e] * r_out[t / 2];
    }
    SM90_TRACE(kTraceStoreBegin, seg_info.whole);
    if (SegmentReadsForeignPage(p, saw_foreign_page)) {
      Zero(keep);
      Zero(l);
    }
    StoreRegsTiles(args, seg_info, part, wg, wg_tid, lane, keep, l, m_t);
    SM90_TRACE(kTraceStoreEnd, 0);
    it += n_blocks;
    ++seg;
  }
  });
}

}  // namespace sm90
}  // namespace jax_mla
