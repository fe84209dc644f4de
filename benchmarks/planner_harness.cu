// The GPU planner's kernel on its own, without JAX: word-for-word against its host twin on random
// cases, and its time per launch replayed in a CUDA graph, with the clock cycle at which thread 0
// leaves each barrier-separated phase.
//
//   nvcc -std=c++17 -O3 -arch=sm_90a -Iffi benchmarks/planner_harness.cu -o planner_harness
//   ./planner_harness check 1000   # kernel == twin on 1000 random cases (exit 1 on a mismatch)
//   ./planner_harness time [B ...] # markdown table: µs per launch and phase stamps (all or these B)
//   ./planner_harness one B H q L  # two launches of one case (for ncu or compute-sanitizer)
//
// The layout below mirrors jax_mla.planning.schedule_layout (kv_lora_rank 512).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "device_plan.cuh"
#include "plan_info.h"
#include "plan_twin.cuh"

using namespace jax_mla;

__device__ long long g_stamps[16];  // 0..5: the kernel's phases; 6..15: a build's own marks

// PlanKernel's phase marks as thread 0's clock.
struct ClockStamps {
  __device__ static void Mark(int phase) {
    if (threadIdx.x == 0) g_stamps[phase] = clock64();
  }
};

#define CHECK_CUDA(call)                                                                  \
  do {                                                                                    \
    cudaError_t status = (call);                                                          \
    if (status != cudaSuccess) {                                                          \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(status), __FILE__, __LINE__); \
      exit(2);                                                                            \
    }                                                                                     \
  } while (0)

struct Layout {
  int64_t plan_info[kPlanInfoSize];
  int64_t int_workspace_bytes;
};

Layout ScheduleLayout(int sm_count, int q_len, int num_heads) {
  Layout layout{};
  const int cluster_size = q_len * num_heads > 64 ? 2 : 1;
  layout.plan_info[0] = cluster_size;
  layout.plan_info[1] = sm_count / cluster_size;
  int64_t end = 0;
  auto alloc = [&](int64_t size) {
    const int64_t start = (end + 15) / 16 * 16;
    end = start + size;
    return start;
  };
  int entry = 2;
  for (int i = 0; i < 3; ++i) layout.plan_info[entry++] = alloc(4 * kMaxTotalWorks);  // indptrs
  for (int i = 0; i < 5; ++i) layout.plan_info[entry++] = alloc(4 * sm_count);        // merges
  for (int i = 0; i < 6; ++i) layout.plan_info[entry++] = alloc(4 * kMaxTotalWorks);  // per work
  layout.int_workspace_bytes = end;
  return layout;
}

struct Case {
  int batch, q_len, num_heads;
  std::vector<int32_t> lengths;
};

// kind 0: uniform in [mean/2, 3 mean/2]; 1: all mean; 2: one 32k among short; 3: at most 50;
// 4: all q_len; 5: heavy-tailed; 6: about 2^30 each (64-bit cost sums).
std::vector<int32_t> Lengths(std::mt19937& rng, int batch, int kind, int mean, int q_len) {
  std::vector<int32_t> lengths(batch);
  std::uniform_int_distribution<int> uniform(mean / 2, 3 * mean / 2);
  for (int b = 0; b < batch; ++b) {
    double x = uniform(rng);
    if (kind == 1) x = mean;
    if (kind == 2) x = b == 0 ? 32768 : 1 + rng() % 600;
    if (kind == 3) x = 1 + rng() % 50;
    if (kind == 4) x = q_len;
    if (kind == 5) x = std::min(131072.0, mean / 4 / std::pow((rng() % 10000 + 1) / 10001.0, 0.7));
    if (kind == 6) x = (1 << 30) + rng() % 100000;
    lengths[b] = std::max(static_cast<int>(x), q_len);
  }
  return lengths;
}

struct Launch {
  Layout layout;
  ScheduleShape shape;
  int32_t* lengths;
  uint8_t* workspace;

  Launch(const Case& c, int sm_count) : layout(ScheduleLayout(sm_count, c.q_len, c.num_heads)) {
    int max_pages = 0;
    for (int x : c.lengths) max_pages = std::max(max_pages, (x + 63) / 64);
    shape = MakeShape(c.batch, c.q_len, c.num_heads, max_pages, sm_count, c.q_len > 1,
                      layout.plan_info);
    CHECK_CUDA(cudaMalloc(&lengths, 4 * c.lengths.size()));
    CHECK_CUDA(cudaMemcpy(lengths, c.lengths.data(), 4 * c.lengths.size(), cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMalloc(&workspace, layout.int_workspace_bytes));
    CHECK_CUDA(cudaMemset(workspace, 0, layout.int_workspace_bytes));
  }
  ~Launch() {
    cudaFree(lengths);
    cudaFree(workspace);
  }
  void operator()(cudaStream_t stream) const {
    PlanKernel<ClockStamps><<<1, kPlanThreads, 0, stream>>>(shape, OffsetsFromPlanInfo(layout.plan_info),
                                                            lengths, workspace);
  }
};

// Whether the kernel writes the same bytes as the twin (both into zeroed workspaces).
bool KernelMatchesTwin(const Case& c, int sm_count) {
  const Launch launch(c, sm_count);
  std::vector<uint8_t> twin(launch.layout.int_workspace_bytes, 0), kernel(twin.size());
  const int works = PlanOnHost(launch.shape, OffsetsFromPlanInfo(launch.layout.plan_info),
                               c.lengths.data(), twin.data());
  if (works < 0) return true;  // over a capacity: the Python API refuses such calls
  launch(0);
  CHECK_CUDA(cudaDeviceSynchronize());
  CHECK_CUDA(cudaMemcpy(kernel.data(), launch.workspace, kernel.size(), cudaMemcpyDeviceToHost));
  const auto diff = std::mismatch(kernel.begin(), kernel.end(), twin.begin());
  if (diff.first == kernel.end()) return true;
  printf("MISMATCH B=%d q_len=%d H=%d works=%d at byte %zu\n", c.batch, c.q_len, c.num_heads, works,
         static_cast<size_t>(diff.first - kernel.begin()));
  return false;
}

__global__ void EmptyKernel() {}

// Median µs per launch of `launches` calls of body captured in one CUDA graph.
double GraphMicroseconds(cudaStream_t stream, int launches, const std::function<void()>& body) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < launches; ++i) body();
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int rep = 0; rep < 18; ++rep) {
    CHECK_CUDA(cudaEventRecord(start, stream));
    CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaEventRecord(stop, stream));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float x;
    CHECK_CUDA(cudaEventElapsedTime(&x, start, stop));
    if (rep >= 3) ms.push_back(x);  // the first replays warm up
  }
  std::sort(ms.begin(), ms.end());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return ms[ms.size() / 2] * 1e3 / launches;
}

