// How fast a CTA can hand 36,864 bytes (32 tokens x 576 bf16 channels: half of a 64-token KV
// tile) to the other CTA of a cluster of two, every SM busy: a design probe for the fp8 cache's
// 64-row tiles, where the two CTAs of an M-tile pair could each convert half of a block into both
// tiles (docs/fp8-cache.md, "What else remains of issue 15"). No jax_mla code runs here.
//
// Each CTA (384 threads, 200 KB of shared memory, so one per SM; clusters of two over the whole
// device) runs ROUNDS rounds; in each round its 256 "consumer" threads hand a half tile over and
// receive the peer's, double-buffered, and read what they received (a checksum the host checks;
// the bulk copies' source is static, so there it shows that every buffer read holds the source,
// not which round's copy it came from):
//   local       each thread stores its 144 bytes (nine 16-byte stores) into its own CTA's buffer,
//               then the 256 threads meet at a named barrier (the baseline: a conversion's stores);
//   remote      each thread stores its 144 bytes into the peer's buffer (st.shared::cluster),
//               arrives on the peer's mbarrier (release at cluster scope) and waits on its own
//               (acquire at cluster scope) for the peer's stores of the round;
//   remote-free the same stores with no hand-over (their throughput alone), one cluster barrier
//               at the end;
//   bulk N      one thread copies a static 36,864-byte source in its shared memory into the
//               peer's buffer with N bulk copies (cp.async.bulk shared::cta -> shared::cluster),
//               completed on the peer's mbarrier by bytes; the receiver acknowledges each buffer
//               back once its threads have read it.
// µs per round: one launch timed by events after a warm-up launch, median of 5.
//
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a benchmarks/dsmem_store_probe.cu \
//        -o .gpu/dsmem_store_probe
//   .gpu/dsmem_store_probe [ROUNDS]   # default 2000
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "check_cuda.h"

constexpr int kThreads = 384;
constexpr int kSenders = 256;
constexpr int kHalfTileBytes = 32 * 576 * 2;
constexpr int kUnitsPerThread = kHalfTileBytes / 16 / kSenders;  // 16-byte units
constexpr int kSmemBytes = 200 * 1024;
static_assert(kUnitsPerThread * 16 * kSenders == kHalfTileBytes, "whole units per thread");

enum Mode { kLocal, kRemote, kRemoteFree, kBulk };

// Shared memory: two receive buffers, the bulk copies' source, then the barriers.
constexpr int kBuf = 0;
constexpr int kSrc = 2 * kHalfTileBytes;
constexpr int kBarriers = kSrc + kHalfTileBytes;  // full[2], ack[2]

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint32_t PeerAddr(uint32_t addr, uint32_t rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}
__device__ __forceinline__ uint32_t CtaRank() {
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  return rank;
}
__device__ __forceinline__ void ClusterSync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;" ::: "memory");
}
__device__ __forceinline__ void BarrierInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void ArriveRemote(uint32_t cluster_bar) {
  asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(cluster_bar)
               : "memory");
}
__device__ __forceinline__ void ArriveExpectTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void WaitCluster(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred done;\nwait_%=:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_%=;\n}" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void StoreRemote(uint32_t addr, uint4 v) {
  asm volatile("st.shared::cluster.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x),
               "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void BulkToPeer(uint32_t dst_cluster, uint32_t src, int bytes,
                                           uint32_t bar_cluster) {
  asm volatile(
      "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, "
      "[%3];" ::"r"(dst_cluster),
      "r"(src), "r"(bytes), "r"(bar_cluster)
      : "memory");
}

// The 16-byte unit u of the half tile that CTA `cta` sends in round `round` (round 0 for the bulk
// copies' static source): four different words.
__host__ __device__ inline uint4 UnitValue(int cta, int round, int u) {
  const uint32_t x = static_cast<uint32_t>(cta) * 2654435761u ^
                     static_cast<uint32_t>(round) * 40503u ^ static_cast<uint32_t>(u);
  return make_uint4(x, x * 3u + 1u, x ^ 0x9e3779b9u, x * 7u + 5u);
}

// What a received unit adds to a thread's checksum (sums of every round's units).
__host__ __device__ inline uint32_t UnitSum(uint4 v) {
  return v.x + 3u * v.y + 5u * v.z + 7u * v.w;
}

__device__ __forceinline__ uint32_t ReceivedUnitSum(const uint8_t* buffer, int u) {
  return UnitSum(reinterpret_cast<const uint4*>(buffer)[u]);
}

