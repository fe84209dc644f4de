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

constexpr int kNumBarriers = 2 * kStages + 2;  // full[kStages], empty[kStages], q_full, q_empty
constexpr int kSmemAlign = 1024;
constexpr int kMaxSmemBytes = 232448;  // per block on SM90 (227 KB)

// fp8 cache: a staged 64-token block of raw cache rows (docs/fp8-cache.md), and the exchange area
// of the transposed scores' partial S^T (two warpgroups x kFp8MaxRows / 8 slots of 128 x 16 bytes).
constexpr int kFp8StageBytes = kBlockN * kFp8RowBytes;  // 41984
constexpr int kFp8HalfStageBytes = kFp8StageBytes / 2;  // 32 tokens, one bulk copy
constexpr int kFp8ExchangeBytes = kConsumerWarpgroups * (kFp8MaxRows / 8) * 128 * 16;

// Byte offsets of the regions of one DecodeKernel instantiation, from the 1024-aligned base.
//  - bf16 cache (kFp8 false): the query tile (64 rows), kStages KV stages, P, the row statistics
//    and the barriers; the transposed scores' exchange lives in the query tile's unused rows.
//  - fp8 cache (kFp8 true, at most kFp8MaxRows query rows): a 32-row query tile, one bf16 KV tile
//    that the consumers dequantise each block into, kStages stages of raw fp8 rows that the
//    producer fills, P (one tile per latent group), the exchange area, the row statistics and the
//    barriers.
template <bool kFp8>
struct SmemLayout {
  static constexpr int kQChunkRows = kFp8 ? kFp8MaxRows : kBlockM;
  static constexpr int kQChunkBytes = kQChunkRows * kRowBytes;
  static constexpr int kQ = 0;
  static constexpr int kKv = kQ + kNumChunks * kQChunkBytes;
  static constexpr int kKvTiles = kFp8 ? 1 : kStages;
  static constexpr int kFp8Stages = kKv + kKvTiles * kTileBytes;
  static constexpr int kP = kFp8Stages + (kFp8 ? kStages * kFp8StageBytes : 0);
  // P: with the bf16 cache one 64-row chunk; with the fp8 cache one kFp8MaxRows-row tile per latent
  // group, P times the group's scale of each token.
  static constexpr int kPTileBytes = kFp8 ? kFp8MaxRows * kRowBytes : kChunkBytes;
  static constexpr int kPTiles = kFp8 ? kLatentDim / kFp8GroupSize : 1;
  static constexpr int kExchange = kP + kPTiles * kPTileBytes;
  static constexpr int kRowMax = kExchange + (kFp8 ? kFp8ExchangeBytes : 0);  // f32 [2][64]
  static constexpr int kRowSum = kRowMax + kConsumerWarpgroups * kBlockM * 4;  // f32 [2][64]
  static constexpr int kBarriers = kRowSum + kConsumerWarpgroups * kBlockM * 4;
  static constexpr int kUsed = kBarriers + kNumBarriers * 8;
  static constexpr int kBytes = kUsed + kSmemAlign;  // slack to align the base to 1024
  static_assert(kBytes <= kMaxSmemBytes, "exceeds the 227 KB per-block shared memory of SM90");
  static_assert(kKv % 1024 == 0 && kP % 1024 == 0 && kFp8Stages % 16 == 0,
                "swizzled tiles need 1024-byte alignment, bulk copies 16");
};

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
