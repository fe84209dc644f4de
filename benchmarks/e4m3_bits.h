// e4m3 values as bf16 or f16 without the conversion instruction: a byte permute that replicates
// each byte's sign into the byte above it, a shift and a mask put the e4m3 fields where bf16's
// or f16's go (benchmarks/cvt_probe.cu times it against cvt.rn.f16x2.e4m3x2). Host and device
// code: on the host the permute is emulated, so that tests/test_e4m3_bits.py checks the
// selectors too.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define JAX_MLA_E4M3_HD __host__ __device__ __forceinline__
#else
#define JAX_MLA_E4M3_HD inline
#endif

// The prmt.b32 selector for bytes 2 half and 2 half + 1 of a word: result bytes (low to high) the
// first byte, its sign replicated, the second byte, its sign replicated (a selector nibble with
// bit 3 set replicates the sign of the byte it names).
JAX_MLA_E4M3_HD uint32_t E4m3PairSelector(int half) { return half == 0 ? 0x9180u : 0xB3A2u; }

// PTX prmt.b32 in its default mode: result byte i is byte (selector nibble i) & 7 of {a, b}
// (a's bytes 0-3, then b's), or with the nibble's bit 3 set that byte's sign bit in all 8 bits.
JAX_MLA_E4M3_HD uint32_t Prmt(uint32_t a, uint32_t b, uint32_t selector) {
#ifdef __CUDA_ARCH__
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
#else
  const uint64_t bytes = static_cast<uint64_t>(b) << 32 | a;
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t nibble = (selector >> (4 * i)) & 0xFu;
    uint32_t byte = static_cast<uint32_t>(bytes >> (8 * (nibble & 7u))) & 0xFFu;
    if (nibble & 8u) byte = (byte & 0x80u) ? 0xFFu : 0u;
    r |= byte << (8 * i);
  }
  return r;
#endif
}

// The e4m3 bytes 2 half and 2 half + 1 of `word` (half 0 or 1; sign, 4 exponent bits of bias 7,
// 3 mantissa bits) as two bf16 (the first byte in the low half) whose values are the e4m3 values
// times 2^-120: after the permute each 16-bit lane holds the byte in its low 8 bits and the sign
// in its high 8, so shifted left by 4 the sign reaches bit 15 and the exponent and mantissa bits
// 10..4; bf16's exponent field then holds the e4m3 one (bias 127 = 7 + 120), and a subnormal
// e4m3 (exponent 0) becomes a subnormal bf16 of the same mantissa. Exact for every finite e4m3
// value; a NaN byte (exponent and mantissa all ones) becomes the finite 480 x 2^-120 of its sign.
// Scaling back takes one bf16 multiply by scale x 2^120, a finite bf16 only for scales up to 2^7.
JAX_MLA_E4M3_HD uint32_t E4m3x2ToBf16x2TimesTwoToMinus120(uint32_t word, int half) {
  return (Prmt(word, 0u, E4m3PairSelector(half)) << 4) & 0x87F087F0u;
}

// As E4m3x2ToBf16x2TimesTwoToMinus120, as two f16 whose values are the e4m3 values times 2^-8:
// shifted left by 7 the exponent and mantissa bits reach bits 13..7 (f16's exponent field holds
// the e4m3 one: bias 15 = 7 + 8) and the sign bit 15. Exact for every finite e4m3 value, subnormals
// becoming f16 subnormals; a NaN byte becomes the finite 480 x 2^-8 of its sign. Scaling back
// takes one f16 multiply by scale x 2^8.
JAX_MLA_E4M3_HD uint32_t E4m3x2ToF16x2TimesTwoToMinus8(uint32_t word, int half) {
  return (Prmt(word, 0u, E4m3PairSelector(half)) << 7) & 0xBF80BF80u;
}
