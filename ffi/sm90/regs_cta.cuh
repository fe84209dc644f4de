// What both register-operand kernels' CTAs share: the start of their shared memory, the roles
// (one producer thread staging raw blocks, the consumer warpgroups running the kernel's own
// loop), a segment's start (the rows' causal limits and softmax state, the query tile
// converted), the warpgroups' hand-over, and the segment's output stores by column.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "decode_params.h"
#include "fragment_layout.h"
#include "pipeline.cuh"
#include "producer.cuh"
#include "regs_operands.cuh"
#include "regs_softmax.cuh"
#include "schedule.cuh"
#include "smem_layout.cuh"
#include "softmax.cuh"
#include "trace.cuh"

namespace jax_mla {
namespace sm90 {

// The start of both register-operand kernels' shared memory, byte offsets from the 1024-aligned
// base: the query tile of kRows rows (nine 128-byte-swizzled chunks: eight f16 latent, one bf16
// rope), the ring of kSlots raw 64-token stages, then from kP the P tiles (f16 [kRows rows][64
// tokens], K-major, kPTileBytes each) and what each kernel's layout adds after them.
template <int kSlots, int kRows>
struct RegsSmemLayoutBase {
  static constexpr bool kHalfStages = false;
  static constexpr bool kEveryThreadReleases = true;
  static constexpr int kStageSlots = kSlots;
  static constexpr int kQChunkRows = kRows;
  static constexpr int kQChunkBytes = kQChunkRows * kRowBytes;
  static constexpr int kQ = 0;
  static constexpr int kFp8Stages = kQ + kNumChunks * kQChunkBytes;
  static constexpr int kKv = kFp8Stages;  // no bf16 tile (ProduceTiles' bf16 branch names it)
  static constexpr int kPTileBytes = kQChunkRows * kRowBytes;
  static constexpr int kP = (kFp8Stages + kStageSlots * kFp8StageBytes + 1023) / 1024 * 1024;
};

namespace detail {

// The consumer warpgroups' hand-over of values written just after a warpgroup barrier (each
// thread's writes, then the other warpgroup's reads): ConsumerSync, twice. One orders them as well,
// but compute-sanitizer's racecheck reports such pairs as hazards after one barrier and not after
// two (docs/fp8-cache.md: the runs and what the second costs).
__device__ __forceinline__ void ConsumerHandover() {
  ConsumerSync();
  ConsumerSync();
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
      SegmentWalker walker(ScheduleView::Load(p, args.num_parts), part, RequestLengths::Of(p));
      ProduceTiles<1, true, Layout>(q_map, kv_map, args, smem, walker, 0, 0);
    }
    return;
  }
  GridDependencyWait();
  GridDependencyLaunchDependents();
  cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
  SM90_TRACE(kTraceStart, 0);
  SegmentWalker walker(ScheduleView::Load(p, args.num_parts), part, RequestLengths::Of(p));
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
  const DecodeParams& p = args.p;
  const int rows = p.q_len * p.num_heads;
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
    const float inv = RowInverse(l[i]);
    const float lse = RowLse(m[i], l[i], args.scale_log2);
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
}  // namespace sm90
}  // namespace jax_mla
