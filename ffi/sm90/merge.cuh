// Merging split requests inside the SM90 decode kernel (DecodeKernelArgs::merge_splits), instead of
// a combine kernel after it.
//
// Every CTA of the decode grid is resident at once (one per SM, launched cooperatively: the launch
// fails rather than leave a CTA waiting for one that cannot start). A CTA that stored a split
// segment's partial results of (request b, M tile m) counts it on the counter of (b, m); once it
// has decoded all its segments it waits until the counter shows every split of (b, m) stored
// (n, the parts the request spans), then merges its share of the M tile's rows (MergeSplitRow,
// the wide combine's merge, so the results are the same bits). Each CTA counts its merge too: the
// last of the n to pass its wait (the one that brings the counter to 2n) sets it back to 0, so the
// counters are zero whenever no decode of their slot runs. A decode only touches them after its
// GridDependencyWait, which returns once the kernel before it in the stream has completed.
//
// The counters live in a pool per device (g_merge_counters: zero when the module loads), one slot
// per caller (DecodeParams::merge_slot). Requests with no KV block are written here as well (by
// the CTA whose index is the request's modulo the grid), so no kernel follows the decode.
#pragma once

#include <cstdint>

#include "combine_kernel.cuh"
#include "decode_params.h"
#include "schedule.cuh"

namespace jax_mla {
namespace sm90 {

// Partial rows in flight per lane in the merge: as many as the decode kernel's registers hold
// without spilling.
constexpr int kMergeRowsInFlightBf16 = 16;
constexpr int kMergeRowsInFlightF32 = 8;

__device__ uint32_t g_merge_counters[kMergeCounterSlots * kMergeCountersPerSlot];

// Whether a decode of `batch` requests in m_tiles M tiles can merge its splits with the counters of
// `slot`.
__host__ __device__ __forceinline__ bool MergeCountersFit(int slot, int batch, int m_tiles) {
  return slot >= 0 && slot < kMergeCounterSlots &&
         static_cast<long long>(batch) * m_tiles <= kMergeCountersPerSlot;
}

__device__ __forceinline__ uint32_t* MergeCounter(int slot, int b, int m_tiles, int mtile) {
  return g_merge_counters + static_cast<size_t>(slot) * kMergeCountersPerSlot + b * m_tiles + mtile;
}

__device__ __forceinline__ uint32_t LoadAcquire(const uint32_t* ptr) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
  return v;
}

// One thread, after a barrier that every thread which stored the split's partial results passed.
__device__ __forceinline__ void CountStoredSplit(uint32_t* counter) {
  __threadfence();
  atomicAdd(counter, 1u);
}

// One thread: waits until the n splits of the counter's (request, M tile) are stored, then counts
// this CTA's merge; the last CTA to do so leaves the counter at zero for the next decode.
__device__ __forceinline__ void WaitForSplits(uint32_t* counter, uint32_t n) {
  while (LoadAcquire(counter) < n) __nanosleep(64);
  if (atomicAdd(counter, 1u) == 2 * n - 1) atomicExch(counter, 0u);
}

// This CTA's share of the merge of M tile `mtile` of split request b, which part `part` decoded a
// segment of: the tile's rows part - first, part - first + n, ... (n: the request's parts),
// kConsumerThreads / 32 / kCombineWarpsPerRow rows at a time. `sync` is a barrier of the
// kConsumerThreads threads that call this; thread 0 waits for the splits.
template <class Sync>
__device__ __forceinline__ void MergeSplitTile(const DecodeParams& p, const ScheduleView& view,
                                               int num_parts, int part, int b, int mtile,
                                               int m_tiles, bool bf16_partials, int tid,
                                               Sync sync) {
  constexpr int kRowGroups = kConsumerThreads / 32 / kCombineWarpsPerRow;
  const SplitRequest req = SplitRequest::Load(p, view, num_parts, b);
  const int n = req.last - req.first + 1;
  if (tid == 0) WaitForSplits(MergeCounter(p.merge_slot, b, m_tiles, mtile), n);
  sync();
  const int rows = p.q_len * p.num_heads;
  const int tile_rows = min(kBlockM, rows - mtile * kBlockM);
  const int warp = tid / 32, lane = tid % 32;
  for (int r = part - req.first + (warp / kCombineWarpsPerRow) * n; r < tile_rows;
       r += kRowGroups * n) {
    const int row = mtile * kBlockM + r;
    if (bf16_partials) {
      MergeSplitRow<kMergeRowsInFlightBf16, true>(p, req, b, rows, row, warp % kCombineWarpsPerRow, lane);
    } else {
      MergeSplitRow<kMergeRowsInFlightF32, false>(p, req, b, rows, row, warp % kCombineWarpsPerRow, lane);
    }
  }
}

// Zeros and LSE -inf for the requests with no KV block among b = cta, cta + ctas, ... (one warp per
// output row) by the kConsumerThreads threads of the CTA.
__device__ __forceinline__ void WriteEmptyRequests(const DecodeParams& p, int cta, int ctas,
                                                   int tid) {
  constexpr int kWarps = kConsumerThreads / 32;
  const int rows = p.q_len * p.num_heads;
  for (int b = cta; b < p.batch; b += ctas) {
    if (NumKvBlocks(EffectiveLength(p.seq_lens[b], p.max_pages, p.page_size)) != 0) continue;
    for (int row = tid / 32; row < rows; row += kWarps) WriteEmptyRow(p, rows, b, row, tid % 32);
  }
}

}  // namespace sm90
}  // namespace jax_mla
