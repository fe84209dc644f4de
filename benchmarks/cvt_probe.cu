// How fast an SM turns e4m3 values times a power-of-two scale into bf16, by method: a design probe
// for the fp8 cache's conversions (docs/fp8-cache.md, "What else remains of issue 15"). The
// question is whether the conversion instruction (cvt.rn.f16x2.e4m3x2) and a bit-field
// construction issue to different pipes, so that sending some pairs each way converts faster
// than either alone. No jax_mla kernel runs here; the kernels' conversion function does.
//
// As the kernels' DequantiseRow does, each thread loads 16 e4m3 values (16 bytes) from shared
// memory, converts them and stores the 16 bf16 (32 bytes) to shared memory, four such units per
// loop iteration, from an input region that moves every iteration. Methods:
//   copy       no conversion: the raw bytes stored twice (the loads' and stores' own cost)
//   cvt        the kernels' conversion of each pair (E4m3x2ToBf16x2 in ffi/sm90/fp8_convert.cuh:
//              cvt to f16 pairs, to float, packed into bf16, one bf16 multiply by the scale)
//   bits       E4m3x2ToBf16x2TimesTwoToMinus120 (benchmarks/e4m3_bits.h: byte permute, shift,
//              mask) and one bf16 multiply by the scale times 2^120
//   bits k/8   k of each unit's 8 pairs by bits, the others by cvt (k = 2, 4, 6)
//   f16        cvt to f16 pairs and one f16 multiply (f16 out: as the register-operand kernels
//              convert, and the branch fp8-tiles-f16)
//   f16 bits   E4m3x2ToF16x2TimesTwoToMinus8 and one f16 multiply by the scale times 2^8
//   f16 bits 4/8  half of each unit's pairs each way
// Before any timing, bits is checked against cvt bit for bit on all 64,516 byte pairs of finite
// values, in both halves of a word, at scales 2^-126 (the smallest write_kv writes; subnormal
// products), 2^-20, 1 and 2^7 (the largest whose product with 2^120 is a finite bf16), and f16
// bits against f16 at scales 2^-10, 1 and 2^7.
//
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I. -I<cutlass>/include \
//        --expt-relaxed-constexpr benchmarks/cvt_probe.cu -o .gpu/cvt_probe
//   .gpu/cvt_probe [ITERS] [CTAS_PER_SM]   # defaults 2048 and as many as fit; 1 CTA of 256
//                                          # threads is the kernels' two consumer warpgroups
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "check_cuda.h"
#include "e4m3_bits.h"
#include "ffi/sm90/fp8_convert.cuh"

constexpr int kThreads = 256;
constexpr int kUnitsPerIteration = 4;
constexpr int kInputUnits = 1024;  // 16 KB of e4m3 values in shared memory, a power of two
// Methods besides kBitsPairs = 0 (cvt) .. 8 (bits).
constexpr int kCopy = -1, kF16 = -2, kF16Bits = -3, kF16Mixed = -4;

__device__ __forceinline__ uint32_t Bits(__nv_bfloat162 v) {
  return *reinterpret_cast<const uint32_t*>(&v);
}

__device__ __forceinline__ __nv_bfloat162 AsBf16x2(uint32_t bits) {
  return *reinterpret_cast<const __nv_bfloat162*>(&bits);
}

// Half `half` (bytes 2 half, 2 half + 1) of `word` by the kernels' conversion.
__device__ __forceinline__ uint32_t ViaCvt(uint32_t word, int half, __nv_bfloat162 scale2) {
  return jax_mla::sm90::detail::E4m3x2ToBf16x2(word >> (16 * half), scale2);
}

// scale2_2p120: the scale times 2^120 in both halves.
__device__ __forceinline__ uint32_t ViaBits(uint32_t word, int half, __nv_bfloat162 scale2_2p120) {
  return Bits(__hmul2(AsBf16x2(E4m3x2ToBf16x2TimesTwoToMinus120(word, half)), scale2_2p120));
}

__device__ __forceinline__ uint32_t ViaF16(uint32_t word, int half, __half2 scale2) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
      static_cast<__nv_fp8x2_storage_t>(word >> (16 * half)), __NV_E4M3);
  const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&h), scale2);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// scale2_2p8: the scale times 2^8 in both halves.
__device__ __forceinline__ uint32_t ViaF16Bits(uint32_t word, int half, __half2 scale2_2p8) {
  const uint32_t bits = E4m3x2ToF16x2TimesTwoToMinus8(word, half);
  const __half2 v = __hmul2(*reinterpret_cast<const __half2*>(&bits), scale2_2p8);
  return *reinterpret_cast<const uint32_t*>(&v);
}

struct Scales {
  __nv_bfloat162 bf16, bf16_2p120;
  __half2 f16, f16_2p8;
};

