// FlashInfer's fa3/fa2 MLA work schedule, built from seq_lens by the GPU planner (device_plan.cuh)
// and by its sequential host twin (plan_twin.cuh) with the same per-tile arithmetic.
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
// least (MLAPlan's cost model).
#pragma once

#include <cstdint>

#include "lengths.h"
#include "plan_info.h"

namespace jax_mla {

constexpr int kCtaTileQ = 64;
constexpr int kMaxTotalWorks = 16384;  // MLAPlan's capacity of every per-work array
constexpr int kMaxClusters = 256;
// A tile's last chunk of t tokens is big for variant v when 4 * t >= BigQuarters(v) * limit: at
// least the whole limit, 3/4, 1/2 or 1/4 of it.
constexpr int kVariants = 4;
__host__ __device__ constexpr int BigQuarters(int v) { return 4 - v; }

struct ScheduleShape {
  int batch, q_len, num_heads, max_pages, sm_count, cluster_size, num_clusters;
  bool causal;
  __host__ __device__ int packed_q() const { return q_len * num_heads; }
  __host__ __device__ int cluster_tile_q() const { return cluster_size * kCtaTileQ; }
  __host__ __device__ int num_q_tiles() const {
    return (packed_q() + cluster_tile_q() - 1) / cluster_tile_q();
  }
  __host__ __device__ int num_items() const { return batch * num_q_tiles(); }
};

inline ScheduleShape MakeShape(int batch, int q_len, int num_heads, int max_pages, int sm_count,
                               bool causal, const int64_t* plan_info) {
  return {batch, q_len, num_heads, max_pages, sm_count, static_cast<int>(plan_info[0]),
          static_cast<int>(plan_info[1]), causal};
}

// ceil(a / b) for 0 <= a, 0 < b in 32-bit arithmetic (no overflow near INT_MAX).
__host__ __device__ inline int CeilDiv(int a, int b) {
  return static_cast<int>(static_cast<unsigned>(a) / static_cast<unsigned>(b) +
                          (static_cast<unsigned>(a) % static_cast<unsigned>(b) != 0));
}

// Exact floor(x / value) for 0 <= x < 2^46 by a multiply with 1/value in double and a correction
// (the product is within 1 of the quotient), instead of a long 64-bit integer division: the chunk
// size divides every tile's tokens in every pass.
struct Divisor {
  int64_t value;
  double inverse;
  __host__ __device__ explicit Divisor(int64_t v) : value(v) {
#ifdef __CUDA_ARCH__
    // 1 / v to within an ulp or two without a branch (__drcp_rn's check for special inputs, which
    // a positive integer never is, keeps the compiler from interleaving it with other work): the
    // hardware approximation and two Newton steps. The twin's division may differ in the last
    // bit; Floor's correction makes both exact.
    const double d = static_cast<double>(v);
    double r;
    asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(r) : "d"(d));
    r = fma(r, fma(-d, r, 1.0), r);
    inverse = fma(r, fma(-d, r, 1.0), r);
#else
    inverse = 1.0 / static_cast<double>(v);
#endif
  }
  __host__ __device__ int64_t Floor(int64_t x) const {
    int64_t q = static_cast<int64_t>(static_cast<double>(x) * inverse);
    q -= q * value > x ? 1 : 0;
    q += (q + 1) * value <= x ? 1 : 0;
    return q;
  }
  __host__ __device__ int64_t Ceil(int64_t x) const { return Floor(x + value - 1); }
};

// Request `request`'s length as the planner uses it, clamped to [0, kMaxKvLen]: a negative length
// would give negative counts and writes past the workspace, a longer one could overflow the chunk
// size. jax_mla.decode gives longer requests nothing to read (jax_mla.guard).
__host__ __device__ inline int ReadKvLen(const int32_t* seq_lens, int request) {
  return ClampLength(seq_lens[request], kMaxKvLen);
}

// MLAPlan's kv range of a query tile: under the causal mask earlier tiles see fewer tokens.
__host__ __device__ inline int TileKvLen(const ScheduleShape& s, int kv_len, int tile) {
  const int tiles = s.num_q_tiles();
  if (!s.causal || tile + 1 == tiles) return kv_len;
  int end = kv_len - s.q_len + CeilDiv((tile + 1) * s.cluster_tile_q(), s.num_heads);
  end = end < kv_len ? end : kv_len;
  return end > 0 ? end : 0;
}

