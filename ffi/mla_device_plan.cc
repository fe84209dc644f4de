// The GPU planner's kernel and XLA FFI handler (JaxMlaDevicePlan), plus the same schedule built by a
// sequential host driver (JaxMlaDevicePlanOnHost) for the CPU tests. See mla_device_plan.cuh.
#include <cuda_runtime.h>

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>
#include <vector>

#include "mla_device_plan.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_mla {
namespace {

constexpr int kThreads = 1024;

struct SumCounts {
  __device__ ItemCounts operator()(const ItemCounts& a, const ItemCounts& b) const { return a + b; }
};

ScheduleOffsets OffsetsFromPlanInfo(const int64_t* p) {
  return {p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], p[10], p[11], p[12], p[13], p[14], p[15]};
}

// One block walks the (request, tile) items in rounds of kThreads: totals, then rest-work
// clusters, then the writes, each round scanning its items' counts on top of the carry.
__global__ void __launch_bounds__(kThreads)
    PlanKernel(ScheduleShape s, ScheduleOffsets o, const int32_t* seq_lens, uint8_t* ws) {
  using Reduce = cub::BlockReduce<int64_t, kThreads>;
  using Scan = cub::BlockScan<ItemCounts, kThreads>;
  __shared__ union {
    typename Reduce::TempStorage reduce;
    typename Scan::TempStorage scan;
  } temp;
  __shared__ int64_t total_kv;
  __shared__ ItemCounts carry;
  __shared__ double budget_prefix[kMaxClusters + 1];
  __shared__ unsigned long long big_load[kMaxClusters];
  __shared__ int rest_count[kMaxClusters], rest_start[kMaxClusters], cluster_start[kMaxClusters + 1];
  const int items = s.num_items(), n = s.num_clusters, t = threadIdx.x;

  int64_t kv_sum = 0;
  for (int i = t; i < items; i += kThreads) {
    kv_sum += TileKvLen(s, seq_lens[i / s.num_q_tiles()], i % s.num_q_tiles());
  }
  kv_sum = Reduce(temp.reduce).Sum(kv_sum);
  if (t == 0) total_kv = kv_sum;
  for (int c = t; c < n; c += kThreads) rest_count[c] = 0, big_load[c] = 0;
  __syncthreads();
  const int limit = KvLenLimit(total_kv, n);

  // Pass 1: totals. Pass 2: rest clusters. Pass 3: writes.
  for (int pass = 1; pass <= 3; ++pass) {
    if (t == 0) carry = ItemCounts{};
    __syncthreads();
    for (int round = 0; round * kThreads < items; ++round) {
      const int i = round * kThreads + t;
      Item it{};
      ItemCounts own{};
      if (i < items) {
        it = DescribeItem(s, seq_lens, i, limit);
        own = CountItem(s, it, limit);
      }
      ItemCounts before, aggregate;
      Scan(temp.scan).ExclusiveScan(own, before, ItemCounts{}, SumCounts(), aggregate);
      before = before + carry;
      if (i < items && pass == 1) {
        DealBigWorks(s, it, before, own, limit, big_load);
      }
      if (i < items && own.rest && pass == 2) {
        atomicAdd(&rest_count[RestCluster(budget_prefix, n, RestMidpoint(before, own))], 1);
      }
      if (i < items && pass == 3) {
        int rest_slot = -1;
        if (own.rest) {
          const int c = RestCluster(budget_prefix, n, RestMidpoint(before, own));
          rest_slot = RestSlot(c, before, rest_count, cluster_start, rest_start);
        }
        WriteItem(s, o, ws, it, before, limit, cluster_start, rest_slot);
      }
      __syncthreads();
      if (t == 0) carry = carry + aggregate;
      __syncthreads();
    }
    if (t == 0 && pass == 1) {
      RestBudgets(s, carry, big_load, budget_prefix);
    }
    if (t == 0 && pass == 2) {
      ClusterStarts(s, carry, rest_count, cluster_start, rest_start);
      ClearUnusedMerges(o, ws, carry.merge, s.num_sm);
    }
    __syncthreads();
  }
  for (int c = t; c <= n; c += kThreads) At<int32_t>(ws, o.work_indptr)[c] = cluster_start[c];
}

ffi::Error DevicePlanImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> seq_lens,
                          ffi::Result<ffi::AnyBuffer> int_workspace, int64_t q_len,
                          int64_t num_heads, int64_t max_pages, int64_t num_sm, bool causal,
                          ffi::Span<const int64_t> plan_info) {
  if (plan_info.size() != 18 || plan_info[1] > kMaxClusters) {
    return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                      "jax_mla: device plan needs an 18-entry plan_info and at most 512 clusters");
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

// The sequential twin of PlanKernel, for tests on machines without a GPU. Returns the number of
// works, or -1 when a capacity (16384 works, #SM merge CTAs, 512 clusters) would be exceeded.
extern "C" int JaxMlaDevicePlanOnHost(const int32_t* seq_lens, int batch, int q_len, int num_heads,
                                      int max_pages, int num_sm, int causal,
                                      const int64_t* plan_info, uint8_t* ws) {
  using namespace jax_mla;
  ScheduleShape s{batch, q_len, num_heads, max_pages, num_sm, static_cast<int>(plan_info[0]),
                  static_cast<int>(plan_info[1]), causal != 0};
  const ScheduleOffsets o = OffsetsFromPlanInfo(plan_info);
  const int items = s.num_items(), n = s.num_clusters;
  if (n > kMaxClusters) return -1;
  int64_t total_kv = 0;
  for (int i = 0; i < items; ++i) {
    total_kv += TileKvLen(s, seq_lens[i / s.num_q_tiles()], i % s.num_q_tiles());
  }
  const int limit = KvLenLimit(total_kv, n);
  std::vector<Item> its(items);
  std::vector<ItemCounts> own(items), before(items);
  std::vector<unsigned long long> big_load(n, 0);
  ItemCounts total{};
  for (int i = 0; i < items; ++i) {
    its[i] = DescribeItem(s, seq_lens, i, limit);
    own[i] = CountItem(s, its[i], limit);
    before[i] = total;
    total = total + own[i];
    DealBigWorks(s, its[i], before[i], own[i], limit, big_load.data());
  }
  if (total.full + total.rest > kMaxTotalWorks || total.merge > num_sm) return -1;
  std::vector<double> budget_prefix(n + 1);
  RestBudgets(s, total, big_load.data(), budget_prefix.data());
  std::vector<int> rest_cluster(items, -1), rest_count(n, 0), rest_start(n), cluster_start(n + 1);
  for (int i = 0; i < items; ++i) {
    if (!own[i].rest) continue;
    rest_cluster[i] = RestCluster(budget_prefix.data(), n, RestMidpoint(before[i], own[i]));
    ++rest_count[rest_cluster[i]];
  }
  ClusterStarts(s, total, rest_count.data(), cluster_start.data(), rest_start.data());
  ClearUnusedMerges(o, ws, total.merge, num_sm);
  for (int i = 0; i < items; ++i) {
    const int c = rest_cluster[i];
    const int rest_slot =
        c < 0 ? -1 : RestSlot(c, before[i], rest_count.data(), cluster_start.data(), rest_start.data());
    WriteItem(s, o, ws, its[i], before[i], limit, cluster_start.data(), rest_slot);
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
