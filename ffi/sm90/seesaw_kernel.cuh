// The SM90 MLA decode kernel's "seesaw" variant for 64-row M tiles (q_len * num_heads > 32).
//
// Same CTA, producer, pipeline, schedule and epilogue as DecodeKernel (decode_kernel.cuh); the
// consumers differ. As in DecodeKernel, consumer warpgroup w scores the 32 tokens of half w of each
// 64-token block (WGMMA 64x32x16) and owns output columns [256 w, 256 w + 256), but the two do not
// exchange row maxima and run the softmax at the same time. Instead the softmax passes from one to
// the other:
//  - warpgroup 0 runs half 0's softmax against the running maxima, publishes the new maxima and
//    its bf16 probabilities P_0 (shared memory), and multiplies P_0, taken from its registers, by
//    its columns of V over half 0;
//  - warpgroup 1 takes the new maxima and P_0 from shared memory, multiplies P_0 by its columns of
//    V over half 0 while it runs half 1's softmax against those maxima, publishes the result and
//    P_1, and multiplies P_1 (registers) by its columns of V over half 1;
//  - warpgroup 0 moves its output to the final maxima and multiplies P_1 (shared memory) by its
//    columns of V over half 1, then scores the next block while warpgroup 1 finishes.
// So one warpgroup's softmax runs while the other's products occupy the tensor pipe. Both end a
// block with the same row maxima; each keeps the row sums of its own half, and the epilogue adds
// the two in a fixed order.
#pragma once

#include "decode_kernel.cuh"

