// The GPU planner's kernel: one block builds the schedule of schedule.cuh from device-resident
// seq_lens, so a jitted step plans without reading the lengths back to the host.
#pragma once

#include <cstdint>

#include "schedule.cuh"

namespace jax_mla {

constexpr int kPlanThreads = 512, kPlanWarps = kPlanThreads / 32;
constexpr int kClustersPerLane = kMaxClusters / 32;  // when one warp handles every cluster
constexpr unsigned kFullMask = 0xffffffffu;

__device__ inline int64_t WarpSum(int64_t x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// The sum of x over the block, in every thread. warp_sums: shared, kPlanWarps entries.
__device__ inline int64_t BlockSum(int64_t x, int64_t* warp_sums, int warp, int lane) {
  x = WarpSum(x);
  if (lane == 0) warp_sums[warp] = x;
  __syncthreads();
  x = lane < kPlanWarps ? warp_sums[lane] : 0;
  return WarpSum(x);
}

__device__ inline int64_t WarpMax(int64_t x) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const int64_t y = __shfl_xor_sync(kFullMask, x, offset);
    x = y > x ? y : x;
  }
  return x;
}

// A 64-bit add to shared memory as two native 32-bit atomics: sm_90 has no 64-bit shared atomicAdd
// (it compiles to a compare-and-swap loop, which lanes of a warp adding to one cluster serialize).
// The low word's carry is found from its old value and added to the high word.
__device__ inline void SharedAdd64(unsigned long long* address, unsigned long long x) {
  unsigned* words = reinterpret_cast<unsigned*>(address);
  const unsigned low = static_cast<unsigned>(x), old = atomicAdd(words, low);
  const unsigned high = static_cast<unsigned>(x >> 32) + (old + low < old ? 1u : 0u);
  if (high != 0) atomicAdd(words + 1, high);
}

// The sum of x over the lanes below this one.
__device__ inline int64_t WarpExclusiveSum(int64_t x, int lane) {
  int64_t inclusive = x;
  for (int offset = 1; offset < 32; offset <<= 1) {
    const int64_t below = __shfl_up_sync(kFullMask, inclusive, offset);
    if (lane >= offset) inclusive += below;
  }
  return inclusive - x;
}

// One field of ItemCounts from the lane `delta` below (kUp) or from lane `delta` (else). kNarrow:
// the 64-bit costs are known to stay below 2^31, so they travel as one word instead of two.
template <bool kNarrow, bool kUp, typename T>
__device__ T Shuffle(T x, int delta) {
  if constexpr (kNarrow && sizeof(T) == 8) {
    const int word = static_cast<int>(x);
    return static_cast<T>(kUp ? __shfl_up_sync(kFullMask, word, delta) : __shfl_sync(kFullMask, word, delta));
  } else {
    return kUp ? __shfl_up_sync(kFullMask, x, delta) : __shfl_sync(kFullMask, x, delta);
  }
}

// The exclusive prefix of `own` over the block's threads, and the sum over all in *total (shared):
// warp scans by shuffles, then one warp scans the warp totals (cub's BlockScan has every thread
// add up the totals of all warps below its own, one by one). warp_totals: shared, kPlanWarps
// entries.
template <bool kNarrow>
__device__ ItemCounts BlockExclusiveScan(const ItemCounts& own, ItemCounts* warp_totals, int warp,
                                         int lane, ItemCounts* total) {
  ItemCounts inclusive = own;
  #pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const ItemCounts below = inclusive.Map([&](auto x) { return Shuffle<kNarrow, true>(x, offset); });
    if (lane >= offset) inclusive = inclusive + below;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {  // the warp totals become each warp's exclusive prefix
    const ItemCounts warp_total = lane < kPlanWarps ? warp_totals[lane] : ZeroCounts();
    ItemCounts warps = warp_total;  // then: over warps 0 .. lane
    #pragma unroll
    for (int offset = 1; offset < kPlanWarps; offset *= 2) {
      const ItemCounts below = warps.Map([&](auto x) { return Shuffle<kNarrow, true>(x, offset); });
      if (lane >= offset) warps = warps + below;
    }
    __syncwarp();
    if (lane < kPlanWarps) warp_totals[lane] = warps - warp_total;
    if (lane == kPlanWarps - 1) *total = warps;
  }
  __syncthreads();
  return warp_totals[warp] + (inclusive - own);
}

