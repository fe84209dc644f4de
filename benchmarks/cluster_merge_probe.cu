// What merging split partial outputs inside a thread-block cluster would cost, beside storing
// them whole: a design probe for the sm90 decode at few requests (docs/sm90-kernel.md, "Next
// steps" 4). No jax_mla code runs here.
//
// Each CTA (384 threads, the decode kernel's 231,504 bytes of shared memory, so one per SM) ends
// holding a 64 x 512 fp32 partial output in its two consumer warpgroups' registers and 64 row
// LSEs, as a split segment of the decode does. Epilogues timed:
//   none     nothing (the launch and the grid);
//   store    each CTA writes its 128 KB and 64 LSEs to global memory (what the decode does now,
//            without its staging through shared memory);
//   merge C  each CTA writes them into its own shared memory; the cluster of C CTAs synchronises;
//            CTA r merges rows [64 r / C, 64 (r + 1) / C) of the C partials, LSE-weighted, read
//            through distributed shared memory, and writes them to global memory; the cluster
//            synchronises again before any CTA exits (the others may still read its memory);
//   stage C  the merge's shared-memory writes and its two cluster barriers, without the reads.
// A merge is checked against the same merge on the host. µs per launch: graph replay of 200
// launches, median of 5 replays.
//
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a benchmarks/cluster_merge_probe.cu \
//        -o .gpu/cluster_merge_probe
//   .gpu/cluster_merge_probe [CTAS ...]   # default 64 (B = 1, L = 4k at 128 heads) and 128
#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "check_cuda.h"

namespace cg = cooperative_groups;

constexpr int kThreads = 384;
constexpr int kConsumerThreads = 256;
constexpr int kRows = 64, kCols = 512;
constexpr int kTileVec = kRows * kCols / 4;  // float4 per tile
constexpr int kSmemBytes = 231504;

// The value a consumer thread holds for element i of CTA `cta`'s partial output, and row r's LSE.
__host__ __device__ inline float PartialValue(int cta, int i) {
  return static_cast<float>((cta * 131 + i * 7) & 1023) * 1e-3f - 0.5f;
}
__host__ __device__ inline float PartialLse(int cta, int r) {
  return static_cast<float>((cta * 17 + r * 5) % 23) * 0.25f;
}

__device__ inline float4 HeldValues(int cta, int v) {
  return make_float4(PartialValue(cta, 4 * v), PartialValue(cta, 4 * v + 1),
                     PartialValue(cta, 4 * v + 2), PartialValue(cta, 4 * v + 3));
}

enum Epilogue { kNone, kStore, kStage, kMerge };

