// The compute side of one M tile at 128 heads, two schedules side by side, every SM busy: a design
// probe for the seesaw on 32-token blocks (docs/sm90-kernel.md, next steps 1). No loads: the query
// tile and the KV stages sit in shared memory as zeros, so what is timed is the two consumer
// warpgroups' MMAs (CuTe's WGMMA wrappers of ffi/sm90/mma.cuh), a softmax stand-in and their
// hand-overs. The values are not checked; the schedules are.
//
//   lockstep  as DecodeKernel's 64-row tiles: per 64-token block (two 72 KB stages) warpgroup 0
//             scores all 64 tokens (36 m64n64k16), runs the softmax and writes P over the
//             stage's rope chunk, one named barrier hands P over, both run PV on their 256
//             columns (4 m64n256k16); warpgroup 0's PV stays in flight under the next scores.
//   seesaw    32-token blocks in four 36 KB stages; warpgroup w scores blocks 2j + w (36
//             m64n32k16), waits for the other's softmax of the block before (a named barrier:
//             its row maxima and P), runs its own softmax, writes P (64 rows x 32 tokens, 64-byte
//             swizzle) over its stage's rope chunk, signals the other, then PV on its 256 columns
//             for the other's block and its own (2 m64n256k16 each).
// Each with the softmax stand-in or without it (`mma`: the MMAs' own time and the hand-overs).
// The softmax stand-in is what the kernels' is in the common case: the row maxima over a
// thread's values and its quad, the running maximum, exp2 of each score, the row sums, bf16 pairs
// stored to P; the output's rescale is skipped (the kernels skip it unless a maximum grows by
// 2^8).
//
// Reported: clocks per 64 tokens (each CTA's clock64 span over its blocks, median over CTAs) and
// the wall time of the launch (events, after a warm-up launch, median of 5), for each mode.
//
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I. -I$CUTLASS_INCLUDE \
//        --expt-relaxed-constexpr benchmarks/seesaw_probe.cu -o .gpu/seesaw_probe
//   .gpu/seesaw_probe [TOKENS_PER_CTA]   # default 8192 (128 blocks of 64 tokens)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <vector>

#include <cuda_bf16.h>

#include "benchmarks/check_cuda.h"
#include "ffi/sm90/mma.cuh"

using namespace jax_mla::sm90;
using namespace jax_mla::sm90::detail;

constexpr int kProbeThreads = 256;  // the two consumer warpgroups
constexpr int kQBytes = kTileBytes;                    // 64 rows x 576, 73,728 B
constexpr int kSeesawStageTokens = 32;
constexpr int kSeesawChunkBytes = kSeesawStageTokens * kRowBytes;  // 4,096
constexpr int kSeesawStageBytes = kNumChunks * kSeesawChunkBytes;  // 36,864
constexpr int kSeesawStages = 4;
constexpr int kKvBytes = kSeesawStages * kSeesawStageBytes;        // = 2 x kTileBytes
constexpr int kProbeSmemBytes = kQBytes + kKvBytes + 1024;          // slack to align to 1024
static_assert(kKvBytes == kStages * kTileBytes, "both schedules fill the same KV bytes");
static_assert(kProbeSmemBytes <= kMaxSmemBytes, "fits the 227 KB of an SM90 block");

// Named barriers 1 and 2: "warpgroup 1 - w may read block b's P and row maxima", posted by w.
constexpr int kHandoverBarrier = 1;

__device__ __forceinline__ void NamedSync(int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(kProbeThreads) : "memory");
}
__device__ __forceinline__ void NamedArrive(int id) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(kProbeThreads) : "memory");
}
__device__ __forceinline__ void FenceProxyAsync() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// K-major P of 64 rows x 32 tokens: 64-byte rows, 64-byte swizzle, 8-row groups 512 B apart.
__device__ __forceinline__ uint64_t KMajorDesc64B(uint32_t smem_addr) {
  uint64_t desc = MakeSmemDesc(smem_addr, 16, 8 * 64);
  desc &= ~(3ull << 62);
  return desc | (2ull << 62);  // SWIZZLE_64B
}

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
    const int p_row = row + 8 * r;  // the swizzle's XOR: bits 7-9 of the row's byte offset
    const uint32_t offset = p_row * p_row_bytes +
                            (((col * 2 / 16) ^ (p_row * p_row_bytes / 128 % 8)) * 16) % p_row_bytes +
                            (col * 2) % 16;
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

