// A stand-in for FlashInfer's trtllm_paged_attention_decode with the very same TVM-FFI signature,
// for testing jax_mla's trtllm-gen handler on GPUs that cannot run the real (SM100/SM103) kernel.
//
// Registered as the TVM-FFI global "jax_mla.test.trtllm_double" when the library loads. It records
// what it receives (readable as text through "jax_mla.test.trtllm_double_record") and writes
// outputs that prove the views alias the right memory, on the stream TVM-FFI reports:
//   out[t, h, :] = query[t, h, :kv_lora_rank] (an e4m3 query converted to bf16, exactly)
//   lse[t, h] = seq_lens[t / max_q_len] + h
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <sstream>
#include <string>
#include <vector>

#include "tvm/ffi/container/tensor.h"
#include "tvm/ffi/container/variant.h"
#include "tvm/ffi/extra/c_env_api.h"
#include "tvm/ffi/function.h"
#include "tvm/ffi/optional.h"
#include "tvm/ffi/reflection/registry.h"
#include "tvm/ffi/string.h"

using tvm::ffi::Optional;
using tvm::ffi::Tensor;
using tvm::ffi::TensorView;
using tvm::ffi::Variant;

namespace {

std::string g_record;

__global__ void FillLse(float* lse, const int* seq_lens, int q_len, int heads, int tokens,
                        long stride_tokens, long stride_heads) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= tokens * heads) return;
  int t = i / heads, h = i % heads;
  lse[t * stride_tokens + h * stride_heads] = static_cast<float>(seq_lens[t / q_len] + h);
}

__global__ void E4m3RowsToBf16(__nv_bfloat16* out, const __nv_fp8_e4m3* query, int rows, int rank,
                               int dim) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= rows * rank) return;
  out[i] = __float2bfloat16(static_cast<float>(query[(i / rank) * dim + i % rank]));
}

void Describe(std::ostringstream& os, const char* name, const TensorView& t) {
  os << name << " shape";
  for (int i = 0; i < t.ndim(); ++i) os << ' ' << t.size(i);
  os << " strides";
  for (int i = 0; i < t.ndim(); ++i) os << ' ' << t.stride(i);
  os << " dtype " << int(t.dtype().code) << ':' << int(t.dtype().bits) << '\n';
}

// A scale given as a number, or as a device float32 [1] (read back here; -1 for anything else).
double Scalar(const Variant<double, Tensor>& v, cudaStream_t stream) {
  if (auto value = v.as<double>()) return *value;
  auto tensor = v.as<Tensor>();
  if (!tensor || tensor->numel() != 1 || tensor->dtype().bits != 32) return -1.0;
  float host = 0;
  cudaMemcpyAsync(&host, tensor->data_ptr(), sizeof(float), cudaMemcpyDeviceToHost, stream);
  cudaStreamSynchronize(stream);
  return host;
}

