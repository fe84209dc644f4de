// The host planning code under AddressSanitizer (tests/test_planner_asan.py builds and runs it):
// the GPU planner's host twin (the same range walks as its kernel) and the length clamping that
// runs before FlashInfer's host planner, on lengths that include bad ones.
//
// stdin, one case a line: q_len num_heads max_pages page_size sm_count causal workspace_bytes
// batch, the 18 plan_info entries, then batch lengths. stdout, a line a case: the number of works
// (-1: over a capacity) and the clamped lengths' min and max.
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <vector>

#include "lengths.h"
#include "plan_twin.cuh"

int main() {
  int64_t q_len, num_heads, max_pages, page_size, sm_count, causal, workspace_bytes, batch;
  while (std::cin >> q_len >> num_heads >> max_pages >> page_size >> sm_count >> causal >>
         workspace_bytes >> batch) {
    std::vector<int64_t> plan_info(jax_mla::kPlanInfoSize);
    for (int64_t& entry : plan_info) std::cin >> entry;
    std::vector<int32_t> lengths(batch);  // exactly batch entries, so a read past them is caught
    for (int32_t& length : lengths) std::cin >> length;
    std::vector<uint8_t> workspace(workspace_bytes);
    const int works = jax_mla::PlanOnHost(
        jax_mla::MakeShape(batch, q_len, num_heads, max_pages, sm_count, causal != 0, plan_info.data()),
        jax_mla::OffsetsFromPlanInfo(plan_info.data()), lengths.data(), workspace.data());
    jax_mla::ClampLengths(lengths.data(), batch, max_pages * page_size);
    int32_t low = lengths[0], high = lengths[0];
    for (int32_t length : lengths) low = length < low ? length : low, high = length > high ? length : high;
    std::printf("%d %d %d\n", works, low, high);
  }
  return 0;
}
