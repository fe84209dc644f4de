// The split-KV schedule of the SM90 decode kernel, built on the GPU from seq_lens.
//
// Request b has n_b = ceil(L_b / 64) KV blocks (L_b clamped to [0, max_pages * page_size]) and
// costs F + n_b units (0 when n_b == 0), F = fixed_cost_blocks. ScheduleKernel writes the exclusive
// prefix S[b] of those costs and the total S[batch]. Part p of the persistent grid owns the cost
// units [p * Q, (p + 1) * Q) with Q = max(ceil(total / parts), SplitUnits(total / batch),
// min_blocks_per_part) (UnitsPerPart); block k of request b sits at unit S[b] + F + k, so the
// parts walk contiguous (request, block) ranges and request b is split over parts
// PartOf(b, 0) .. PartOf(b, n_b - 1). Everything else (each CTA's ranges, each request's split
// count) is derived from S by the kernels themselves.
#pragma once

#include <cstdint>

#include "../lengths.h"
#include "decode_params.h"

namespace jax_mla {
namespace sm90 {

__device__ __forceinline__ void GridDependencyWait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void GridDependencyLaunchDependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

// Sequence length clamped to what the block table can address; negative lengths become 0.
__host__ __device__ __forceinline__ int EffectiveLength(int seq_len, int max_pages, int page_size) {
  return ClampLength(seq_len, static_cast<int64_t>(max_pages) * page_size);
}

__host__ __device__ __forceinline__ int NumKvBlocks(int len) { return (len + kBlockN - 1) / kBlockN; }

// The length a decode and its combine give request b: EffectiveLength(seq_lens[b]), or 0 where
// seq_lens[b] differs from plan_lens[b] (the schedule was built from other lengths) or, failing
// closed, lies outside [q_len, capacity]. Never above EffectiveLength, so never more blocks than
// the schedule has for the request. `load(ptr)` reads one int32 of seq_lens or plan_lens.
struct RequestLengths {
  const int32_t* seq_lens;
  const int32_t* plan_lens;  // nullptr: the schedule was built from seq_lens
  int max_pages, page_size, q_len;
  bool fail_closed;

  __host__ __device__ __forceinline__ static RequestLengths Of(const DecodeParams& p) {
    return {p.seq_lens, p.plan_lens, p.max_pages, p.page_size, p.q_len, p.fail_closed};
  }
  template <class Load>
  __host__ __device__ __forceinline__ int Get(int b, Load load) const {
    const int len = load(seq_lens + b);
    if (plan_lens != nullptr && len != load(plan_lens + b)) return 0;
    const int clamped = EffectiveLength(len, max_pages, page_size);
    return fail_closed && (len < q_len || len != clamped) ? 0 : clamped;
  }
  __host__ __device__ __forceinline__ int Get(int b) const {
    return Get(b, [](const int32_t* v) { return *v; });
  }
};

// A request's cost in schedule units: its KV blocks plus the fixed cost, 0 when it has none.
__host__ __device__ __forceinline__ int RequestCost(int seq_len, int max_pages, int page_size,
                                                    int fixed_cost) {
  const int n = NumKvBlocks(EffectiveLength(seq_len, max_pages, page_size));
  return n > 0 ? n + fixed_cost : 0;
}

// The last index b in [0, n) with prefix[b] <= x, or 0 (n >= 1); `load(ptr)` reads prefix[].
template <class Load>
__host__ __device__ __forceinline__ int LastAtMost(const int32_t* prefix, int n, int x, Load load) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) >> 1;
    if (load(prefix + mid) <= x) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// The fewest units a part takes where requests cost `units_per_request` on average and a KV block
// costs a part `block_to_split_cost` times what one more split costs the request: splitting n
// blocks into n / q parts costs a part q blocks and the request n / q splits, cheapest at q =
// sqrt(n / block_to_split_cost), here rounded to the nearest integer; at least 1.
__host__ __device__ __forceinline__ int SplitUnits(int units_per_request, int block_to_split_cost) {
  int q = 1;
  // sqrt(units / ratio) >= q + 1/2, i.e. ratio (2 q + 1)^2 <= 4 units: round up to q + 1. The
  // loop runs about sqrt(units / ratio) times: 12 for a request of 128k tokens.
  while (static_cast<long long>(block_to_split_cost) * (2 * q + 1) * (2 * q + 1) <=
         4LL * units_per_request) {
    ++q;
  }
  return q;
}

// Q: the cost units of a part, for the schedule's `total` units over num_parts parts.
__host__ __device__ __forceinline__ int UnitsPerPart(const DecodeParams& p, int total,
                                                     int num_parts) {
  const int q = max((total + num_parts - 1) / num_parts,
                    SplitUnits(total / max(p.batch, 1), max(p.block_to_split_cost, 1)));
  return max(q, p.min_blocks_per_part);
}

struct ScheduleView {
  const int32_t* prefix;  // S[0..batch]
  int batch;
  int units_per_part;     // Q
  int fixed_cost;         // F

