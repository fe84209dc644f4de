// One M tile at 128 heads under three schedules, every SM busy: a design probe for the seesaw on
// 32-token blocks (docs/sm90-kernel.md, next steps 1). What is timed is the two consumer
// warpgroups' MMAs (CuTe's WGMMA wrappers of ffi/sm90/mma.cuh), a softmax stand-in and their
// hand-overs, without loads (the stages keep what was written at the start) or with them: a
// producer thread streams each stage's rows from global memory by plain bulk copies (the bytes of
// the kernels' tensor-map boxes, unswizzled) through full and empty mbarriers, the two CTAs of an
// M-tile pair (blockIdx.x / 2) reading the same rows as the kernels' pairs do (here each its own
// copy, the second mostly from L2, where the kernels multicast one). The values are not checked;
// the schedules are. Operands are pseudo-random bf16 in [-1, 1) (zeros would draw less power).
//
//   lockstep  as DecodeKernel's 64-row tiles: per 64-token block (two 72 KB stages) warpgroup 0
//             scores all 64 tokens (36 m64n64k16), runs the softmax and writes P over the
//             stage's rope chunk, one named barrier hands P over, both run PV on their 256
//             columns (4 m64n256k16); warpgroup 0's PV stays in flight under the next scores.
//   seesaw, 32-token blocks  in four 36 KB stages; warpgroup w scores blocks 2j + w (36
//             m64n32k16), waits for the other's softmax of the block before (a named barrier:
//             its row maxima and P), runs its own softmax, writes P (64 rows x 32 tokens, 64-byte
//             swizzle) over its stage's rope chunk, signals the other, then PV on its 256 columns
//             for the other's block and its own (2 m64n256k16 each).
//   seesaw, 64-token blocks  the same on two 72 KB stages (m64n64k16 scores, P in 128-byte
//             rows): the arrangement measured before and not kept (docs/sm90-kernel.md,
//             "Seesaw", without the multicast this probe lacks too). A pair holds both stages, so
//             its PVs are waited for and the stages released before the next pair's blocks can
//             load. It calibrates the probe: with loads it should come out near lockstep, not far
//             ahead of it.
// Each with the softmax stand-in or without it (`mma only`: the MMAs and the hand-overs), with the
// loads or without them. Stages are released to the producer by one thread of each consumer
// warpgroup once its PVs of the stage have completed (lockstep: warpgroup 0 once its next scores
// are issued, as its PV stays in flight; seesaw: each once its next scores are issued, or on two
// stages before it waits for its next block). Warpgroup 0's first seesaw PV of "the other's block
// before" reads the last stage (the start's values, or rows being loaded): it keeps the PVs
// unbranched and is not counted as a use of that stage.
// The softmax stand-in is what the kernels' is in the common case: the row maxima over a
// thread's values and its quad, the running maximum, exp2 of each score, the row sums, bf16 pairs
// stored to P; the output's rescale is skipped (the kernels skip it unless a maximum grows by
// 2^8).
//
// Reported: clocks per 64 tokens (each CTA's clock64 span over its blocks, the median CTA, the
// median of 5 launches after a warm-up launch) and the launch's wall time (events, median of the
// 5), for each mode; the schedules alternate, and the whole table runs twice.
//
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I. -I$CUTLASS_INCLUDE \
//        --expt-relaxed-constexpr benchmarks/seesaw_probe.cu -o .gpu/seesaw_probe
//   .gpu/seesaw_probe [TOKENS_PER_CTA]   # default 8192 (128 blocks; B=128 L=4k gives a CTA 124)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>

#include "benchmarks/check_cuda.h"
#include "ffi/sm90/mma.cuh"
#include "ffi/sm90/pipeline.cuh"

using namespace jax_mla::sm90;
using namespace jax_mla::sm90::detail;

constexpr int kQBytes = kTileBytes;                    // 64 rows x 576, 73,728 B
constexpr int kKvBytes = kStages * kTileBytes;      // both schedules' stages fill the same bytes
constexpr int kMaxStages = 4;                       // the seesaw's 32-token stages
constexpr int kBarrierBytes = 2 * kMaxStages * 8;   // full and empty per stage
constexpr int kProbeSmemBytes = kQBytes + kKvBytes + kBarrierBytes + 1024;  // + alignment slack
constexpr int kTokenBytes = kHeadDim * 2;                           // 1,152
static_assert(kProbeSmemBytes <= kMaxSmemBytes, "fits the 227 KB of an SM90 block");

