// XLA FFI handlers that run FlashInfer's MLA decode kernels on XLA's buffers and stream.
//
// FlashInfer's kernels are compiled entry points of its JIT modules (TVM-FFI functions `run`, `plan`,
// `trtllm_paged_attention_decode`). jax_mla's Python side loads those modules once and registers
// the functions in TVM-FFI's global registry; the handlers below look them up by the name given in
// the `*_fn` attribute, wrap the XLA buffers as DLTensor views (no copies: the combined
// [pages, page_size, kv_lora_rank + rope] cache becomes strided latent/rope views), point TVM-FFI's
// environment stream at XLA's stream for the duration of the call, and call them. No Python runs.
//
// Handlers:
//   JaxMlaFaDecode          fa3/fa2 with a precomputed schedule (jax_mla.plan); CUDA-graph safe.
//   JaxMlaFaDecodeSelfPlan  fa3/fa2 planning inside the call: reads seq_lens back to the host (a
//                           stream sync), so it is not command-buffer compatible. Its host staging
//                           is XLA FFI state (type JaxMlaPlanStaging, made by
//                           JaxMlaFaDecodeSelfPlanInstantiate).
//   JaxMlaTrtllmDecode      trtllm-gen (SM100/SM103); CUDA-graph safe.
//   JaxMlaTrtllmDecodeFp8   the same on the e4m3 cache with an e4m3 query, whose softmax scale
//                           comes from the device (it holds the query's quantisation scale).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common.h"
#include "lengths.h"
#include "plan_info.h"
#include "tvm/ffi/container/array.h"
#include "tvm/ffi/container/tuple.h"
#include "tvm/ffi/container/variant.h"

namespace jax_mla {
namespace {

// FlashInfer's MaskMode for fa3/fa2 `run`.
constexpr int64_t kMaskNone = 0, kMaskCausal = 1;
// trtllm-gen's lse is a base-2 logarithm; jax_mla returns natural ones.
constexpr double kTrtllmLseScale = 0.69314718055994530942;  // ln 2

// The fa3/fa2 `run` call shared by the planned and self-planning handlers.
//   query [N, H, D] with N = batch * q_len; kv_cache [P, page_size, D]; block_tables [B, max_pages]
//   out [N, H, kv_lora_rank]; lse f32 [N, H] (natural log).
ffi::Error RunFa(cudaStream_t stream, int32_t device, ffi::AnyBuffer query, ffi::AnyBuffer kv_cache,
                 ffi::Buffer<ffi::S32> block_tables, ffi::AnyBuffer int_workspace,
                 ffi::AnyBuffer out, ffi::Buffer<ffi::F32> lse, ffi::AnyBuffer float_workspace,
                 std::string_view run_fn, int64_t kv_lora_rank, bool causal, double softmax_scale,
                 ffi::Span<const int64_t> plan_info) {
  auto q_dims = query.dimensions();
  auto kv_dims = kv_cache.dimensions();
  if (q_dims.size() != 3 || kv_dims.size() != 3 || out.dimensions().size() != 3) {
    return InvalidArgument("fa decode expects query [N, H, D], kv_cache [P, page, D], out [N, H, r]");
  }
  const int64_t n = q_dims[0], heads = q_dims[1], dim = q_dims[2];
  const int64_t pages = kv_dims[0], page_size = kv_dims[1];
  const int64_t rope = dim - kv_lora_rank;
  if (kv_dims[2] != dim || rope <= 0 || plan_info.size() != kPlanInfoSize) {
    return InvalidArgument("inconsistent head dims or plan_info (expected " +
                           std::to_string(kPlanInfoSize) + " entries)");
  }
  auto fn = LookUp(run_fn);
  if (fn.has_error()) return fn.error();

  const DLDataType q_type = ToDLDataType(query.element_type());
  const DLDataType kv_type = ToDLDataType(kv_cache.element_type());
  const uint64_t rope_offset = kv_lora_rank * (q_type.bits / 8);
  View q_nope(query.untyped_data(), q_type, device, {n, heads, kv_lora_rank}, {heads * dim, dim, 1});
  View q_pe(query.untyped_data(), q_type, device, {n, heads, rope}, {heads * dim, dim, 1}, rope_offset);
  View ckv(kv_cache.untyped_data(), kv_type, device, {pages, page_size, kv_lora_rank},
           {page_size * dim, dim, 1});
  View kpe(kv_cache.untyped_data(), kv_type, device, {pages, page_size, rope},
           {page_size * dim, dim, 1}, kv_lora_rank * (kv_type.bits / 8));
  View kv_indices(block_tables.untyped_data(), kInt32, device,
                  {static_cast<int64_t>(block_tables.element_count())});
  View o(out.untyped_data(), ToDLDataType(out.element_type()), device, {n, heads, kv_lora_rank});
  View lse_view(lse.untyped_data(), kFloat32, device, {n, heads});
  View float_ws(float_workspace.untyped_data(), kUInt8, device,
                {static_cast<int64_t>(float_workspace.size_bytes())});
  View int_ws(int_workspace.untyped_data(), kUInt8, device,
              {static_cast<int64_t>(int_workspace.size_bytes())});
  tvm::ffi::Array<int64_t> info(plan_info.begin(), plan_info.end());

  EnvStreamScope scope(device, stream);
  return Guarded(run_fn, [&] {
    (*fn)(&float_ws, &int_ws, info, &q_nope, &q_pe, &ckv, &kpe, &kv_indices, &o, &lse_view,
          causal ? kMaskCausal : kMaskNone, heads, page_size, softmax_scale,
          /*return_lse_base_on_e=*/true, /*ckv_scale=*/1.0, /*kpe_scale=*/1.0,
          /*ckv_scale_arr=*/nullptr);
  });
}

ffi::Error FaDecodeImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer query,
                        ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> block_tables,
                        ffi::AnyBuffer int_workspace, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Result<ffi::Buffer<ffi::F32>> lse,
                        ffi::Result<ffi::AnyBuffer> float_workspace, std::string_view run_fn,
                        int64_t kv_lora_rank, bool causal, double softmax_scale,
                        ffi::Span<const int64_t> plan_info) {
  return RunFa(stream, device, query, kv_cache, block_tables, int_workspace, *out, *lse,
               *float_workspace, run_fn, kv_lora_rank, causal, softmax_scale, plan_info);
}

// Page-locked host memory, grown on demand.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer() {
    if (data_ != nullptr) cudaFreeHost(data_);
  }

  cudaError_t Reserve(size_t bytes) {
    if (capacity_ >= bytes) return cudaSuccess;
    if (data_ != nullptr) cudaFreeHost(data_);
    data_ = nullptr;
    capacity_ = 0;
    const cudaError_t status = cudaMallocHost(&data_, bytes);
    if (status == cudaSuccess) capacity_ = bytes;
    return status;
  }
  void* data() const { return data_; }

 private:
  void* data_ = nullptr;
  size_t capacity_ = 0;
};

