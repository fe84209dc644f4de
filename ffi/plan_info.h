// FlashInfer's MLAPlanInfo: the int64 list that its fa3/fa2 `plan` returns and `run` takes.
//   [0] CTAs per cluster  [1] clusters  [2..15] byte offsets of the schedule's arrays in the int
//   workspace  [16..17] byte offsets of the partial outputs and their lse in the float workspace
#pragma once

#include <cstdint>

namespace jax_mla {

constexpr int kPlanInfoSize = 18;

// The schedule arrays' byte offsets in the int workspace, plan_info[2..15] in order.
struct ScheduleOffsets {
  int64_t q_indptr, kv_indptr, partial_indptr, merge_packed_start, merge_packed_end,
      merge_partial_start, merge_partial_end, merge_partial_stride, q_len, kv_len, q_start,
      kv_start, kv_end, work_indptr;
};

inline ScheduleOffsets OffsetsFromPlanInfo(const int64_t* p) {
  return {p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9], p[10], p[11], p[12], p[13], p[14], p[15]};
}

}  // namespace jax_mla
