// XLA FFI handlers of jax_mla's own SM90 (Hopper) MLA decode kernel (ffi/sm90).
//
// JaxMlaSm90Schedule builds the step's split-KV schedule from seq_lens; JaxMlaSm90Decode decodes
// one layer with it (JaxMlaSm90DecodeFp8 with the fp8 cache): the decode and combine kernels on
// XLA's stream. The schedule depends only on
// seq_lens and the block table's shape, so the custom calls of every layer of a step are identical
// and XLA keeps one of them (common-subexpression elimination): the schedule is built once per
// step (or once before a scanned loop, by jax_mla.sm90_plan). A request whose length differs from
// the one the schedule was built from (plan_lens) reads nothing. With fail_closed the kernels also
// give a request whose length lies outside [q_len, max_pages * page_size] or which reads a
// block-table entry outside [0, num_pages) out 0 and lse -inf (DecodeParams). The tensor maps of the query and the cache
// are encoded on the host from the buffer pointers of each call (no device work, no sync), so both
// handlers are command-buffer compatible.
//
//   query        bf16 [B, q_len, H, 576]       (kv_lora_rank 512 + rope 64)
//   kv_cache     bf16 [num_pages, page_size, 576], page_size 32 or 64; JaxMlaSm90DecodeFp8: the
//                fp8 cache, u8 [num_pages, page_size, 656] (docs/fp8-cache.md)
//   block_tables int32 [B, max_pages]
//   seq_lens     int32 [B]
//   plan_lens    int32 [B]                      (the lengths the schedule was built from)
//   schedule     int32 [B + 1]                  (JaxMlaSm90Schedule's result)
//   out          bf16 [B, q_len, H, 512]        (times output_scale)
//   lse          f32  [B, q_len, H]             (natural log; -inf for rows that see no token)
//   workspace    u8   [>= JaxMlaSm90WorkspaceBytes(B, q_len, H, sm_count)]
// Attributes: softmax_scale (f64), output_scale (f64), sm_count (i64), enable_pdl (bool),
// fail_closed (bool); the schedule's: max_pages, page_size (i64), enable_pdl.
#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "sm90/launch.cuh"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_mla {
namespace {

// What jax_mla.gpu.check_sm90_shapes accepts; the handler re-checks it.
constexpr int64_t kMaxQLen = 4;
constexpr int64_t kMaxHeads = 128;

ffi::Error Invalid(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_mla: sm90 decode: " + message);
}

std::string Shape(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

bool Aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

// Token positions and the schedule's per-request costs (64-token blocks + the fixed cost) are
// summed in int32: the block table's capacity and batch * capacity must stay below that.
ffi::Error CheckTableCapacity(int64_t batch, int64_t max_pages, int64_t page_size) {
  using namespace sm90;
  if (max_pages * page_size >= (int64_t{1} << 30)) {
    return Invalid("block_tables max_pages * page_size must be < 2^30 tokens, got " +
                   std::to_string(max_pages * page_size));
  }
  if (batch * (max_pages * page_size / kBlockN + kFixedCostBlocks + 1) >= (int64_t{1} << 31)) {
    return Invalid("batch * block-table capacity too large for the int32 schedule");
  }
  return ffi::Error::Success();
}

// Success, or the CUDA error of launching `what` ("decode", "schedule").
ffi::Error Launched(const std::string& what, cudaError_t status) {
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal("jax_mla: sm90 " + what + " launch failed: " +
                              cudaGetErrorString(status));
}

// kCacheType: ffi::BF16 for the bf16 cache, ffi::U8 for the fp8 cache.
template <ffi::DataType kCacheType>
ffi::Error Sm90DecodeImpl(cudaStream_t stream, ffi::Buffer<ffi::BF16> query,
                          ffi::Buffer<kCacheType> kv_cache, ffi::Buffer<ffi::S32> block_tables,
                          ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> plan_lens,
                          ffi::Buffer<ffi::S32> schedule,
                          ffi::Result<ffi::Buffer<ffi::BF16>> out,
                          ffi::Result<ffi::Buffer<ffi::F32>> lse,
                          ffi::Result<ffi::Buffer<ffi::U8>> workspace, double softmax_scale,
                          double output_scale, int64_t sm_count, bool enable_pdl,
                          bool fail_closed) {
  using namespace sm90;
  const auto q = query.dimensions();
  const auto kv = kv_cache.dimensions();
  const auto bt = block_tables.dimensions();
  if (q.size() != 4 || q[3] != kHeadDim) {
    return Invalid("query must be [batch, q_len, num_heads, " + std::to_string(kHeadDim) +
                   "], got " + Shape(q));
  }
  const int64_t batch = q[0], q_len = q[1], heads = q[2];
  if (batch < 1 || q_len < 1 || q_len > kMaxQLen || heads < 1 || heads > kMaxHeads) {
    return Invalid("needs batch >= 1, q_len in [1, " + std::to_string(kMaxQLen) +
                   "] and num_heads in [1, " + std::to_string(kMaxHeads) + "], got query " +
                   Shape(q));
  }
  constexpr bool kFp8 = kCacheType == ffi::U8;
  const int64_t row = kFp8 ? kFp8RowBytes : kHeadDim;
  if (kv.size() != 3 || kv[2] != row || kv[0] < 1) {
    return Invalid(std::string(kFp8 ? "the fp8 " : "") + "kv_cache must be [num_pages >= 1, "
                   "page_size, " + std::to_string(row) + "], got " + Shape(kv));
  }
  const int64_t num_pages = kv[0], page_size = kv[1];
  if (page_size != 32 && page_size != 64) {
    return Invalid("kv_cache page_size must be 32 or 64, got " + std::to_string(page_size));
  }
  if (num_pages * page_size >= (int64_t{1} << 31)) {
    return Invalid("kv_cache holds num_pages * page_size = " +
                   std::to_string(num_pages * page_size) + " tokens; at most 2^31 - 1 supported");
  }
  if (bt.size() != 2 || bt[0] != batch || bt[1] < 1) {
    return Invalid("block_tables must be [batch=" + std::to_string(batch) +
                   ", max_pages >= 1], got " + Shape(bt));
  }
  const int64_t max_pages = bt[1];
  if (ffi::Error capacity = CheckTableCapacity(batch, max_pages, page_size); capacity.failure()) {
    return capacity;
  }
  if (seq_lens.dimensions().size() != 1 || seq_lens.element_count() != static_cast<size_t>(batch)) {
    return Invalid("seq_lens must be [batch=" + std::to_string(batch) + "], got " +
                   Shape(seq_lens.dimensions()));
  }
  if (plan_lens.dimensions().size() != 1 ||
      plan_lens.element_count() != static_cast<size_t>(batch)) {
    return Invalid("plan_lens must be [batch=" + std::to_string(batch) + "], got " +
                   Shape(plan_lens.dimensions()));
  }
  if (schedule.dimensions().size() != 1 ||
      schedule.element_count() != static_cast<size_t>(batch) + 1) {
    return Invalid("schedule must be [batch + 1 = " + std::to_string(batch + 1) + "], got " +
                   Shape(schedule.dimensions()));
  }
  const auto o = out->dimensions();
  const auto l = lse->dimensions();
  if (o.size() != 4 || o[0] != batch || o[1] != q_len || o[2] != heads || o[3] != kLatentDim) {
    return Invalid("out must be [batch, q_len, num_heads, " + std::to_string(kLatentDim) +
                   "] = [" + std::to_string(batch) + ", " + std::to_string(q_len) + ", " +
                   std::to_string(heads) + ", 512], got " + Shape(o));
  }
  if (l.size() != 3 || l[0] != batch || l[1] != q_len || l[2] != heads) {
    return Invalid("lse must be [batch, q_len, num_heads], got " + Shape(l));
  }
  if (sm_count < 1 || sm_count > 65535) {
    return Invalid("sm_count must be in [1, 65535], got " + std::to_string(sm_count));
  }
  const size_t needed = WorkspaceBytes(static_cast<int>(batch), static_cast<int>(q_len),
                                       static_cast<int>(heads), static_cast<int>(sm_count));
  if (workspace->size_bytes() < needed) {
    return Invalid("workspace has " + std::to_string(workspace->size_bytes()) + " bytes, needs " +
                   std::to_string(needed));
  }
  const float scale = static_cast<float>(softmax_scale);
  if (!(scale > 0.f) || !std::isfinite(scale)) {
    return Invalid("softmax_scale must be positive and finite in float32, got " +
                   std::to_string(softmax_scale));
  }
  if (!Aligned16(query.untyped_data()) || !Aligned16(kv_cache.untyped_data()) ||
      !Aligned16(out->untyped_data()) || !Aligned16(workspace->untyped_data())) {
    return Invalid("query, kv_cache, out and workspace must be 16-byte aligned");
  }
  if (detail::TensorMapEncoder() == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_mla: sm90 decode: the CUDA driver has no cuTensorMapEncodeTiled "
                      "(needs a CUDA 12 or newer driver)");
  }

  DecodeParams p{};
  p.query = query.untyped_data();
  p.kv_cache = kv_cache.untyped_data();
  p.block_tables = block_tables.typed_data();
  p.seq_lens = seq_lens.typed_data();
  if (plan_lens.typed_data() != p.seq_lens) p.plan_lens = plan_lens.typed_data();
  p.schedule = schedule.typed_data();
  p.out = out->untyped_data();
  p.lse = lse->typed_data();
  p.workspace = workspace->untyped_data();
  p.batch = static_cast<int>(batch);
  p.q_len = static_cast<int>(q_len);
  p.num_heads = static_cast<int>(heads);
  p.num_pages = static_cast<int>(num_pages);
  p.page_size = static_cast<int>(page_size);
  p.max_pages = static_cast<int>(max_pages);
  p.softmax_scale = scale;
  p.output_scale = static_cast<float>(output_scale);
  p.num_sms = static_cast<int>(sm_count);
  p.enable_pdl = enable_pdl;
  p.kv_fp8 = kFp8;
  p.fail_closed = fail_closed;

  return Launched("decode", LaunchDecode(p, stream));
}

// The step's schedule: int32 [B + 1] from seq_lens [B] (ScheduleKernel, ffi/sm90/schedule.cuh).
ffi::Error Sm90ScheduleImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> seq_lens,
                            ffi::Result<ffi::Buffer<ffi::S32>> schedule, int64_t max_pages,
                            int64_t page_size, bool enable_pdl) {
  using namespace sm90;
  const auto lens = seq_lens.dimensions();
  if (lens.size() != 1 || lens[0] < 1) {
    return Invalid("schedule: seq_lens must be [batch >= 1], got " + Shape(lens));
  }
  const int64_t batch = lens[0];
  if (schedule->dimensions().size() != 1 ||
      schedule->element_count() != static_cast<size_t>(batch) + 1) {
    return Invalid("schedule: the result must be [batch + 1 = " + std::to_string(batch + 1) +
                   "], got " + Shape(schedule->dimensions()));
  }
  if (page_size != 32 && page_size != 64) {
    return Invalid("schedule: page_size must be 32 or 64, got " + std::to_string(page_size));
  }
  if (max_pages < 1) {
    return Invalid("schedule: max_pages must be >= 1, got " + std::to_string(max_pages));
  }
  if (ffi::Error capacity = CheckTableCapacity(batch, max_pages, page_size); capacity.failure()) {
    return capacity;
  }
  DecodeParams p{};
  p.seq_lens = seq_lens.typed_data();
  p.schedule = schedule->typed_data();
  p.batch = static_cast<int>(batch);
  p.max_pages = static_cast<int>(max_pages);
  p.page_size = static_cast<int>(page_size);
  p.enable_pdl = enable_pdl;
  return Launched("schedule", LaunchSchedule(p, stream));
}

}  // namespace
}  // namespace jax_mla

