// The lengths the fa3/fa2 planners take, the host-side clamping before FlashInfer's host planner
// (MLAPlan) sees them, and the clamp to a block table's capacity that every schedule applies
// (ffi/schedule.cuh, ffi/sm90/schedule.cuh).
#pragma once

#include <cstdint>

namespace jax_mla {

#ifdef __CUDACC__
#define JAX_MLA_LENGTHS_HD __host__ __device__ inline
#else
#define JAX_MLA_LENGTHS_HD inline
#endif

// The longest request the fa3/fa2 schedule takes (planning.MAX_KV_LEN): with every length at most
// this, all tile tokens over the clusters (the planners' int chunk size) stay below 2^31 for every
// batch that planning.max_batch_for_works allows.
constexpr int kMaxKvLen = 1 << 22;

// `length` clamped to [0, capacity].
JAX_MLA_LENGTHS_HD int32_t ClampLength(int64_t length, int64_t capacity) {
  return static_cast<int32_t>(length < 0 ? 0 : (length > capacity ? capacity : length));
}

// Clamps each of `batch` lengths to [0, capacity]. MLAPlan writes past its host buffers for a
// negative length mixed with long ones, and a length above the block table's capacity
// (max_pages * page_size) would schedule reads past the request's own table row.
inline void ClampLengths(int32_t* seq_lens, int64_t batch, int64_t capacity) {
  for (int64_t b = 0; b < batch; ++b) seq_lens[b] = ClampLength(seq_lens[b], capacity);
}

}  // namespace jax_mla

#undef JAX_MLA_LENGTHS_HD