// The softmax stand-in over a thread's kN scores (rows r and r + 8 of its warp's 16, alternating
// pairs as WGMMA's accumulator holds them); P's bf16 pairs go to shared memory at p_addr, one
// 32-bit store each, rows `p_row_bytes` apart.
template <int kN>
__device__ __forceinline__ void SoftmaxStandIn(const float (&s)[kN], float (&row_max)[2],
                                               float (&row_sum)[2], uint32_t p_addr,
                                               int p_row_bytes) {
  float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int i = 0; i < kN; ++i) block_max[(i / 2) % 2] = fmaxf(block_max[(i / 2) % 2], s[i]);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    block_max[r] = fmaxf(block_max[r], __shfl_xor_sync(0xffffffffu, block_max[r], 1));
    block_max[r] = fmaxf(block_max[r], __shfl_xor_sync(0xffffffffu, block_max[r], 2));
    row_max[r] = fmaxf(row_max[r], block_max[r]);
  }
  const int lane = threadIdx.x % 32, warp = (threadIdx.x / 32) % 4;
  const int row = warp * 16 + lane / 4;
#pragma unroll
  for (int i = 0; i < kN; i += 2) {
    const int r = (i / 2) % 2;
    const float p0 = exp2f(s[i] - row_max[r]), p1 = exp2f(s[i + 1] - row_max[r]);
    row_sum[r] += p0 + p1;
    const __nv_bfloat162 pair = __floats2bfloat162_rn(p0, p1);
    const int col = (i / 4) * 8 + (lane % 4) * 2;
    const int p_row = row + 8 * r;
    const uint32_t offset =
        p_row_bytes == kRowBytes64B ? SwizzledOffset64B(p_row, col) : SwizzledOffset(p_row, col);
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(p_addr + offset),
                 "r"(*reinterpret_cast<const uint32_t*>(&pair))
                 : "memory");
  }
}

// Scores of one block: kN tokens (kN = 64: a 64-token stage with 8 KB chunks; 32: 4 KB chunks).
template <int kN>
__device__ __forceinline__ void Scores(float (&s)[kN / 2], uint32_t q_addr, uint32_t kv_addr) {
  using Op = std::conditional_t<kN == 64, QkMma64, QkMma>;
  constexpr int kKvChunkBytes = kN * kRowBytes;
  FenceRegisters(s);
  cute::warpgroup_arrive();
  const uint64_t q_desc = KMajorDesc(q_addr), k_desc = KMajorDesc(kv_addr);
#pragma unroll
  for (int g = 0; g < kQkSteps; ++g) {
    Gmma<Op>(DescAdd(q_desc, QkStepOffset(g)), DescAdd(k_desc, QkStepOffset<kKvChunkBytes>(g)), s,
             g > 0);
  }
  cute::warpgroup_commit_batch();
}

using Barrier = cutlass::arch::ClusterTransactionBarrier;

// Two bf16 values in [-1, 1) from a hash of i: operands that toggle like real data (the tensor
// pipe's power depends on them).
__host__ __device__ inline uint32_t RandomBf16Pair(uint32_t i) {
  uint32_t h = i * 0x9E3779B1u;
  h ^= h >> 15;
  h *= 0x85EBCA77u;
  h ^= h >> 13;
  // sign, exponent 120-126 (2^-7 .. 2^-1), 7 random mantissa bits, for each half
  const uint32_t lo = ((h & 1u) << 15) | ((120u + (h >> 1) % 7u) << 7) | ((h >> 4) & 0x7Fu);
  const uint32_t hi = ((h >> 11 & 1u) << 15) | ((120u + (h >> 12) % 7u) << 7) | ((h >> 16) & 0x7Fu);
  return lo | (hi << 16);
}

__global__ void FillRandom(uint32_t* words, size_t count) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    words[i] = RandomBf16Pair(static_cast<uint32_t>(i));
  }
}