// Each CTA's epilogue (kStage: the merge's writes to shared memory and its two cluster barriers,
// without the reads) with clusters of kCluster CTAs.
template <Epilogue kMode, int kCluster>
__global__ void __launch_bounds__(kThreads) EpilogueKernel(float4* out, float* lse_out) {
  extern __shared__ float4 smem[];
  const int cta = blockIdx.x, tid = threadIdx.x;
  if constexpr (kMode == kStore) {
    if (tid < kConsumerThreads) {
      float4* dst = out + static_cast<size_t>(cta) * kTileVec;
      for (int v = tid; v < kTileVec; v += kConsumerThreads) dst[v] = HeldValues(cta, v);
      if (tid < kRows) lse_out[cta * kRows + tid] = PartialLse(cta, tid);
    }
  } else if constexpr (kMode == kStage || kMode == kMerge) {
    cg::cluster_group cluster = cg::this_cluster();
    const int rank = static_cast<int>(cluster.block_rank());
    float* lse = reinterpret_cast<float*>(smem + kTileVec);
    if (tid < kConsumerThreads) {
      for (int v = tid; v < kTileVec; v += kConsumerThreads) smem[v] = HeldValues(cta, v);
      if (tid < kRows) lse[tid] = PartialLse(cta, tid);
    }
    cluster.sync();
    if constexpr (kMode == kMerge) {
      constexpr int kRowsHere = kRows / kCluster, kItems = kRowsHere * (kCols / 4);
      // float4 loads a thread has in flight: 16 / kCluster rows' worth.
      constexpr int kInFlight = kCluster >= 16 ? 1 : 16 / kCluster;
      const int row0 = rank * kRowsHere, first_cta = cta - rank;
      float* weights = lse + kRows;  // [kRowsHere][kCluster]: each partial's weight in these rows
      if (tid < kRowsHere) {
        const int r = row0 + tid;
        float max_lse = -INFINITY;
#pragma unroll
        for (int j = 0; j < kCluster; ++j) {
          max_lse = fmaxf(max_lse, cluster.map_shared_rank(lse, j)[r]);
        }
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < kCluster; ++j) {
          sum += __expf(cluster.map_shared_rank(lse, j)[r] - max_lse);
        }
        const float merged_lse = max_lse + __logf(sum);
#pragma unroll
        for (int j = 0; j < kCluster; ++j) {
          weights[tid * kCluster + j] = __expf(cluster.map_shared_rank(lse, j)[r] - merged_lse);
        }
        lse_out[first_cta * kRows + r] = merged_lse;
      }
      const float4* peer[kCluster];
#pragma unroll
      for (int j = 0; j < kCluster; ++j) peer[j] = cluster.map_shared_rank(smem, j);
      __syncthreads();
      const int v0 = row0 * (kCols / 4);
      for (int base = tid; base < kItems; base += kThreads * kInFlight) {
        float4 x[kInFlight][kCluster];
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) {
          const int item = base + u * kThreads;
#pragma unroll
          for (int j = 0; j < kCluster; ++j) {
            if (item < kItems) x[u][j] = peer[j][v0 + item];
          }
        }
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) {
          const int item = base + u * kThreads;
          if (item >= kItems) continue;
          const float* w = weights + (item / (kCols / 4)) * kCluster;
          float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
          for (int j = 0; j < kCluster; ++j) {
            acc.x = fmaf(w[j], x[u][j].x, acc.x);
            acc.y = fmaf(w[j], x[u][j].y, acc.y);
            acc.z = fmaf(w[j], x[u][j].z, acc.z);
            acc.w = fmaf(w[j], x[u][j].w, acc.w);
          }
          out[static_cast<size_t>(first_cta) * kTileVec + v0 + item] = acc;
        }
      }
    }
    cluster.sync();
  }
}

static void Launch(const void* kernel, int ctas, int cluster, cudaStream_t stream, void** args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ctas);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim = {static_cast<unsigned>(cluster), 1, 1};
  config.attrs = attr;
  config.numAttrs = 1;
  CHECK_CUDA(cudaLaunchKernelExC(&config, kernel, args));
}

// Median µs per launch over 5 replays of a graph of 200 launches.
static double TimeLaunches(const void* kernel, int ctas, int cluster, void** args) {
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  constexpr int kLaunches = 200;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < kLaunches; ++i) Launch(kernel, ctas, cluster, stream, args);
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  CHECK_CUDA(cudaGraphLaunch(exec, stream));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<double> us;
  for (int rep = 0; rep < 5; ++rep) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    us.push_back(ms * 1e3 / kLaunches);
  }
  std::sort(us.begin(), us.end());
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  CHECK_CUDA(cudaGraphExecDestroy(exec));
  CHECK_CUDA(cudaGraphDestroy(graph));
  CHECK_CUDA(cudaStreamDestroy(stream));
  return us[2];
}

// Largest relative error of the merged rows of one launch against the host's merge.
static double CheckMerge(const std::vector<float>& out, const std::vector<float>& lse, int ctas,
                         int cluster) {
  double worst = 0;
  for (int first = 0; first < ctas; first += cluster) {
    for (int r = 0; r < kRows; ++r) {
      double max_lse = -INFINITY, sum = 0;
      for (int j = 0; j < cluster; ++j) {
        max_lse = std::max<double>(max_lse, PartialLse(first + j, r));
      }
      for (int j = 0; j < cluster; ++j) sum += std::exp(PartialLse(first + j, r) - max_lse);
      const double merged = max_lse + std::log(sum);
      worst = std::max(worst, std::fabs(merged - lse[first * kRows + r]) / std::fabs(merged));
      for (int c = 0; c < kCols; ++c) {
        double ref = 0;
        for (int j = 0; j < cluster; ++j) {
          ref += std::exp(PartialLse(first + j, r) - merged) *
                 PartialValue(first + j, r * kCols + c);
        }
        const double got = out[static_cast<size_t>(first) * kRows * kCols + r * kCols + c];
        worst = std::max(worst, std::fabs(got - ref) / std::max(std::fabs(ref), 1e-3));
      }
    }
  }
  return worst;
}