  __host__ __device__ __forceinline__ static ScheduleView Load(const DecodeParams& p, int num_parts) {
    ScheduleView v;
    v.prefix = p.schedule;
    v.batch = p.batch;
    v.fixed_cost = p.fixed_cost_blocks;
    v.units_per_part = UnitsPerPart(p, v.prefix[p.batch], num_parts);
    return v;
  }
  __host__ __device__ __forceinline__ int Total() const { return prefix[batch]; }
  // Last request b with S[b] <= x (x >= 0).
  __host__ __device__ __forceinline__ int FindRequest(int x) const {
    return LastAtMost(prefix, batch, x, [](const int32_t* v) { return *v; });
  }
  __host__ __device__ __forceinline__ int PartOf(int b, int block) const {
    return (prefix[b] + fixed_cost + block) / units_per_part;
  }
  // The cost unit where part y + 1 begins (the boundary between parts y and y + 1).
  __host__ __device__ __forceinline__ long long BoundaryUnit(int y) const {
    return static_cast<long long>(y + 1) * units_per_part;
  }
  // For b = FindRequest(BoundaryUnit(y)) (below Total()): whether request b's KV blocks are split
  // between parts y and y + 1 with y its first part. Each split request is so named by exactly one
  // boundary (its blocks' units lie at [S[b] + F, S[b + 1]), so it has S[b + 1] - S[b] - F blocks).
  __host__ __device__ __forceinline__ bool FirstSplitAt(int b, int y) const {
    const int cost = prefix[b + 1] - prefix[b];
    return cost > 0 && PartOf(b, 0) == y && PartOf(b, cost - fixed_cost - 1) > y;
  }
};

// One work segment of a part: blocks [kv_begin, kv_end) of request b.
struct Segment {
  int b;
  int kv_begin;
  int kv_end;
  int len;       // request b's length (RequestLengths)
  bool whole;    // the segment is the whole request: write the final output directly
};

// Walks the segments of one part in order. Usage:
//   SegmentWalker w(view, part, ...); Segment s; while (w.Next(s)) {...}
struct SegmentWalker {
  ScheduleView view;
  RequestLengths lengths;
  int x0, x1, b;

  __host__ __device__ __forceinline__ SegmentWalker(const ScheduleView& v, int part,
                                                    const RequestLengths& lens)
      : view(v), lengths(lens) {
    int total = v.Total();
    long long begin = static_cast<long long>(part) * v.units_per_part;
    long long end = begin + v.units_per_part;
    x0 = static_cast<int>(begin < total ? begin : total);
    x1 = static_cast<int>(end < total ? end : total);
    b = x0 < x1 ? v.FindRequest(x0) : v.batch;
  }