// The stages of a schedule: kStageCount of kStageTokens tokens each, and their barriers.
// kSeesaw: the seesaw's block tokens (32 or 64), 0 for the lockstep schedule.
template <int kSeesaw>
struct Stages {
  static constexpr int kStageTokens = kSeesaw ? kSeesaw : kBlockN;
  static constexpr int kBytes = kStageTokens * kTokenBytes;
  static constexpr int kStageCount = kKvBytes / kBytes;
  static constexpr int kChunkBytes = kStageTokens * kRowBytes;
  static_assert(kStageCount <= kMaxStages, "barriers for every stage");
  uint64_t* barriers;
  __device__ uint64_t* Full(int i) const { return barriers + 2 * (i % kStageCount); }
  __device__ uint64_t* Empty(int i) const { return barriers + 2 * (i % kStageCount) + 1; }
  __device__ static uint32_t Phase(int i) { return (i / kStageCount) & 1; }
};

// Stage i of the CTA's walk is loaded: wait for it (kLoads), else nothing.
template <bool kLoads, int kSeesaw>
__device__ __forceinline__ void WaitLoaded(const Stages<kSeesaw>& stages, int i) {
  if (kLoads) Barrier::wait(stages.Full(i), Stages<kSeesaw>::Phase(i));
}

// This warpgroup is done with stage i (its PVs of it completed): one thread arrives.
template <bool kLoads, int kSeesaw>
__device__ __forceinline__ void Release(const Stages<kSeesaw>& stages, int i) {
  if (kLoads && i >= 0 && threadIdx.x % 128 == 0) Barrier::arrive(stages.Empty(i));
}

// The producer's thread: stage i of `count` from the pair's rows, once both warpgroups released
// stage i - kStageCount.
template <int kSeesaw>
__device__ void Produce(const Stages<kSeesaw>& stages, uint32_t kv_base, const uint8_t* rows,
                        int count) {
  using S = Stages<kSeesaw>;
  for (int i = 0; i < count; ++i) {
    if (i >= S::kStageCount) Barrier::wait(stages.Empty(i), S::Phase(i) ^ 1);
    Barrier::arrive_and_expect_tx(stages.Full(i), S::kBytes);
    uint8_t* dst = reinterpret_cast<uint8_t*>(__cvta_shared_to_generic(
        kv_base + (i % S::kStageCount) * S::kBytes));
    cute::SM90_BULK_COPY_G2S::copy(rows + static_cast<size_t>(i) * S::kBytes, stages.Full(i), dst,
                                   S::kBytes);
  }
}