// The self-planning handler's state, one per call site: host staging per device for the seq_lens
// read back and the schedule FlashInfer's planner writes before its upload. An executable that
// runs on several devices at once shares it, hence one staging (and lock) per device.
struct PlanStaging {
  struct Device {
    std::mutex mutex;
    PinnedBuffer seq_lens, schedule;
  };

  static ffi::TypeId id;

  Device& For(int32_t device) {
    std::lock_guard<std::mutex> lock(mutex);
    return devices[device];
  }

  std::mutex mutex;
  std::unordered_map<int32_t, Device> devices;
};

ffi::TypeId PlanStaging::id = {};

ffi::ErrorOr<std::unique_ptr<PlanStaging>> InstantiatePlanStaging() {
  return std::make_unique<PlanStaging>();
}

ffi::Error FaDecodeSelfPlanImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer query,
                                ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> block_tables,
                                ffi::Buffer<ffi::S32> seq_lens, PlanStaging* state,
                                ffi::Result<ffi::AnyBuffer> out,
                                ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                ffi::Result<ffi::AnyBuffer> float_workspace,
                                ffi::Result<ffi::AnyBuffer> int_workspace, std::string_view run_fn,
                                std::string_view plan_fn, int64_t kv_lora_rank, int64_t q_len,
                                bool causal, double softmax_scale,
                                ffi::Span<const int64_t> plan_info) {
  const int64_t batch = seq_lens.element_count();
  const int64_t max_pages = block_tables.dimensions()[1];
  const int64_t heads = query.dimensions()[1];
  auto plan = LookUp(plan_fn);
  if (plan.has_error()) return plan.error();

  PlanStaging::Device& staging = state->For(device);
  std::lock_guard<std::mutex> lock(staging.mutex);
  const size_t int_ws_bytes = int_workspace->size_bytes();
  cudaError_t status = staging.seq_lens.Reserve(batch * sizeof(int32_t));
  if (status == cudaSuccess) status = staging.schedule.Reserve(int_ws_bytes);
  if (status == cudaSuccess) {
    status = cudaMemcpyAsync(staging.seq_lens.data(), seq_lens.typed_data(),
                             batch * sizeof(int32_t), cudaMemcpyDeviceToHost, stream);
  }
  // The sync also retires the previous call's schedule upload from `staging.schedule`.
  if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
  if (status != cudaSuccess) return CudaFailure("reading seq_lens for planning", status);
  const int64_t page_size = kv_cache.dimensions()[1];
  ClampLengths(static_cast<int32_t*>(staging.seq_lens.data()), batch,
               std::min<int64_t>(max_pages * page_size, kMaxKvLen));

  // CSR metadata over the padded block table: request b's pages start at b * max_pages.
  std::vector<int32_t> qo_indptr(batch + 1), kv_indptr(batch + 1);
  for (int64_t b = 0; b <= batch; ++b) {
    qo_indptr[b] = static_cast<int32_t>(b * q_len);
    kv_indptr[b] = static_cast<int32_t>(b * max_pages);
  }
  View qo_view(qo_indptr.data(), kInt32, device, {batch + 1}, {}, 0, kDLCPU);
  View kv_view(kv_indptr.data(), kInt32, device, {batch + 1}, {}, 0, kDLCPU);
  View len_view(staging.seq_lens.data(), kInt32, device, {batch}, {}, 0, kDLCPU);
  View staging_view(staging.schedule.data(), kUInt8, device, {static_cast<int64_t>(int_ws_bytes)},
                    {}, 0, kDLCPU);
  View float_ws(float_workspace->untyped_data(), kUInt8, device,
                {static_cast<int64_t>(float_workspace->size_bytes())});
  View int_ws(int_workspace->untyped_data(), kUInt8, device, {static_cast<int64_t>(int_ws_bytes)});

  int64_t staged_bytes = 0;
  std::vector<int64_t> planned_info;
  ffi::Error planned = Guarded(plan_fn, [&] {
    auto result = (*plan)(&float_ws, &int_ws, &staging_view, &qo_view, &kv_view, &len_view, heads,
                          kv_lora_rank, causal)
                      .cast<tvm::ffi::Tuple<tvm::ffi::Array<int64_t>, int64_t>>();
    for (int64_t v : result.get<0>()) planned_info.push_back(v);
    staged_bytes = result.get<1>();
  });
  if (planned.failure()) return planned;
  if (!std::equal(planned_info.begin(), planned_info.end(), plan_info.begin(), plan_info.end())) {
    return ffi::Error::Internal(
        "jax_mla: FlashInfer's plan_info differs from the one jax_mla derived at trace time "
        "(SM count or FlashInfer version mismatch)");
  }
  status = cudaMemcpyAsync(int_workspace->untyped_data(), staging.schedule.data(), staged_bytes,
                           cudaMemcpyHostToDevice, stream);
  if (status != cudaSuccess) return CudaFailure("uploading the schedule", status);
  return RunFa(stream, device, query, kv_cache, block_tables, *int_workspace, *out, *lse,
               *float_workspace, run_fn, kv_lora_rank, causal, softmax_scale, plan_info);
}

