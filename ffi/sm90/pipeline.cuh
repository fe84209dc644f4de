// Synchronisation of a decode CTA: named barriers (both consumer warpgroups, or one's four warps),
// cluster barriers, the mbarrier pipeline between the producer thread and the consumers (Pipeline, stage
// release, the fp8 half-stage ring) and the CTA's set-up.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

#include "decode_params.h"
#include "smem_layout.cuh"

namespace jax_mla {
namespace sm90 {
namespace detail {

constexpr int kConsumerBarrier = 1;  // named barrier id shared by the two consumer warpgroups
// + the posting warpgroup (2, 3): the seesaw's hand-over of a block (PostHandover;
// benchmarks/seesaw_probe.cu)
constexpr int kHandoverBarrier = 2;
constexpr int kWarpgroupBarrier = 4;  // + warpgroup: its own four warps

__device__ __forceinline__ uint32_t ClusterCtaRank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}

// All threads of all CTAs of the cluster (not warp-aligned: callers may have diverged).
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}

// A named barrier that is also a compiler barrier for memory: CUTLASS's NamedBarrier::sync has no
// memory clobber, so without the empty asm statements around it the compiler may move shared-memory
// loads and stores across it.
__device__ __forceinline__ void NamedSync(int threads, int id) {
  asm volatile("" ::: "memory");
  cutlass::arch::NamedBarrier::sync(threads, id);
  asm volatile("" ::: "memory");
}

// Arrives at named barrier id without waiting (NamedSync's compiler barriers around it).
__device__ __forceinline__ void NamedArrive(int threads, int id) {
  asm volatile("" ::: "memory");
  cutlass::arch::NamedBarrier::arrive(threads, id);
  asm volatile("" ::: "memory");
}

__device__ __forceinline__ void ConsumerSync() { NamedSync(kConsumerThreads, kConsumerBarrier); }

// NamedSync over `threads` threads at barrier `id` (CUTLASS's numbering: its NamedBarrier puts ids
// after its reserved ones) that also returns whether `pred` holds for any of them (bar.red.or).
__device__ __forceinline__ bool NamedSyncAny(uint32_t threads, uint32_t id, bool pred) {
  const uint32_t hardware_id = id + cutlass::arch::NamedBarrier::ReservedNamedBarrierCount;
  uint32_t any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n"
      " selp.u32 %0, 1, 0, q;\n}"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(pred)), "r"(hardware_id), "r"(threads)
      : "memory");
  return any != 0;
}

// ConsumerSync that also returns whether `pred` holds for any consumer thread.
__device__ __forceinline__ bool ConsumerSyncAny(bool pred) {
  return NamedSyncAny(kConsumerThreads, kConsumerBarrier, pred);
}

// "Warpgroup wg's latest block is done": wg's 128 threads arrive, the other warpgroup's wait
// (WaitHandover). Each post is waited for once before the next.
__device__ __forceinline__ void PostHandover(int wg) {
  NamedArrive(kConsumerThreads, kHandoverBarrier + wg);
}

__device__ __forceinline__ void WaitHandover(int wg) {
  NamedSync(kConsumerThreads, kHandoverBarrier + (wg ^ 1));
}

__device__ __forceinline__ void WarpgroupSync(int wg) { NamedSync(128, kWarpgroupBarrier + wg); }

// Whether x holds for any thread of warpgroup wg (all its threads call it): WarpgroupSync with an
// OR over the threads.
__device__ __forceinline__ bool WarpgroupAny(int wg, bool x) {
  return NamedSyncAny(128, kWarpgroupBarrier + wg, x);
}

// The pipeline's barriers in shared memory: the query tile's pair, then for each slot (a KV stage,
// or with half stages a 32-token stage) "full" (the producer's pieces landed) and "empty" (its
// consumer warpgroups, of every CTA that multicasts into it, released it). When a bf16 stage is
// released in two parts (DecodeKernel's kSplitRelease), Full/Empty guard its chunks from
// kWg0VChunks on and V0Full/V0Empty warpgroup 0's V chunks [0, kWg0VChunks).
struct Pipeline {
  uint64_t* base;
  uint64_t* v0;

