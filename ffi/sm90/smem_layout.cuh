// Shared-memory layout of the SM90 decode kernel and the WGMMA descriptors that read it.
//
// Every 576-wide tile (the query tile and each KV stage) is stored as 9 chunks of 64 columns; a
// chunk holds its rows at 128 bytes each with the 128-byte swizzle that the bulk-tensor copy
// writes (16-byte unit u of row r sits at unit u ^ (r % 8)), so chunks are 1024-byte aligned.
//  - QK^T reads the query (A) and the KV tile (B) K-major: per k step of 16 columns the descriptor
//    start advances 32 bytes inside the chunk, 8-row groups are 1024 bytes apart.
//  - PV reads the same KV tile as V (B) MN-major (transposed view): 64 columns of a chunk are
//    contiguous, chunks are kChunkBytes apart (leading byte offset), 8-token groups 1024 bytes
//    apart (stride byte offset); a k step of 16 tokens advances the start by 2048 bytes.
//  - P (64 rows x 64 tokens, bf16) is one K-major chunk written by the consumer warpgroups.
#pragma once

#include <cstdint>

#include "decode_params.h"

namespace jax_mla {
namespace sm90 {

constexpr int kRowBytes = kChunkCols * 2;                 // 128
constexpr int kChunkBytes = kBlockN * kRowBytes;          // 8192 (64 rows)
constexpr int kTileBytes = kNumChunks * kChunkBytes;      // 73728
constexpr int kHalfTileBytes = kTileBytes / 2;            // bytes of 32 tokens

constexpr int kSmemQ = 0;
constexpr int kSmemKv = kSmemQ + kTileBytes;
constexpr int kSmemP = kSmemKv + kStages * kTileBytes;
constexpr int kSmemRowMax = kSmemP + kChunkBytes;                          // f32 [2][64]
constexpr int kSmemRowSum = kSmemRowMax + kConsumerWarpgroups * kBlockM * 4;  // f32 [2][64]
constexpr int kSmemBarriers = kSmemRowSum + kConsumerWarpgroups * kBlockM * 4;
constexpr int kNumBarriers = 2 * kStages + 2;  // full[kStages], empty[kStages], q_full, q_empty
constexpr int kSmemUsed = kSmemBarriers + kNumBarriers * 8;
constexpr int kSmemAlign = 1024;
constexpr int kSmemBytes = kSmemUsed + kSmemAlign;  // slack to align the base to 1024
static_assert(kSmemBytes <= 232448, "exceeds the 227 KB per-block shared memory of SM90");

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// GMMA shared-memory descriptor, 128-byte swizzle.
__device__ __forceinline__ uint64_t MakeSmemDesc(uint32_t smem_addr, uint32_t leading_bytes,
                                                 uint32_t stride_bytes) {
  uint64_t desc = 0;
  desc |= static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4);
  desc |= static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16;
  desc |= static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32;
  desc |= static_cast<uint64_t>(1) << 62;  // SWIZZLE_128B
  return desc;
}

// K-major operand (rows x 64 columns per chunk): leading offset unused (1), 8-row groups 1024 B.
__device__ __forceinline__ uint64_t KMajorDesc(uint32_t smem_addr) {
  return MakeSmemDesc(smem_addr, 16, 8 * kRowBytes);
}

// MN-major operand (V): 64-column chunks kChunkBytes apart, 8-token groups 1024 B apart.
__device__ __forceinline__ uint64_t MNMajorDesc(uint32_t smem_addr) {
  return MakeSmemDesc(smem_addr, kChunkBytes, 8 * kRowBytes);
}

// Byte offset of element (row, col) inside a 128-byte-swizzled chunk of bf16 (col < 64).
__device__ __forceinline__ uint32_t SwizzledOffset(int row, int col) {
  return row * kRowBytes + ((((col >> 3) ^ (row & 7))) << 4) + ((col & 7) << 1);
}

}  // namespace sm90
}  // namespace jax_mla
