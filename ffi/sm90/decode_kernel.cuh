// The SM90 (Hopper) MLA decode kernel: persistent split-KV over a GPU-built schedule.
//
// CTA = 2 consumer warpgroups + 1 producer warpgroup (384 threads), one CTA per SM; a 1-D grid of
// parts x M tiles. Each CTA walks the (request, KV block) range that the schedule gives its part:
//  - one producer thread loads the 64-row query tile once per request segment and every 64-token
//    KV tile (64 x 576 bf16) as 64-column bulk-tensor pieces of one page (64 rows) or of two
//    pages of 32 into a 2-stage mbarrier pipeline; a stage goes back to the producer once both
//    warpgroups are done reading it (in two parts with kSplitRelease, below; on the fp8 cache once
//    its rows are converted);
//  - QK^T: consumer warpgroup 0 computes the scores of all 64 tokens for all 64 rows (WGMMA
//    64x64x16, both operands in shared memory) and their online softmax, and writes the bf16
//    probabilities P over the block's rope chunk (which only QK^T reads) and each row's rescale
//    factor to shared memory;
//  - both warpgroups run PV over the 64 tokens for their own 256 output columns (WGMMA 64x256x16,
//    V read as the transposed view of the KV tile in place), warpgroup 1 after rescaling its half
//    of the output by warpgroup 0's factors;
//  - with kColumnHalves (few requests, where the grid has more SMs than the schedule has blocks
//    to share out) the grid holds two CTAs of each part and M tile: both score the part's blocks,
//    each runs PV and the stores for 256 of the 512 columns, 128 a warpgroup;
//  - a request handled whole writes bf16 output and LSE; a split one writes its partial output
//    (bf16 in 64-row tiles, fp32 in the transposed kernels) and LSE to the workspace for the
//    combine kernel.
// Optionally (kCluster == 2) two CTAs holding consecutive M tiles share each KV tile by multicast.
// Up to 32 query rows the scores and PV are computed transposed (kScoreN; on the fp8 cache the
// register-operand kernels run those rows unless LaunchOptions asks for this one). With the fp8
// cache (kFp8) the producer stages raw cache rows that the consumers convert into one bf16 KV tile
// per block.
// The kernel is below; PrepareKvTile before it makes a landed block ready for the MMAs, and the
// pieces both use live in one header per concern (producer, kv_blocks, pipeline, mma, softmax,
// fp8_convert, epilogue).
// Safety: only pages whose id is in range and that hold tokens below the request's length
// (RequestLengths: clamped to the table's capacity, or 0) are loaded from the cache (with pages of
// 64 the whole page, its tail included); the shared-memory rows of tokens at or beyond the length
// or of pages not loaded are zeroed (so 0 * NaN never enters PV) and their scores masked to -inf
// by select. Failing closed, a segment whose request reads a page out of range stores out 0 and
// lse -inf.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "decode_params.h"
#include "epilogue.cuh"
#include "fp8_convert.cuh"
#include "fragment_layout.h"
#include "kv_blocks.cuh"
#include "mma.cuh"
#include "pipeline.cuh"
#include "producer.cuh"
#include "schedule.cuh"
#include "smem_layout.cuh"
#include "softmax.cuh"
#include "trace.cuh"

