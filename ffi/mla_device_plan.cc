// The GPU planner's kernel and XLA FFI handler (JaxMlaDevicePlan), plus the same schedule built by a
// sequential host driver (JaxMlaDevicePlanOnHost) for the CPU tests. See mla_device_plan.cuh.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "mla_device_plan.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Marks the kernel's start and the end of each barrier-separated phase; empty unless a timing
// harness (benchmarks/planner_harness.cu) defines it to record clock stamps.
#ifndef JAX_MLA_PLAN_STAMP
#define JAX_MLA_PLAN_STAMP(phase)
#endif

namespace jax_mla {
namespace {

constexpr int kThreads = 512, kWarps = kThreads / 32;
constexpr int kClustersPerLane = kMaxClusters / 32;  // when one warp handles every cluster

ScheduleOffsets OffsetsFromPlanInfo(const int64_t* p) {
  return {p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], p[10], p[11], p[12], p[13], p[14], p[15]};
}

constexpr unsigned kFullMask = 0xffffffffu;

__device__ int64_t WarpSum(int64_t x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(kFullMask, x, offset);
  return x;
}

// The sum of x over the block, in every thread. warp_sums: shared, kWarps entries.
__device__ int64_t BlockSum(int64_t x, int64_t* warp_sums, int warp, int lane) {
  x = WarpSum(x);
  if (lane == 0) warp_sums[warp] = x;
  __syncthreads();
  x = lane < kWarps ? warp_sums[lane] : 0;
  return WarpSum(x);
}

__device__ int64_t WarpMax(int64_t x) {
  for (int offset = 16; offset > 0; offset >>= 1) {
    const int64_t y = __shfl_xor_sync(kFullMask, x, offset);
    x = y > x ? y : x;
  }
  return x;
}

// A 64-bit add to shared memory as two native 32-bit atomics: sm_90 has no 64-bit shared atomicAdd
// (it compiles to a compare-and-swap loop, which lanes of a warp adding to one cluster serialize).
// The low word's carry is found from its old value and added to the high word.
__device__ void SharedAdd64(unsigned long long* address, unsigned long long x) {
  unsigned* words = reinterpret_cast<unsigned*>(address);
  const unsigned low = static_cast<unsigned>(x), old = atomicAdd(words, low);
  const unsigned high = static_cast<unsigned>(x >> 32) + (old + low < old ? 1u : 0u);
  if (high != 0) atomicAdd(words + 1, high);
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
// warp scans by shuffles, then one warp scans the warp totals. (cub's BlockScan has every thread
// add up the totals of all warps below its own, one by one: at 16 warps of 12-word counts,
// thousands of cycles; every warp scanning them by shuffles costs ~250 cycles more than one warp
// and a barrier.) warp_totals: shared, kWarps entries.
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
    const ItemCounts warp_total = lane < kWarps ? warp_totals[lane] : ZeroCounts();
    ItemCounts warps = warp_total;  // then: over warps 0 .. lane
    #pragma unroll
    for (int offset = 1; offset < kWarps; offset *= 2) {
      const ItemCounts below = warps.Map([&](auto x) { return Shuffle<kNarrow, true>(x, offset); });
      if (lane >= offset) warps = warps + below;
    }
    __syncwarp();
    if (lane < kWarps) warp_totals[lane] = warps - warp_total;
    if (lane == kWarps - 1) *total = warps;
  }
  __syncthreads();
  return warp_totals[warp] + (inclusive - own);
}