template <int kMode, int kCopies>
__global__ void __launch_bounds__(kThreads, 1) HandOverKernel(int rounds, uint32_t* checksum) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int tid = threadIdx.x;
  const uint32_t rank = CtaRank();
  const uint32_t peer = rank ^ 1;
  const int cta = blockIdx.x;
  const uint32_t buf = SmemAddr(smem + kBuf);
  const uint32_t full = SmemAddr(smem + kBarriers);
  const uint32_t ack = full + 16;
  if (tid == 0) {
    for (int b = 0; b < 2; ++b) {
      BarrierInit(full + 8 * b, kMode == kRemote ? kSenders : 1);
      BarrierInit(ack + 8 * b, 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  if (kMode == kBulk) {
    for (int u = tid; u < kHalfTileBytes / 16; u += kThreads) {
      reinterpret_cast<uint4*>(smem + kSrc)[u] = UnitValue(cta, 0, u);
    }
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  ClusterSync();
  uint32_t sum = 0;
  if (tid < kSenders) {
    for (int r = 0; r < rounds; ++r) {
      const int b = r & 1;
      const uint32_t parity = (r >> 1) & 1;
      const uint32_t mine = buf + b * kHalfTileBytes;
      if (kMode == kBulk) {
        if (tid == 0) {
          ArriveExpectTx(full + 8 * b, kHalfTileBytes);
          if (r >= 2) WaitCluster(ack + 8 * b, parity ^ 1);
          constexpr int kPiece = kHalfTileBytes / kCopies;
          for (int c = 0; c < kCopies; ++c) {
            BulkToPeer(PeerAddr(mine, peer) + c * kPiece, SmemAddr(smem + kSrc) + c * kPiece,
                       kPiece, PeerAddr(full + 8 * b, peer));
          }
        }
        WaitCluster(full + 8 * b, parity);
      } else {
        for (int i = 0; i < kUnitsPerThread; ++i) {
          const int u = i * kSenders + tid;
          const uint4 v = UnitValue(cta, r, u);
          if (kMode == kLocal) {
            reinterpret_cast<uint4*>(smem + kBuf + b * kHalfTileBytes)[u] = v;
          } else {
            StoreRemote(PeerAddr(mine, peer) + 16 * u, v);
          }
        }
        if (kMode == kLocal) asm volatile("bar.sync 1, %0;" ::"n"(kSenders) : "memory");
        if (kMode == kRemote) {
          ArriveRemote(PeerAddr(full + 8 * b, peer));
          WaitCluster(full + 8 * b, parity);
        }
      }
      if (kMode != kRemoteFree) {
        for (int i = 0; i < kUnitsPerThread; ++i) {
          sum += ReceivedUnitSum(smem + kBuf + b * kHalfTileBytes, i * kSenders + tid);
        }
      }
      if (kMode == kBulk) {
        asm volatile("bar.sync 1, %0;" ::"n"(kSenders) : "memory");
        if (tid == 0) ArriveRemote(PeerAddr(ack + 8 * b, peer));
      }
    }
  }
  ClusterSync();
  if (kMode == kRemoteFree && tid < kSenders) {
    // The last round's stores, read after the cluster barrier.
    const int b = (rounds - 1) & 1;
    for (int i = 0; i < kUnitsPerThread; ++i) {
      sum += ReceivedUnitSum(smem + kBuf + b * kHalfTileBytes, i * kSenders + tid);
    }
  }
  if (tid < kSenders) checksum[cta * kSenders + tid] = sum;
}

// What thread t of CTA `cta` should have summed.
static uint32_t ExpectedSum(int mode, int cta, int t, int rounds) {
  const int from = mode == kLocal ? cta : cta ^ 1;
  uint32_t sum = 0;
  auto add = [&](int round) {
    for (int i = 0; i < kUnitsPerThread; ++i) {
      sum += UnitSum(UnitValue(from, mode == kBulk ? 0 : round, i * kSenders + t));
    }
  };
  if (mode == kRemoteFree) {
    add(rounds - 1);
  } else {
    for (int r = 0; r < rounds; ++r) add(r);
  }
  return sum;
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? atoi(argv[1]) : 2000;
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int ctas = sms / 2 * 2;
  struct Kernel {
    const char* name;
    int mode;
    const void* fn;
  };
  const Kernel kernels[] = {
      {"local", kLocal, reinterpret_cast<const void*>(&HandOverKernel<kLocal, 1>)},
      {"remote", kRemote, reinterpret_cast<const void*>(&HandOverKernel<kRemote, 1>)},
      {"remote-free", kRemoteFree, reinterpret_cast<const void*>(&HandOverKernel<kRemoteFree, 1>)},
      {"bulk 1", kBulk, reinterpret_cast<const void*>(&HandOverKernel<kBulk, 1>)},
      {"bulk 4", kBulk, reinterpret_cast<const void*>(&HandOverKernel<kBulk, 4>)},
      {"bulk 16", kBulk, reinterpret_cast<const void*>(&HandOverKernel<kBulk, 16>)},
  };
  uint32_t* checksum;
  CHECK_CUDA(cudaMalloc(&checksum, ctas * kSenders * sizeof(uint32_t)));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  printf("# %d CTAs in clusters of two, %d rounds of %d bytes each way\n", ctas, rounds,
         kHalfTileBytes);
  printf("| hand-over | µs per round | GB/s received per SM | checksums |\n|---|---|---|---|\n");
  for (const Kernel& k : kernels) {
    CHECK_CUDA(cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(ctas);
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = kSmemBytes;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = 2;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    config.attrs = attr;
    config.numAttrs = 1;
    void* args[] = {const_cast<int*>(&rounds), &checksum};
    std::vector<float> us;
    for (int rep = 0; rep < 6; ++rep) {
      CHECK_CUDA(cudaMemset(checksum, 0, ctas * kSenders * sizeof(uint32_t)));
      CHECK_CUDA(cudaEventRecord(start));
      CHECK_CUDA(cudaLaunchKernelExC(&config, k.fn, args));
      CHECK_CUDA(cudaEventRecord(stop));
      CHECK_CUDA(cudaEventSynchronize(stop));
      float ms = 0;
      CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
      if (rep > 0) us.push_back(ms * 1e3f / rounds);
    }
    std::sort(us.begin(), us.end());
    std::vector<uint32_t> got(ctas * kSenders);
    CHECK_CUDA(cudaMemcpy(got.data(), checksum, got.size() * 4, cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int c = 0; c < ctas; ++c) {
      for (int t = 0; t < kSenders; ++t) {
        bad += got[c * kSenders + t] != ExpectedSum(k.mode, c, t, rounds);
      }
    }
    const double t = us[us.size() / 2];
    printf("| %s | %.3f | %.1f | %s |\n", k.name, t, kHalfTileBytes / t / 1e3,
           bad ? "WRONG" : "ok");
  }
  CHECK_CUDA(cudaFree(checksum));
  return 0;
}