// O[:, 256 wg ...] += P V over a 32-token stage (V MN-major, 4 KB chunks; P 64-byte rows).
__device__ __forceinline__ void SeesawPv(float (&o)[kLatentDim / kConsumerWarpgroups / 2],
                                         uint32_t kv_addr, uint32_t p_addr, int wg) {
  const uint64_t p_desc = KMajorDesc64B(p_addr);
  const uint64_t v_desc = MakeSmemDesc(kv_addr + wg * (kNumVChunks / 2) * kSeesawChunkBytes,
                                       kSeesawChunkBytes, 8 * kRowBytes);
#pragma unroll
  for (int kk = 0; kk < kSeesawStageTokens / 16; ++kk) {
    Gmma<PvMma>(DescAdd(p_desc, kk * 32), DescAdd(v_desc, kk * 16 * kRowBytes), o, true);
  }
}

template <bool kSeesaw, bool kSoftmax>
__global__ void __launch_bounds__(kProbeThreads, 1)
    ProbeKernel(int blocks64, long long* cycles, float* sink) {
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>(
      (reinterpret_cast<uintptr_t>(smem_raw) + 1023) / 1024 * 1024);
  for (int i = threadIdx.x; i < (kQBytes + kKvBytes) / 16; i += blockDim.x) {
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  }
  FenceProxyAsync();
  __syncthreads();
  const int wg = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x / 128), 0);
  const uint32_t q_addr = SmemAddr(smem), kv_base = q_addr + kQBytes;
  float o[kLatentDim / kConsumerWarpgroups / 2] = {};
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.f, 0.f};
  const long long start = clock64();
  if constexpr (!kSeesaw) {
    float s[32];
    for (int b = 0; b < blocks64; ++b) {
      const uint32_t stage = kv_base + (b % kStages) * kTileBytes;
      const uint32_t p_addr = stage + (kNumChunks - 1) * kChunkBytes;  // the rope chunk
      if (wg == 0) {
        Scores<64>(s, q_addr, stage);
        cute::warpgroup_wait<0>();  // the scores, and the PV of the block before
        FenceRegisters(s);
        if (kSoftmax) SoftmaxStandIn(s, row_max, row_sum, p_addr, kRowBytes);
        FenceProxyAsync();
      }
      NamedSync(kHandoverBarrier);
      IssuePv<false>(o, stage, p_addr, wg);
      cute::warpgroup_commit_batch();
      if (wg == 1) cute::warpgroup_wait<0>();
    }
  } else {
    float s[16];
    const int pairs = blocks64;  // a pair of 32-token blocks is 64 tokens
    for (int j = 0; j < pairs; ++j) {
      const int own = 2 * j + wg;
      const uint32_t own_stage = kv_base + (own % kSeesawStages) * kSeesawStageBytes;
      const uint32_t own_p = own_stage + (kNumChunks - 1) * kSeesawChunkBytes;
      Scores<32>(s, q_addr, own_stage);
      cute::warpgroup_wait<0>();  // the scores, and the PVs of the pair before
      FenceRegisters(s);
      // The other's block own - 1 is done (warpgroup 0's first block has none before it).
      if (wg == 1) {
        NamedSync(kHandoverBarrier + 1);
      } else if (j > 0) {
        NamedSync(kHandoverBarrier);
      }
      if (kSoftmax) SoftmaxStandIn(s, row_max, row_sum, own_p, 64);
      FenceProxyAsync();
      // This block's P and maxima for the other.
      if (wg == 0) {
        NamedArrive(kHandoverBarrier + 1);
      } else {
        NamedArrive(kHandoverBarrier);
      }
      // PV of the other's block own - 1 and of this one; for warpgroup 0's first block "own - 1"
      // is the last stage (zeros), which leaves the PVs unbranched and their count that of the
      // blocks: warpgroup 0 does not multiply warpgroup 1's last block.
      const int other = (own + kSeesawStages - 1) % kSeesawStages;
      const uint32_t other_stage = kv_base + other * kSeesawStageBytes;
      FenceRegisters(o);
      cute::warpgroup_arrive();
      SeesawPv(o, other_stage, other_stage + (kNumChunks - 1) * kSeesawChunkBytes, wg);
      SeesawPv(o, own_stage, own_p, wg);
      cute::warpgroup_commit_batch();
    }
    if (wg == 0) NamedSync(kHandoverBarrier);  // warpgroup 1's last arrival
  }
  cute::warpgroup_wait<0>();
  FenceRegisters(o);
  __syncthreads();
  const long long end = clock64();
  if (threadIdx.x == 0) cycles[blockIdx.x] = end - start;
  float acc = row_sum[0] + row_sum[1];
