// The SM90 MLA decode kernel's "seesaw" variant for 64-row M tiles (q_len * num_heads > 32).
//
// Same CTA, producer, pipeline, schedule and epilogue as DecodeKernel (decode_kernel.cuh); the
// consumers differ. The KV blocks of a segment are taken in pairs (A, B), one per stage:
//  - warpgroup 0 scores all 64 tokens of A, warpgroup 1 those of B (S = Q K^T, WGMMA 64x64x16,
//    both warpgroups' products on the tensor pipe at once);
//  - warpgroup 0 runs A's softmax against the running maxima, publishes A's new maxima and its
//    bf16 probabilities P_A (into A's stage, over the rope chunk that nothing reads after A's
//    scores), and multiplies P_A by its 256 columns of V_A with P_A taken from registers;
//  - meanwhile warpgroup 1 takes P_A from shared memory for its 256 columns of V_A, then runs B's
//    softmax against A's maxima and publishes B's maxima and P_B the same way, and multiplies P_B
//    by its columns of V_B from registers;
//  - warpgroup 0 rescales its output to B's maxima and multiplies P_B (shared memory) by its
//    columns of V_B.
// So one warpgroup's softmax runs while the other's products occupy the tensor pipe, and stage A
// is released halfway through the pair. Both warpgroups end a pair with the same row maxima; each
// keeps the row sums of the blocks it scored, and the epilogue adds the two in a fixed order.
#pragma once

#include "decode_kernel.cuh"