void TrtllmDouble(TensorView out, Optional<TensorView> out_scale_factor, TensorView query,
                  TensorView key_cache, TensorView value_cache, TensorView workspace,
                  TensorView counter, TensorView block_tables, TensorView seq_lens,
                  int64_t max_q_len, int64_t max_kv_len, Variant<double, Tensor> bmm1_scale,
                  Variant<double, Tensor> bmm2_scale, double o_sf_scale, int64_t o_sf_vec_size,
                  int64_t o_sf_start_index, int64_t batch_size, int64_t window_left,
                  int64_t sparse_mla_top_k, int64_t sm_count, bool enable_pdl,
                  int64_t workspace_size, Optional<TensorView> attention_sinks,
                  Optional<TensorView> cum_seq_lens_q, Optional<TensorView> key_block_scales,
                  Optional<TensorView> value_block_scales,
                  Optional<float> skip_softmax_threshold_scale_factor,
                  Optional<bool> uses_shared_paged_kv_idx, Optional<TensorView> lse,
                  double lse_scale, int64_t lse_stride_tokens, int64_t lse_stride_heads,
                  bool enable_block_sparse_attention, Optional<TensorView> sparse_mla_top_k_lens,
                  int64_t bf16q_fp8kv_transform_mode, Optional<bool> use_fp16_softmax) {
  cudaStream_t stream = static_cast<cudaStream_t>(
      TVMFFIEnvGetStream(kDLCUDA, query.device().device_id));
  std::vector<unsigned char> counter_host(counter.size(0));
  cudaMemcpyAsync(counter_host.data(), counter.data_ptr(), counter_host.size(),
                  cudaMemcpyDeviceToHost, stream);
  cudaStreamSynchronize(stream);
  bool counter_zero = true;
  for (unsigned char c : counter_host) counter_zero &= c == 0;

  std::ostringstream os;
  Describe(os, "out", out);
  Describe(os, "query", query);
  Describe(os, "key_cache", key_cache);
  Describe(os, "workspace", workspace);
  Describe(os, "counter", counter);
  Describe(os, "block_tables", block_tables);
  Describe(os, "seq_lens", seq_lens);
  if (lse.has_value()) Describe(os, "lse", lse.value());
  os << "same_kv " << (key_cache.data_ptr() == value_cache.data_ptr()) << '\n'
     << "counter_zero " << counter_zero << '\n'
     << "scalars " << max_q_len << ' ' << max_kv_len << ' ' << Scalar(bmm1_scale, stream) << ' '
     << Scalar(bmm2_scale, stream) << ' ' << o_sf_scale << ' ' << o_sf_vec_size << ' '
     << o_sf_start_index << ' ' << batch_size << ' ' << window_left << ' ' << sparse_mla_top_k << ' ' << sm_count
     << ' ' << enable_pdl << ' ' << workspace_size << ' ' << lse_scale << ' ' << lse_stride_tokens
     << ' ' << lse_stride_heads << ' ' << enable_block_sparse_attention << ' '
     << bf16q_fp8kv_transform_mode << '\n'
     << "absent " << !out_scale_factor.has_value() << !attention_sinks.has_value()
     << !cum_seq_lens_q.has_value() << !key_block_scales.has_value()
     << !value_block_scales.has_value() << !skip_softmax_threshold_scale_factor.has_value()
     << !sparse_mla_top_k_lens.has_value() << !use_fp16_softmax.has_value() << '\n'
     << "shared_paged_kv_idx " << uses_shared_paged_kv_idx.value_or(false) << '\n'
     << "bmm1_on_device " << bmm1_scale.as<Tensor>().has_value() << '\n';
  g_record = os.str();

  const int64_t tokens = query.size(0), heads = query.size(1), rank = out.size(2);
  if (query.dtype().bits == 8) {
    const int total = static_cast<int>(tokens * heads * rank);
    E4m3RowsToBf16<<<(total + 255) / 256, 256, 0, stream>>>(
        static_cast<__nv_bfloat16*>(out.data_ptr()),
        static_cast<const __nv_fp8_e4m3*>(query.data_ptr()), static_cast<int>(tokens * heads),
        static_cast<int>(rank), static_cast<int>(query.size(2)));
  } else {
    cudaMemcpy2DAsync(out.data_ptr(), rank * 2, query.data_ptr(), query.size(2) * 2, rank * 2,
                      tokens * heads, cudaMemcpyDeviceToDevice, stream);
  }
  if (lse.has_value()) {
    int total = static_cast<int>(tokens * heads);
    FillLse<<<(total + 255) / 256, 256, 0, stream>>>(
        static_cast<float*>(lse.value().data_ptr()), static_cast<const int*>(seq_lens.data_ptr()),
        static_cast<int>(max_q_len), static_cast<int>(heads), static_cast<int>(tokens),
        lse_stride_tokens, lse_stride_heads);
  }
}

tvm::ffi::String Record() { return g_record; }

}  // namespace

TVM_FFI_STATIC_INIT_BLOCK() {
  tvm::ffi::reflection::GlobalDef()
      .def("jax_mla.test.trtllm_double", TrtllmDouble)
      .def("jax_mla.test.trtllm_double_record", Record);
}