// A device buffer lent to a callee that takes an owning tvm::ffi::Tensor: the Tensor frees nothing.
struct BorrowedData {
  void* data;
  void AllocData(DLTensor* tensor) { tensor->data = data; }
  void FreeData(DLTensor*) {}
};

// trtllm-gen's softmax scale: a number, or a device float32 [1] holding it times log2(e).
using Bmm1Scale = tvm::ffi::Variant<double, tvm::ffi::Tensor>;

// trtllm-gen MLA decode (FlashInfer's trtllm_paged_attention_decode), bf16 out; query and cache
// both bf16, or both e4m3.
//   query [B, q_len, H, D]; kv_cache [P, page_size, D]; block_tables [B, max_pages]; seq_lens [B];
//   counter: multi-CTA counter buffer, zeroed once by jax_mla (the kernel leaves it zeroed).
//   out [B, q_len, H, kv_lora_rank]; lse f32 [B, q_len, H]; workspace: scratch.
ffi::Error RunTrtllm(cudaStream_t stream, int32_t device, ffi::AnyBuffer query,
                     ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> block_tables,
                     ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::U8> counter,
                     ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                     ffi::Result<ffi::Buffer<ffi::U8>> workspace, std::string_view decode_fn,
                     int64_t kv_lora_rank, int64_t max_seq_len, const Bmm1Scale& bmm1_scale,
                     double output_scale, int64_t sm_count, bool enable_pdl) {
  auto q_dims = query.dimensions();
  auto kv_dims = kv_cache.dimensions();
  if (q_dims.size() != 4 || kv_dims.size() != 3) {
    return InvalidArgument("trtllm-gen decode expects query [B, q_len, H, D], kv_cache [P, page, D]");
  }
  const int64_t batch = q_dims[0], q_len = q_dims[1], heads = q_dims[2], dim = q_dims[3];
  const int64_t pages = kv_dims[0], page_size = kv_dims[1];
  auto fn = LookUp(decode_fn);
  if (fn.has_error()) return fn.error();

  const DLDataType q_type = ToDLDataType(query.element_type());
  View q_flat(query.untyped_data(), q_type, device, {batch * q_len, heads, dim});
  View kv4(kv_cache.untyped_data(), ToDLDataType(kv_cache.element_type()), device,
           {pages, 1, page_size, dim});
  View o(out->untyped_data(), ToDLDataType(out->element_type()), device,
         {batch * q_len, heads, kv_lora_rank});
  View lse_view(lse->untyped_data(), kFloat32, device, {batch * q_len, heads});
  View ws(workspace->untyped_data(), kUInt8, device,
          {static_cast<int64_t>(workspace->element_count())});
  View counter_view(counter.untyped_data(), kUInt8, device,
                    {static_cast<int64_t>(counter.element_count())});
  View tables(block_tables.untyped_data(), kInt32, device,
              {block_tables.dimensions()[0], block_tables.dimensions()[1]});
  View lens(seq_lens.untyped_data(), kInt32, device, {batch});

  EnvStreamScope scope(device, stream);
  return Guarded(decode_fn, [&] {
    (*fn)(&o, /*out_scale_factor=*/nullptr, &q_flat, &kv4, &kv4, &ws, &counter_view, &tables, &lens,
          /*max_q_len=*/q_len, /*max_kv_len=*/max_seq_len, bmm1_scale,
          /*bmm2_scale=*/output_scale, /*o_sf_scale=*/-1.0, /*o_sf_vec_size=*/int64_t{-1},
          /*o_sf_start_index=*/int64_t{0}, batch, /*window_left=*/int64_t{-1},
          /*sparse_mla_top_k=*/int64_t{0}, sm_count, enable_pdl,
          static_cast<int64_t>(workspace->element_count()),
          /*attention_sinks=*/nullptr, /*cum_seq_lens_q=*/nullptr, /*key_block_scales=*/nullptr,
          /*value_block_scales=*/nullptr, /*skip_softmax_threshold_scale_factor=*/nullptr,
          /*uses_shared_paged_kv_idx=*/true, &lse_view, kTrtllmLseScale,
          /*lse_stride_tokens=*/heads, /*lse_stride_heads=*/int64_t{1},
          /*enable_block_sparse_attention=*/false, /*sparse_mla_top_k_lens=*/nullptr,
          /*bf16q_fp8kv_transform_mode=*/int64_t{0}, /*use_fp16_softmax=*/nullptr);
  });
}