int Check(int cases, int sm_count) {
  std::mt19937 rng(1234);
  const int heads[] = {16, 32, 64, 128};
  int mismatches = 0;
  for (int i = 0; i < cases; ++i) {
    Case c;
    c.batch = 1 + static_cast<int>(rng() % (i % 3 == 0 ? 32 : 1500));
    c.q_len = 1 + static_cast<int>(rng() % 4);
    c.num_heads = heads[rng() % 4];
    c.lengths = Lengths(rng, c.batch, static_cast<int>(rng() % 6), 256 << (rng() % 8), c.q_len);
    if (i % 25 == 0) c.batch = 1 + i % 3, c.lengths = Lengths(rng, c.batch, 6, 0, c.q_len);
    mismatches += !KernelMatchesTwin(c, sm_count);
  }
  printf("kernel == twin: %d random cases, %d mismatches\n", cases, mismatches);
  return mismatches != 0;
}

// only_batches: the batch sizes to time (all when empty).
int Time(int sm_count, const std::vector<int>& only_batches) {
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  const double empty = GraphMicroseconds(stream, 200, [&] { EmptyKernel<<<1, kPlanThreads, 0, stream>>>(); });
  printf("An empty kernel: %.2f µs per launch in a CUDA graph.\n\n", empty);
  printf("| B | H | q_len | L | planner µs per launch | cycles to the end of phases 1..5 (thread 0) |\n");
  printf("|---|---|---|---|---|---|\n");
  for (int num_heads : {16, 128}) {
    for (int q_len : {1, 2}) {
      for (int batch : {1, 32, 128, 512}) {
        for (int mean : {4096, 32768}) {
          if (mean == 32768 && batch > 32) continue;
          if (!only_batches.empty() &&
              std::find(only_batches.begin(), only_batches.end(), batch) == only_batches.end()) continue;
          std::mt19937 rng(batch * 7 + num_heads + q_len);
          const Case c{batch, q_len, num_heads, Lengths(rng, batch, 0, mean, q_len)};
          const bool same = KernelMatchesTwin(c, sm_count);
          const Launch launch(c, sm_count);
          const double us = GraphMicroseconds(stream, 200, [&] { launch(stream); });
          long long stamps[16] = {};
          CHECK_CUDA(cudaMemcpyToSymbol(g_stamps, stamps, sizeof(stamps)));
          launch(stream);
          CHECK_CUDA(cudaStreamSynchronize(stream));
          CHECK_CUDA(cudaMemcpyFromSymbol(stamps, g_stamps, sizeof(stamps)));
          printf("| %d | %d | %d | %dk | %.2f%s |", batch, num_heads, q_len, mean / 1024, us,
                 same ? "" : " (differs from the twin)");
          for (int phase = 1; phase <= 5; ++phase) printf(" %lld", stamps[phase] - stamps[0]);
          for (int mark = 6; mark < 16; ++mark) {
            if (stamps[mark]) printf(" %s%d:%lld", mark == 6 ? "/ " : "", mark, stamps[mark] - stamps[0]);
          }
          printf(" |\n");
        }
      }
    }
  }
  return 0;
}

int main(int argc, char** argv) {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int sm_count = prop.multiProcessorCount;
  const char* mode = argc > 1 ? argv[1] : "time";
  if (!strcmp(mode, "check")) return Check(argc > 2 ? atoi(argv[2]) : 1000, sm_count);
  if (!strcmp(mode, "one") && argc == 6) {
    std::mt19937 rng(1);
    const int batch = atoi(argv[2]), num_heads = atoi(argv[3]), q_len = atoi(argv[4]);
    const Launch launch(Case{batch, q_len, num_heads, Lengths(rng, batch, 0, atoi(argv[5]), q_len)}, sm_count);
    launch(0);
    launch(0);
    CHECK_CUDA(cudaDeviceSynchronize());
    return 0;
  }
  if (!strcmp(mode, "time")) {
    std::vector<int> only_batches;
    for (int i = 2; i < argc; ++i) only_batches.push_back(atoi(argv[i]));
    return Time(sm_count, only_batches);
  }
  printf("usage: %s check [cases] | time [B ...] | one B H q_len L\n", argv[0]);
  return 2;
}