namespace jax_mla {
namespace sm90 {
namespace detail {

using BlockScoreMma = cute::SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<cute::SM90::GMMA::Major::K,
                                                                     cute::SM90::GMMA::Major::K>;
using PvFromRegistersMma =
    cute::SM90::GMMA::MMA_64x256x16_F32BF16BF16_RS<cute::SM90::GMMA::Major::K,
                                                   cute::SM90::GMMA::Major::MN>;

// Named barriers of both consumer warpgroups, reached at different call sites (HandOff): the
// pair's first block's maxima and P are in shared memory (warpgroup 0 wrote them); the second
// block's (warpgroup 1).
constexpr int kFirstBlockReadyBarrier = 6;
constexpr int kSecondBlockReadyBarrier = 7;

// Both consumer warpgroups meet at named barrier `id` (numbered as cutlass::arch::NamedBarrier's),
// each from its own call site: barrier.sync without .aligned, which requires every thread of the
// CTA that reaches the barrier to execute the same instruction.
__device__ __forceinline__ void HandOff(int id) {
  const int hw_id =
      id + static_cast<int>(cutlass::arch::ReservedNamedBarriers::FirstUserBarrier);
  asm volatile("barrier.sync %0, %1;" ::"r"(hw_id), "n"(kConsumerThreads) : "memory");
}

// Where a block's P (64 rows x 64 tokens, bf16, one K-major swizzled chunk) lives: its stage's
// rope chunk.
constexpr int kPInStage = kNumVChunks * kChunkBytes;

template <class Mma, int N, size_t... I>
__device__ __forceinline__ void MmaRsImpl(const uint32_t (&a)[4], uint64_t desc_b, float (&d)[N],
                                          std::index_sequence<I...>) {
  Mma::fma(a[0], a[1], a[2], a[3], desc_b, d[I]..., cute::SM90::GMMA::ScaleOut::One);
}

// S = Q K^T over the 576 columns for the block's 64 tokens (this thread: 32 floats).
__device__ __forceinline__ void IssueBlockScores(uint32_t q_addr, uint32_t kv_addr,
                                                 float (&s)[32]) {
  FenceRegisters(s);
  cute::warpgroup_arrive();
  // A descriptor's start address field counts 16-byte units: a step's offset is added to it.
  const uint64_t q_desc = KMajorDesc(q_addr), kv_desc = KMajorDesc(kv_addr);
#pragma unroll
  for (int g = 0; g < kQkSteps; ++g) {
    const uint32_t units = QkStepOffset(g) >> 4;
    Gmma<BlockScoreMma>(q_desc + units, kv_desc + units, s, g != 0);
  }
  cute::warpgroup_commit_batch();
}

// Masks this thread's scores of the block (tokens token_base + Fragment::Col, rows with causal
// limits limit0 and limit1) to -inf past the limit or in a half that was not loaded, and returns
// the rows' maxima over the block (reduced over the quad that shares the rows).
__device__ __forceinline__ void MaskBlockScores(float (&s)[32], const BlockLoad& load,
                                                int token_base, int lane, int limit0, int limit1,
                                                float& max0, float& max1) {
  max0 = kNegInf;
  max1 = kNegInf;
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int tok = token_base + Fragment::Col(lane, j, e);
      const bool loaded = load.half_ok[j < kHalfN / 8 ? 0 : 1];  // column groups j of one half
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

// P = exp2((S - m) * scale_log2) for the thread's two rows (maxima m0, m1), summed per row, packed
// to bf16 as WGMMA A fragments: p[4 kk .. 4 kk + 3] are the thread's values of tokens
// [16 kk, 16 kk + 16), the accumulator fragment of a 64 x 64 product being the A fragment of the
// 64 x 16 k steps that consume it.
__device__ __forceinline__ void Exponentiate(const float (&s)[32], float m0, float m1,
                                             float scale_log2, float& sum0, float& sum1,
                                             uint32_t (&p)[16]) {
  const float nb0 = -MaxOffset(m0) * scale_log2;
  const float nb1 = -MaxOffset(m1) * scale_log2;
  sum0 = 0.f;
  sum1 = 0.f;
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j) {
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

// exp2((from - to) * scale_log2): the factor that moves values kept against maximum `from` to
// maximum `to` (>= from).
__device__ __forceinline__ float RescaleFactor(float from, float to, float scale_log2) {
  return Exp2((from - MaxOffset(to)) * scale_log2);
}

// Writes the thread's packed P values into a K-major swizzled P tile (rows r0 and r0 + 8).
__device__ __forceinline__ void StoreProbabilities(uint8_t* p_tile, const uint32_t (&p)[16],
                                                   int r0, int lane) {
#pragma unroll
  for (int j = 0; j < kBlockN / 8; ++j) {
    const int col = Fragment::Col(lane, j, 0);
    *reinterpret_cast<uint32_t*>(p_tile + SwizzledOffset(r0, col)) = p[2 * j];
    *reinterpret_cast<uint32_t*>(p_tile + SwizzledOffset(r0 + 8, col)) = p[2 * j + 1];
  }
}

// O[:, 256 wg : 256 wg + 256] += P V over the block's 64 tokens, P from registers.
__device__ __forceinline__ void IssuePvFromRegisters(uint32_t (&p)[16], uint32_t kv_addr, int wg,
                                                     float (&o)[128]) {
  FenceRegisters(o);
#pragma unroll
  for (int i = 0; i < 16; ++i) cute::warpgroup_fence_operand(p[i]);
  cute::warpgroup_arrive();
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk) {
    const uint32_t a[4] = {p[4 * kk], p[4 * kk + 1], p[4 * kk + 2], p[4 * kk + 3]};
    MmaRsImpl<PvFromRegistersMma>(
        a, MNMajorDesc(kv_addr + wg * (kNumVChunks / 2) * kChunkBytes + kk * 16 * kRowBytes), o,
        std::make_index_sequence<128>{});
  }
  cute::warpgroup_commit_batch();
}

// The same with P read from the block's stage (kPInStage).
__device__ __forceinline__ void IssuePvFromStage(uint32_t kv_addr, int wg, float (&o)[128]) {
  FenceRegisters(o);
  cute::warpgroup_arrive();
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk) {
    Gmma<PvMma>(KMajorDesc(kv_addr + kPInStage + kk * 32),
                MNMajorDesc(kv_addr + wg * (kNumVChunks / 2) * kChunkBytes + kk * 16 * kRowBytes),
                o, true);
  }
  cute::warpgroup_commit_batch();
}

// Waits for a pipeline barrier's phase. The wait spins inside inline assembly, so the warp's
// threads may leave it apart: they are reconverged before the aligned barriers and products that
// follow.
__device__ __forceinline__ void WaitConverged(uint64_t* barrier, uint32_t phase) {
  cutlass::arch::ClusterBarrier::wait(barrier, phase);
  __syncwarp();
}

// Makes the stage's unloaded rows safe for this warpgroup's PV (its four V chunks).
__device__ __forceinline__ void PrepareVHalf(uint8_t* stage_base, const BlockLoad& load, int wg,
                                             int wg_tid) {
  if (load.Complete()) return;
  ZeroUnloadedRows<kNumVChunks / 2, 128>(stage_base, load, wg * (kNumVChunks / 2), wg_tid);
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
  using Barrier = cutlass::arch::ClusterBarrier;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = SmemAddr(smem_raw);
  uint8_t* smem = smem_raw + ((kSmemAlign - (raw_addr & (kSmemAlign - 1))) & (kSmemAlign - 1));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kSmemBarriers);
  uint64_t* empty = full + kStages;
  uint64_t* q_full = full + 2 * kStages;
  uint64_t* q_empty = q_full + 1;

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
    // f32 [2][64]: the new row maxima after the pair's first block, after its second.
    float* pair_max = reinterpret_cast<float*>(smem + kSmemRowMax);
    float* row_sum = reinterpret_cast<float*>(smem + kSmemRowSum);
    const uint32_t q_addr = SmemAddr(smem + kSmemQ);
    const float sl2 = args.scale_log2;