template <int kSeesaw, bool kSoftmax, bool kLoads>
__global__ void __launch_bounds__(kThreads, 1)
    ProbeKernel(int blocks64, const uint8_t* rows, long long* cycles, float* sink) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) / 1024 * 1024);
  for (int i = threadIdx.x; i < (kQBytes + kKvBytes) / 4; i += blockDim.x) {
    reinterpret_cast<uint32_t*>(smem)[i] = RandomBf16Pair(blockIdx.x * 65536u + i);
  }
  const Stages<kSeesaw> stages{reinterpret_cast<uint64_t*>(smem + kQBytes + kKvBytes)};
  if (threadIdx.x < Stages<kSeesaw>::kStageCount) {
    Barrier::init(stages.Full(threadIdx.x), 1);
    Barrier::init(stages.Empty(threadIdx.x), kConsumerWarpgroups);
  }
  cutlass::arch::fence_barrier_init();
  cutlass::arch::fence_view_async_shared();
  __syncthreads();
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  const int stage_count = blocks64 * kBlockN / Stages<kSeesaw>::kStageTokens;  // main: whole pairs
  if (wg == kConsumerWarpgroups) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    if (kLoads && threadIdx.x == kConsumerThreads) {
      const size_t pair_bytes = static_cast<size_t>(blocks64) * kBlockN * kTokenBytes;
      Produce(stages, SmemAddr(smem) + kQBytes, rows + (blockIdx.x / 2) * pair_bytes, stage_count);
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
  const uint32_t q_addr = SmemAddr(smem), kv_base = q_addr + kQBytes;
  float o[kLatentDim / kConsumerWarpgroups / 2] = {};
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  const long long start = clock64();
  if constexpr (kSeesaw == 0) {
    float s[32];
    for (int b = 0; b < blocks64; ++b) {
      const uint32_t stage = kv_base + (b % kStages) * kTileBytes;
      const uint32_t p_addr = stage + (kNumChunks - 1) * kChunkBytes;  // the rope chunk
      WaitLoaded<kLoads>(stages, b);
      if (wg == 0) {
        Scores<64>(s, q_addr, stage);
        cute::warpgroup_wait<1>();  // the PV of the block before
        Release<kLoads>(stages, b - 1);
        cute::warpgroup_wait<0>();  // the scores
        FenceRegisters(s);
        if (kSoftmax) SoftmaxStandIn(s, row_max, row_sum, p_addr, kRowBytes);
        cutlass::arch::fence_view_async_shared();
      }
      ConsumerSync();
      IssuePv<false>(o, stage, p_addr, wg);
      cute::warpgroup_commit_batch();
      if (wg == 1) {
        cute::warpgroup_wait<0>();
        Release<kLoads>(stages, b);
      }
    }
  } else {
    using S = Stages<kSeesaw>;
    constexpr int kPRowBytes = 2 * kSeesaw;
    float s[kSeesaw / 2];
    const int pairs = blocks64 * kBlockN / (2 * kSeesaw);
    for (int j = 0; j < pairs; ++j) {
      const int own = 2 * j + wg;
      const uint32_t own_stage = kv_base + (own % S::kStageCount) * S::kBytes;
      const uint32_t own_p = own_stage + (kNumChunks - 1) * S::kChunkBytes;
      if constexpr (S::kStageCount == 2) {
        // Two stages: both hold the pair before until its PVs complete, so the PVs are waited
        // for and released before this block's stage can be loaded.
        cute::warpgroup_wait<0>();
        Release<kLoads>(stages, own - 3);
        Release<kLoads>(stages, own - 2);
        WaitLoaded<kLoads>(stages, own);
        Scores<kSeesaw>(s, q_addr, own_stage);
        cute::warpgroup_wait<0>();
      } else {
        WaitLoaded<kLoads>(stages, own);
        Scores<kSeesaw>(s, q_addr, own_stage);
        cute::warpgroup_wait<1>();  // the PVs of the pair before
        Release<kLoads>(stages, own - 3);
        Release<kLoads>(stages, own - 2);
        cute::warpgroup_wait<0>();  // the scores
      }
      FenceRegisters(s);
      // The other's block own - 1 is done (warpgroup 0's first block has none before it).
      if (wg == 1 || j > 0) WaitHandover(wg);
      if (kSoftmax) SoftmaxStandIn(s, row_max, row_sum, own_p, kPRowBytes);
      cutlass::arch::fence_view_async_shared();
      PostHandover(wg);  // this block's P and maxima for the other
      // PV of the other's block own - 1 and of this one; for warpgroup 0's first block "own - 1"
      // is the last stage (not yet a block of this walk), which leaves the PVs unbranched and
      // their count that of the blocks: warpgroup 0 does not multiply warpgroup 1's last block.
      const int other = (own + S::kStageCount - 1) % S::kStageCount;
      const uint32_t other_stage = kv_base + other * S::kBytes;
      FenceRegisters(o);
      cute::warpgroup_arrive();
      PvMmas<false, kSeesaw>(o, other_stage, other_stage + (kNumChunks - 1) * S::kChunkBytes, wg);
      PvMmas<false, kSeesaw>(o, own_stage, own_p, wg);
      cute::warpgroup_commit_batch();
    }
    if (wg == 0) {
      if constexpr (S::kStageCount == 2) {
        // On two stages the producer's last block waits for warpgroup 0's PVs of its last pair.
        cute::warpgroup_wait<0>();
        Release<kLoads>(stages, 2 * pairs - 3);
        Release<kLoads>(stages, 2 * pairs - 2);
      }
      WaitHandover(wg);  // warpgroup 1's last post
    }
  }
  cute::warpgroup_wait<0>();
  FenceRegisters(o);
  ConsumerSync();
  const long long end = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = end - start;
  float acc = row_sum[0] + row_sum[1];
#pragma unroll
  for (int i = 0; i < kLatentDim / kConsumerWarpgroups / 2; ++i) acc += o[i];
  if (acc == 1.2345f) sink[threadIdx.x] = acc;  // keeps the work
}