// Pair p (< 8) of a 16-byte unit by kMethod: the last kMethod pairs by bits, the others by cvt.
template <int kMethod>
__device__ __forceinline__ uint32_t ConvertPair(const uint32_t (&w)[4], int p, const Scales& s) {
  const uint32_t word = w[p / 2];
  if (kMethod == kCopy) return word;
  if (kMethod == kF16) return ViaF16(word, p % 2, s.f16);
  if (kMethod == kF16Bits || (kMethod == kF16Mixed && p % 2 == 1)) {
    return ViaF16Bits(word, p % 2, s.f16_2p8);
  }
  if (kMethod == kF16Mixed) return ViaF16(word, p % 2, s.f16);
  return p >= 8 - kMethod ? ViaBits(word, p % 2, s.bf16_2p120) : ViaCvt(word, p % 2, s.bf16);
}

template <int kMethod>
__global__ void __launch_bounds__(kThreads) ConvertKernel(int iters, uint32_t seed, uint32_t* sink,
                                                          long long* cycles) {
  __shared__ uint4 in[kInputUnits];
  __shared__ uint4 out_lo[kUnitsPerIteration * kThreads], out_hi[kUnitsPerIteration * kThreads];
  const Scales s{__float2bfloat162_rn(0.25f), __float2bfloat162_rn(0.25f * 0x1p120f),
                 __float2half2_rn(0.25f), __float2half2_rn(0.25f * 0x1p8f)};
  uint32_t x = seed ^ (blockIdx.x * kThreads + threadIdx.x) * 0x9E3779B9u;
  for (int u = threadIdx.x; u < kInputUnits; u += kThreads) {
    uint32_t w[4];
    for (uint32_t& v : w) v = x = x * 1664525u + 1013904223u;
    in[u] = make_uint4(w[0], w[1], w[2], w[3]);
  }
  __syncthreads();
  const long long start = clock64();
  for (int i = 0; i < iters; ++i) {
#pragma unroll
    for (int j = 0; j < kUnitsPerIteration; ++j) {
      const uint4 raw = in[(threadIdx.x + (i * kUnitsPerIteration + j) * kThreads) &
                           (kInputUnits - 1)];
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
      uint32_t c[8];
#pragma unroll
      for (int p = 0; p < 8; ++p) c[p] = ConvertPair<kMethod>(w, p, s);
      out_lo[j * kThreads + threadIdx.x] = make_uint4(c[0], c[1], c[2], c[3]);
      out_hi[j * kThreads + threadIdx.x] = make_uint4(c[4], c[5], c[6], c[7]);
    }
    asm volatile("" ::: "memory");  // every iteration's stores happen
  }
  __syncthreads();
  const long long stop = clock64();
  const uint4 a = out_lo[threadIdx.x], b = out_hi[threadIdx.x];
  sink[blockIdx.x * kThreads + threadIdx.x] = a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
  if (threadIdx.x == 0) cycles[blockIdx.x] = stop - start;
}

// counts[2 s]: byte pairs of finite e4m3 values compared at scale s; counts[2 s + 1]: those where
// bits (the pair in bytes 0-1 of a word, and in bytes 2-3) and cvt differ; s = 4..6 the same for
// f16 bits against f16.
__global__ void CheckBitsKernel(int* counts) {
  const uint32_t pair = blockIdx.x * blockDim.x + threadIdx.x;  // 0 .. 65535
  if ((pair & 0x7F) == 0x7F || ((pair >> 8) & 0x7F) == 0x7F) return;  // a NaN byte
  const float scales[4] = {0x1p-126f, 0x1p-20f, 1.f, 0x1p7f};
  for (int s = 0; s < 4; ++s) {
    const uint32_t want = ViaCvt(pair, 0, __float2bfloat162_rn(scales[s]));
    const __nv_bfloat162 scale2_2p120 = __float2bfloat162_rn(scales[s] * 0x1p120f);
    const uint32_t low = ViaBits(pair | 0xA5A50000u, 0, scale2_2p120);
    const uint32_t high = ViaBits((pair << 16) | 0x5A5Au, 1, scale2_2p120);
    atomicAdd(&counts[2 * s], 1);
    if (want != low || want != high) atomicAdd(&counts[2 * s + 1], 1);
  }
  const float f16_scales[3] = {0x1p-10f, 1.f, 0x1p7f};
  for (int s = 0; s < 3; ++s) {
    const uint32_t want = ViaF16(pair, 0, __float2half2_rn(f16_scales[s]));
    const __half2 scale2_2p8 = __float2half2_rn(f16_scales[s] * 0x1p8f);
    const uint32_t low = ViaF16Bits(pair | 0xA5A50000u, 0, scale2_2p8);
    const uint32_t high = ViaF16Bits((pair << 16) | 0x5A5Au, 1, scale2_2p8);
    atomicAdd(&counts[2 * (4 + s)], 1);
    if (want != low || want != high) atomicAdd(&counts[2 * (4 + s) + 1], 1);
  }
}

struct Kernel {
  const char* name;
  const void* fn;
};