// MLAPlan's chunk size for a total of `total_kv` tile tokens.
__host__ __device__ inline int KvLenLimit(int64_t total_kv, const Divisor& num_clusters) {
  int64_t per_cluster = num_clusters.Ceil(total_kv);
  int x = static_cast<int>(per_cluster > 1 ? per_cluster : 1);
  if (x <= 8) return 32;
  if (x <= 16) return 64;
  if (x <= 32) return 128;
  if (x <= 64) return 192;
  return CeilDiv(x, 256) * 256;
}

// The work counts of one (request, query tile) item, or summed over items, in as few words as the
// block-wide scan can carry. Counts of works and merges are 16-bit fields: the chunk size is at
// least 1/num_clusters of all tile tokens, so there are at most items + num_clusters <= 16384
// works (the callers keep to max_works_fit) and at most sm_count merge CTAs. A tile's last chunk is
// a small work under variants 0 .. k-1 for some k (IsSmall is monotone in v), so an item's small
// works per variant are 0/1 counts, 16-bit fields too.
struct ItemCounts {
  unsigned works_merges;       // works (big ones dealt round-robin, plus small ones) | merge CTAs << 16
  unsigned rest01, rest23;     // small works of variants 0|1 and 2|3, 16 bits each
  int partial;                 // partial-output rows (split tiles only)
  int64_t rest_cost[kVariants];
  __host__ __device__ int chunks() const { return static_cast<int>(works_merges & 0xffffu); }
  __host__ __device__ int merge() const { return static_cast<int>(works_merges >> 16); }
  __host__ __device__ int rest(int v) const {
    return static_cast<int>(((v < 2 ? rest01 : rest23) >> (16 * (v & 1))) & 0xffffu);
  }
  __host__ __device__ int full(int v) const { return chunks() - rest(v); }
  // rest_cost[v] by selects, so a runtime v does not move the counts to local memory.
  __host__ __device__ int64_t cost(int v) const {
    return v == 0 ? rest_cost[0] : v == 1 ? rest_cost[1] : v == 2 ? rest_cost[2] : rest_cost[3];
  }
  __host__ __device__ ItemCounts operator+(const ItemCounts& o) const {
    ItemCounts sum;
    sum.works_merges = works_merges + o.works_merges;
    sum.rest01 = rest01 + o.rest01;
    sum.rest23 = rest23 + o.rest23;
    sum.partial = partial + o.partial;
    #pragma unroll
    for (int v = 0; v < kVariants; ++v) sum.rest_cost[v] = rest_cost[v] + o.rest_cost[v];
    return sum;
  }
  // Field by field (every field of o is at most this one's: o is a part of this sum).
  __host__ __device__ ItemCounts operator-(const ItemCounts& o) const {
    ItemCounts difference;
    difference.works_merges = works_merges - o.works_merges;
    difference.rest01 = rest01 - o.rest01;
    difference.rest23 = rest23 - o.rest23;
    difference.partial = partial - o.partial;
    #pragma unroll
    for (int v = 0; v < kVariants; ++v) difference.rest_cost[v] = rest_cost[v] - o.rest_cost[v];
    return difference;
  }
  // Every field through f (a warp shuffle).
  template <typename F>
  __host__ __device__ ItemCounts Map(F f) const {
    ItemCounts mapped;
    mapped.works_merges = f(works_merges);
    mapped.rest01 = f(rest01);
    mapped.rest23 = f(rest23);
    mapped.partial = f(partial);
    #pragma unroll
    for (int v = 0; v < kVariants; ++v) mapped.rest_cost[v] = f(rest_cost[v]);
    return mapped;
  }
};

__host__ __device__ inline ItemCounts ZeroCounts() {
  ItemCounts c;
  c.works_merges = c.rest01 = c.rest23 = 0;
  c.partial = 0;
  #pragma unroll
  for (int v = 0; v < kVariants; ++v) c.rest_cost[v] = 0;
  return c;
}

__host__ __device__ inline int WorkCost(const ScheduleShape& s, int kv_tokens) {
  return 2 * s.cluster_tile_q() + kv_tokens;  // MLAPlan's cost_function
}

struct Item {
  int request, tile, kv_len, remaining, chunks, row_tile;
  bool split;
};