// Every thread owns a contiguous range of (request, tile) items (one item each up to 512 items) and
// walks it with running sums, so a block-wide scan is needed once (each range's prefix), not per
// item. Pass 1 adds up the short big works per cluster (every variant); then one warp per variant
// turns them into cluster costs and lays out the small works' budgets. Pass 2 places the small
// works (every variant, in runs of one cluster); then one warp per variant finds its busiest
// cluster and lays out its work lists. Pass 3 writes the cheapest variant's schedule. The kernel
// is one chain of dependent steps (a few thousand cycles per phase whatever B is), so its code
// avoids what lengthens the chain: no 64-bit division or compare-and-swap loop, searches without
// branches, per-lane cluster values kept in registers.
__global__ void __launch_bounds__(kThreads)
    PlanKernel(ScheduleShape s, ScheduleOffsets o, const int32_t* seq_lens, uint8_t* ws) {
  __shared__ int64_t warp_sums[kWarps];
  __shared__ ItemCounts warp_totals[kWarps];
  __shared__ ItemCounts total;
  __shared__ unsigned long long load[kVariants][kMaxClusters];  // shortfalls, then costs
  __shared__ int64_t makespan[kVariants];
  __shared__ int64_t budget_prefix2[kVariants][kMaxClusters];
  __shared__ int rest_count[kVariants][kMaxClusters];
  __shared__ int rest_start[kVariants][kMaxClusters], cluster_start[kVariants][kMaxClusters + 1];  // per variant
  JAX_MLA_PLAN_STAMP(0)
  const int n = s.num_clusters, t = threadIdx.x, warp = t / 32, lane = t % 32;
  int first, end, lane_first, lane_end;
  ThreadItems(s.num_items(), kThreads, t, &first, &end);
  ThreadItems(n, 32, lane, &lane_first, &lane_end);  // the clusters a lane of a warp handles

  for (int i = t; i < kVariants * kMaxClusters; i += kThreads) {
    const int v = i / kMaxClusters, c = i % kMaxClusters;
    load[v][c] = 0;
    rest_count[v][c] = 0;
    if (c >= n) budget_prefix2[v][c] = INT64_MAX;  // RestCluster's searches stop short of these
  }
  const int64_t total_kv = BlockSum(RangeKv(s, seq_lens, first, end), warp_sums, warp, lane);
  JAX_MLA_PLAN_STAMP(1)
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
  JAX_MLA_PLAN_STAMP(2)
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
  JAX_MLA_PLAN_STAMP(3)

  unsigned first_found = 0;
  RangeRests(s, seq_lens, first, end, limit, before, &budget_prefix2[0][0], known, &first_found,
             [&](int v, int c, int works, int64_t cost) {
               atomicAdd(&rest_count[v][c], works);
               SharedAdd64(&load[v][c], static_cast<unsigned long long>(cost));
             });
  ClearUnusedMerges(o, ws, total.merge(), s.num_sm, t, kThreads);
  __syncthreads();
  JAX_MLA_PLAN_STAMP(4)
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
  JAX_MLA_PLAN_STAMP(5)

  int v = 0;  // the cheapest variant (the first of equals)
  for (int u = 1; u < kVariants; ++u) v = makespan[u] < makespan[v] ? u : v;
  RangeWrites(s, o, ws, seq_lens, first, end, limit, before, v, budget_prefix2[v], known, first_found,
              rest_count[v], cluster_start[v], rest_start[v]);
  for (int c = t; c <= n; c += kThreads) At<int32_t>(ws, o.work_indptr)[c] = cluster_start[v][c];
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

namespace {
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
}  // namespace

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
  const Divisor clusters(n), limit(KvLenLimit(total_kv, clusters));
  std::vector<ItemCounts> before(kThreads);
  std::vector<FirstItem> known(kThreads);
  ItemCounts total = ZeroCounts();
  for (int t = 0; t < kThreads; ++t) {
    before[t] = total;
    total = total + RangeCounts(s, seq_lens, first[t], end[t], limit, &known[t]);
  }
  if (total.chunks() > kMaxTotalWorks || total.merge() > num_sm) return -1;
  std::vector<int64_t> load(kVariants * n, 0);  // shortfalls, then costs
  for (int t = 0; t < kThreads; ++t) {
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
  std::vector<unsigned> first_found(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
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
  ClearUnusedMerges(o, ws, total.merge(), num_sm);
  for (int t = 0; t < kThreads; ++t) {
    RangeWrites(s, o, ws, seq_lens, first[t], end[t], limit, before[t], v,
                &budget_prefix2[v * kMaxClusters], known[t], first_found[t], counts, cluster_start.data(), rest_start.data());
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
