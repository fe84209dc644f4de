// FlashInfer's fa3/fa2 MLA work schedule built on the GPU from device-resident seq_lens.
//
// It fills the int workspace exactly where FlashInfer's host MLAPlan (scheduler.cuh) would, with
// the same work items: each request's packed query rows are cut into tiles of cluster_tile_q rows,
// each tile's kv range into chunks of at most kv_len_limit tokens (FlashInfer's formula), a split
// tile gets partial-output rows and merge entries (at most #SM merge CTAs), and every chunk becomes
// one work of some cluster. Only the balancing differs from MLAPlan's (sequential) min-heap. Every
// chunk but a tile's last has kv_len_limit tokens; these "big" works are dealt round-robin over the
// clusters. A tile's last chunk is big too when it has at least a fraction f of the limit, else
// "small": the small works (at most one per tile) fill the clusters' leftover cost budgets, laid
// along them in order. No single f suits every length mix, so the planner builds the schedule for
// kVariants fractions at once (one counter set each) and keeps the one whose busiest cluster costs
// least (MLAPlan's cost model). The per-tile arithmetic is shared by the kernel and a sequential
// host driver that the CPU tests check.
#pragma once

#include <cstdint>

namespace jax_mla {

constexpr int kCtaTileQ = 64;
constexpr int kMaxTotalWorks = 16384;  // MLAPlan's capacity of every per-work array
constexpr int kMaxClusters = 256;
// A tile's last chunk of t tokens is big for variant v when 4 * t >= BigQuarters(v) * limit: at
// least the whole limit, 3/4, 1/2 or 1/4 of it.
constexpr int kVariants = 4;
__host__ __device__ constexpr int BigQuarters(int v) { return 4 - v; }

// Where MLAPlan's arrays live in the int workspace: plan_info entries 2..15, in bytes.
struct ScheduleOffsets {
  int64_t q_indptr, kv_indptr, partial_indptr, merge_packed_start, merge_packed_end,
      merge_partial_start, merge_partial_end, merge_partial_stride, q_len, kv_len, q_start,
      kv_start, kv_end, work_indptr;
};

struct ScheduleShape {
  int batch, q_len, num_heads, max_pages, num_sm, cluster_size, num_clusters;
  bool causal;
  __host__ __device__ int packed_q() const { return q_len * num_heads; }
  __host__ __device__ int cluster_tile_q() const { return cluster_size * kCtaTileQ; }
  __host__ __device__ int num_q_tiles() const {
    return (packed_q() + cluster_tile_q() - 1) / cluster_tile_q();
  }
  __host__ __device__ int num_items() const { return batch * num_q_tiles(); }
};

__host__ __device__ inline int CeilDiv(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

// MLAPlan's kv range of a query tile: under the causal mask earlier tiles see fewer tokens.
__host__ __device__ inline int TileKvLen(const ScheduleShape& s, int kv_len, int tile) {
  const int tiles = s.num_q_tiles();
  if (!s.causal || tile + 1 == tiles) return kv_len;
  int end = kv_len - s.q_len + CeilDiv(static_cast<int64_t>(tile + 1) * s.cluster_tile_q(), s.num_heads);
  end = end < kv_len ? end : kv_len;
  return end > 0 ? end : 0;
}

// MLAPlan's chunk size for a total of `total_kv` tile tokens.
__host__ __device__ inline int KvLenLimit(int64_t total_kv, int num_clusters) {
  int64_t per_cluster = (total_kv + num_clusters - 1) / num_clusters;
  int x = static_cast<int>(per_cluster > 1 ? per_cluster : 1);
  if (x <= 8) return 32;
  if (x <= 16) return 64;
  if (x <= 32) return 128;
  if (x <= 64) return 192;
  return CeilDiv(x, 256) * 256;
}

// The work counts of one (request, query tile) item, per balancing variant where they differ.
struct ItemCounts {
  int full[kVariants];        // big works: dealt round-robin
  int rest[kVariants];        // 0 or 1: the last chunk when small (or a zero-length tile)
  int partial;                // partial-output rows (split tiles only)
  int merge;                  // merge CTAs (split tiles only)
  int64_t rest_cost[kVariants];
  __host__ __device__ ItemCounts operator+(const ItemCounts& o) const {
    ItemCounts sum;
    for (int v = 0; v < kVariants; ++v) {
      sum.full[v] = full[v] + o.full[v];
      sum.rest[v] = rest[v] + o.rest[v];
      sum.rest_cost[v] = rest_cost[v] + o.rest_cost[v];
    }
    sum.partial = partial + o.partial;
    sum.merge = merge + o.merge;
    return sum;
  }
};

__host__ __device__ inline ItemCounts ZeroCounts() {
  ItemCounts c;
  for (int v = 0; v < kVariants; ++v) c.full[v] = c.rest[v] = 0, c.rest_cost[v] = 0;
  c.partial = c.merge = 0;
  return c;
}

__host__ __device__ inline int WorkCost(const ScheduleShape& s, int kv_tokens) {
  return 2 * s.cluster_tile_q() + kv_tokens;  // MLAPlan's cost_function
}

struct Item {
  int request, tile, kv_len, remaining, chunks, row_tile, row_chunk;
  bool split;
};

__host__ __device__ inline Item DescribeItem(const ScheduleShape& s, const int32_t* seq_lens,
                                             int index, int limit) {
  Item it;
  it.request = index / s.num_q_tiles();
  it.tile = index % s.num_q_tiles();
  it.kv_len = seq_lens[it.request];
  it.remaining = TileKvLen(s, it.kv_len, it.tile);
  it.chunks = it.remaining == 0 ? 1 : CeilDiv(it.remaining, limit);
  it.split = it.remaining > limit;
  const int rows_left = s.packed_q() - it.tile * s.cluster_tile_q();
  it.row_tile = rows_left < s.cluster_tile_q() ? rows_left : s.cluster_tile_q();
  int q_chunks = static_cast<int>(static_cast<int64_t>(it.remaining) * s.cluster_size / limit);
  q_chunks = q_chunks > 1 ? q_chunks : 1;
  it.row_chunk = CeilDiv(it.row_tile, q_chunks);
  return it;
}

__host__ __device__ inline int ChunkTokens(const Item& it, int chunk, int limit) {
  int left = it.remaining - chunk * limit;
  return left < limit ? left : limit;
}

// Whether a tile's last chunk of `kv_tokens` is a small work under balancing variant v.
__host__ __device__ inline bool IsSmall(int kv_tokens, int limit, int v) {
  return 4 * static_cast<int64_t>(kv_tokens) < static_cast<int64_t>(BigQuarters(v)) * limit;
}

__host__ __device__ inline ItemCounts CountItem(const ScheduleShape& s, const Item& it, int limit) {
  const int last = ChunkTokens(it, it.chunks - 1, limit);
  ItemCounts c = ZeroCounts();
  for (int v = 0; v < kVariants; ++v) {
    c.rest[v] = IsSmall(last, limit, v) ? 1 : 0;
    c.full[v] = it.chunks - c.rest[v];
    c.rest_cost[v] = c.rest[v] ? WorkCost(s, last) : 0;
  }
  c.partial = it.split ? it.chunks * it.row_tile : 0;
  c.merge = it.split ? CeilDiv(it.row_tile, it.row_chunk) : 0;
  return c;
}

template <typename T>
__host__ __device__ inline T* At(uint8_t* base, int64_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

// Writes one item's works (given their slots) under variant v, and its merge entries. `before`
// holds the exclusive prefix of every count over the items before this one.
__host__ __device__ inline void WriteItem(const ScheduleShape& s, const ScheduleOffsets& o,
                                          uint8_t* ws, const Item& it, const ItemCounts& before,
                                          const ItemCounts& own, int v, const int* cluster_start,
                                          int rest_slot, int limit) {
  const int n = s.num_clusters;
  for (int chunk = 0; chunk < it.chunks; ++chunk) {
    int slot;
    if (chunk >= own.full[v]) {  // the small last chunk
      slot = rest_slot;
    } else {
      const int full = before.full[v] + chunk;  // dealt round-robin: cluster full % n, place full / n
      slot = cluster_start[full % n] + full / n;
    }
    At<int32_t>(ws, o.q_indptr)[slot] = it.request * s.q_len;
    At<int32_t>(ws, o.kv_indptr)[slot] = it.request * s.max_pages;
    At<int32_t>(ws, o.partial_indptr)[slot] = it.split ? before.partial + chunk * it.row_tile : -1;
    At<int32_t>(ws, o.q_len)[slot] = s.q_len;
    At<int32_t>(ws, o.kv_len)[slot] = it.kv_len;
    At<int32_t>(ws, o.q_start)[slot] = it.tile * s.cluster_tile_q();
    At<int32_t>(ws, o.kv_start)[slot] = chunk * limit;
    At<int32_t>(ws, o.kv_end)[slot] = chunk * limit + ChunkTokens(it, chunk, limit);
  }
  if (!it.split) return;
  const int packed_base = it.request * s.packed_q() + it.tile * s.cluster_tile_q();
  int merge = before.merge;
  for (int offset = 0; offset < it.row_tile; offset += it.row_chunk, ++merge) {
    const int end = offset + it.row_chunk < it.row_tile ? offset + it.row_chunk : it.row_tile;
    At<int32_t>(ws, o.merge_packed_start)[merge] = packed_base + offset;
    At<int32_t>(ws, o.merge_packed_end)[merge] = packed_base + end;
    At<int32_t>(ws, o.merge_partial_start)[merge] = before.partial + offset;
    At<int32_t>(ws, o.merge_partial_end)[merge] = before.partial + it.chunks * it.row_tile;
    At<int32_t>(ws, o.merge_partial_stride)[merge] = it.row_tile;
  }
}

// Big works dealt round-robin: cluster c gets this many of `full` of them over n clusters.
__host__ __device__ inline int DealtTo(int full, int n, int c) { return full / n + (c < full % n ? 1 : 0); }

// A big work costs a full chunk's cost, less this shortfall for a tile's last chunk that is big
// under variant v but shorter than the limit (0 otherwise); *cluster receives its cluster.
__host__ __device__ inline int64_t BigShortfall(const ScheduleShape& s, const Item& it,
                                                const ItemCounts& before, const ItemCounts& own,
                                                int v, int limit, int* cluster) {
  const int last = ChunkTokens(it, it.chunks - 1, limit);
  if (own.rest[v] || last >= limit) return 0;
  *cluster = (before.full[v] + own.full[v] - 1) % s.num_clusters;
  return limit - last;
}

// Cluster c's cost from its big works: dealt full chunks less the shortfalls that landed there.
__host__ __device__ inline int64_t BigLoad(const ScheduleShape& s, const ItemCounts& total, int v,
                                           int limit, int c, int64_t shortfall) {
  return DealtTo(total.full[v], s.num_clusters, c) * static_cast<int64_t>(WorkCost(s, limit)) - shortfall;
}

// The cost every cluster should end with under variant v (all big plus small works, over n), and
// a cluster's budget for small works given its big works' cost.
__host__ __device__ inline int64_t TargetCost(const ScheduleShape& s, const ItemCounts& total, int v,
                                              int64_t big_cost_sum) {
  return (big_cost_sum + total.rest_cost[v]) / s.num_clusters;
}
__host__ __device__ inline int64_t Budget(int64_t target, int64_t big_load) {
  return target > big_load ? target - big_load : 0;
}

// The small works are laid in item order along the clusters' budgets, end to end; a small work
// goes to the cluster whose stretch holds its midpoint. All positions are doubled (integers).
// `budget_prefix2[c]`: twice the budgets of the clusters before c.
__host__ __device__ inline int64_t RestMidpoint2(const ItemCounts& before, const ItemCounts& own, int v) {
  return 2 * before.rest_cost[v] + own.rest_cost[v];
}
__host__ __device__ inline int RestCluster(const int64_t* budget_prefix2, int n, int64_t x2) {
  int lo = 0, hi = n - 1;  // the last cluster c with budget_prefix2[c] <= x2
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (budget_prefix2[mid] <= x2) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Works in cluster c's list under variant v: its dealt big works, then its small ones.
__host__ __device__ inline int ClusterWorks(const ScheduleShape& s, const ItemCounts& total, int v,
                                            int c, int rest_count) {
  return DealtTo(total.full[v], s.num_clusters, c) + rest_count;
}

// The slot of a tile's small work: after its cluster's big works and the small ones before it.
// cluster_start / rest_start: works / small works in the clusters before.
__host__ __device__ inline int RestSlot(int cluster, int rests_before, const int* rest_count,
                                        const int* cluster_start, const int* rest_start) {
  return cluster_start[cluster + 1] - rest_count[cluster] + (rests_before - rest_start[cluster]);
}

// Merge CTAs past the used ones do nothing: their row ranges are empty. Clears entries
// used + first, used + first + step, ... (step 1 clears them all).
__host__ __device__ inline void ClearUnusedMerges(const ScheduleOffsets& o, uint8_t* ws, int used,
                                                  int num_sm, int first = 0, int step = 1) {
  for (int m = used + first; m < num_sm; m += step) {
    for (int64_t offset : {o.merge_packed_start, o.merge_packed_end, o.merge_partial_start,
                           o.merge_partial_end, o.merge_partial_stride}) {
      At<int32_t>(ws, offset)[m] = 0;
    }
  }
}

}  // namespace jax_mla