namespace jax_mla {
namespace sm90 {

namespace detail {

// A block's KV tile made ready for its MMAs; every consumer thread calls it, once the block's
// stage has landed (the fp8 cache's 64-row tiles: each warpgroup waits here for its half stage,
// HalfSlot):
//  - the fp8 cache, 64-row tiles: both warpgroups' PV of the previous block are done with the
//    bf16 tile. Warpgroup wg converts half wg of the block (tokens [32 wg, 32 wg + 32), all
//    columns) from that half's stage, and each thread hands the stage back after its reads; the
//    fence orders the stage's reads before its refill (async proxy) and the tile's writes before
//    QK^T's WGMMAs.
//  - the fp8 cache, transposed scores: the warpgroup's PV of the previous block is done with its
//    columns of the bf16 tile. Its new values are fenced for the WGMMAs before the warpgroup
//    barrier where QK^T reads them (32 rows), else by the fence before PV; up to 16 rows the keys
//    also go into frag. After the second warpgroup barrier (its reads of the staged rows done)
//    thread 0 of each warpgroup hands the stage back.
//  - the bf16 cache: the V columns of the rows the block did not load are zeroed by all consumer
//    threads (so that 0 x NaN never enters PV; with kSplitRelease warpgroup 1 also writes
//    warpgroup 0's V chunks, hence the caller's wait for them), fenced for the WGMMAs and behind
//    a consumer barrier. The stage goes back after PV.
template <int kCluster, int kScoreN, bool kFp8>
__device__ __forceinline__ void PrepareKvTile(uint8_t* smem, const Pipeline& pipe,
                                              const BlockLoad& load, int it, int stage, int wg,
                                              int wg_tid, int tid, KFragments& frag) {
  using Layout = KernelSmemLayout<kFp8, kScoreN>;
  if constexpr (kFp8 && kScoreN == 0) {
    const int half_row = wg * kHalfN + wg_tid % kHalfN;  // the (row, part) this thread converts
    const int half_part = wg_tid / kHalfN;
    ConsumerSync();
    const HalfSlot slot = HalfSlot::Of<Layout>(it, wg);
    cutlass::arch::ClusterBarrier::wait(pipe.Full(slot.index), slot.round & 1);
    DequantiseRow(smem + Layout::kFp8Stages + slot.index * kFp8HalfStageBytes +
                      (wg_tid % kHalfN) * kFp8RowBytes,
                  load.RowLoaded(half_row), half_part, smem + Layout::kKv, half_row);
    cutlass::arch::fence_view_async_shared();
    ReleaseStage<kCluster>(pipe, slot.index);
    ConsumerSync();  // warpgroup 0's QK^T reads both halves
  } else if constexpr (kFp8) {
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
// kColumnHalves (the 64-row tiles): args.num_parts parts in a grid of 2 x num_parts x
// M tiles CTAs; CTA (part + num_parts half, M tile) walks the part's blocks as CTA (part, M tile)
// does and keeps output columns [256 half, 256 half + 256): warpgroup w accumulates and stores
// columns [128 (2 half + w), + 128), a 64 x 128 accumulator, and the LSE comes from half 0.
// kFp8: the cache is the fp8 cache. The producer stages raw cache rows; at each block the consumers
// convert them into the one bf16 KV tile, which QK^T and PV read.
// The latent values go into the tile times their group's scale, exact for the power-of-two scales
// write_kv writes (docs/fp8-cache.md); the rest is the bf16 cache's path.
//  - Transposed scores (LaunchOptions::fp8_registers = 0; by default the register-operand kernels
//    run up to 32 rows): each warpgroup converts the columns it reads in QK^T and PV (its two
//    latent groups and half the rope, ScoresFp8*), and both hand the stage back. Up to 16 query rows
//    (kScoreN 16) each thread also keeps its tokens' converted values as QK^T A fragments in
//    registers (LoadKFragments) and QK^T runs from them against the column-permuted query tile;
//    with 32 rows QK^T reads the tile (DequantiseRow).
//  - 64-row tiles (kScoreN 0): once both warpgroups' PV of the block before is done, warpgroup w
//    converts half w of the block (32 tokens, all columns) from its 32-token stage (HalfSlot);
//    once both halves are in the tile, warpgroup 0 scores the block as in the bf16 cache's 64-row
//    tiles (kWg0Scores), with P over the tile's rope chunk.
template <bool kEarlyRelease, int kSkip = 0, int kCluster = 1, int kScoreN = 0, bool kFp8 = false,
          bool kSplitRelease = false, bool kColumnHalves = false>
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
  static_assert(!kColumnHalves || (kWg0Scores && !kSplitRelease && kSkip == 0),
                "column halves are the 64-row tiles'");
  static_assert(4 * kScoreN <= kConsumerWarpgroups * kBlockM,
                "a warpgroup's exchange buffer, f32 [4][kScoreN], must fit its 64 x 2 floats");
  using namespace detail;
  using Barrier = cutlass::arch::ClusterBarrier;

  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = SmemAddr(smem_raw);
  uint8_t* smem = smem_raw + ((kSmemAlign - (raw_addr & (kSmemAlign - 1))) & (kSmemAlign - 1));
  const Pipeline pipe = Pipeline::At<Layout>(smem);

  SM90_TRACE_KERNEL(kTracedDecode, kKernelEntry);
  const DecodeParams& p = args.p;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int rows = p.q_len * p.num_heads;
  const int m_tiles = NumMTiles(p.q_len, p.num_heads);
  const int mtile = blockIdx.x % m_tiles;
  // kColumnHalves: the output columns [256 half, 256 half + 256) of the part.
  const int part = kColumnHalves ? blockIdx.x / m_tiles % args.num_parts : blockIdx.x / m_tiles;
  const int half = kColumnHalves ? blockIdx.x / m_tiles / args.num_parts : 0;

  SetUpCta<kCluster, Layout, kSplitRelease>(smem, args.q_box_rows, tid);
  const uint32_t cta_rank = kCluster > 1 ? ClusterCtaRank() : 0;

  if (warp >= kConsumerThreads / 32) {
    // ---------------------------------------------------------------- producer warpgroup
    if constexpr (!kFp8 && kScoreN == 0) {
      if (p.batch <= kPrefetchMaxBatch && warp == kConsumerThreads / 32 + 1 && lane == 0) {
        // The part's CTAs of the two column halves ask for every other half block.
        PrefetchFirstKvBlocks(p, args.num_parts, part,
                              kColumnHalves ? mtile + m_tiles * half : mtile,
                              kColumnHalves ? 2 * m_tiles : m_tiles);
      }
    }
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    // Everything below reads inputs that earlier kernels in the stream may write.
    GridDependencyWait();
    GridDependencyLaunchDependents();
    if (warp == kConsumerThreads / 32 && lane == 0) {
      SegmentWalker walker(ScheduleView::Load(p, args.num_parts), part, RequestLengths::Of(p));
      ProduceTiles<kCluster, kFp8, Layout, (kSkip & 32) != 0, kSplitRelease>(
          q_map, kv_map, args, smem, walker, mtile, cta_rank);
    }
  } else {
  // ------------------------------------------------------------------ consumer warpgroups
  GridDependencyWait();
  GridDependencyLaunchDependents();
  SM90_TRACE(kTraceStart, 0);
  SM90_TRACE_KERNEL(kTracedDecode, kKernelWaited);
  cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
  SegmentWalker walker(ScheduleView::Load(p, args.num_parts), part, RequestLengths::Of(p));
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

  // Output accumulator of this warpgroup's 256 columns: O, 64 rows x 256 fp32 in one tile (with
  // kColumnHalves 128 columns); with transposed scores O^T, four tiles of 64 columns x kScoreN
  // rows (fragment_layout.h).
  constexpr int kOTiles = kScoreN > 0 ? kNumVChunks / kConsumerWarpgroups : 1;
  constexpr int kOPerTile = kScoreN > 0     ? kScoreN / 2
                            : kColumnHalves ? kLatentDim / 4 / 2
                                            : kLatentDim / kConsumerWarpgroups / 2;
  // The 64-row tiles: this warpgroup's output columns, block col_block of 2 kOPerTile columns
  // ([256 wg, 256 wg + 256), or with kColumnHalves [128 (2 half + wg), + 128)).
  const int col_block = kColumnHalves ? 2 * half + wg : wg;
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
  using QkT = TransposedMma<kScoreN == 16 ? 16 : 32, cute::SM90::GMMA::Major::K>;
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

    const bool saw_foreign_page = ThreadSeesForeignPage(p, seg_info, tid);
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
      const int stage = it % kStages;  // with half stages (kFp8, kScoreN 0): PrepareKvTile
      BlockPages next = {{-1, -1}};
      if (k + 1 < seg_info.kv_end) next = BlockPages::Read(p, seg_info, k + 1);
      // Half stages: PrepareKvTile waits for each warpgroup's half.
      if (!Layout::kHalfStages) Barrier::wait(pipe.Full(stage), (it / kStages) & 1);
      // With kSplitRelease warpgroup 1 reads warpgroup 0's V chunks only to zero unloaded rows
      // (PrepareKvTile).
      if (kSplitRelease && (wg == 0 || !load.Complete())) {
        Barrier::wait(pipe.V0Full(stage), (it / kStages) & 1);
      }
      SM90_TRACE(kTraceBlockReady, k);
      const uint32_t kv_addr = kv_addr0 + (kFp8 ? 0 : stage * kTileBytes);
      const int token_base = k * kBlockN;
      const bool half_ok0 = load.half_ok[0];
      const bool half_ok1 = load.half_ok[1];
      KFragments frag;  // fp8 cache, up to 16 rows: the block's keys as QK^T's A operand
      PrepareKvTile<kCluster, kScoreN, kFp8>(smem, pipe, load, it, stage, wg, wg_tid, tid, frag);
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
        // columns (with the fp8 cache: its two latent groups and half the rope);
        // ExchangePartialScores then completes its owned rows' scores.
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
        ExchangePartialScores<kScoreN, kFp8>(smem, wg, wg_tid, st, so);
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
        // before PV; the next block writes them only after ExchangePartialScores' barrier, which
        // the other warpgroup reaches only after reading these.
        if (warp_in_wg == 0 && lane < 4) {
#pragma unroll
          for (int k = 0; k < kOwnRowsT; ++k) {
            row_stats[stats_q * kRowsT + own_first + k] = alpha_o[k];
          }
        }
        // Both warpgroups are past the previous block's PV (each waited for its own at the end of
        // that block, kEarlyRelease, before ExchangePartialScores' barrier): P can be rewritten.
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
          // The bf16 cache's scores in two accumulator chains (even and odd k steps), added once
          // both are done, so that consecutive WGMMAs do not wait on each other's accumulator
          // (one chain where a second does not pay or does not fit: the fp8 cache, the split
          // release).
          constexpr int kChains = kFp8 || kSplitRelease ? 1 : 2;
          float s_full[kBlockM * kBlockN / 128];
          float s_odd[kBlockM * kBlockN / 128];
          FenceRegisters(s_full);
          if constexpr (kChains == 2) FenceRegisters(s_odd);
          cute::warpgroup_arrive();
          if (kSkip & 1) {
#pragma unroll
            for (int i = 0; i < 32; ++i) s_full[i] = s_odd[i] = 0.f;
          }
          const uint64_t q_desc = KMajorDesc(q_addr), k_desc = KMajorDesc(kv_addr);
#pragma unroll
          for (int g = 0; g < ((kSkip & 1) ? 0 : kQkSteps); ++g) {
            const uint64_t a = DescAdd(q_desc, QkStepOffset(g));
            const uint64_t b = DescAdd(k_desc, QkStepOffset(g));
            if (g % kChains == 0) {
              Gmma<QkMma64>(a, b, s_full, g >= kChains);
            } else {
              Gmma<QkMma64>(a, b, s_odd, g >= kChains);
            }
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
          if constexpr (kChains == 2) {
            FenceRegisters(s_odd);
#pragma unroll
            for (int i = 0; i < 32; ++i) s_full[i] += s_odd[i];
          }
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
        IssueTransposedPv(o_tiles, kv_addr, p_addr, wg);
      } else {
        // With kSplitRelease warpgroup 0 reads its own copy of P (the P tile): the rope chunk may
        // be refilled under its PV.
        const uint32_t pv_p_addr = SmemAddr(kSplitRelease && wg == 0 ? p_tile : p_block);
        IssuePv<(kSkip & 2) != 0>(o, kv_addr, pv_p_addr, col_block);
      }
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
    if (SegmentReadsForeignPage(p, saw_foreign_page)) {
      Zero(o_tiles);
      Zero(l_o);
      l0 = l1 = 0.f;
    }

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
    StorePlain(p, seg_info, part, args.num_parts, rows, wg, col_block, wg == 0 && half == 0, lane,
               r0, gr0, gr1, o, l0, l1, m0, m1, sl2, args.bf16_partials, row_sum,
               p_tile + warp * kBounceBytes);
    }  // kScoreN == 0
    SM90_TRACE(kTraceStoreEnd, 0);
    ++seg;
  }
  SM90_TRACE(kTraceEnd, 0);
  SM90_TRACE_KERNEL(kTracedDecode, kKernelExit);
  }
  // The peer may still multicast into this CTA or arrive on its barriers until it is done.
  if (kCluster > 1) ClusterSync();
}

}  // namespace sm90
}  // namespace jax_mla