#pragma unroll
  for (int i = 0; i < kLatentDim / kConsumerWarpgroups / 2; ++i) acc += o[i];
  if (acc == 1.2345f) sink[threadIdx.x] = acc;  // keeps the work
}

template <bool kSeesaw, bool kSoftmax>
void Run(const char* name, int sms, int blocks64, long long* d_cycles, float* d_sink) {
  auto kernel = ProbeKernel<kSeesaw, kSoftmax>;
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  kProbeSmemBytes));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  kernel<<<sms, kProbeThreads, kProbeSmemBytes>>>(blocks64, d_cycles, d_sink);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<float> times;
  for (int rep = 0; rep < 5; ++rep) {
    CHECK_CUDA(cudaEventRecord(start));
    kernel<<<sms, kProbeThreads, kProbeSmemBytes>>>(blocks64, d_cycles, d_sink);
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  std::vector<long long> cycles(sms);
  CHECK_CUDA(cudaMemcpy(cycles.data(), d_cycles, sms * sizeof(long long), cudaMemcpyDeviceToHost));
  std::sort(cycles.begin(), cycles.end());
  std::sort(times.begin(), times.end());
  printf("| %s | %s | %.0f | %.0f | %.1f | %.3f |\n", kSeesaw ? "seesaw, 32-token blocks" : "lockstep",
         kSoftmax ? "softmax" : "mma", static_cast<double>(cycles[sms / 2]) / blocks64,
         static_cast<double>(cycles.back()) / blocks64, 1e3 * times[2], 1e6 * times[2] / blocks64);
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
}

int main(int argc, char** argv) {
  const int tokens = argc > 1 ? atoi(argv[1]) : 8192;
  const int blocks64 = std::max(1, tokens / 64);
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  long long* d_cycles;
  float* d_sink;
  CHECK_CUDA(cudaMalloc(&d_cycles, sms * sizeof(long long)));
  CHECK_CUDA(cudaMalloc(&d_sink, kProbeThreads * sizeof(float)));
  printf("%d CTAs of %d threads, %d B of shared memory each, %d tokens (%d blocks of 64) each\n",
         sms, kProbeThreads, kProbeSmemBytes, blocks64 * 64, blocks64);
  printf("| schedule | work | clocks / 64 tokens (median CTA) | (slowest CTA) | launch µs | ns / 64 tokens |\n");
  printf("|---|---|---|---|---|---|\n");
  Run<false, true>("lockstep", sms, blocks64, d_cycles, d_sink);
  Run<true, true>("seesaw", sms, blocks64, d_cycles, d_sink);
  Run<false, false>("lockstep", sms, blocks64, d_cycles, d_sink);
  Run<true, false>("seesaw", sms, blocks64, d_cycles, d_sink);
  CHECK_CUDA(cudaFree(d_cycles));
  CHECK_CUDA(cudaFree(d_sink));
  return 0;
}
