// What jax_mla's XLA FFI handlers share: DLTensor views of XLA buffers, TVM-FFI's environment
// stream pointed at XLA's stream, FlashInfer entry points looked up by name, and errors.
#pragma once

#include <cuda_runtime.h>
#include <dlpack/dlpack.h>

#include <cstdint>
#include <exception>
#include <initializer_list>
#include <string>
#include <string_view>

#include "tvm/ffi/container/tensor.h"
#include "tvm/ffi/extra/c_env_api.h"
#include "tvm/ffi/function.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_mla {

constexpr int kMaxRank = 4;

// A DLTensor that owns its shape and strides. Not copyable: `tensor` points into the object.
struct View {
  DLTensor tensor{};
  int64_t shape[kMaxRank]{};
  int64_t strides[kMaxRank]{};

  View(void* data, DLDataType dtype, int32_t device, std::initializer_list<int64_t> dims,
       std::initializer_list<int64_t> element_strides = {}, uint64_t byte_offset = 0,
       DLDeviceType device_type = kDLCUDA) {
    int rank = 0;
    for (int64_t d : dims) shape[rank++] = d;
    if (element_strides.size() == 0) {
      int64_t stride = 1;
      for (int i = rank - 1; i >= 0; --i) {
        strides[i] = stride;
        stride *= shape[i];
      }
    } else {
      int i = 0;
      for (int64_t s : element_strides) strides[i++] = s;
    }
    // FlashInfer reads TensorView::data_ptr(), which ignores byte_offset: fold it into the pointer.
    tensor.data = static_cast<char*>(data) + byte_offset;
    tensor.device = DLDevice{device_type, device_type == kDLCUDA ? device : 0};
    tensor.ndim = rank;
    tensor.dtype = dtype;
    tensor.shape = shape;
    tensor.strides = strides;
    tensor.byte_offset = 0;
  }
  View(const View&) = delete;
  View& operator=(const View&) = delete;
  DLTensor* operator&() { return &tensor; }
};

inline DLDataType ToDLDataType(ffi::DataType dtype) {
  switch (dtype) {
    case ffi::DataType::BF16: return {kDLBfloat, 16, 1};
    case ffi::DataType::F16: return {kDLFloat, 16, 1};
    case ffi::DataType::F32: return {kDLFloat, 32, 1};
    case ffi::DataType::S32: return {kDLInt, 32, 1};
    case ffi::DataType::U8: return {kDLUInt, 8, 1};
    case ffi::DataType::F8E4M3FN: return {kDLFloat8_e4m3fn, 8, 1};
    default: return {kDLOpaqueHandle, 0, 0};
  }
}

constexpr DLDataType kInt32 = {kDLInt, 32, 1};
constexpr DLDataType kUInt8 = {kDLUInt, 8, 1};
constexpr DLDataType kFloat32 = {kDLFloat, 32, 1};

// Points TVM-FFI's per-device environment stream at XLA's stream for one call.
class EnvStreamScope {
 public:
  EnvStreamScope(int32_t device, cudaStream_t stream) : device_(device) {
    TVMFFIEnvSetStream(kDLCUDA, device_, stream, &previous_);
  }
  ~EnvStreamScope() { TVMFFIEnvSetStream(kDLCUDA, device_, previous_, nullptr); }
  EnvStreamScope(const EnvStreamScope&) = delete;
  EnvStreamScope& operator=(const EnvStreamScope&) = delete;

 private:
  int32_t device_;
  TVMFFIStreamHandle previous_ = nullptr;
};

inline ffi::Error InvalidArgument(const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, "jax_mla: " + message);
}

inline ffi::Error CudaFailure(std::string_view what, cudaError_t status) {
  return ffi::Error::Internal("jax_mla: " + std::string(what) + " failed: " +
                              cudaGetErrorString(status));
}

// The error of the last kernel launch, if any.
inline ffi::Error LaunchStatus(std::string_view what) {
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return CudaFailure(std::string(what) + " launch", status);
  return ffi::Error::Success();
}

// Looks up a FlashInfer entry point registered by jax_mla's Python side.
inline ffi::ErrorOr<tvm::ffi::Function> LookUp(std::string_view name) {
  auto fn = tvm::ffi::Function::GetGlobal(name);
  if (!fn.has_value()) {
    return ffi::Unexpected(ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        "jax_mla: FlashInfer entry point '" + std::string(name) +
            "' is not registered; call jax_mla.decode (which loads it) rather than the raw target"));
  }
  return *fn;
}

// Runs `call`, turning TVM-FFI/FlashInfer exceptions and CUDA launch errors into ffi::Error.
template <typename Call>
ffi::Error Guarded(std::string_view what, Call&& call) {
  try {
    call();
  } catch (const std::exception& e) {
    return ffi::Error::Internal("jax_mla: " + std::string(what) + " failed: " + e.what());
  }
  return LaunchStatus(what);
}

}  // namespace jax_mla