// Item `request * num_q_tiles + tile` under chunk size `limit`.
__host__ __device__ inline Item DescribeItem(const ScheduleShape& s, int request, int tile,
                                             int kv_len, const Divisor& limit) {
  Item it;
  it.request = request;
  it.tile = tile;
  it.kv_len = kv_len;
  it.remaining = TileKvLen(s, kv_len, tile);
  it.split = it.remaining > limit.value;
  it.chunks = it.split ? static_cast<int>(limit.Ceil(it.remaining)) : 1;
  const int rows_left = s.packed_q() - tile * s.cluster_tile_q();
  it.row_tile = rows_left < s.cluster_tile_q() ? rows_left : s.cluster_tile_q();
  return it;
}

// The rows each merge CTA of a split item combines (MLAPlan's).
__host__ __device__ inline int RowChunk(const ScheduleShape& s, const Item& it, const Divisor& limit) {
  int q_chunks = static_cast<int>(limit.Floor(static_cast<int64_t>(it.remaining) * s.cluster_size));
  q_chunks = q_chunks > 1 ? q_chunks : 1;
  return CeilDiv(it.row_tile, q_chunks);
}

__host__ __device__ inline int ChunkTokens(const Item& it, int chunk, const Divisor& limit) {
  const int tokens = static_cast<int>(limit.value), left = it.remaining - chunk * tokens;
  return left < tokens ? left : tokens;
}

// Whether a tile's last chunk of `kv_tokens` is a small work under balancing variant v.
__host__ __device__ inline bool IsSmall(int kv_tokens, int limit, int v) {
  return 4 * static_cast<int64_t>(kv_tokens) < static_cast<int64_t>(BigQuarters(v)) * limit;
}

__host__ __device__ inline ItemCounts CountItem(const ScheduleShape& s, const Item& it,
                                                const Divisor& limit) {
  const int last = ChunkTokens(it, it.chunks - 1, limit);
  ItemCounts c = ZeroCounts();
  #pragma unroll
  for (int v = 0; v < kVariants; ++v) {
    const bool small = IsSmall(last, static_cast<int>(limit.value), v);
    (v < 2 ? c.rest01 : c.rest23) |= (small ? 1u : 0u) << (16 * (v & 1));
    c.rest_cost[v] = small ? WorkCost(s, last) : 0;
  }
  c.partial = it.split ? it.chunks * it.row_tile : 0;
  const int merges = it.split ? CeilDiv(it.row_tile, RowChunk(s, it, limit)) : 0;
  c.works_merges = static_cast<unsigned>(it.chunks) | static_cast<unsigned>(merges) << 16;
  return c;
}

// A range's first item and its counts, described by the first walk and reused by the later ones
// (with one item per thread, as at B <= 512 and q_len * H <= 128, the only item).
struct FirstItem {
  Item it;
  ItemCounts own;
};

// Walks the items [first, end) in order (the range one thread owns), each with its counts and
// the exclusive prefix `before` of every count over all items before it. `known`: the first
// item, when an earlier walk described it; a range of that item alone (one item per thread, the
// common case) is visited without the loop, whose running state lengthens every walk.
template <typename Visit>
__host__ __device__ inline void WalkItems(const ScheduleShape& s, const int32_t* seq_lens, int first,
                                          int end, const Divisor& limit, ItemCounts before, Visit visit,
                                          const FirstItem* known = nullptr) {
  if (first >= end) return;
  if (known && end == first + 1) {
    visit(known->it, known->own, before);
    return;
  }
  const int tiles = s.num_q_tiles();
  int request, tile, kv_len;
  if (known) {
    request = known->it.request, tile = known->it.tile, kv_len = known->it.kv_len;
  } else {
    request = first / tiles, tile = first % tiles, kv_len = ReadKvLen(seq_lens, request);
  }
  for (int i = first; i < end; ++i) {
    const bool cached = known && i == first;
    const Item it = cached ? known->it : DescribeItem(s, request, tile, kv_len, limit);
    const ItemCounts own = cached ? known->own : CountItem(s, it, limit);
    visit(it, own, before);
    before = before + own;
    if (++tile == tiles && i + 1 < end) tile = 0, kv_len = ReadKvLen(seq_lens, ++request);
  }
}

// The items one of `threads` threads owns: a contiguous range, so running sums follow item order.
__host__ __device__ inline void ThreadItems(int items, int threads, int t, int* first, int* end) {
  const int per = (items + threads - 1) / threads;
  *first = t * per < items ? t * per : items;
  *end = *first + per < items ? *first + per : items;
}