ffi::Error TrtllmDecodeImpl(cudaStream_t stream, int32_t device, ffi::AnyBuffer query,
                            ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> block_tables,
                            ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::U8> counter,
                            ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
                            ffi::Result<ffi::Buffer<ffi::U8>> workspace, std::string_view decode_fn,
                            int64_t kv_lora_rank, int64_t max_seq_len, double output_scale,
                            int64_t sm_count, bool enable_pdl, double softmax_scale) {
  return RunTrtllm(stream, device, query, kv_cache, block_tables, seq_lens, counter, out, lse,
                   workspace, decode_fn, kv_lora_rank, max_seq_len, Bmm1Scale(softmax_scale),
                   output_scale, sm_count, enable_pdl);
}

// The e4m3 cache: query e4m3 too; softmax_scale_log2 f32 [1] on the device holds the softmax scale
// (the query's and the cache's scales included) times log2(e).
ffi::Error TrtllmDecodeFp8Impl(cudaStream_t stream, int32_t device, ffi::AnyBuffer query,
                               ffi::AnyBuffer kv_cache, ffi::Buffer<ffi::S32> block_tables,
                               ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::U8> counter,
                               ffi::Buffer<ffi::F32> softmax_scale_log2,
                               ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::Buffer<ffi::F32>> lse,
                               ffi::Result<ffi::Buffer<ffi::U8>> workspace,
                               std::string_view decode_fn, int64_t kv_lora_rank,
                               int64_t max_seq_len, double output_scale, int64_t sm_count,
                               bool enable_pdl) {
  if (query.element_type() != ffi::DataType::F8E4M3FN ||
      kv_cache.element_type() != ffi::DataType::F8E4M3FN ||
      softmax_scale_log2.element_count() != 1) {
    return InvalidArgument("trtllm-gen fp8 decode expects an e4m3 query and cache and one float32 "
                           "softmax scale");
  }
  const int64_t one = 1;
  tvm::ffi::Tensor scale = tvm::ffi::Tensor::FromNDAlloc(
      BorrowedData{softmax_scale_log2.untyped_data()}, tvm::ffi::ShapeView(&one, 1), kFloat32,
      DLDevice{kDLCUDA, device});
  return RunTrtllm(stream, device, query, kv_cache, block_tables, seq_lens, counter, out, lse,
                   workspace, decode_fn, kv_lora_rank, max_seq_len, Bmm1Scale(scale),
                   output_scale, sm_count, enable_pdl);
}