template <int kSeesaw, bool kSoftmax, bool kLoads>
void Run(int sms, int blocks64, const uint8_t* d_rows, long long* d_cycles, float* d_sink) {
  auto kernel = ProbeKernel<kSeesaw, kSoftmax, kLoads>;
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kProbeSmemBytes));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  kernel<<<sms, kThreads, kProbeSmemBytes>>>(blocks64, d_rows, d_cycles, d_sink);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> times;
  std::vector<long long> cycles(sms), median_cycles;
  for (int rep = 0; rep < 5; ++rep) {
    CHECK_CUDA(cudaEventRecord(start));
    kernel<<<sms, kThreads, kProbeSmemBytes>>>(blocks64, d_rows, d_cycles, d_sink);
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
    CHECK_CUDA(cudaMemcpy(cycles.data(), d_cycles, sms * sizeof(long long),
                          cudaMemcpyDeviceToHost));
    std::sort(cycles.begin(), cycles.end());
    median_cycles.push_back(cycles[sms / 2]);
  }
  std::sort(times.begin(), times.end());
  std::sort(median_cycles.begin(), median_cycles.end());
  const double pairs_bytes = static_cast<double>(sms / 2) * blocks64 * kBlockN * kTokenBytes;
  printf("| %s | %s | %s | %.0f | %.1f | %.1f | %.0f |\n",
         kSeesaw == 0    ? "lockstep"
         : kSeesaw == 32 ? "seesaw, 32-token blocks"
                         : "seesaw, 64-token blocks",
         kSoftmax ? "softmax" : "mma only",
         kLoads ? "yes" : "no", static_cast<double>(median_cycles[2]) / blocks64, 1e3 * times[2],
         1e6 * times[2] / blocks64, kLoads ? pairs_bytes / (1e6 * times[2]) : 0.0);
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
}

// The schedules one after the other at one setting: the comparison this probe is for.
template <bool kSoftmax, bool kLoads>
void RunBoth(int sms, int blocks64, const uint8_t* d_rows, long long* d_cycles, float* d_sink) {
  Run<0, kSoftmax, kLoads>(sms, blocks64, d_rows, d_cycles, d_sink);
  Run<32, kSoftmax, kLoads>(sms, blocks64, d_rows, d_cycles, d_sink);
  Run<64, kSoftmax, kLoads>(sms, blocks64, d_rows, d_cycles, d_sink);
}

int main(int argc, char** argv) {
  const int tokens = argc > 1 ? atoi(argv[1]) : 8192;
  // An even count of 64-token blocks, at least 2: whole pairs of the 64-token seesaw, so every
  // schedule consumes every stage its producer loads.
  const int blocks64 = std::max(2, tokens / kBlockN / 2 * 2);
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t pair_bytes = static_cast<size_t>(blocks64) * kBlockN * kTokenBytes;
  uint8_t* d_rows;
  long long* d_cycles;
  float* d_sink;
  CHECK_CUDA(cudaMalloc(&d_rows, (sms / 2 + 1) * pair_bytes));
  FillRandom<<<4 * sms, 256>>>(reinterpret_cast<uint32_t*>(d_rows), (sms / 2 + 1) * pair_bytes / 4);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaMalloc(&d_cycles, sms * sizeof(long long)));
  CHECK_CUDA(cudaMalloc(&d_sink, kConsumerThreads * sizeof(float)));
  printf("%d CTAs of %d threads, %d B of shared memory each, %d tokens (%d blocks of 64) each; "
         "pairs of CTAs read the same %.1f MB\n",
         sms, kThreads, kProbeSmemBytes, blocks64 * kBlockN, blocks64, pair_bytes / 1e6);
  printf("| schedule | work | loads | clocks / 64 tokens (median CTA, median launch) | "
         "launch µs | ns / 64 tokens | pairs' rows GB/s |\n|---|---|---|---|---|---|---|\n");
  for (int round = 0; round < 2; ++round) {
    RunBoth<true, true>(sms, blocks64, d_rows, d_cycles, d_sink);
    RunBoth<true, false>(sms, blocks64, d_rows, d_cycles, d_sink);
    RunBoth<false, true>(sms, blocks64, d_rows, d_cycles, d_sink);
    RunBoth<false, false>(sms, blocks64, d_rows, d_cycles, d_sink);
  }
  CHECK_CUDA(cudaFree(d_rows));
  CHECK_CUDA(cudaFree(d_cycles));
  CHECK_CUDA(cudaFree(d_sink));
  return 0;
}