namespace jax_mla {
namespace sm90 {
namespace detail {

using PvFromRegistersMma =
    cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K,
                                                   cute::SM90::GMMA::Major::MN>;

// Named barriers of both consumer warpgroups, reached at different call sites (HandOff): half 0's
// maxima and P are in shared memory (warpgroup 0 wrote them); half 1's (warpgroup 1).
constexpr int kFirstHalfReadyBarrier = 6;
constexpr int kSecondHalfReadyBarrier = 7;

// Both consumer warpgroups meet at named barrier `id` (numbered as cutlass::arch::NamedBarrier's),
// each from its own call site: barrier.sync without .aligned, which requires every thread of the
// CTA that reaches the barrier to execute the same instruction.
__device__ __forceinline__ void HandOff(int id) {
  const int hw_id =
      id + static_cast<int>(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier);
  asm volatile("barrier.sync %0, %1;" ::"r"(hw_id), "n"(kConsumerThreads) : "memory");
}

// Waits for a pipeline barrier's phase. The wait spins inside inline assembly, so the warp's
// threads may leave it apart: they are reconverged before the aligned barriers and products that
// follow.
__device__ __forceinline__ void WaitConverged(uint64_t* barrier, uint32_t phase) {
  cutlass::arch::ClusterBarrier::wait(barrier, phase);
  __syncwarp();
}

template <class Mma, int N, size_t... I>
__device__ __forceinline__ void MmaRsImpl(const uint32_t (&a)[4], uint64_t desc_b, float (&d)[N],
                                          std::index_sequence<I...>) {
  Mma::fma(a[0], a[1], a[2], a[3], desc_b, d[I]..., cute::SM90::GMMA::ScaleOut::One);
}

// Scores of half `half` of the block in the stage at kv_addr: S = Q K^T for its 32 tokens, all
// 64 rows (this thread: 16 floats).
__device__ __forceinline__ void IssueHalfScores(uint32_t q_addr, uint32_t kv_addr, int half,
                                                float (&s)[16]) {
  FenceRegisters(s);
  cute::warpgroup_arrive();
  // A descriptor's start address field counts 16-byte units: a step's offset is added to it.
  const uint64_t q_desc = KMajorDesc(q_addr);
  const uint64_t kv_desc = KMajorDesc(kv_addr + half * kHalfN * kRowBytes);
#pragma unroll
  for (int g = 0; g < kQkSteps; ++g) {
    const uint32_t units = QkStepOffset(g) >> 4;
    Gmma<QkMma>(q_desc + units, kv_desc + units, s, g != 0);
  }
  cute::warpgroup_commit_batch();
}

// Masks this thread's scores of a half (tokens token0 + Fragment::Col, rows with causal limits
// limit0 and limit1; the whole half when it was not loaded) to -inf, and returns the rows'
// maxima over the half (reduced over the quad that shares the rows).
__device__ __forceinline__ void MaskHalfScores(float (&s)[16], bool loaded, int token0, int lane,
                                               int limit0, int limit1, float& max0, float& max1) {
  max0 = kNegInf;
  max1 = kNegInf;
#pragma unroll
  for (int j = 0; j < kHalfN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int tok = token0 + Fragment::Col(lane, j, e);
      const float a = (loaded && tok <= limit0) ? s[Fragment::Element(j, e, 0)] : kNegInf;
      const float c = (loaded && tok <= limit1) ? s[Fragment::Element(j, e, 1)] : kNegInf;
      s[Fragment::Element(j, e, 0)] = a;
      s[Fragment::Element(j, e, 1)] = c;
      max0 = fmaxf(max0, a);
      max1 = fmaxf(max1, c);
    }
  }
  max0 = fmaxf(max0, __shfl_xor_sync(0xffffffffu, max0, 1));
  max0 = fmaxf(max0, __shfl_xor_sync(0xffffffffu, max0, 2));
  max1 = fmaxf(max1, __shfl_xor_sync(0xffffffffu, max1, 1));
  max1 = fmaxf(max1, __shfl_xor_sync(0xffffffffu, max1, 2));
}

// The softmax offset of a row maximum: -inf (a row that has seen nothing) counts as 0.
__device__ __forceinline__ float MaxOffset(float m) { return m == kNegInf ? 0.f : m; }

// exp2((from - to) * scale_log2): the factor that moves values kept against maximum `from` to
// maximum `to` (>= from).
__device__ __forceinline__ float RescaleFactor(float from, float to, float scale_log2) {
  return Exp2((from - MaxOffset(to)) * scale_log2);
}

// P = exp2((S - m) * scale_log2) for the thread's two rows (maxima m0, m1), summed per row, packed
// to bf16 as WGMMA A fragments: p[4 kk .. 4 kk + 3] are the thread's values of tokens
// [16 kk, 16 kk + 16) of the half, the accumulator fragment of a 64 x 32 product being the A
// fragment of the two 64 x 16 k steps that consume it.
__device__ __forceinline__ void Exponentiate(const float (&s)[16], float m0, float m1,
                                             float scale_log2, float& sum0, float& sum1,
                                             uint32_t (&p)[8]) {
  const float nb0 = -MaxOffset(m0) * scale_log2;
  const float nb1 = -MaxOffset(m1) * scale_log2;
  sum0 = 0.f;
  sum1 = 0.f;
#pragma unroll
  for (int j = 0; j < kHalfN / 8; ++j) {
    const float p00 = Exp2(fmaf(s[4 * j + 0], scale_log2, nb0));
    const float p01 = Exp2(fmaf(s[4 * j + 1], scale_log2, nb0));
    const float p10 = Exp2(fmaf(s[4 * j + 2], scale_log2, nb1));
    const float p11 = Exp2(fmaf(s[4 * j + 3], scale_log2, nb1));
    sum0 += p00 + p01;
    sum1 += p10 + p11;
    p[2 * j] = PackBf16x2(p00, p01);
    p[2 * j + 1] = PackBf16x2(p10, p11);
  }
}

// Writes the thread's packed P values of half `half` into the P tile (rows r0 and r0 + 8).
__device__ __forceinline__ void StoreProbabilities(uint8_t* p_tile, const uint32_t (&p)[8],
                                                   int half, int r0, int lane) {
#pragma unroll
  for (int j = 0; j < kHalfN / 8; ++j) {
    const int col = half * kHalfN + Fragment::Col(lane, j, 0);
    *reinterpret_cast<uint32_t*>(p_tile + SwizzledOffset(r0, col)) = p[2 * j];
    *reinterpret_cast<uint32_t*>(p_tile + SwizzledOffset(r0 + 8, col)) = p[2 * j + 1];
  }
}

// V descriptor of k step kk (16 tokens) of half `half` for warpgroup wg's 256 columns.
__device__ __forceinline__ uint64_t VDesc(uint32_t kv_addr, int wg, int half, int kk) {
  return MNMajorDesc(kv_addr + wg * (kNumVChunks / 2) * kChunkBytes +
                     (half * (kHalfN / 16) + kk) * 16 * kRowBytes);
}

// O[:, 256 wg : 256 wg + 256] += P V over half `half`, P from registers.
__device__ __forceinline__ void IssuePvFromRegisters(uint32_t (&p)[8], uint32_t kv_addr, int wg,
                                                     int half, float (&o)[128]) {
  FenceRegisters(o);
#pragma unroll
  for (int i = 0; i < 8; ++i) cute::warpgroup_fence_operand(p[i]);
  cute::warpgroup_arrive();
#pragma unroll
  for (int kk = 0; kk < kHalfN / 16; ++kk) {
    const uint32_t a[4] = {p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3]};
    MmaRsImpl<PvFromRegistersMma>(a, VDesc(kv_addr, wg, half, kk), o,
                                  std::make_index_sequence<128>{});
  }
  cute::warpgroup_commit_batch();
}

// The same with P read from the P tile.
__device__ __forceinline__ void IssuePvFromTile(uint32_t p_addr, uint32_t kv_addr, int wg,
                                                int half, float (&o)[128]) {
  FenceRegisters(o);
  cute::warpgroup_arrive();
#pragma unroll
  for (int kk = 0; kk < kHalfN / 16; ++kk) {
    Gmma<PvMma>(KMajorDesc(p_addr + (half * (kHalfN / 16) + kk) * 32),
                VDesc(kv_addr, wg, half, kk), o, true);
  }
  cute::warpgroup_commit_batch();
}

// Zeroes the stage's rows of half `half` that were not loaded (or hold tokens past the length)
// in warpgroup wg's V columns, before its PV over that half reads them.
__device__ __forceinline__ void PrepareVHalf(uint8_t* stage_base, const BlockLoad& load, int wg,
                                             int half, int wg_tid) {
  if (load.Complete()) return;
  ZeroUnloadedRows<kNumVChunks / 2, 128, kHalfN>(stage_base, load, wg * (kNumVChunks / 2),
                                                 half * kHalfN, wg_tid);
  cutlass::arch::fence_view_async_shared();
  WarpgroupSync(wg);
}

}  // namespace detail

