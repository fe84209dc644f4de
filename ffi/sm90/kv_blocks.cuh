// Which cache rows a KV block reads (block-table entries checked against the cache and the
// clamped length) and the zeroing of the rows a block did not load, so that 0 x NaN never enters
// PV.
#pragma once

#include <cstdint>

#include "decode_params.h"
#include "pipeline.cuh"
#include "schedule.cuh"
#include "smem_layout.cuh"

namespace jax_mla {
namespace sm90 {
namespace detail {

// Request b's block-table entry for the page that holds token0, as read (not yet checked).
__device__ __forceinline__ int TableEntry(const DecodeParams& p, int b, int token0) {
  return p.block_tables[static_cast<long long>(b) * p.max_pages + (token0 >> PageShift(p))];
}

// Whether a block-table entry names a page of the cache.
__device__ __forceinline__ bool PageInRange(const DecodeParams& p, int page) {
  return page >= 0 && page < p.num_pages;
}

// Cache row of the 32 tokens starting at token0 (a multiple of 32) of request b, or -1 when they
// are beyond the length or their page id is out of range.
__device__ __forceinline__ int KvRow(const DecodeParams& p, int b, int token0, int len) {
  if (token0 >= len) return -1;
  const int page = TableEntry(p, b, token0);
  if (!PageInRange(p, page)) return -1;
  return page * p.page_size + (token0 & (p.page_size - 1));
}

// The block table entries of the two 32-token halves of a segment's KV block k as read (-1 for a
// half past the length), not yet checked: a kernel reads them a block ahead and checks them
// (BlockLoad::Of) where it needs them, so that nothing waits for the read before.
struct BlockPages {
  int page[2];

  __device__ __forceinline__ static BlockPages Read(const DecodeParams& p, const Segment& seg,
                                                    int k) {
    BlockPages v;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int token0 = k * kBlockN + h * kHalfN;
      v.page[h] = token0 < seg.len ? TableEntry(p, seg.b, token0) : -1;
    }
    return v;
  }
};

// What of a 64-token KV block was loaded: tokens [0, n_valid) are below the length, and the
// 32-token halves whose page id is in range (half_ok[h]); the rest of the stage holds stale data.
struct BlockLoad {
  int n_valid;
  bool half_ok[2];

  __device__ __forceinline__ static BlockLoad Of(const DecodeParams& p, const Segment& seg, int k) {
    return Of(p, seg, k, BlockPages::Read(p, seg, k));
  }
  // The same from block k's table entries read before (BlockPages::Read).
  __device__ __forceinline__ static BlockLoad Of(const DecodeParams& p, const Segment& seg, int k,
                                                 const BlockPages& pages) {
    BlockLoad v;
    v.n_valid = min(kBlockN, seg.len - k * kBlockN);
#pragma unroll
    for (int h = 0; h < 2; ++h) v.half_ok[h] = PageInRange(p, pages.page[h]);
    return v;
  }
  __device__ __forceinline__ bool Complete() const {
    return n_valid == kBlockN && half_ok[0] && half_ok[1];
  }
  __device__ __forceinline__ bool RowLoaded(int row) const {
    return row < n_valid && (row < kHalfN ? half_ok[0] : half_ok[1]);
  }
};

// Failing closed (DecodeParams::fail_closed), whether this consumer thread's share of the
// block-table entries that request seg.b reads (those below ceil(seg.len / page_size), every
// kConsumerThreads-th from tid) holds one that is no page of the cache. Read at a segment's start;
// SegmentReadsForeignPage combines the threads' answers where the segment's results are stored.
__device__ __forceinline__ bool ThreadSeesForeignPage(const DecodeParams& p, const Segment& seg,
                                                      int tid) {
  if (!p.fail_closed) return false;
  const int pages = (seg.len + p.page_size - 1) >> PageShift(p);
  const int32_t* row = p.block_tables + static_cast<long long>(seg.b) * p.max_pages;
  bool foreign = false;
#pragma unroll 4
  for (int i = tid; i < pages; i += kConsumerThreads) foreign |= !PageInRange(p, row[i]);
  return foreign;
}

// Failing closed, whether any consumer thread saw a foreign page (ThreadSeesForeignPage): the
// segment then stores out 0 and lse -inf (Zero on its output and row sums), as does every other
// segment of the request, so the combine writes the same. Every consumer thread calls it.
__device__ __forceinline__ bool SegmentReadsForeignPage(const DecodeParams& p, bool thread_saw) {
  return p.fail_closed && ConsumerSyncAny(thread_saw);
}

// Sets every value of `values` to 0 (a segment's output and row sums: a row sum of 0 gives lse
// -inf). The empty volatile asm cannot be executed speculatively, so a caller's
// `if (...) Zero(...)` stays a branch instead of becoming one select per value that every segment
// executes.
template <int N>
__device__ __forceinline__ void Zero(float (&values)[N]) {
  asm volatile("");
#pragma unroll
  for (int i = 0; i < N; ++i) values[i] = 0.f;
}
template <int M, int N>
__device__ __forceinline__ void Zero(float (&values)[M][N]) {
#pragma unroll
  for (int t = 0; t < M; ++t) Zero(values[t]);
}

// Zeroes the V columns (chunks 0 .. kNumVChunks - 1) of the rows of a stage that were not loaded
// (or hold tokens past the length), so 0 * NaN can never enter PV. The consumer threads tid share
// the work, a few per row; the caller fences and synchronises them afterwards.
__device__ __forceinline__ void ZeroUnloadedRows(uint8_t* stage_base, const BlockLoad& load,
                                                 int tid) {
  constexpr int kThreadsPerRow = kConsumerThreads / kBlockN;
  constexpr int kChunksPerThread = kNumVChunks / kThreadsPerRow;
  static_assert(kThreadsPerRow * kBlockN == kConsumerThreads &&
                    kChunksPerThread * kThreadsPerRow == kNumVChunks,
                "rows and chunks split evenly over the threads");
  const int row = tid / kThreadsPerRow;
  if (load.RowLoaded(row)) return;
  uint8_t* dst = stage_base + (tid % kThreadsPerRow) * kChunksPerThread * kChunkBytes +
                 row * kRowBytes;
#pragma unroll
  for (int c = 0; c < kChunksPerThread; ++c) {
#pragma unroll
    for (int unit = 0; unit < kRowBytes / 16; ++unit) {
      *reinterpret_cast<uint4*>(dst + c * kChunkBytes + unit * 16) = make_uint4(0, 0, 0, 0);
    }
  }
}

}  // namespace detail
}  // namespace sm90
}  // namespace jax_mla
