// The GPU planner's sequential host twin, for tests on machines without a GPU and for checking the
// kernel word for word: the same range walks as PlanKernel's threads, one thread after another,
// and the kernel's block-wide steps done in order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "device_plan.cuh"

namespace jax_mla {

// The twin's sums per (variant, cluster), in host arrays. (A functor rather than a lambda: a host
// lambda called from the shared __host__ __device__ walks draws an nvcc warning.)
struct HostAdd {
  int64_t* load;
  int* rest_count;
  int n;
  __host__ __device__ void operator()(int v, int c, int64_t shortfall) const { load[v * n + c] += shortfall; }
  __host__ __device__ void operator()(int v, int c, int works, int64_t cost) const {
    rest_count[v * n + c] += works;
    load[v * n + c] += cost;
  }
};

// Writes the schedule into ws (host memory) and returns the number of works, or -1 when a capacity
// (kMaxTotalWorks works, sm_count merge CTAs, kMaxClusters clusters) would be exceeded.
inline int PlanOnHost(const ScheduleShape& s, const ScheduleOffsets& o, const int32_t* seq_lens,
                      uint8_t* ws) {
  const int items = s.num_items(), n = s.num_clusters;
  if (n > kMaxClusters) return -1;
  std::vector<int> first(kPlanThreads), end(kPlanThreads);
  int64_t total_kv = 0;
  for (int t = 0; t < kPlanThreads; ++t) {
    ThreadItems(items, kPlanThreads, t, &first[t], &end[t]);
    total_kv += RangeKv(s, seq_lens, first[t], end[t]);
  }
  const Divisor clusters(n), limit(KvLenLimit(total_kv, clusters));
  std::vector<ItemCounts> before(kPlanThreads);
  std::vector<FirstItem> known(kPlanThreads);
  ItemCounts total = ZeroCounts();
  for (int t = 0; t < kPlanThreads; ++t) {
    before[t] = total;
    total = total + RangeCounts(s, seq_lens, first[t], end[t], limit, &known[t]);
  }
  if (total.chunks() > kMaxTotalWorks || total.merge() > s.sm_count) return -1;
  std::vector<int64_t> load(kVariants * n, 0);  // shortfalls, then costs
  for (int t = 0; t < kPlanThreads; ++t) {
    RangeShortfalls(s, seq_lens, first[t], end[t], limit, before[t], known[t],
                    HostAdd{load.data(), nullptr, n});
  }
  std::vector<int64_t> budget_prefix2(kVariants * kMaxClusters, INT64_MAX);
  for (int v = 0; v < kVariants; ++v) {
    const Deal deal(total.full(v), n);
    int64_t big_sum = 0;
    for (int c = 0; c < n; ++c) {
      load[v * n + c] = BigLoad(s, deal, limit, c, load[v * n + c]);
      big_sum += load[v * n + c];
    }
    const int64_t target = TargetCost(clusters, total, v, big_sum);
    int64_t position2 = -RestShift2(total, v);
    for (int c = 0; c < n; ++c) {
      budget_prefix2[v * kMaxClusters + c] = position2;
      position2 += 2 * Budget(target, load[v * n + c]);
    }
  }
  std::vector<int> rest_count(kVariants * n, 0);
  std::vector<unsigned> first_found(kPlanThreads, 0);
  for (int t = 0; t < kPlanThreads; ++t) {
    RangeRests(s, seq_lens, first[t], end[t], limit, before[t], budget_prefix2.data(), known[t], &first_found[t],
               HostAdd{load.data(), rest_count.data(), n});
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
  ClearUnusedMerges(o, ws, total.merge(), s.sm_count);
  for (int t = 0; t < kPlanThreads; ++t) {
    RangeWrites(s, o, ws, seq_lens, first[t], end[t], limit, before[t], v,
                &budget_prefix2[v * kMaxClusters], known[t], first_found[t], counts, cluster_start.data(), rest_start.data());
  }
  for (int c = 0; c <= n; ++c) At<int32_t>(ws, o.work_indptr)[c] = cluster_start[c];
  return cluster_start[n];
}

}  // namespace jax_mla