// The tile tokens of items [first, end) (their sum over all items sets the chunk size).
__host__ __device__ inline int64_t RangeKv(const ScheduleShape& s, const int32_t* seq_lens, int first,
                                           int end) {
  const int tiles = s.num_q_tiles();
  int64_t sum = 0;
  for (int i = first, request = first / tiles, tile = first % tiles; i < end; ++i) {
    sum += TileKvLen(s, ReadKvLen(seq_lens, request), tile);
    if (++tile == tiles) tile = 0, ++request;
  }
  return sum;
}

// The counts of items [first, end), and (*known) the first one, for the later walks.
__host__ __device__ inline ItemCounts RangeCounts(const ScheduleShape& s, const int32_t* seq_lens,
                                                  int first, int end, const Divisor& limit,
                                                  FirstItem* known) {
  ItemCounts sum = ZeroCounts();
  bool first_item = true;
  WalkItems(s, seq_lens, first, end, limit, ZeroCounts(),
            [&](const Item& it, const ItemCounts& own, const ItemCounts&) {
              if (first_item) known->it = it, known->own = own, first_item = false;
              sum = sum + own;
            });
  return sum;
}

template <typename T>
__host__ __device__ inline T* At(uint8_t* base, int64_t offset) {
  return reinterpret_cast<T*>(base + offset);
}

// The position of the next big work dealt round-robin over n clusters: cluster `cluster`, the
// `place`-th big work there. Walks advance it item by item instead of dividing per item.
struct DealPosition {
  int place, cluster;
  __host__ __device__ DealPosition(int dealt, int n) : place(dealt / n), cluster(dealt % n) {}
  __host__ __device__ void Advance(int works, int n) {
    cluster += works;
    if (cluster >= n) place += cluster / n, cluster %= n;
  }
};

// Pass 1 over a range: add(v, cluster, shortfall) for every big work shorter than the limit (a
// tile's last chunk that is big under variant v, which costs that much less than a full chunk).
// Variant 0 has none: there a last chunk shorter than the limit is small.
template <typename Add>
__host__ __device__ inline void RangeShortfalls(const ScheduleShape& s, const int32_t* seq_lens,
                                                int first, int end, const Divisor& limit,
                                                const ItemCounts& before, const FirstItem& known, Add add) {
  const int n = s.num_clusters;
  if (first >= end) return;
  DealPosition next[kVariants] = {{0, n}, {before.full(1), n}, {before.full(2), n}, {before.full(3), n}};
  WalkItems(s, seq_lens, first, end, limit, before,
            [&](const Item& it, const ItemCounts& own, const ItemCounts&) {
              const int last = ChunkTokens(it, it.chunks - 1, limit), tokens = static_cast<int>(limit.value);
              #pragma unroll
              for (int v = 1; v < kVariants; ++v) {
                next[v].Advance(own.full(v), n);
                if (!own.rest(v) && last < tokens) add(v, next[v].cluster == 0 ? n - 1 : next[v].cluster - 1, tokens - last);
              }
            }, &known);
}

// `full` big works dealt round-robin over n clusters: cluster c gets To(c) of them.
struct Deal {
  int per, extra;
  __host__ __device__ Deal(int full, int n) : per(full / n), extra(full % n) {}
  __host__ __device__ int To(int c) const { return per + (c < extra ? 1 : 0); }
};

// Cluster c's cost from its big works: dealt full chunks less the shortfalls that landed there.
__host__ __device__ inline int64_t BigLoad(const ScheduleShape& s, const Deal& deal, const Divisor& limit,
                                           int c, int64_t shortfall) {
  return deal.To(c) * static_cast<int64_t>(WorkCost(s, static_cast<int>(limit.value))) - shortfall;
}

// The cost every cluster should end with under variant v (all big plus small works, over n), and
// a cluster's budget for small works given its big works' cost.
__host__ __device__ inline int64_t TargetCost(const Divisor& num_clusters, const ItemCounts& total, int v,
                                              int64_t big_cost_sum) {
  return num_clusters.Floor(big_cost_sum + total.rest_cost[v]);
}
__host__ __device__ inline int64_t Budget(int64_t target, int64_t big_load) {
  return target > big_load ? target - big_load : 0;
}

