// The GPU planner's kernel and XLA FFI handler (JaxMlaDevicePlan), plus the same schedule built by a
// sequential host driver (JaxMlaDevicePlanOnHost) for the CPU tests. See mla_device_plan.cuh.
#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <algorithm>
#include <vector>

#include "mla_device_plan.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_mla {
namespace {

constexpr int kThreads = 256;

struct SumCounts {
  __device__ ItemCounts operator()(const ItemCounts& a, const ItemCounts& b) const { return a + b; }
};

ScheduleOffsets OffsetsFromPlanInfo(const int64_t* p) {
  return {p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], p[10], p[11], p[12], p[13], p[14], p[15]};
}

constexpr unsigned kFullMask = 0xffffffffu;

__device__ int64_t WarpSum(int64_t x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

__device__ int64_t WarpMax(int64_t x) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const int64_t y = __shfl_xor_sync(kFullMask, x, offset);
    x = y > x ? y : x;
  }
  return x;
}

// The sum of x over the lanes below this one.
__device__ int64_t WarpExclusiveSum(int64_t x, int lane) {
  int64_t inclusive = x;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int64_t below = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += below;
  }
  return inclusive - x;
}

// Every thread owns a contiguous range of (request, tile) items and walks it with running sums,
// so a block-wide scan is needed once (each range's prefix), not per item. Pass 1 adds up the
// short big works per cluster (every variant); then one warp per variant turns them into cluster
// costs and lays out the small works' budgets. Pass 2 places the small works (every variant, in
// runs of one cluster); then the cheapest variant is picked and its work lists laid out. Pass 3
// writes the picked schedule. Work per cluster is spread over a warp's lanes.
__global__ void __launch_bounds__(kThreads)
    PlanKernel(ScheduleShape s, ScheduleOffsets o, const int32_t* seq_lens, uint8_t* ws) {
  using Reduce = cub::BlockReduce<int64_t, kThreads>;
  using Scan = cub::BlockScan<ItemCounts, kThreads, cub::BLOCK_SCAN_WARP_SCANS>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } temp;
  __shared__ int64_t total_kv;
  __shared__ ItemCounts total;
  __shared__ int chosen;
  __shared__ unsigned long long load[kVariants][kMaxClusters];  // shortfalls, then costs
  __shared__ int64_t makespan[kVariants];
  __shared__ int64_t budget_prefix2[kVariants][kMaxClusters];
  __shared__ int rest_count[kVariants][kMaxClusters];
  __shared__ int rest_start[kMaxClusters], cluster_start[kMaxClusters + 1];
  const int n = s.num_clusters, t = threadIdx.x, warp = t / 32, lane = t % 32;
  int first, end, lane_first, lane_end;
  ThreadItems(s.num_items(), kThreads, t, &first, &end);
  ThreadItems(n, 32, lane, &lane_first, &lane_end);  // the clusters a lane of a warp handles

  const int64_t kv_sum = Reduce(temp.reduce).Sum(RangeKv(s, seq_lens, first, end));
  if (t == 0) total_kv = kv_sum;
  for (int i = t; i < kVariants * kMaxClusters; i += kThreads) {
    load[i / kMaxClusters][i % kMaxClusters] = 0;
    rest_count[i / kMaxClusters][i % kMaxClusters] = 0;
  }
  __syncthreads();
  const int limit = KvLenLimit(total_kv, n);
  ItemCounts before, aggregate;
  Scan(temp.scan).ExclusiveScan(RangeCounts(s, seq_lens, first, end, limit), before, ZeroCounts(),
                                SumCounts(), aggregate);
  if (t == 0) total = aggregate;

  RangeShortfalls(s, seq_lens, first, end, limit, before, [&](int v, int c, int64_t shortfall) {
    atomicAdd(&load[v][c], static_cast<unsigned long long>(shortfall));
  });
  __syncthreads();
  if (warp < kVariants) {  // big-work costs, then the small works' budgets
    const int v = warp;
    const Deal deal(total.full(v), n);
    int64_t big_sum = 0;
    for (int c = lane_first; c < lane_end; ++c) {
      const int64_t cost = BigLoad(s, deal, limit, c, static_cast<int64_t>(load[v][c]));
      load[v][c] = static_cast<unsigned long long>(cost);
      big_sum += cost;
    }
    const int64_t target = TargetCost(s, total, v, WarpSum(big_sum));
    int64_t budgets = 0;
    for (int c = lane_first; c < lane_end; ++c) budgets += Budget(target, load[v][c]);
    int64_t position2 = 2 * WarpExclusiveSum(budgets, lane);
    for (int c = lane_first; c < lane_end; ++c) {
      budget_prefix2[v][c] = position2;
      position2 += 2 * Budget(target, load[v][c]);
    }
  }
  __syncthreads();

  RangeRests(s, seq_lens, first, end, limit, before, &budget_prefix2[0][0], kMaxClusters,
             [&](int v, int c, int works, int64_t cost) {
               atomicAdd(&rest_count[v][c], works);
               atomicAdd(&load[v][c], static_cast<unsigned long long>(cost));
             });
  ClearUnusedMerges(o, ws, total.merge, s.num_sm, t, kThreads);
  __syncthreads();
  if (warp < kVariants) {
    int64_t busiest = 0;
    for (int c = lane_first; c < lane_end; ++c) {
      busiest = static_cast<int64_t>(load[warp][c]) > busiest ? static_cast<int64_t>(load[warp][c]) : busiest;
    }
    busiest = WarpMax(busiest);
    if (lane == 0) makespan[warp] = busiest;
  }
  __syncthreads();
  if (warp == 0) {  // the cheapest variant (the first of equals), and its work-list layout
    int v = 0;
    for (int u = 1; u < kVariants; ++u) v = makespan[u] < makespan[v] ? u : v;
    const Deal deal(total.full(v), n);
    int works = 0, rests = 0;
    for (int c = lane_first; c < lane_end; ++c) {
      works += ClusterWorks(deal, c, rest_count[v][c]);
      rests += rest_count[v][c];
    }
    int works_before = static_cast<int>(WarpExclusiveSum(works, lane));
    int rests_before = static_cast<int>(WarpExclusiveSum(rests, lane));
    for (int c = lane_first; c < lane_end; ++c) {
      cluster_start[c] = works_before;
      rest_start[c] = rests_before;
      works_before += ClusterWorks(deal, c, rest_count[v][c]);
      rests_before += rest_count[v][c];
    }
    if (lane == 31) chosen = v, cluster_start[n] = works_before;
  }
  __syncthreads();

  const int v = chosen;
  RangeWrites(s, o, ws, seq_lens, first, end, limit, before, v, budget_prefix2[v], rest_count[v],
              cluster_start, rest_start);
  for (int c = t; c <= n; c += kThreads) At<int32_t>(ws, o.work_indptr)[c] = cluster_start[c];
}

