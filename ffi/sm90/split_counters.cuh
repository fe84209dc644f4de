// Split requests' completion counters: the decode kernel counts each split segment's stored
// partial results, and the combine kernels wait for a request's count rather than for the whole
// decode, so that each split request is merged as soon as its splits are stored, under the
// decode's tail and its end, instead of after the kernel boundary.
//
// The counter of (slot, key) with key = the request's first part x m_tiles + M tile: the decode
// CTA of each of the request's n = last - first + 1 split segments of the M tile adds one once its
// partial results are stored (CountStoredSplit, after a barrier of the threads that stored them);
// each combine warp that merges part of the tile waits until the count reaches n (WaitForSplits),
// merges, and adds one more (DepartSplits); the warp whose add brings the count to n + R (R: the
// tile's merging warps) sets it back to zero. A part's last request is the only one of its
// requests that can extend past it, so each split request has its own first part and a slot needs
// one counter per CTA of the decode grid. The counters are zero whenever no decode of their slot
// runs: every decode + combine pair that runs to completion leaves them so, and one that does not
// leaves its CUDA context unusable. The next decode of a slot counts only after its dependency
// wait, when the combine before it has completed.
//
// A combine warp waits only for CTAs of the decode grid ahead of it in the stream, all of which
// are running when it starts (with programmatic dependent launch the combine launches once every
// decode CTA has started) or done (without it), so the wait always ends.
//
// The counters live in a pool per device (g_split_counters, zero when the module loads), one
// slot per caller (DecodeParams::split_counter_slot).
#pragma once

#include <cstdint>

#include "decode_params.h"

namespace jax_mla {
namespace sm90 {

__device__ uint32_t g_split_counters[kSplitCounterSlots * kSplitCountersPerSlot];

// Whether a decode grid of `ctas` CTAs can count its splits with the counters of `slot`.
__host__ __device__ __forceinline__ bool SplitCountersFit(int slot, int ctas) {
  return slot >= 0 && slot < kSplitCounterSlots && ctas <= kSplitCountersPerSlot;
}

__device__ __forceinline__ uint32_t* SplitCounter(int slot, int key) {
  return g_split_counters + static_cast<size_t>(slot) * kSplitCountersPerSlot + key;
}

// One thread, after a barrier of every thread that stored the split segment's partial results.
__device__ __forceinline__ void CountStoredSplit(uint32_t* counter) {
  __threadfence();
  atomicAdd(counter, 1u);
}

__device__ __forceinline__ uint32_t LoadAcquire(const uint32_t* counter) {
  uint32_t v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(counter) : "memory");
  return v;
}

// One whole warp: returns once the n split segments of its tile are counted; the partial results
// are then visible to every lane (read them through L2: ld.global.cg).
__device__ __forceinline__ void WaitForSplits(const uint32_t* counter, uint32_t n, int lane) {
  if (lane == 0) {
    while (LoadAcquire(counter) < n) __nanosleep(128);
  }
  __syncwarp();
}

// One whole warp, after its reads of the tile's partial results: counts the warp out; the last of
// the tile's `readers` warps sets the counter back to zero.
__device__ __forceinline__ void DepartSplits(uint32_t* counter, uint32_t n, uint32_t readers,
                                             int lane) {
  __syncwarp();
  if (lane == 0 && atomicAdd(counter, 1u) == n + readers - 1) atomicExch(counter, 0u);
}

}  // namespace sm90
}  // namespace jax_mla