  __host__ __device__ __forceinline__ bool Next(Segment& s) {
    while (b < view.batch && view.prefix[b] < x1) {
      int cur = b++;
      int len = lengths.Get(cur);
      int n = NumKvBlocks(len);
      int first = view.prefix[cur] + view.fixed_cost;
      int kb = x0 - first, ke = x1 - first;
      kb = kb < 0 ? 0 : (kb > n ? n : kb);
      ke = ke < 0 ? 0 : (ke > n ? n : ke);
      if (ke > kb) {
        s.b = cur;
        s.kv_begin = kb;
        s.kv_end = ke;
        s.len = len;
        s.whole = (kb == 0 && ke == n);
        return true;
      }
    }
    return false;
  }
};

// The cache rows of a part's first blocks that the decode asks L2 for before its dependency wait
// (PrefetchFirstKvBlocks in producer.cuh), when the schedule, lengths and block table may
// still be being written: whatever they hold, every read stays inside its array and every row
// visited lies in the cache (tests/sm90_prefetch_check.cu). From the block of the request holding
// the part's first cost unit (its block 0 where that unit is part of the fixed cost) through that
// request, then the next one, up to max_halves 32-token halves, those with index % m_tiles ==
// mtile: visit(row, tokens) for each whose page id is in [0, num_pages), tokens being the half's
// tokens below the request's length (RequestLengths), all in that page. load(ptr) reads one int32
// of the schedule, seq_lens, plan_lens or block table. Needs batch * max_pages < 2^31 (the block table's index is
// an int; the decode calls it with batch <= 16 and ValidShape keeps max_pages * page_size < 2^30).
template <class Load, class Visit>
__host__ __device__ __forceinline__ void ForEachPrefetchHalf(const DecodeParams& p, int num_parts,
                                                             int part, int mtile, int m_tiles,
                                                             int max_halves, Load load,
                                                             Visit visit) {
  const int32_t* prefix = p.schedule;
  const int total = load(prefix + p.batch);
  // Read before the dependency wait, the schedule may not be written yet: a total no schedule of
  // this table can have is not walked (nor given to SplitUnits, whose loop it would lengthen).
  const long long most_per_request =
      RequestCost(INT32_MAX, p.max_pages, p.page_size, p.fixed_cost_blocks);
  if (total <= 0 || total > p.batch * most_per_request) return;
  const int per_part = UnitsPerPart(p, total, num_parts);
  if (part >= CeilDivInt(total, per_part)) return;
  const int x0 = part * per_part;
  const int lo = LastAtMost(prefix, p.batch, x0, load);  // as ScheduleView::FindRequest
  const int page_shift = PageShift(p);
  int half = 0;  // halves visited or passed over so far
  for (int b = lo; b < min(lo + 2, p.batch) && half < max_halves; ++b) {
    const int len = RequestLengths::Of(p).Get(b, load);
    const int kb = max(x0 - (load(prefix + b) + p.fixed_cost_blocks), 0);
    const int token_begin = kb < NumKvBlocks(len) ? kb * kBlockN : len;
    for (int token0 = token_begin; token0 < len && half < max_halves; token0 += kHalfN, ++half) {
      if (half % m_tiles != mtile) continue;
      const int page = load(p.block_tables + b * p.max_pages + (token0 >> page_shift));
      if (page < 0 || page >= p.num_pages) continue;
      visit(page * p.page_size + (token0 & (p.page_size - 1)), min(kHalfN, len - token0));
    }
  }
}

constexpr int kScheduleThreads = 256;

// One CTA: S[b] = sum of costs of requests < b, S[batch] = total.
__global__ void __launch_bounds__(kScheduleThreads)
ScheduleKernel(const int32_t* seq_lens, int batch, int max_pages, int page_size, int fixed_cost,
               int32_t* prefix) {
  GridDependencyWait();
  __shared__ int warp_sums[kScheduleThreads / 32];
  __shared__ int carry_in;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (threadIdx.x == 0) carry_in = 0;
  __syncthreads();
  for (int base = 0; base < batch; base += kScheduleThreads) {
    int b = base + threadIdx.x;
    const int cost = b < batch ? RequestCost(seq_lens[b], max_pages, page_size, fixed_cost) : 0;
    int incl = cost;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (lane >= d) incl += v;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    int warp_offset = 0, chunk_total = 0;
    for (int w = 0; w < kScheduleThreads / 32; ++w) {
      if (w < warp) warp_offset += warp_sums[w];
      chunk_total += warp_sums[w];
    }
    int carry = carry_in;
    if (b < batch) prefix[b] = carry + warp_offset + incl - cost;
    __syncthreads();
    if (threadIdx.x == 0) carry_in = carry + chunk_total;
    __syncthreads();
  }
  if (threadIdx.x == 0) prefix[batch] = carry_in;
  GridDependencyLaunchDependents();
}

}  // namespace sm90
}  // namespace jax_mla