// kCluster == 2: as in DecodeKernel, the two CTAs of a cluster (consecutive M tiles) share each
// KV tile by multicast.
template <int kCluster>
__global__ void __launch_bounds__(kThreads, 1)
SeesawKernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap kv_map,
             const DecodeKernelArgs args) {
  using namespace detail;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = SmemAddr(smem_raw);
  uint8_t* smem = smem_raw + ((kSmemAlign - (raw_addr & (kSmemAlign - 1))) & (kSmemAlign - 1));
  const Pipeline pipe = Pipeline::At(smem);

  const DecodeParams& p = args.p;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int rows = p.q_len * p.num_heads;
  const int mtile = blockIdx.y;
  const int part = blockIdx.x;

  SetUpCta<kCluster>(smem, args.q_box_rows, tid);
  const uint32_t cta_rank = kCluster > 1 ? ClusterCtaRank() : 0;

  // Everything below reads inputs that earlier kernels in the stream may write.
  GridDependencyWait();
  GridDependencyLaunchDependents();

  const ScheduleView view = ScheduleView::Load(p, args.num_parts);
  SegmentWalker walker(view, part, p.seq_lens, p.max_pages, p.page_size);
  Segment seg_info;

  if (warp >= kConsumerThreads / 32) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (warp == kConsumerThreads / 32 && lane == 0) {
      ProduceTiles<kCluster>(q_map, kv_map, args, smem, walker, mtile, cta_rank);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
    // Broadcast from lane 0, so the compiler sees a warp-uniform value for the branches below.
    const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);
    const int wg_tid = tid % 128;
    const int r0 = Fragment::Row(wg_tid, 0);
    const int r1 = Fragment::Row(wg_tid, 1);
    const int gr0 = mtile * kBlockM + r0;
    const int gr1 = mtile * kBlockM + r1;
    // f32 [2][64]: the new row maxima after half 0 of the block, after half 1.
    float* half_max = reinterpret_cast<float*>(smem + kSmemRowMax);
    float* row_sum = reinterpret_cast<float*>(smem + kSmemRowSum);
    uint8_t* p_tile = smem + kSmemP;
    const uint32_t p_addr = SmemAddr(p_tile);
    const uint32_t q_addr = SmemAddr(smem + kSmemQ);
    const float sl2 = args.scale_log2;

    float o[128];   // this warpgroup's 64 x 256 output columns
    float s[16];    // scores of this warpgroup's half of the block, 64 x 32
    uint32_t pr[8]; // its probabilities, bf16 A fragments
    int it = 0, seg = 0;
    while (walker.Next(seg_info)) {
      // Query token of row r is r / num_heads; it sees kv positions [0, len - q_len + token].
      const int limit0 = gr0 < rows ? seg_info.len - p.q_len + gr0 / p.num_heads : -1;
      const int limit1 = gr1 < rows ? seg_info.len - p.q_len + gr1 / p.num_heads : -1;
      float m0 = kNegInf, m1 = kNegInf, l0 = 0.f, l1 = 0.f;
#pragma unroll
      for (int i = 0; i < 128; ++i) o[i] = 0.f;
      WaitConverged(pipe.QFull(), seg & 1);

      for (int k = seg_info.kv_begin; k < seg_info.kv_end; ++k, ++it) {
        const int stage = it % kStages;
        uint8_t* stage_base = smem + kSmemKv + stage * kTileBytes;
        const uint32_t kv_addr = SmemAddr(stage_base);
        const uint32_t phase = (it / kStages) & 1;
        const BlockLoad load = BlockLoad::Of(p, seg_info, k);
        WaitConverged(pipe.Full(stage, wg), phase);
        IssueHalfScores(q_addr, kv_addr, wg, s);
        float mx0, mx1, mh0, mh1;  // this half's maxima; the maxima after half 0

        if (wg == 0) {
          cute::warpgroup_wait<0>();
          FenceRegisters(s);
          if (k == seg_info.kv_end - 1 && wg_tid == 0) {
            cutlass::arch::ClusterBarrier::arrive(pipe.QEmpty());
          }
          MaskHalfScores(s, load.half_ok[0], k * kBlockN, lane, limit0, limit1, mx0, mx1);
          mh0 = fmaxf(m0, mx0);
          mh1 = fmaxf(m1, mx1);
          float sum0, sum1;
          Exponentiate(s, mh0, mh1, sl2, sum0, sum1, pr);
          const float alpha0 = RescaleFactor(m0, mh0, sl2);
          const float alpha1 = RescaleFactor(m1, mh1, sl2);
          l0 = l0 * alpha0 + sum0;
          l1 = l1 * alpha1 + sum1;
          StoreProbabilities(p_tile, pr, 0, r0, lane);
          if ((lane & 3) == 0) {
            half_max[r0] = mh0;
            half_max[r1] = mh1;
          }
          cutlass::arch::fence_view_async_shared();
          HandOff(kFirstHalfReadyBarrier);
          PrepareVHalf(stage_base, load, wg, 0, wg_tid);
          RescaleRows(o, alpha0, alpha1);
          IssuePvFromRegisters(pr, kv_addr, wg, 0, o);

          HandOff(kSecondHalfReadyBarrier);
          m0 = half_max[kBlockM + r0];
          m1 = half_max[kBlockM + r1];
          const float beta0 = RescaleFactor(mh0, m0, sl2);
          const float beta1 = RescaleFactor(mh1, m1, sl2);
          l0 *= beta0;
          l1 *= beta1;
          WaitConverged(pipe.Full(stage, 1), phase);
          PrepareVHalf(stage_base, load, wg, 1, wg_tid);
          cute::warpgroup_wait<0>();
          FenceRegisters(o);
          if (wg_tid == 0) ReleaseHalf<kCluster>(pipe, stage, 0);
          RescaleRows(o, beta0, beta1);
          IssuePvFromTile(p_addr, kv_addr, wg, 1, o);
        } else {
          HandOff(kFirstHalfReadyBarrier);
          mh0 = half_max[r0];
          mh1 = half_max[r1];
          const float alpha0 = RescaleFactor(m0, mh0, sl2);
          const float alpha1 = RescaleFactor(m1, mh1, sl2);
          l0 *= alpha0;
          l1 *= alpha1;
          // The scores are usually done by now (warpgroup 0 has scored and exponentiated its
          // half); waiting for them keeps every product in flight clear of the registers
          // rescaled next.
          cute::warpgroup_wait<0>();
          FenceRegisters(s);
          if (k == seg_info.kv_end - 1 && wg_tid == 0) {
            cutlass::arch::ClusterBarrier::arrive(pipe.QEmpty());
          }
          WaitConverged(pipe.Full(stage, 0), phase);
          PrepareVHalf(stage_base, load, wg, 0, wg_tid);
          RescaleRows(o, alpha0, alpha1);
          IssuePvFromTile(p_addr, kv_addr, wg, 0, o);
          MaskHalfScores(s, load.half_ok[1], k * kBlockN + kHalfN, lane, limit0, limit1, mx0,
                         mx1);
          m0 = fmaxf(mh0, mx0);
          m1 = fmaxf(mh1, mx1);
          float sum0, sum1;
          Exponentiate(s, m0, m1, sl2, sum0, sum1, pr);
          const float beta0 = RescaleFactor(mh0, m0, sl2);
          const float beta1 = RescaleFactor(mh1, m1, sl2);
          l0 = l0 * beta0 + sum0;
          l1 = l1 * beta1 + sum1;
          StoreProbabilities(p_tile, pr, 1, r0, lane);
          if ((lane & 3) == 0) {
            half_max[kBlockM + r0] = m0;
            half_max[kBlockM + r1] = m1;
          }
          cutlass::arch::fence_view_async_shared();
          PrepareVHalf(stage_base, load, wg, 1, wg_tid);
          // Half 0's P is read before warpgroup 0 overwrites it for the next block.
          cute::warpgroup_wait<0>();
          FenceRegisters(o);
          if (wg_tid == 0) ReleaseHalf<kCluster>(pipe, stage, 0);
          HandOff(kSecondHalfReadyBarrier);
          RescaleRows(o, beta0, beta1);
          IssuePvFromRegisters(pr, kv_addr, wg, 1, o);
        }
        cute::warpgroup_wait<0>();
        FenceRegisters(o);
        if (wg_tid == 0) ReleaseHalf<kCluster>(pipe, stage, 1);
      }
      StorePlain(p, seg_info, part, args.num_parts, rows, wg, lane, r0, gr0, gr1, o, l0, l1, m0,
                 m1, sl2, row_sum);
      ++seg;
    }
  }
  // The peer may still multicast into this CTA or arrive on its barriers until it is done.
  if (kCluster > 1) ClusterSync();
}

}  // namespace sm90
}  // namespace jax_mla