ffi::Error DevicePlanImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> seq_lens,
                          ffi::Result<ffi::AnyBuffer> int_workspace, int64_t q_len,
                          int64_t num_heads, int64_t max_pages, int64_t num_sm, bool causal,
                          ffi::Span<const int64_t> plan_info) {
  if (plan_info.size() != 18 || plan_info[1] > kMaxClusters) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jax_mla: device plan needs an 18-entry plan_info and at most 256 clusters");
  }
  ScheduleShape s{static_cast<int>(seq_lens.element_count()), static_cast<int>(q_len),
                  static_cast<int>(num_heads), static_cast<int>(max_pages), static_cast<int>(num_sm),
                  static_cast<int>(plan_info[0]), static_cast<int>(plan_info[1]), causal};
  PlanKernel<<<1, kThreads, 0, stream>>>(s, OffsetsFromPlanInfo(plan_info.begin()), seq_lens.typed_data(),
                                         static_cast<uint8_t*>(int_workspace->untyped_data()));
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_mla: device plan launch failed: ") +
                                cudaGetErrorString(status));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_mla

// The sequential twin of PlanKernel, for tests on machines without a GPU: the same range walks
// for each of the kernel's threads in turn, the block-wide steps done in order. Returns the number
// of works, or -1 when a capacity (16384 works, #SM merge CTAs, 256 clusters) would be exceeded.
extern "C" int JaxMlaDevicePlanOnHost(const int32_t* seq_lens, int batch, int q_len, int num_heads,
                                      int max_pages, int num_sm, int causal,
                                      const int64_t* plan_info, uint8_t* ws) {
  using namespace jax_mla;
  ScheduleShape s{batch, q_len, num_heads, max_pages, num_sm, static_cast<int>(plan_info[0]),
                  static_cast<int>(plan_info[1]), causal != 0};
  const ScheduleOffsets o = OffsetsFromPlanInfo(plan_info);
  const int items = s.num_items(), n = s.num_clusters;
  if (n > kMaxClusters) return -1;
  std::vector<int> first(kThreads), end(kThreads);
  int64_t total_kv = 0;
  for (int t = 0; t < kThreads; ++t) {
    ThreadItems(items, kThreads, t, &first[t], &end[t]);
    total_kv += RangeKv(s, seq_lens, first[t], end[t]);
  }
  const int limit = KvLenLimit(total_kv, n);
  std::vector<ItemCounts> before(kThreads);
  ItemCounts total = ZeroCounts();
  for (int t = 0; t < kThreads; ++t) {
    before[t] = total;
    total = total + RangeCounts(s, seq_lens, first[t], end[t], limit);
  }
  if (total.chunks > kMaxTotalWorks || total.merge > num_sm) return -1;
  std::vector<int64_t> load(kVariants * n, 0);  // shortfalls, then costs
  for (int t = 0; t < kThreads; ++t) {
    RangeShortfalls(s, seq_lens, first[t], end[t], limit, before[t],
                    [&](int v, int c, int64_t shortfall) { load[v * n + c] += shortfall; });
  }
  std::vector<int64_t> budget_prefix2(kVariants * n);
  for (int v = 0; v < kVariants; ++v) {
    const Deal deal(total.full(v), n);
    int64_t big_sum = 0;
    for (int c = 0; c < n; ++c) {
      load[v * n + c] = BigLoad(s, deal, limit, c, load[v * n + c]);
      big_sum += load[v * n + c];
    }
    const int64_t target = TargetCost(s, total, v, big_sum);
    int64_t position2 = 0;
    for (int c = 0; c < n; ++c) {
      budget_prefix2[v * n + c] = position2;
      position2 += 2 * Budget(target, load[v * n + c]);
    }
  }
  std::vector<int> rest_count(kVariants * n, 0);
  for (int t = 0; t < kThreads; ++t) {
    RangeRests(s, seq_lens, first[t], end[t], limit, before[t], budget_prefix2.data(), n,
               [&](int v, int c, int works, int64_t cost) {
                 rest_count[v * n + c] += works;
                 load[v * n + c] += cost;
               });
  }
  int v = 0;  // the cheapest variant (the first of equals)
  std::vector<int64_t> makespan(kVariants, 0);
  for (int u = 0; u < kVariants; ++u) {
    for (int c = 0; c < n; ++c) makespan[u] = std::max(makespan[u], load[u * n + c]);
    if (makespan[u] < makespan[v]) v = u;
  }
  const int* counts = &rest_count[v * n];
  std::vector<int> rest_start(n), cluster_start(n + 1, 0);
  const Deal deal(total.full(v), n);
  int rests = 0;
  for (int c = 0; c < n; ++c) {
    rest_start[c] = rests;
    rests += counts[c];
    cluster_start[c + 1] = cluster_start[c] + ClusterWorks(deal, c, counts[c]);
  }
  ClearUnusedMerges(o, ws, total.merge, num_sm);
  for (int t = 0; t < kThreads; ++t) {
    RangeWrites(s, o, ws, seq_lens, first[t], end[t], limit, before[t], v, &budget_prefix2[v * n],
                counts, cluster_start.data(), rest_start.data());
  }
  for (int c = 0; c <= n; ++c) At<int32_t>(ws, o.work_indptr)[c] = cluster_start[c];
  return cluster_start[n];
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaDevicePlan, jax_mla::DevicePlanImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens [B]
                                  .Ret<ffi::AnyBuffer>()         // int_workspace (the schedule)
                                  .Attr<int64_t>("q_len")
                                  .Attr<int64_t>("num_heads")
                                  .Attr<int64_t>("max_pages")
                                  .Attr<int64_t>("num_sm")
                                  .Attr<bool>("causal")
                                  .Attr<ffi::Span<const int64_t>>("plan_info"),
                              {ffi::Traits::kCmdBufferCompatible});