int main(int argc, char** argv) {
  const int iters = argc > 1 ? atoi(argv[1]) : 2048;
  const int ctas_per_sm = argc > 2 ? atoi(argv[2]) : 0;
  int sms = 0, clock_khz = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK_CUDA(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));

  constexpr int kChecks = 7;
  int* counts;
  CHECK_CUDA(cudaMalloc(&counts, 2 * kChecks * sizeof(int)));
  CHECK_CUDA(cudaMemset(counts, 0, 2 * kChecks * sizeof(int)));
  CheckBitsKernel<<<256, 256>>>(counts);
  CHECK_CUDA(cudaGetLastError());
  int host_counts[2 * kChecks];
  CHECK_CUDA(cudaMemcpy(host_counts, counts, sizeof(host_counts), cudaMemcpyDeviceToHost));
  const char* check_names[kChecks] = {"bf16 2^-126", "bf16 2^-20", "bf16 1", "bf16 2^7",
                                      "f16 2^-10", "f16 1", "f16 2^7"};
  bool bits_exact = true;
  printf("bits against cvt, byte pairs of finite values compared / differing, per scale:");
  for (int c = 0; c < kChecks; ++c) {
    printf(" %s %d/%d", check_names[c], host_counts[2 * c], host_counts[2 * c + 1]);
    bits_exact = bits_exact && host_counts[2 * c] == 254 * 254 && host_counts[2 * c + 1] == 0;
  }
  printf("\n");

  const Kernel kernels[] = {
      {"copy", reinterpret_cast<const void*>(&ConvertKernel<kCopy>)},
      {"cvt", reinterpret_cast<const void*>(&ConvertKernel<0>)},
      {"bits 2/8", reinterpret_cast<const void*>(&ConvertKernel<2>)},
      {"bits 4/8", reinterpret_cast<const void*>(&ConvertKernel<4>)},
      {"bits 6/8", reinterpret_cast<const void*>(&ConvertKernel<6>)},
      {"bits", reinterpret_cast<const void*>(&ConvertKernel<8>)},
      {"f16", reinterpret_cast<const void*>(&ConvertKernel<kF16>)},
      {"f16 bits 4/8", reinterpret_cast<const void*>(&ConvertKernel<kF16Mixed>)},
      {"f16 bits", reinterpret_cast<const void*>(&ConvertKernel<kF16Bits>)},
  };
  printf("# %d SMs, peak clock %d MHz, %d iterations of %d units (16 values each) a thread\n", sms,
         clock_khz / 1000, iters, kUnitsPerIteration);
  printf("| method | CTAs per SM | values per clock and SM | ms |\n|---|---|---|---|\n");
  for (const Kernel& k : kernels) {
    int fit = 0;  // all CTAs resident at once, so that the mean CTA span is the run's
    CHECK_CUDA(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&fit, k.fn, kThreads, 0));
    const int per_sm = ctas_per_sm > 0 && ctas_per_sm < fit ? ctas_per_sm : fit;
    const int ctas = per_sm * sms;
    uint32_t* sink;
    long long* cycles;
    CHECK_CUDA(cudaMalloc(&sink, static_cast<size_t>(ctas) * kThreads * sizeof(uint32_t)));
    CHECK_CUDA(cudaMalloc(&cycles, ctas * sizeof(long long)));
    int n = iters;
    uint32_t seed = 12345;
    void* args[] = {&n, &seed, &sink, &cycles};
    cudaEvent_t start, stop;
    CHECK_CUDA(cudaEventCreate(&start));
    CHECK_CUDA(cudaEventCreate(&stop));
    CHECK_CUDA(cudaLaunchKernel(k.fn, dim3(ctas), dim3(kThreads), args, 0, nullptr));  // warm-up
    CHECK_CUDA(cudaEventRecord(start));
    CHECK_CUDA(cudaLaunchKernel(k.fn, dim3(ctas), dim3(kThreads), args, 0, nullptr));
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float ms = 0.f;
    CHECK_CUDA(cudaEventElapsedTime(&ms, start, stop));
    std::vector<long long> host_cycles(ctas);
    CHECK_CUDA(cudaMemcpy(host_cycles.data(), cycles, ctas * sizeof(long long),
                          cudaMemcpyDeviceToHost));
    double mean_cycles = 0;
    for (long long c : host_cycles) mean_cycles += static_cast<double>(c) / ctas;
    const double values_per_cta = static_cast<double>(iters) * kUnitsPerIteration * 16 * kThreads;
    printf("| %s | %d | %.1f | %.3f |\n", k.name, per_sm, values_per_cta * per_sm / mean_cycles,
           ms);
    CHECK_CUDA(cudaFree(sink));
    CHECK_CUDA(cudaFree(cycles));
    CHECK_CUDA(cudaEventDestroy(start));
    CHECK_CUDA(cudaEventDestroy(stop));
  }
  return bits_exact ? 0 : 1;
}
