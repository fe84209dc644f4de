// JaxMlaDevicePlan: the XLA FFI handler that launches the GPU planner (device_plan.cuh) on XLA's
// stream, writing FlashInfer's fa3/fa2 schedule into the int workspace it returns.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common.h"
#include "device_plan.cuh"
#include "plan_info.h"

namespace jax_mla {
namespace {

ffi::Error DevicePlanImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> seq_lens,
                          ffi::Result<ffi::AnyBuffer> int_workspace, int64_t q_len,
                          int64_t num_heads, int64_t max_pages, int64_t sm_count, bool causal,
                          ffi::Span<const int64_t> plan_info) {
  if (plan_info.size() != kPlanInfoSize || plan_info[1] > kMaxClusters) {
    return InvalidArgument("device plan needs plan_info of " + std::to_string(kPlanInfoSize) +
                           " entries and at most " + std::to_string(kMaxClusters) + " clusters");
  }
  const ScheduleShape shape =
      MakeShape(static_cast<int>(seq_lens.element_count()), static_cast<int>(q_len),
                static_cast<int>(num_heads), static_cast<int>(max_pages),
                static_cast<int>(sm_count), causal, plan_info.begin());
  PlanKernel<<<1, kPlanThreads, 0, stream>>>(shape, OffsetsFromPlanInfo(plan_info.begin()),
                                             seq_lens.typed_data(),
                                             static_cast<uint8_t*>(int_workspace->untyped_data()));
  return LaunchStatus("device plan");
}

}  // namespace
}  // namespace jax_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaDevicePlan, jax_mla::DevicePlanImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // seq_lens [B]
                                  .Ret<ffi::AnyBuffer>()         // int_workspace (the schedule)
                                  .Attr<int64_t>("q_len")
                                  .Attr<int64_t>("num_heads")
                                  .Attr<int64_t>("max_pages")
                                  .Attr<int64_t>("sm_count")
                                  .Attr<bool>("causal")
                                  .Attr<ffi::Span<const int64_t>>("plan_info"),
                              {ffi::Traits::kCmdBufferCompatible});