// The small works are laid in item order along the clusters' budgets, end to end; a small work
// goes to the cluster whose stretch holds its midpoint. All positions are doubled (integers).
// `budget_prefix2[c]`: twice the budgets of the clusters before c less the variant's RestShift2,
// kMaxClusters entries per variant, INT64_MAX past the last cluster.
__host__ __device__ inline int64_t RestMidpoint2(const ItemCounts& before, const ItemCounts& own, int v) {
  return 2 * before.cost(v) + own.cost(v);
}

// How far (doubled) variant v's small works are shifted along the budgets before the midpoint
// rule places them. IsSmall is monotone in v, so variants with as many small works have the same
// ones and would build the same schedule (every work is small when all tiles are short against
// the chunk size): the j-th of such equals shifts them by 1/2, 1/4 or 3/4 of their mean cost,
// another phase of the rule, whose overshoot (up to half a work per cluster) then falls elsewhere.
__host__ __device__ inline int64_t RestShift2(const ItemCounts& total, int v) {
  int equals_before = 0;
  #pragma unroll
  for (int u = 0; u < kVariants - 1; ++u) equals_before += u < v && total.rest(u) == total.rest(v) ? 1 : 0;
  if (equals_before == 0 || total.rest(v) == 0) return 0;
  const int quarters = equals_before == 1 ? 2 : equals_before == 2 ? 1 : 3;
  return Divisor(2 * total.rest(v)).Floor(quarters * total.cost(v));
}

// The last cluster c with budget_prefix2[c] <= x2, or 0 (budget_prefix2[0] is never read): a
// binary search of fixed depth (kMaxClusters = 2^8) without branches, so several can run interleaved.
__host__ __device__ inline int RestCluster(const int64_t* budget_prefix2, int64_t x2) {
  int c = 0;
  #pragma unroll
  for (int step = kMaxClusters / 2; step > 0; step /= 2) c += budget_prefix2[c + step] <= x2 ? step : 0;
  return c;
}

// Pass 2 over a range: every small work's cluster under every variant, reported in runs of
// consecutive works of one cluster as add(v, cluster, works, cost). *first_found: the clusters
// found for the range's first item, 8 bits per variant, which spare pass 3 one search.
template <typename Add>
__host__ __device__ inline void RangeRests(const ScheduleShape& s, const int32_t* seq_lens, int first,
                                           int end, const Divisor& limit, const ItemCounts& before,
                                           const int64_t* budget_prefix2, const FirstItem& known,
                                           unsigned* first_found, Add add) {
  int cluster[kVariants], works[kVariants];
  int64_t cost[kVariants];
  #pragma unroll
  for (int v = 0; v < kVariants; ++v) cluster[v] = works[v] = 0, cost[v] = 0;
  bool first_item = true;
  WalkItems(s, seq_lens, first, end, limit, before,
            [&](const Item&, const ItemCounts& own, const ItemCounts& b) {
              int found[kVariants];  // searched for every variant at once, used where small
              unsigned packed = 0;
              #pragma unroll
              for (int v = 0; v < kVariants; ++v) {
                found[v] = RestCluster(budget_prefix2 + v * kMaxClusters, RestMidpoint2(b, own, v));
                packed |= static_cast<unsigned>(found[v]) << (8 * v);
              }
              if (first_item) *first_found = packed, first_item = false;
              #pragma unroll
              for (int v = 0; v < kVariants; ++v) {
                if (!own.rest(v)) continue;
                const int c = found[v];
                if (c != cluster[v] && works[v]) add(v, cluster[v], works[v], cost[v]), works[v] = 0, cost[v] = 0;
                cluster[v] = c;
                ++works[v];
                cost[v] += own.rest_cost[v];
              }
            }, &known);
  #pragma unroll
  for (int v = 0; v < kVariants; ++v) {
    if (works[v]) add(v, cluster[v], works[v], cost[v]);
  }
}

// Works in cluster c's list: its dealt big works, then its small ones.
__host__ __device__ inline int ClusterWorks(const Deal& deal, int c, int rest_count) {
  return deal.To(c) + rest_count;
}

