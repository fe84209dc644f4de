// Merging split requests inside the SM90 decode kernel (DecodeKernelArgs::merge_splits) instead of
// in a combine kernel after it: the CTA that stores the last of an M tile's split results merges
// them, so no CTA waits for another.
//
// A CTA that stored the partial results of a split segment of (request b, M tile m) counts them on
// the counter of (the request's first part, m): its consumer threads' stores, a barrier, a fence
// and one atomic add. The CTA whose add completes the count (n: the parts the request spans) sets
// the counter back to zero and merges the n partial results of the M tile (MergeTileOfSplits, in
// part order: deterministic). A part's last request is the only one of its requests that can extend
// past it, so each split request has its own first part and the counters of a slot need one per
// CTA of the grid. They are zero whenever no decode of their slot runs: every decode that starts
// leaves them so, and one that does not complete leaves its CUDA context unusable.
//
// The counters live in a pool per device (g_merge_counters, zero when the module loads), one slot
// per caller (DecodeParams::merge_slot). Requests with no KV block get zeros and LSE -inf from the
// decode CTAs too (WriteEmptyRequests), so no kernel follows the decode.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

#include "combine_kernel.cuh"
#include "decode_params.h"
#include "schedule.cuh"

namespace jax_mla {
namespace sm90 {

__device__ uint32_t g_merge_counters[kMergeCounterSlots * kMergeCountersPerSlot];

// Whether a decode grid of `ctas` CTAs can merge its splits with the counters of `slot`.
__host__ __device__ __forceinline__ bool MergeCountersFit(int slot, int ctas) {
  return slot >= 0 && slot < kMergeCounterSlots && ctas <= kMergeCountersPerSlot;
}

__device__ __forceinline__ uint32_t* MergeCounter(int slot, int cta) {
  return g_merge_counters + static_cast<size_t>(slot) * kMergeCountersPerSlot + cta;
}

// One thread, after a barrier of every thread that stored this CTA's partial results of the split:
// counts them and returns whether they complete the n splits, in which case the counter is zero
// again and the other splits' results are visible to the threads that pass a barrier with this
// one after it returns.
__device__ __forceinline__ bool CountStoredSplit(uint32_t* counter, uint32_t n) {
  __threadfence();
  if (atomicAdd(counter, 1u) != n - 1) return false;
  atomicExch(counter, 0u);
  __threadfence();
  return true;
}

// Partial results as stored, read through L2 (ld.global.cg): they were written by other SMs
// during this kernel, so no L1 line of them may be used.
__device__ __forceinline__ float4 LoadPartial(const float4* ptr) { return __ldcg(ptr); }
__device__ __forceinline__ Bf16x4 LoadPartial(const Bf16x4* ptr) {
  const uint2 bits = __ldcg(reinterpret_cast<const uint2*>(ptr));
  Bf16x4 v;
  memcpy(&v, &bits, sizeof(v));
  return v;
}

// Merges the partial results of split request b's M tile (query rows row0 .. row0 + tile_rows - 1
// of its `rows`, tile_rows <= kMaxRows) into its bf16 output x output_scale and LSE, by the
// kConsumerThreads threads of a CTA (tid: 0 .. kConsumerThreads - 1): warp w merges rows w, w + 8,
// ..., lane l columns 4 l + 128 g (g < 4). The splits' LSEs of all the warp's rows are read first
// (lane j: split first + j), then the partial rows kRowsPerPass at a time, two splits at a time,
// accumulated in part order. A row that no split sees gets zeros and LSE -inf, as in the combine
// kernels. kBf16Partials: the partial outputs are bf16, else fp32.
template <int kMaxRows, bool kBf16Partials>
__device__ __forceinline__ void MergeTileOfSplits(const DecodeParams& p, const SplitRequest& req,
                                                  int b, int rows, int row0, int tile_rows,
                                                  int tid) {
  constexpr int kWarps = kConsumerThreads / 32;
  constexpr int kRowsPerWarp = (kMaxRows + kWarps - 1) / kWarps;
  // Rows a warp merges at once: as many as the decode kernel's registers hold beside its own.
  constexpr int kRowsPerPassMax = kBf16Partials ? 4 : 2;
  constexpr int kRowsPerPass = kRowsPerWarp < kRowsPerPassMax ? kRowsPerWarp : kRowsPerPassMax;
  static_assert(kRowsPerWarp % kRowsPerPass == 0, "passes cover the warp's rows");
  constexpr int kVecs = kLatentDim / 128;  // four columns a vector, 32 lanes
  using Cols = PartialCols<kBf16Partials>;
  constexpr float kNegInf = -__builtin_huge_valf();
  const int warp = tid / 32, lane = tid % 32;
  const int first = req.first, last = req.last;
  const Cols* part_out = reinterpret_cast<const Cols*>(req.part_out);

  // Row i of the warp: LSE, and lane j's weight of split first + j (valid for j < 32).
  float lse[kRowsPerWarp], w_lane[kRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int r = warp + kWarps * i;
    lse[i] = kNegInf;
    w_lane[i] = 0.f;
    if (r >= tile_rows) continue;
    auto split_lse = [&](int s) { return __ldcg(req.part_lse + req.SlotRow(b, s, row0 + r)); };
    const float lse_first = first + lane <= last ? split_lse(first + lane) : kNegInf;
    float max_lse = lse_first;
#pragma unroll 1
    for (int s = first + 32 + lane; s <= last; s += 32) max_lse = fmaxf(max_lse, split_lse(s));
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
      max_lse = fmaxf(max_lse, __shfl_xor_sync(0xffffffffu, max_lse, d));
    }
    if (max_lse == kNegInf) continue;
    float sum = __expf(lse_first - max_lse);
#pragma unroll 1
    for (int s = first + 32 + lane; s <= last; s += 32) sum += __expf(split_lse(s) - max_lse);
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
    lse[i] = max_lse + __logf(sum);
    w_lane[i] = __expf(lse_first - lse[i]);
  }

#pragma unroll
  for (int pass = 0; pass < kRowsPerWarp / kRowsPerPass; ++pass) {
    float4 acc[kRowsPerPass][kVecs];
#pragma unroll
    for (int i = 0; i < kRowsPerPass; ++i) {
#pragma unroll
      for (int g = 0; g < kVecs; ++g) acc[i][g] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
    // Split s's weight for the pass's row i (all lanes).
    auto weight = [&](int i, int s) {
      const int k = pass * kRowsPerPass + i;
      if (s - first < 32) return __shfl_sync(0xffffffffu, w_lane[k], s - first);
      const int r = warp + kWarps * k;
      return lse[k] == kNegInf
                 ? 0.f
                 : __expf(__ldcg(req.part_lse + req.SlotRow(b, s, row0 + r)) - lse[k]);
    };
#pragma unroll 1
    for (int s = first; s <= last; s += 2) {
      Cols v[2][kRowsPerPass][kVecs];
#pragma unroll
      for (int t = 0; t < 2; ++t) {
#pragma unroll
        for (int i = 0; i < kRowsPerPass; ++i) {
          const int r = warp + kWarps * (pass * kRowsPerPass + i);
          if (s + t > last || r >= tile_rows) continue;
          const Cols* src = part_out + req.SlotRow(b, s + t, row0 + r) * (kLatentDim / 4);
#pragma unroll
          for (int g = 0; g < kVecs; ++g) v[t][i][g] = LoadPartial(src + g * 32 + lane);
        }
      }
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        if (s + t > last) continue;
#pragma unroll
        for (int i = 0; i < kRowsPerPass; ++i) {
          const float w = weight(i, s + t);
#pragma unroll
          for (int g = 0; g < kVecs; ++g) {
            const int r = warp + kWarps * (pass * kRowsPerPass + i);
            if (r >= tile_rows) continue;
            const float4 x = Widen(v[t][i][g]);
            acc[i][g].x = fmaf(w, x.x, acc[i][g].x);
            acc[i][g].y = fmaf(w, x.y, acc[i][g].y);
            acc[i][g].z = fmaf(w, x.z, acc[i][g].z);
            acc[i][g].w = fmaf(w, x.w, acc[i][g].w);
          }
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerPass; ++i) {
      const int k = pass * kRowsPerPass + i;
      const int r = warp + kWarps * k;
      if (r >= tile_rows) continue;
      const size_t out_row = static_cast<size_t>(b) * rows + row0 + r;
      Bf16x4* out = reinterpret_cast<Bf16x4*>(static_cast<__nv_bfloat16*>(p.out) +
                                              out_row * kLatentDim);
      const bool seen = lse[k] != kNegInf;
      const float f = p.output_scale;
#pragma unroll
      for (int g = 0; g < kVecs; ++g) {
        const float4 a = seen ? acc[i][g] : make_float4(0.f, 0.f, 0.f, 0.f);
        out[g * 32 + lane] = Bf16x4{__floats2bfloat162_rn(a.x * f, a.y * f),
                                    __floats2bfloat162_rn(a.z * f, a.w * f)};
      }
      if (lane == 0) p.lse[out_row] = lse[k];
    }
  }
}

// Zeros and LSE -inf for the requests with no KV block among b = cta, cta + ctas, ..., by the
// kConsumerThreads threads of a CTA: warp w checks requests cta + ctas (w + 8 k) and writes the
// rows of an empty one.
__device__ __forceinline__ void WriteEmptyRequests(const DecodeParams& p, int cta, int ctas,
                                                   int tid) {
  constexpr int kWarps = kConsumerThreads / 32;
  const int warp = tid / 32, lane = tid % 32;
  const int rows = p.q_len * p.num_heads;
  for (long long b = cta + static_cast<long long>(ctas) * warp; b < p.batch;
       b += static_cast<long long>(ctas) * kWarps) {
    if (NumKvBlocks(EffectiveLength(p.seq_lens[b], p.max_pages, p.page_size)) != 0) continue;
    for (int row = 0; row < rows; ++row) WriteEmptyRow(p, rows, static_cast<int>(b), row, lane);
  }
}

}  // namespace sm90
}  // namespace jax_mla