  template <class Layout>
  __device__ __forceinline__ static Pipeline At(uint8_t* smem) {
    uint64_t* base = reinterpret_cast<uint64_t*>(smem + Layout::kBarriers);
    return {base, base + 2 + 2 * Layout::kStageSlots};
  }
  __device__ __forceinline__ uint64_t* QFull() const { return base; }
  __device__ __forceinline__ uint64_t* QEmpty() const { return base + 1; }
  __device__ __forceinline__ uint64_t* Full(int slot) const { return base + 2 + 2 * slot; }
  __device__ __forceinline__ uint64_t* Empty(int slot) const { return base + 3 + 2 * slot; }
  __device__ __forceinline__ uint64_t* V0Full(int stage) const { return v0 + 2 * stage; }
  __device__ __forceinline__ uint64_t* V0Empty(int stage) const { return v0 + 1 + 2 * stage; }
};

// Warpgroup 0's V columns (its 256 output columns) are the stage's first chunks.
constexpr int kWg0VChunks = kNumVChunks / kConsumerWarpgroups;

// Arrives on an empty barrier in every CTA that multicasts into the stage it guards.
template <int kCluster>
__device__ __forceinline__ void ReleaseBarrier(uint64_t* empty) {
  if (kCluster == 1) {
    cutlass::arch::ClusterBarrier::arrive(empty);
  } else {
#pragma unroll
    for (int r = 0; r < kCluster; ++r) cutlass::arch::ClusterBarrier::arrive(empty, r, 1u);
  }
}

// Hands a KV stage (with kSplitRelease: its chunks from kWg0VChunks on) back to the producer of
// every CTA that multicasts into it (called by one thread of each consumer warpgroup that releases
// it, or with half stages by every thread of the one that read it).
template <int kCluster>
__device__ __forceinline__ void ReleaseStage(const Pipeline& pipe, int stage) {
  ReleaseBarrier<kCluster>(pipe.Empty(stage));
}

// fp8 cache, 64-row tiles: the ring slot of half h of the it-th block a CTA loads, and how many
// times the ring went round before it (the parity of its barriers' phase).
struct HalfSlot {
  int index;
  int round;

  template <class Layout>
  __device__ __forceinline__ static HalfSlot Of(int it, int h) {
    const int q = 2 * it + h;
    return {q % Layout::kStageSlots, q / Layout::kStageSlots};
  }
};

// Zeroes the query tile's rows that the bulk copy never writes (q_len * num_heads < 64; they stay
// zero for the whole kernel), initialises the pipeline barriers and synchronises the CTA (the
// cluster when kCluster > 1: the peer multicasts into this CTA's stages and arrives on its
// barriers). kSplitRelease: each stage is released in two parts, warpgroup 0's V chunks by
// warpgroup 0 and the rest by warpgroup 1 (Pipeline).
template <int kCluster, class Layout, bool kSplitRelease = false>
__device__ __forceinline__ void SetUpCta(uint8_t* smem, int q_box_rows, int tid) {
  using Barrier = cutlass::arch::ClusterBarrier;
  const Pipeline pipe = Pipeline::At<Layout>(smem);
  if (tid < kConsumerThreads && q_box_rows < Layout::kQChunkRows) {
    const int units = (Layout::kQChunkRows - q_box_rows) * kNumChunks * (kRowBytes / 16);
    for (int i = tid; i < units; i += kConsumerThreads) {
      const int row = q_box_rows + i / (kNumChunks * 8);
      const int chunk = (i / 8) % kNumChunks;
      const int unit = i % 8;
      *reinterpret_cast<uint4*>(smem + Layout::kQ + chunk * Layout::kQChunkBytes +
                                row * kRowBytes + unit * 16) = make_uint4(0, 0, 0, 0);
    }
    cutlass::arch::fence_view_async_shared();
  }
  if (tid == kConsumerThreads) {
    for (int s = 0; s < Layout::kStageSlots; ++s) {
      Barrier::init(pipe.Full(s), 1);
      // A half stage (or any stage of a layout so marked) goes back once every thread that read
      // it released it.
      const int releasers = Layout::kEveryThreadReleases ? Layout::kReleasingThreads
                            : kSplitRelease         ? 1
                                                    : kConsumerWarpgroups;
      Barrier::init(pipe.Empty(s), releasers * kCluster);
      if (kSplitRelease) {
        Barrier::init(pipe.V0Full(s), 1);
        Barrier::init(pipe.V0Empty(s), kCluster);
      }
    }
    Barrier::init(pipe.QFull(), 1);
    Barrier::init(pipe.QEmpty(), kConsumerWarpgroups);
    cutlass::arch::fence_barrier_init();
  }
  if (kCluster > 1) {
    ClusterSync();
  } else {
    __syncthreads();
  }
}

}  // namespace detail
}  // namespace sm90
}  // namespace jax_mla