    float o[128];    // this warpgroup's 64 x 256 output columns
    float s[32];     // scores of the block this warpgroup scores, 64 x 64
    uint32_t pr[16]; // its probabilities, bf16 A fragments
    int it = 0, seg = 0;
    while (walker.Next(seg_info)) {
      // Query token of row r is r / num_heads; it sees kv positions [0, len - q_len + token].
      const int limit0 = gr0 < rows ? seg_info.len - p.q_len + gr0 / p.num_heads : -1;
      const int limit1 = gr1 < rows ? seg_info.len - p.q_len + gr1 / p.num_heads : -1;
      float m0 = kNegInf, m1 = kNegInf, l0 = 0.f, l1 = 0.f;
#pragma unroll
      for (int i = 0; i < 128; ++i) o[i] = 0.f;
      WaitConverged(q_full, seg & 1);

      for (int k = seg_info.kv_begin; k < seg_info.kv_end; k += 2) {
        const bool has_second = __shfl_sync(0xffffffffu, k + 1 < seg_info.kv_end, 0);
        const bool last_pair = k + 2 >= seg_info.kv_end;
        const int stage_a = it % kStages, stage_b = (it + 1) % kStages;
        const uint32_t phase_a = (it / kStages) & 1, phase_b = ((it + 1) / kStages) & 1;
        uint8_t* base_a = smem + kSmemKv + stage_a * kTileBytes;
        uint8_t* base_b = smem + kSmemKv + stage_b * kTileBytes;
        const uint32_t kv_a = SmemAddr(base_a), kv_b = SmemAddr(base_b);
        const BlockLoad load_a = BlockLoad::Of(p, seg_info, k);
        const BlockLoad load_b = has_second ? BlockLoad::Of(p, seg_info, k + 1) : load_a;
        float ma0, ma1, mb0, mb1;  // row maxima after block A, after block B

        if (wg == 0) {
          WaitConverged(&full[stage_a], phase_a);
          IssueBlockScores(q_addr, kv_a, s);
          cute::warpgroup_wait<0>();
          FenceRegisters(s);
          if (last_pair && wg_tid == 0) Barrier::arrive(q_empty);
          float mx0, mx1;
          MaskBlockScores(s, load_a, k * kBlockN, lane, limit0, limit1, mx0, mx1);
          ma0 = fmaxf(m0, mx0);
          ma1 = fmaxf(m1, mx1);
          float sum0, sum1;
          Exponentiate(s, ma0, ma1, sl2, sum0, sum1, pr);
          const float alpha0 = RescaleFactor(m0, ma0, sl2);
          const float alpha1 = RescaleFactor(m1, ma1, sl2);
          l0 = l0 * alpha0 + sum0;
          l1 = l1 * alpha1 + sum1;
          StoreProbabilities(base_a + kPInStage, pr, r0, lane);
          if ((lane & 3) == 0) {
            pair_max[r0] = ma0;
            pair_max[r1] = ma1;
          }
          cutlass::arch::fence_view_async_shared();
          HandOff(kFirstBlockReadyBarrier);
          PrepareVHalf(base_a, load_a, wg, wg_tid);
          RescaleRows(o, alpha0, alpha1);
          IssuePvFromRegisters(pr, kv_a, wg, o);

          HandOff(kSecondBlockReadyBarrier);
          mb0 = has_second ? pair_max[kBlockM + r0] : ma0;
          mb1 = has_second ? pair_max[kBlockM + r1] : ma1;
          const float beta0 = RescaleFactor(ma0, mb0, sl2);
          const float beta1 = RescaleFactor(ma1, mb1, sl2);
          l0 *= beta0;
          l1 *= beta1;
          cute::warpgroup_wait<0>();
          FenceRegisters(o);
          if (wg_tid == 0) ReleaseStage<kCluster>(&empty[stage_a]);
          if (has_second) {
            WaitConverged(&full[stage_b], phase_b);
            PrepareVHalf(base_b, load_b, wg, wg_tid);
            RescaleRows(o, beta0, beta1);
            IssuePvFromStage(kv_b, wg, o);
            cute::warpgroup_wait<0>();
            FenceRegisters(o);
            if (wg_tid == 0) ReleaseStage<kCluster>(&empty[stage_b]);
          }
        } else {
          // Without a second block the scores of A are computed again and discarded: the
          // product is issued on every path, so the compiler can track it to its wait.
          WaitConverged(&full[has_second ? stage_b : stage_a], has_second ? phase_b : phase_a);
          IssueBlockScores(q_addr, has_second ? kv_b : kv_a, s);
          WaitConverged(&full[stage_a], phase_a);
          HandOff(kFirstBlockReadyBarrier);
          ma0 = pair_max[r0];
          ma1 = pair_max[r1];
          const float alpha0 = RescaleFactor(m0, ma0, sl2);
          const float alpha1 = RescaleFactor(m1, ma1, sl2);
          l0 *= alpha0;
          l1 *= alpha1;
          // The scores are usually done by now (warpgroup 0 has scored and exponentiated A);
          // waiting for them keeps every product in flight clear of the registers rescaled next.
          cute::warpgroup_wait<0>();
          FenceRegisters(s);
          PrepareVHalf(base_a, load_a, wg, wg_tid);
          RescaleRows(o, alpha0, alpha1);
          IssuePvFromStage(kv_a, wg, o);
          if (last_pair && wg_tid == 0) Barrier::arrive(q_empty);
          mb0 = ma0;
          mb1 = ma1;
          float beta0 = 1.f, beta1 = 1.f;
          if (has_second) {
            float mx0, mx1;
            MaskBlockScores(s, load_b, (k + 1) * kBlockN, lane, limit0, limit1, mx0, mx1);
            mb0 = fmaxf(ma0, mx0);
            mb1 = fmaxf(ma1, mx1);
            float sum0, sum1;
            Exponentiate(s, mb0, mb1, sl2, sum0, sum1, pr);
            beta0 = RescaleFactor(ma0, mb0, sl2);
            beta1 = RescaleFactor(ma1, mb1, sl2);
            l0 = l0 * beta0 + sum0;
            l1 = l1 * beta1 + sum1;
            StoreProbabilities(base_b + kPInStage, pr, r0, lane);
            if ((lane & 3) == 0) {
              pair_max[kBlockM + r0] = mb0;
              pair_max[kBlockM + r1] = mb1;
            }
            cutlass::arch::fence_view_async_shared();
          }
          HandOff(kSecondBlockReadyBarrier);
          cute::warpgroup_wait<0>();
          FenceRegisters(o);
          if (wg_tid == 0) ReleaseStage<kCluster>(&empty[stage_a]);
          if (has_second) {
            PrepareVHalf(base_b, load_b, wg, wg_tid);
            RescaleRows(o, beta0, beta1);
            IssuePvFromRegisters(pr, kv_b, wg, o);
            cute::warpgroup_wait<0>();
            FenceRegisters(o);
            if (wg_tid == 0) ReleaseStage<kCluster>(&empty[stage_b]);
          }
        }
        m0 = mb0;
        m1 = mb1;
        it += has_second ? 2 : 1;
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