// What PlanKernel does at its start (phase 0) and after each of its five barrier-separated phases:
// nothing, unless a timing harness passes its own type with a __device__ static Mark(int phase).
struct NoPhaseMarks {
  __device__ static void Mark(int) {}
};

// Every thread owns a contiguous range of (request, tile) items (one item each up to 512 items) and
// walks it with running sums, so a block-wide scan is needed once (each range's prefix), not per
// item. Pass 1 adds up the short big works per cluster (every variant); then one warp per variant
// turns them into cluster costs and lays out the small works' budgets. Pass 2 places the small
// works (every variant, in runs of one cluster); then one warp per variant finds its busiest
// cluster and lays out its work lists. Pass 3 writes the cheapest variant's schedule. The kernel
// is one chain of dependent steps, so its code avoids what lengthens the chain: no 64-bit division
// or compare-and-swap loop, searches without branches, per-lane cluster values kept in registers.
template <typename Phases = NoPhaseMarks>
__global__ void __launch_bounds__(kPlanThreads)
    PlanKernel(ScheduleShape s, ScheduleOffsets o, const int32_t* seq_lens, uint8_t* ws) {
  __shared__ int64_t warp_sums[kPlanWarps];
  __shared__ ItemCounts warp_totals[kPlanWarps];
  __shared__ ItemCounts total;
  __shared__ unsigned long long load[kVariants][kMaxClusters];  // shortfalls, then costs
  __shared__ int64_t makespan[kVariants];
  __shared__ int64_t budget_prefix2[kVariants][kMaxClusters];
  __shared__ int rest_count[kVariants][kMaxClusters];
  __shared__ int rest_start[kVariants][kMaxClusters], cluster_start[kVariants][kMaxClusters + 1];  // per variant
  Phases::Mark(0);
  const int n = s.num_clusters, t = threadIdx.x, warp = t / 32, lane = t % 32;
  int first, end, lane_first, lane_end;
  ThreadItems(s.num_items(), kPlanThreads, t, &first, &end);
  ThreadItems(n, 32, lane, &lane_first, &lane_end);  // the clusters a lane of a warp handles

  for (int i = t; i < kVariants * kMaxClusters; i += kPlanThreads) {
    const int v = i / kMaxClusters, c = i % kMaxClusters;
    load[v][c] = 0;
    rest_count[v][c] = 0;
    if (c >= n) budget_prefix2[v][c] = INT64_MAX;  // RestCluster's searches stop short of these
  }
  const int64_t total_kv = BlockSum(RangeKv(s, seq_lens, first, end), warp_sums, warp, lane);
  Phases::Mark(1);
  const Divisor clusters(n), limit(KvLenLimit(total_kv, clusters));
  // Every small work costs at most its tokens plus 2 * cluster_tile_q: when these add up to less
  // than 2^31, so does every prefix of the costs.
  const bool narrow = total_kv + 2LL * s.cluster_tile_q() * s.num_items() < (1LL << 31);
  FirstItem known;
  const ItemCounts own_counts = RangeCounts(s, seq_lens, first, end, limit, &known);
  const ItemCounts before = narrow ? BlockExclusiveScan<true>(own_counts, warp_totals, warp, lane, &total)
                                   : BlockExclusiveScan<false>(own_counts, warp_totals, warp, lane, &total);

  RangeShortfalls(s, seq_lens, first, end, limit, before, known, [&](int v, int c, int64_t shortfall) {
    SharedAdd64(&load[v][c], static_cast<unsigned long long>(shortfall));
  });
  __syncthreads();
  Phases::Mark(2);
  if (warp < kVariants) {  // big-work costs, then the small works' budgets
    const int v = warp;
    const int64_t shift2 = RestShift2(total, v);  // first, so its latency overlaps the sums
    const Deal deal(total.full(v), n);
    int64_t budget[kClustersPerLane], big_sum = 0;  // this lane's clusters lane_first + k
    #pragma unroll
    for (int k = 0; k < kClustersPerLane; ++k) {
      const int c = lane_first + k;
      const int64_t cost = c < lane_end ? BigLoad(s, deal, limit, c, static_cast<int64_t>(load[v][c])) : 0;
      if (c < lane_end) load[v][c] = static_cast<unsigned long long>(cost);
      budget[k] = cost;
      big_sum += cost;
    }
    const int64_t target = TargetCost(clusters, total, v, WarpSum(big_sum));
    int64_t budgets = 0;
    #pragma unroll
    for (int k = 0; k < kClustersPerLane; ++k) {
      budget[k] = lane_first + k < lane_end ? Budget(target, budget[k]) : 0;
      budgets += budget[k];
    }
    int64_t position2 = 2 * WarpExclusiveSum(budgets, lane) - shift2;
    #pragma unroll
    for (int k = 0; k < kClustersPerLane; ++k) {
      if (lane_first + k < lane_end) budget_prefix2[v][lane_first + k] = position2;
      position2 += 2 * budget[k];
    }
  }
  __syncthreads();
  Phases::Mark(3);

  unsigned first_found = 0;
  RangeRests(s, seq_lens, first, end, limit, before, &budget_prefix2[0][0], known, &first_found,
             [&](int v, int c, int works, int64_t cost) {
               atomicAdd(&rest_count[v][c], works);
               SharedAdd64(&load[v][c], static_cast<unsigned long long>(cost));
             });
  ClearUnusedMerges(o, ws, total.merge(), s.sm_count, t, kPlanThreads);
  __syncthreads();
  Phases::Mark(4);
  if (warp < kVariants) {  // every variant's busiest cluster and work-list layout, to pick from
    const int v = warp;
    const Deal deal(total.full(v), n);
    int64_t busiest = 0;
    int counts[kClustersPerLane], works = 0, rests = 0;
    #pragma unroll
    for (int k = 0; k < kClustersPerLane; ++k) {
      const int c = lane_first + k;
      const int64_t cost = c < lane_end ? static_cast<int64_t>(load[v][c]) : 0;
      counts[k] = c < lane_end ? rest_count[v][c] : 0;
      busiest = cost > busiest ? cost : busiest;
      works += c < lane_end ? ClusterWorks(deal, c, counts[k]) : 0;
      rests += counts[k];
    }
    busiest = WarpMax(busiest);
    int works_before = static_cast<int>(WarpExclusiveSum(works, lane));
    int rests_before = static_cast<int>(WarpExclusiveSum(rests, lane));
    #pragma unroll
    for (int k = 0; k < kClustersPerLane; ++k) {
      const int c = lane_first + k;
      if (c >= lane_end) break;
      cluster_start[v][c] = works_before;
      rest_start[v][c] = rests_before;
      works_before += ClusterWorks(deal, c, counts[k]);
      rests_before += counts[k];
    }
    if (lane == 31) cluster_start[v][n] = works_before;
    if (lane == 0) makespan[v] = busiest;
  }
  __syncthreads();
  Phases::Mark(5);

  int v = 0;  // the cheapest variant (the first of equals)
  for (int u = 1; u < kVariants; ++u) v = makespan[u] < makespan[v] ? u : v;
  RangeWrites(s, o, ws, seq_lens, first, end, limit, before, v, budget_prefix2[v], known, first_found,
              rest_count[v], cluster_start[v], rest_start[v]);
  for (int c = t; c <= n; c += kPlanThreads) At<int32_t>(ws, o.work_indptr)[c] = cluster_start[v][c];
}

}  // namespace jax_mla