// Workspace bytes the handler needs (jax_mla.gpu.sm90_workspace_bytes computes the same in Python;
// the tests compare the two through this symbol).
extern "C" size_t JaxMlaSm90WorkspaceBytes(int64_t batch, int64_t q_len, int64_t num_heads,
                                           int64_t sm_count) {
  return jax_mla::sm90::WorkspaceBytes(static_cast<int>(batch), static_cast<int>(q_len),
                                       static_cast<int>(num_heads), static_cast<int>(sm_count));
}

namespace jax_mla {
namespace {

template <ffi::DataType kCacheType>
auto DecodeBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Arg<ffi::Buffer<ffi::BF16>>()                // query
      .Arg<ffi::Buffer<kCacheType>>()               // kv_cache
      .template Arg<ffi::Buffer<ffi::S32>>()        // block_tables
      .template Arg<ffi::Buffer<ffi::S32>>()        // seq_lens
      .template Arg<ffi::Buffer<ffi::S32>>()        // plan_lens
      .template Arg<ffi::Buffer<ffi::S32>>()        // schedule
      .template Ret<ffi::Buffer<ffi::BF16>>()       // out
      .template Ret<ffi::Buffer<ffi::F32>>()        // lse
      .template Ret<ffi::Buffer<ffi::U8>>()         // workspace
      .template Attr<double>("softmax_scale")
      .template Attr<double>("output_scale")
      .template Attr<int64_t>("sm_count")
      .template Attr<bool>("enable_pdl")
      .template Attr<bool>("fail_closed");
}

}  // namespace
}  // namespace jax_mla

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaSm90Decode, jax_mla::Sm90DecodeImpl<ffi::BF16>,
                              jax_mla::DecodeBinding<ffi::BF16>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaSm90DecodeFp8, jax_mla::Sm90DecodeImpl<ffi::U8>,
                              jax_mla::DecodeBinding<ffi::U8>(),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaSm90Schedule, jax_mla::Sm90ScheduleImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()    // seq_lens
                                  .Ret<ffi::Buffer<ffi::S32>>()    // schedule
                                  .Attr<int64_t>("max_pages")
                                  .Attr<int64_t>("page_size")
                                  .Attr<bool>("enable_pdl"),
                              {ffi::Traits::kCmdBufferCompatible});