// What every decode handler binds first: the stream and device, then the query (fa: [N, H, D];
// trtllm: [B, q_len, H, D]), the paged kv_cache and the block_tables.
auto PagedDecodeBinding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>();
}

// trtllm-gen's operands after those: seq_lens and the multi-CTA counter.
auto TrtllmOperands() {
  return PagedDecodeBinding().Arg<ffi::Buffer<ffi::S32>>().Arg<ffi::Buffer<ffi::U8>>();
}

// trtllm-gen's results (out, lse, workspace) and the attributes both of its handlers take.
template <typename Binding>
auto TrtllmResultsAndAttributes(Binding operands) {
  return std::move(operands)
      .template Ret<ffi::AnyBuffer>()
      .template Ret<ffi::Buffer<ffi::F32>>()
      .template Ret<ffi::Buffer<ffi::U8>>()
      .template Attr<std::string_view>("decode_fn")
      .template Attr<int64_t>("kv_lora_rank")
      .template Attr<int64_t>("max_seq_len")
      .template Attr<double>("output_scale")
      .template Attr<int64_t>("sm_count")
      .template Attr<bool>("enable_pdl");
}

}  // namespace
}  // namespace jax_mla

// For jax.ffi.register_ffi_type, before the self-planning target is registered.
extern "C" XLA_FFI_TypeId* JaxMlaPlanStagingTypeId() { return &jax_mla::PlanStaging::id; }

extern "C" const XLA_FFI_TypeInfo* JaxMlaPlanStagingTypeInfo() {
  static const XLA_FFI_TypeInfo info = {
      XLA_FFI_TypeInfo_STRUCT_SIZE, /*extension_start=*/nullptr,
      /*deleter=*/[](void* state) { delete static_cast<jax_mla::PlanStaging*>(state); }};
  return &info;
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaFaDecode, jax_mla::FaDecodeImpl,
                              jax_mla::PagedDecodeBinding()
                                  .Arg<ffi::AnyBuffer>()          // int_workspace (the plan)
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse
                                  .Ret<ffi::AnyBuffer>()          // float_workspace
                                  .Attr<std::string_view>("run_fn")
                                  .Attr<int64_t>("kv_lora_rank")
                                  .Attr<bool>("causal")
                                  .Attr<double>("softmax_scale")
                                  .Attr<ffi::Span<const int64_t>>("plan_info"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaFaDecodeSelfPlanInstantiate, jax_mla::InstantiatePlanStaging,
                              ffi::Ffi::BindInstantiate());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaFaDecodeSelfPlan, jax_mla::FaDecodeSelfPlanImpl,
                              jax_mla::PagedDecodeBinding()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // seq_lens
                                  .Ctx<ffi::State<jax_mla::PlanStaging>>()
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Ret<ffi::Buffer<ffi::F32>>()   // lse
                                  .Ret<ffi::AnyBuffer>()          // float_workspace
                                  .Ret<ffi::AnyBuffer>()          // int_workspace
                                  .Attr<std::string_view>("run_fn")
                                  .Attr<std::string_view>("plan_fn")
                                  .Attr<int64_t>("kv_lora_rank")
                                  .Attr<int64_t>("q_len")
                                  .Attr<bool>("causal")
                                  .Attr<double>("softmax_scale")
                                  .Attr<ffi::Span<const int64_t>>("plan_info"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaTrtllmDecode, jax_mla::TrtllmDecodeImpl,
                              jax_mla::TrtllmResultsAndAttributes(jax_mla::TrtllmOperands())
                                  .Attr<double>("softmax_scale"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMlaTrtllmDecodeFp8, jax_mla::TrtllmDecodeFp8Impl,
                              jax_mla::TrtllmResultsAndAttributes(
                                  jax_mla::TrtllmOperands()
                                      .Arg<ffi::Buffer<ffi::F32>>()),  // softmax scale * log2(e)
                              {ffi::Traits::kCmdBufferCompatible});