// Writes one item's works under variant v, its big works from deal position *next on (advanced
// past them), its small one at rest_slot, and its merge entries. `before` holds the exclusive
// prefix of every count over the items before this one.
__host__ __device__ inline void WriteItem(const ScheduleShape& s, const ScheduleOffsets& o,
                                          uint8_t* ws, const Item& it, const ItemCounts& before,
                                          const ItemCounts& own, int v, DealPosition* next,
                                          const int* cluster_start, int rest_slot, const Divisor& limit) {
  const int n = s.num_clusters, full = own.full(v);
  for (int chunk = 0; chunk < it.chunks; ++chunk) {
    int slot = rest_slot;  // the small last chunk
    if (chunk < full) {
      slot = cluster_start[next->cluster] + next->place;
      next->Advance(1, n);
    }
    At<int32_t>(ws, o.q_indptr)[slot] = it.request * s.q_len;
    At<int32_t>(ws, o.kv_indptr)[slot] = it.request * s.max_pages;
    At<int32_t>(ws, o.partial_indptr)[slot] = it.split ? before.partial + chunk * it.row_tile : -1;
    At<int32_t>(ws, o.q_len)[slot] = s.q_len;
    At<int32_t>(ws, o.kv_len)[slot] = it.kv_len;
    At<int32_t>(ws, o.q_start)[slot] = it.tile * s.cluster_tile_q();
    const int kv_start = chunk * static_cast<int>(limit.value);
    At<int32_t>(ws, o.kv_start)[slot] = kv_start;
    At<int32_t>(ws, o.kv_end)[slot] = kv_start + ChunkTokens(it, chunk, limit);
  }
  if (!it.split) return;
  const int packed_base = it.request * s.packed_q() + it.tile * s.cluster_tile_q();
  const int row_chunk = RowChunk(s, it, limit);
  int merge = before.merge();
  for (int offset = 0; offset < it.row_tile; offset += row_chunk, ++merge) {
    const int end = offset + row_chunk < it.row_tile ? offset + row_chunk : it.row_tile;
    At<int32_t>(ws, o.merge_packed_start)[merge] = packed_base + offset;
    At<int32_t>(ws, o.merge_packed_end)[merge] = packed_base + end;
    At<int32_t>(ws, o.merge_partial_start)[merge] = before.partial + offset;
    At<int32_t>(ws, o.merge_partial_end)[merge] = before.partial + it.chunks * it.row_tile;
    At<int32_t>(ws, o.merge_partial_stride)[merge] = it.row_tile;
  }
}

// The slot of a tile's small work: after its cluster's big works and the small ones before it.
// cluster_start / rest_start: works / small works in the clusters before.
__host__ __device__ inline int RestSlot(int cluster, int rests_before, const int* rest_count,
                                        const int* cluster_start, const int* rest_start) {
  return cluster_start[cluster + 1] - rest_count[cluster] + (rests_before - rest_start[cluster]);
}

// Pass 3 over a range: writes its items' works and merge entries under the chosen variant v.
__host__ __device__ inline void RangeWrites(const ScheduleShape& s, const ScheduleOffsets& o,
                                            uint8_t* ws, const int32_t* seq_lens, int first, int end,
                                            const Divisor& limit, const ItemCounts& before, int v,
                                            const int64_t* budget_prefix2, const FirstItem& known,
                                            unsigned first_found, const int* rest_count,
                                            const int* cluster_start, const int* rest_start) {
  if (first >= end) return;
  int cluster = 0;
  bool first_item = true;
  DealPosition next(before.full(v), s.num_clusters);
  WalkItems(s, seq_lens, first, end, limit, before,
            [&](const Item& it, const ItemCounts& own, const ItemCounts& b) {
              int rest_slot = -1;
              if (own.rest(v)) {
                cluster = first_item ? static_cast<int>(first_found >> (8 * v) & 0xffu)
                                     : RestCluster(budget_prefix2, RestMidpoint2(b, own, v));
                rest_slot = RestSlot(cluster, b.rest(v), rest_count, cluster_start, rest_start);
              }
              WriteItem(s, o, ws, it, b, own, v, &next, cluster_start, rest_slot, limit);
              first_item = false;
            }, &known);
}

// Merge CTAs past the used ones do nothing: their row ranges are empty. Clears entries
// used + first, used + first + step, ... (step 1 clears them all).
__host__ __device__ inline void ClearUnusedMerges(const ScheduleOffsets& o, uint8_t* ws, int used,
                                                  int sm_count, int first = 0, int step = 1) {
  for (int m = used + first; m < sm_count; m += step) {
    for (int64_t offset : {o.merge_packed_start, o.merge_packed_end, o.merge_partial_start,
                           o.merge_partial_end, o.merge_partial_stride}) {
      At<int32_t>(ws, offset)[m] = 0;
    }
  }
}

}  // namespace jax_mla
