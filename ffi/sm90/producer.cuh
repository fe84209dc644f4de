// The producer thread of the decode kernels: query tiles and KV blocks (bulk-tensor pieces of the
// bf16 cache, whole rows of the fp8 cache) into the pipeline's stages, and the first blocks asked
// of L2 before the dependency wait.
#pragma once

#include <cuda.h>

#include <cstdint>

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include "decode_params.h"
#include "kv_blocks.cuh"
#include "pipeline.cuh"
#include "schedule.cuh"
#include "smem_layout.cuh"

namespace jax_mla {
namespace sm90 {
namespace detail {

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

// Stages kHalfN contiguous fp8 cache rows from `row` on into `dst`, completing on `full`, by one
// plain bulk copy.
__device__ __forceinline__ void StageFp8Rows(const DecodeKernelArgs& args, uint8_t* dst, int row,
                                             uint64_t* full) {
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
          StageFp8Rows(args, smem + Layout::kFp8Stages + slot.index * kFp8HalfStageBytes,
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
          StageFp8Rows(args, stage_base + h * kFp8HalfStageBytes, kv_rows[h], full);
        }
        continue;
      }
      // One box per page of the block and chunk: a 64-row box for pages of 64 (the page's tail
      // past the length included: it lies inside the page, and the consumers zero and mask it),
      // two 32-row boxes for pages of 32 (the map's box rows follow the page size). A barrier
      // expects the bytes of the boxes issued under it. The boxes go out chunk by chunk: with
      // pages of 32 the two CTAs of a multicasting pair then issue a chunk's two pages together.
      uint8_t* stage_base = smem + Layout::kKv + stage * kTileBytes;
      const int boxes = p.page_size == kBlockN ? 1 : 2;
      const uint32_t bytes_per_chunk =
          ((kv_rows[0] >= 0) + (boxes > 1 && kv_rows[1] >= 0)) * (kChunkBytes / boxes);
      auto load_chunks = [&](int c_begin, int c_end, uint64_t* barrier) {
        TxBarrier::arrive_and_expect_tx(barrier, kNoLoad ? 0 : (c_end - c_begin) * bytes_per_chunk);
#pragma unroll 1
        for (int c = c_begin; c < c_end; ++c) {
#pragma unroll
          for (int h = 0; h < (kNoLoad ? 0 : 2); ++h) {
            const int kv_row = kv_rows[h];
            if (h >= boxes || kv_row < 0) continue;
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

}  // namespace detail
}  // namespace sm90
}  // namespace jax_mla
