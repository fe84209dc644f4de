// libjax_mla_plan_twin.so: the GPU planner's host twin for the CPU tests (tests/test_device_plan.py).
// Built only with -DJAX_MLA_BUILD_PLAN_TWIN=ON; never part of libjax_mla_ffi.so.
#include <cstdint>

#include "plan_twin.cuh"

extern "C" int JaxMlaDevicePlanOnHost(const int32_t* seq_lens, int batch, int q_len, int num_heads,
                                      int max_pages, int sm_count, int causal,
                                      const int64_t* plan_info, uint8_t* ws) {
  using namespace jax_mla;
  return PlanOnHost(MakeShape(batch, q_len, num_heads, max_pages, sm_count, causal != 0, plan_info),
                    OffsetsFromPlanInfo(plan_info), seq_lens, ws);
}
