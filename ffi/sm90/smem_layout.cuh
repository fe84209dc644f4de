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
//  - P (64 rows x 64 tokens, bf16) is one K-major chunk written by the consumer warpgroups (64-row
//    tiles write it over the KV tile's rope chunk instead).
#pragma once

#include <cstdint>

#include "decode_params.h"

namespace jax_mla {
namespace sm90 {

constexpr int kRowBytes = kChunkCols * 2;                 // 128
constexpr int kChunkBytes = kBlockN * kRowBytes;          // 8192 (64 rows)
constexpr int kTileBytes = kNumChunks * kChunkBytes;      // 73728

constexpr int kSmemAlign = 1024;
constexpr int kMaxSmemBytes = 232448;  // per block on SM90 (227 KB)

// fp8 cache: a staged 64-token block of raw cache rows (docs/fp8-cache.md), and the exchange area
// of the transposed scores (two warpgroups x kFp8TransposedRows / 16 slots of 128 x 16 bytes for
// partial S^T, then one slot for the rows' statistics: ScoreExchangeSlot, RowStats).
constexpr int kFp8StageBytes = kBlockN * kFp8RowBytes;  // 41984
constexpr int kFp8HalfStageBytes = kFp8StageBytes / 2;  // 32 tokens, one bulk copy
constexpr int kFp8ExchangeBytes =
    (kConsumerWarpgroups * (kFp8TransposedRows / 16) + 1) * 128 * 16;
constexpr int kFp8ScaleGroups = kLatentDim / kFp8GroupSize;  // 4
// fp8 cache, 64-row tiles: 32-token stages in a ring (one and a half blocks in flight), each
// released by every thread of the warpgroup that read it.
constexpr int kFp8HalfStages = 3;
constexpr int kHalfStageReleasers = kConsumerThreads / kConsumerWarpgroups;

// Byte offsets of the regions of one DecodeKernel instantiation, from the 1024-aligned base; kQRows
// is the query tile's rows.
//  - bf16 cache (kFp8 false, kQRows 64): the query tile, kStages KV stages, P, the row statistics
//    and the barriers; the transposed scores' exchange lives in the query tile's unused rows.
//  - fp8 cache, transposed scores (kQRows = kFp8TransposedRows): the query tile, one bf16 KV tile
//    that the consumers dequantise each block into, kStages stages of a block's raw fp8 rows that
//    the producer fills, P, the exchange area, the row statistics and the barriers.
//  - fp8 cache, 64-row tiles (kQRows 64): the query tile, the bf16 KV tile, a ring of
//    kFp8HalfStages stages of 32 tokens (a block's half h is converted by warpgroup h), P, the row
//    statistics and the barriers.
template <bool kFp8, int kQRows = kBlockM>
struct SmemLayout {
  static_assert(kQRows == kBlockM || (kFp8 && kQRows == kFp8TransposedRows), "query tile rows");
  static constexpr bool kHalfStages = kFp8 && kQRows == kBlockM;
  // Whether each thread of the warpgroup that read a slot releases it (SetUpCta).
  static constexpr bool kEveryThreadReleases = kHalfStages;
  static constexpr int kReleasingThreads = kHalfStageReleasers;  // with kEveryThreadReleases
  // Pipeline slots, each with a full and an empty barrier: the KV stages, or the half stages.
  static constexpr int kStageSlots = kHalfStages ? kFp8HalfStages : kStages;
  static constexpr int kQChunkRows = kQRows;
  static constexpr int kQChunkBytes = kQChunkRows * kRowBytes;
  static constexpr int kQ = 0;
  static constexpr int kKv = kQ + kNumChunks * kQChunkBytes;
  static constexpr int kKvTiles = kFp8 ? 1 : kStages;
  static constexpr int kFp8Stages = kKv + kKvTiles * kTileBytes;
  static constexpr int kFp8StageSize = kHalfStages ? kFp8HalfStageBytes : kFp8StageBytes;
  static constexpr int kP =
      (kFp8Stages + (kFp8 ? kStageSlots * kFp8StageSize : 0) + 1023) / 1024 * 1024;
  static constexpr int kPTileBytes = kQRows * kRowBytes;  // P: kQRows rows x 64 tokens, bf16
  static constexpr int kExchange = kP + kPTileBytes;
  static constexpr int kRowMax = kExchange + (kFp8 && !kHalfStages ? kFp8ExchangeBytes : 0);
  static constexpr int kRowSum = kRowMax + kConsumerWarpgroups * kBlockM * 4;  // f32 [2][64]
  static constexpr int kBarriers = kRowSum + kConsumerWarpgroups * kBlockM * 4;
  // q_full, q_empty, then full and empty of each slot, then (bf16 cache) full and empty of each
  // stage's warpgroup-0 V chunks when a stage is released in two parts (Pipeline in
  // pipeline.cuh).
  static constexpr int kNumBarriers = 2 + 2 * kStageSlots + (kFp8 ? 0 : 2 * kStages);
  static constexpr int kUsed = kBarriers + kNumBarriers * 8;
  static constexpr int kBytes = kUsed + kSmemAlign;  // slack to align the base to 1024
  static_assert(kBytes <= kMaxSmemBytes, "exceeds the 227 KB per-block shared memory of SM90");
  static_assert(kKv % 1024 == 0 && kP % 1024 == 0 && kFp8Stages % 16 == 0,
                "swizzled tiles need 1024-byte alignment, bulk copies 16");
};

// The layout of DecodeKernel<..., kScoreN, kFp8>: the fp8 cache's transposed scores have their own
// query tile of kFp8TransposedRows rows.
template <bool kFp8, int kScoreN>
using KernelSmemLayout = SmemLayout<kFp8, (kFp8 && kScoreN > 0) ? kFp8TransposedRows : kBlockM>;

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

// MN-major operand (V): 64-column chunks kTileChunkBytes apart (a 64-token tile's by default, 4 KB
// in the seesaw's 32-token stages), 8-token groups 1024 B apart.
template <int kTileChunkBytes = kChunkBytes>
__device__ __forceinline__ uint64_t MNMajorDesc(uint32_t smem_addr) {
  return MakeSmemDesc(smem_addr, kTileChunkBytes, 8 * kRowBytes);
}

// desc with its start address `bytes` further (a multiple of 16). Only the low word changes: the
// 14-bit address field holds any shared-memory address of the CTA (below 256 KB) and does not
// carry into the next field.
__device__ __forceinline__ uint64_t DescAdd(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

// Byte offset of element (row, col) inside a 128-byte-swizzled chunk of bf16 (col < 64).
__device__ __forceinline__ uint32_t SwizzledOffset(int row, int col) {
  return row * kRowBytes + ((((col >> 3) ^ (row & 7))) << 4) + ((col & 7) << 1);
}

// The same in a tile of 64-byte rows (32 bf16 columns) with the 64-byte swizzle: 16-byte unit u
// of row r sits at unit u ^ ((r / 2) % 4), 8-row groups 512 bytes apart (the seesaw's P).
constexpr int kRowBytes64B = 64;

__device__ __forceinline__ uint32_t SwizzledOffset64B(int row, int col) {
  return row * kRowBytes64B + ((((col >> 3) ^ ((row >> 1) & 3))) << 4) + ((col & 7) << 1);
}

// K-major operand in 64-byte-swizzled rows of 32 bf16 columns: 8-row groups 512 B apart.
__device__ __forceinline__ uint64_t KMajorDesc64B(uint32_t smem_addr) {
  const uint64_t desc = MakeSmemDesc(smem_addr, 16, 8 * kRowBytes64B);
  return (desc & ~(3ull << 62)) | (2ull << 62);  // SWIZZLE_64B
}

}  // namespace sm90
}  // namespace jax_mla