int main(int argc, char** argv) {
  std::vector<int> grids;
  for (int i = 1; i < argc; ++i) grids.push_back(atoi(argv[i]));
  if (grids.empty()) grids = {64, 128};
  struct Kernel {
    const char* name;
    int cluster;
    const void* fn;
  };
  const Kernel kernels[] = {
      {"none", 1, reinterpret_cast<const void*>(&EpilogueKernel<kNone, 1>)},
      {"store", 1, reinterpret_cast<const void*>(&EpilogueKernel<kStore, 1>)},
      {"stage", 2, reinterpret_cast<const void*>(&EpilogueKernel<kStage, 2>)},
      {"merge", 2, reinterpret_cast<const void*>(&EpilogueKernel<kMerge, 2>)},
      {"stage", 4, reinterpret_cast<const void*>(&EpilogueKernel<kStage, 4>)},
      {"merge", 4, reinterpret_cast<const void*>(&EpilogueKernel<kMerge, 4>)},
      {"stage", 8, reinterpret_cast<const void*>(&EpilogueKernel<kStage, 8>)},
      {"merge", 8, reinterpret_cast<const void*>(&EpilogueKernel<kMerge, 8>)},
      {"stage", 16, reinterpret_cast<const void*>(&EpilogueKernel<kStage, 16>)},
      {"merge", 16, reinterpret_cast<const void*>(&EpilogueKernel<kMerge, 16>)},
  };
  for (const Kernel& k : kernels) {
    CHECK_CUDA(cudaFuncSetAttribute(k.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    CHECK_CUDA(cudaFuncSetAttribute(k.fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  }
  printf("| CTAs | epilogue | cluster | µs per launch | minus none | global bytes written | "
         "merge max rel err |\n|---|---|---|---|---|---|---|\n");
  for (int ctas : grids) {
    float4* out;
    float* lse;
    CHECK_CUDA(cudaMalloc(&out, static_cast<size_t>(ctas) * kTileVec * sizeof(float4)));
    CHECK_CUDA(cudaMalloc(&lse, static_cast<size_t>(ctas) * kRows * sizeof(float)));
    void* args[] = {&out, &lse};
    double none = 0;
    for (const Kernel& k : kernels) {
      if (ctas % k.cluster != 0) continue;
      CHECK_CUDA(cudaMemset(out, 0xFF, static_cast<size_t>(ctas) * kTileVec * sizeof(float4)));
      const double t = TimeLaunches(k.fn, ctas, k.cluster, args);
      if (k.fn == kernels[0].fn) none = t;
      const bool merge = std::string(k.name) == "merge";
      const int writers = merge ? ctas / k.cluster : std::string(k.name) == "store" ? ctas : 0;
      char err[32] = "";
      if (merge) {
        std::vector<float> h_out(static_cast<size_t>(ctas) * kTileVec * 4), h_lse(ctas * kRows);
        CHECK_CUDA(cudaMemcpy(h_out.data(), out, h_out.size() * 4, cudaMemcpyDeviceToHost));
        CHECK_CUDA(cudaMemcpy(h_lse.data(), lse, h_lse.size() * 4, cudaMemcpyDeviceToHost));
        snprintf(err, sizeof(err), "%.1e", CheckMerge(h_out, h_lse, ctas, k.cluster));
      }
      printf("| %d | %s | %d | %.2f | %.2f | %.1f MB | %s |\n", ctas, k.name, k.cluster, t,
             t - none, writers * (kTileVec * 16.0 + kRows * 4.0) / 1e6, err);
    }
    CHECK_CUDA(cudaFree(out));
    CHECK_CUDA(cudaFree(lse));
  }
  return 0;
}
