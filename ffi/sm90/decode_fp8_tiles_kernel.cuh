// The fp8 cache in 64-row tiles (33-128 query rows) with two bf16 KV tiles
// (DecodeFp8TilesKernel; docs/fp8-cache.md, "33-128 rows: two bf16 tiles").
//
// DecodeKernel's 64-row tiles (warpgroup 0 scores all 64 tokens of a block and runs the softmax,
// P over the tile's rope chunk, both warpgroups PV on their 256 columns), but a block's bf16 tile
// is converted while the block before it is computed, off warpgroup 0's chain:
//  - two bf16 tiles: block it is read from tile it % 2 while block it + 1 lands in the other;
//  - a block's raw rows are staged inside its own tile (the query tile and two bf16 tiles leave
//    no room for separate stages): the producer copies each 32-token half by bulk-tensor boxes,
//    latent group g's 128 bytes per row into the first chunk of its bf16 columns (chunk 2 g), the
//    rope straight into the rope chunk (it is bf16 already) and the group scales into chunk 1;
//  - each consumer warpgroup converts its 32-token half of the next block in place under its PV of
//    the block, group by group: a row's 128 raw bytes become the row's 256 bytes in chunks 2 g and
//    2 g + 1, each octet of lanes reading its row's raw bytes in one instruction before it writes
//    them over, and the half's scales (in chunk 1, over the half's own rows) read first;
//  - warpgroup 0 hands P and the rows' factors to warpgroup 1 through an mbarrier, so it never
//    waits for warpgroup 1 within a segment;
//  - mbarriers per tile: its copies landed (full), its conversion done (ready), its P written
//    (scored), both warpgroups' PV of its block done (free), after which the producer refills it.
// Safety as DecodeKernel: only the halves below the length whose page id is in range are copied
// (a page of 64 holding the length's end whole, inside the page); rows of tokens at or past the
// length or of halves not copied become zero rows of latent values, and their scores are masked by
// select.
#pragma once

#include "decode_kernel.cuh"

namespace jax_mla {
namespace sm90 {

// Shared memory of DecodeFp8TilesKernel, byte offsets from the 1024-aligned base: the query tile,
// two bf16 KV tiles, the P tile (only the epilogue's bounce slices: P goes over a tile's rope
// chunk), the rows' factors (double-buffered by block parity) and sums, the query tile's barriers
// (Pipeline) and each tile's full, ready and free barriers.
struct Fp8TilesSmemLayout {
  static constexpr int kStageSlots = 0;  // no KV stages: SetUpCta sets up the query's barriers
  static constexpr bool kEveryThreadReleases = false;
  static constexpr int kReleasingThreads = 0;
  static constexpr int kQChunkRows = kBlockM;
  static constexpr int kQChunkBytes = kQChunkRows * kRowBytes;
  static constexpr int kQ = 0;
  static constexpr int kTiles = kQ + kNumChunks * kQChunkBytes;
  static constexpr int kNumTiles = 2;
  static constexpr int kP = kTiles + kNumTiles * kTileBytes;
  static constexpr int kPTileBytes = kBlockM * kRowBytes;
  static constexpr int kRowMax = kP + kPTileBytes;
  static constexpr int kRowSum = kRowMax + kConsumerWarpgroups * kBlockM * 4;
  static constexpr int kBarriers = kRowSum + kConsumerWarpgroups * kBlockM * 4;
  static constexpr int kPipeBarriers = 2;  // the query tile's full and empty
  static constexpr int kNumBarriers = kPipeBarriers + 4 * kNumTiles;
  static constexpr int kUsed = kBarriers + kNumBarriers * 8;
  static constexpr int kBytes = kUsed + kSmemAlign;
  // Where a staged block's group scales sit in its tile: half h's f32 [32 rows][4 groups] in
  // chunk 1 over the rows of that half, which only the warpgroup converting it writes.
  __host__ __device__ static constexpr int ScalesOffset(int h) {
    return kChunkBytes + h * kHalfN * kRowBytes;
  }
  static_assert(kBytes <= kMaxSmemBytes, "exceeds the 227 KB per-block shared memory of SM90");
  static_assert(kTiles % 1024 == 0 && kP % 1024 == 0, "swizzled tiles need 1024-byte alignment");
  static_assert(kHalfN * kFp8ScaleGroups * 4 <= kHalfN * kRowBytes, "a half's scales fit its rows");
};

namespace detail {

// Tile t's barriers: full (the producer's copies of the block landed), ready (every consumer
// thread arrives once its rows are converted, fenced for the WGMMAs), scored (every thread of
// warpgroup 0 arrives once the block's P and row factors are written) and free (every consumer
// thread arrives once its warpgroup's PV of the block in it is done).
struct TileBarriers {
  uint64_t* base;
  __device__ __forceinline__ static TileBarriers At(uint8_t* smem) {
    using Layout = Fp8TilesSmemLayout;
    return {reinterpret_cast<uint64_t*>(smem + Layout::kBarriers) + Layout::kPipeBarriers};
  }
  __device__ __forceinline__ uint64_t* Full(int t) const { return base + t; }
  __device__ __forceinline__ uint64_t* Ready(int t) const { return base + 2 + t; }
  __device__ __forceinline__ uint64_t* Scored(int t) const { return base + 4 + t; }
  __device__ __forceinline__ uint64_t* Free(int t) const { return base + 6 + t; }
  __device__ __forceinline__ void Init() const {
    for (int t = 0; t < 2; ++t) {
      cutlass::arch::ClusterBarrier::init(Full(t), 1);
      cutlass::arch::ClusterBarrier::init(Ready(t), kConsumerThreads);
      cutlass::arch::ClusterBarrier::init(Scored(t), kConsumerThreads / kConsumerWarpgroups);
      cutlass::arch::ClusterBarrier::init(Free(t), kConsumerThreads);
    }
  }
};

// Waits for the completion of tile it % 2's barrier `bar` that belongs to the block whose index in
// the CTA's walk is `it` (the tile's (it / 2)-th use).
__device__ __forceinline__ void WaitTileUse(uint64_t* bar, int it) {
  cutlass::arch::ClusterBarrier::wait(bar, (it >> 1) & 1);
}

// The producer thread: each segment's query tile once both consumer warpgroups released the one
// before, and each KV block into tile it % 2 once the block two before it left the tile: per
// 32-token half below the length whose page id is in range, the four latent groups' boxes into
// chunks 0, 2, 4, 6, the rope's into chunk 8 (both 128-byte swizzled, as the bf16 tile's chunks),
// the scales' into chunk 1; with the next block's rows asked of L2.
__device__ __forceinline__ void ProduceFp8Tiles(const CUtensorMap& q_map,
                                                const CUtensorMap& kv_map,
                                                const CUtensorMap& scale_map,
                                                const DecodeKernelArgs& args, uint8_t* smem,
                                                SegmentWalker& walker, int mtile) {
  using Layout = Fp8TilesSmemLayout;
  using Barrier = cutlass::arch::ClusterBarrier;
  constexpr uint32_t kHalfBytes = kHalfN * kFp8RowBytes;
  const DecodeParams& p = args.p;
  const Pipeline pipe = Pipeline::At<Layout>(smem);
  const TileBarriers tiles = TileBarriers::At(smem);
  const int rows = p.q_len * p.num_heads;
  const uint8_t* cache = static_cast<const uint8_t*>(p.kv_cache);
  Segment seg_info;
  int it = 0, seg = 0;
  while (walker.Next(seg_info)) {
    if (seg > 0) Barrier::wait(pipe.QEmpty(), (seg - 1) & 1);
    LoadQueryTile<Layout>(q_map, args, smem, pipe, seg_info.b * rows + mtile * kBlockM);
    for (int k = seg_info.kv_begin; k < seg_info.kv_end; ++k, ++it) {
      int kv_rows[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        kv_rows[h] = KvRow(p, seg_info.b, k * kBlockN + h * kHalfN, seg_info.len);
      }
      if (k + 1 < seg_info.kv_end) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int token0 = (k + 1) * kBlockN + h * kHalfN;
          const int row = KvRow(p, seg_info.b, token0, seg_info.len);
          if (row < 0) continue;
          asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(
                           cache + static_cast<size_t>(row) * kFp8RowBytes),
                       "r"(min(kHalfN, seg_info.len - token0) * kFp8RowBytes)
                       : "memory");
        }
      }
      const int t = it & 1;
      if (it >= 2) Barrier::wait(tiles.Free(t), ((it >> 1) - 1) & 1);
      uint64_t* full = tiles.Full(t);
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(
          full, ((kv_rows[0] >= 0) + (kv_rows[1] >= 0)) * kHalfBytes);
      uint8_t* tile = smem + Layout::kTiles + t * kTileBytes;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (kv_rows[h] < 0) continue;
        const int row_offset = h * kHalfN * kRowBytes;
#pragma unroll 1
        for (int g = 0; g <= kFp8ScaleGroups; ++g) {  // the latent groups, then the rope
          const int chunk = g < kFp8ScaleGroups ? 2 * g : kNumVChunks;
          const int col = g < kFp8ScaleGroups ? g * kFp8GroupSize : kFp8RopeOffset;
          cute::SM90_TMA_LOAD_2D::copy(&kv_map, full, args.kv_cache_hint,
                                       tile + chunk * kChunkBytes + row_offset, col, kv_rows[h]);
        }
        cute::SM90_TMA_LOAD_2D::copy(&scale_map, full, args.kv_cache_hint,
                                     tile + Layout::ScalesOffset(h),
                                     static_cast<int>(kFp8ScalesOffset), kv_rows[h]);
      }
    }
    ++seg;
  }
}

// Warpgroup wg's conversion of its half (rows 32 wg to 32 wg + 31) of the block whose index in
// the CTA's walk is `it` (what is loaded: `load`) in place in tile it % 2, once its copies landed.
// Octet o = 4 (warp) + lane / 8 converts rows 32 wg + o + 16 i (i < 2), lane % 8 the 16-byte unit
// u of each row's 128 raw bytes of a group: its sixteen values times the group's scale become
// columns 128 g + 16 u, in chunk 2 g + u / 4. Rows not loaded become zeros. The half's scales lie
// in chunk 1 where only this warpgroup writes (its rows), and are read before it does.
__device__ __forceinline__ void ConvertTileInPlace(uint8_t* smem, const TileBarriers& tiles,
                                                   int it, const BlockLoad& load, int wg,
                                                   int wg_tid) {
  using Layout = Fp8TilesSmemLayout;
  const int lane = wg_tid % 32;
  const int octet = (wg_tid / 32) * 4 + lane / 8;
  const int unit = lane % 8;
  uint8_t* tile = smem + Layout::kTiles + (it & 1) * kTileBytes;
  const uint8_t* scales = tile + Layout::ScalesOffset(wg);
  WaitTileUse(tiles.Full(it & 1), it);
  float scale[2][kFp8ScaleGroups];  // [row i][group]
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row_in_half = octet + 16 * i;
    const float4 s = load.RowLoaded(kHalfN * wg + row_in_half)
                         ? *reinterpret_cast<const float4*>(scales + row_in_half * 16)
                         : make_float4(0.f, 0.f, 0.f, 0.f);
    scale[i][0] = s.x;
    scale[i][1] = s.y;
    scale[i][2] = s.z;
    scale[i][3] = s.w;
  }
  WarpgroupSync(wg);
#pragma unroll
  for (int g = 0; g < kFp8ScaleGroups; ++g) {
    uint8_t* raw_chunk = tile + 2 * g * kChunkBytes;
    uint8_t* dst_chunk = raw_chunk + (unit / 4) * kChunkBytes;
    const int col = 16 * (unit % 4);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = kHalfN * wg + octet + 16 * i;
      // The raw bytes' 16-byte unit u of a row sits at unit u ^ (row % 8), as the bulk-tensor copy
      // swizzles them; the octet reads them all in one instruction before any is written over.
      const uint4 raw =
          *reinterpret_cast<const uint4*>(raw_chunk + row * kRowBytes + ((unit ^ (row % 8)) << 4));
      __syncwarp();
      uint4 lo = make_uint4(0, 0, 0, 0), hi = make_uint4(0, 0, 0, 0);
      if (load.RowLoaded(row)) E4m3x16ToBf16(raw, __float2bfloat162_rn(scale[i][g]), lo, hi);
      *reinterpret_cast<uint4*>(dst_chunk + SwizzledOffset(row, col)) = lo;
      *reinterpret_cast<uint4*>(dst_chunk + SwizzledOffset(row, col + 8)) = hi;
    }
  }
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::ClusterBarrier::arrive(tiles.Ready(it & 1));
}

// A consumer thread's running state over a segment: its warpgroup's 64 x 256 fp32 output
// accumulator (O[:, 256 wg : 256 wg + 256]), and warpgroup 0's rows' running maxima and sums.
struct Fp8TilesRows {
  float o[kLatentDim / kConsumerWarpgroups / 2];
  float m0, m1, l0, l1;
};

// Warpgroup kWg's part of the blocks of a segment (it: the index of its first block in the CTA's
// walk; the segment's first block already converted): warpgroup 0 scores block k, hands P over
// (scored) and runs its PV; warpgroup 1 waits for P and runs its PV; each converts its half of
// block k + 1 under its PV.
template <int kWg>
__device__ __forceinline__ void Fp8TilesBlocks(uint8_t* smem, const DecodeKernelArgs& args,
                                               const Segment& seg_info, int it, int mtile,
                                               BlockLoad load, BlockLoad load_next,
                                               BlockPages pages2, Fp8TilesRows& st) {
  using Layout = Fp8TilesSmemLayout;
  using Barrier = cutlass::arch::ClusterBarrier;
  const DecodeParams& p = args.p;
  const Pipeline pipe = Pipeline::At<Layout>(smem);
  const TileBarriers tiles = TileBarriers::At(smem);
  const int lane = threadIdx.x % 32;
  const int wg_tid = threadIdx.x % 128;
  const int rows = p.q_len * p.num_heads;
  const int r0 = Fragment::Row(wg_tid, 0);
  const int r1 = Fragment::Row(wg_tid, 1);
  const int gr0 = mtile * kBlockM + r0;
  const int gr1 = mtile * kBlockM + r1;
  const int limit0 = gr0 < rows ? seg_info.len - p.q_len + gr0 / p.num_heads : -1;
  const int limit1 = gr1 < rows ? seg_info.len - p.q_len + gr1 / p.num_heads : -1;
  const int quad_col = Fragment::Col(lane, 0, 0);
  float* const row_max = reinterpret_cast<float*>(smem + Layout::kRowMax);
  const uint32_t q_addr = SmemAddr(smem + Layout::kQ);
  const uint32_t tiles_addr = SmemAddr(smem + Layout::kTiles);
  const float sl2 = args.scale_log2;
  const int kv_end = seg_info.kv_end;
  for (int k = seg_info.kv_begin; k < kv_end; ++k, ++it) {
    const int t = it & 1;
    const uint32_t tile_addr = tiles_addr + t * kTileBytes;
    uint8_t* const p_block =
        smem + Layout::kTiles + t * kTileBytes + kNumVChunks * kChunkBytes;  // the rope chunk
    float* const row_alpha = row_max + t * kBlockM;  // f32 [64]: the block's row factors
    if constexpr (kWg == 0) {
      // S = Q K^T for all 64 tokens and the masked online softmax of rows r0 (elements 4 j + e)
      // and r1 (4 j + 2 + e); element (j, e) is token 8 j + quad_col + e of the block.
      WaitTileUse(tiles.Ready(t), it);
      SM90_TRACE(kTraceBlockReady, k);
      float s[kBlockM * kBlockN / 128];
      FenceRegisters(s);
      cute::warpgroup_arrive();
      const uint64_t q_desc = KMajorDesc(q_addr), k_desc = KMajorDesc(tile_addr);
#pragma unroll
      for (int g = 0; g < kQkSteps; ++g) {
        Gmma<QkMma64>(DescAdd(q_desc, QkStepOffset(g)), DescAdd(k_desc, QkStepOffset(g)), s,
                      g != 0);
      }
      cute::warpgroup_commit_batch();
      cute::warpgroup_wait<0>();
      FenceRegisters(s);
      FenceRegisters(st.o);
      SM90_TRACE(kTraceScoresDone, k);
      if (k == kv_end - 1 && wg_tid == 0) Barrier::arrive(pipe.QEmpty());
      const int token_base = k * kBlockN;
      const bool visible = load.half_ok[0] && load.half_ok[1] &&
                           token_base + kBlockN - 1 <= min(limit0, limit1);
      float mx0, mx1, alpha0, alpha1, sum0, sum1;
      MaskRows<kBlockN / 8>(
          s, token_base + quad_col,
          [&](int j) { return j < kHalfN / 8 ? load.half_ok[0] : load.half_ok[1]; }, limit0,
          limit1, visible, mx0, mx1);
      uint32_t p_packed[2][8];  // P of rows r0, r1 x tokens 0-31 and 32-63, bf16 pairs
      SoftmaxRows<kBlockN / 8>(s, mx0, mx1, sl2, st.m0, st.m1, alpha0, alpha1, sum0, sum1,
                               p_packed);
      StoreWarpTile16x32(p_block, r0 - lane / 4, 0, lane, p_packed[0]);
      StoreWarpTile16x32(p_block, r0 - lane / 4, kHalfN, lane, p_packed[1]);
      if ((lane & 3) == 0) {
        row_alpha[r0] = alpha0;
        row_alpha[r1] = alpha1;
      }
      st.l0 = st.l0 * alpha0 + sum0;
      st.l1 = st.l1 * alpha1 + sum1;
      if (__any_sync(0xffffffffu, alpha0 != 1.f || alpha1 != 1.f)) {
        RescaleRows(st.o, alpha0, alpha1);
      }
      cutlass::arch::fence_view_async_shared();
      Barrier::arrive(tiles.Scored(t));
    } else {
      WaitTileUse(tiles.Scored(t), it);
      const float alpha0 = row_alpha[r0], alpha1 = row_alpha[r1];
      FenceRegisters(st.o);
      if (__any_sync(0xffffffffu, alpha0 != 1.f || alpha1 != 1.f)) {
        RescaleRows(st.o, alpha0, alpha1);
      }
    }
    // O[:, 256 kWg : 256 kWg + 256] += P V over the 64 tokens of the tile, the next block's half
    // converted meanwhile.
    FenceRegisters(st.o);
    cute::warpgroup_arrive();
    const uint64_t p_desc = KMajorDesc(SmemAddr(p_block));
    const uint64_t v_desc = MNMajorDesc(tile_addr + kWg * (kNumVChunks / 2) * kChunkBytes);
#pragma unroll
    for (int kk = 0; kk < kBlockN / 16; ++kk) {
      Gmma<PvMma>(DescAdd(p_desc, kk * 32), DescAdd(v_desc, kk * 16 * kRowBytes), st.o, true);
    }
    cute::warpgroup_commit_batch();
    if (k + 1 < kv_end) ConvertTileInPlace(smem, tiles, it + 1, load_next, kWg, wg_tid);
    cute::warpgroup_wait<0>();
    FenceRegisters(st.o);
    Barrier::arrive(tiles.Free(t));
    SM90_TRACE(kTraceBlockDone, k);
    if constexpr (kWg == 0) load = load_next;  // warpgroup 0 masks the scores
    load_next = k + 2 < kv_end ? BlockLoad::Of(p, seg_info, k + 2, pages2) : BlockLoad{};
    if (k + 3 < kv_end) pages2 = BlockPages::Read(p, seg_info, k + 3);
  }
}

// The consumer warpgroups' walk: see the top of this file.
__device__ __forceinline__ void ConsumeFp8Tiles(uint8_t* smem, const DecodeKernelArgs& args,
                                                SegmentWalker& walker, int mtile, int part) {
  using Layout = Fp8TilesSmemLayout;
  using Barrier = cutlass::arch::ClusterBarrier;
  const DecodeParams& p = args.p;
  const Pipeline pipe = Pipeline::At<Layout>(smem);
  const TileBarriers tiles = TileBarriers::At(smem);
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int wg_tid = tid % 128;
  // Warp-uniform as far as the compiler knows, so that each warpgroup runs its own code.
  const int wg = __shfl_sync(0xffffffffu, warp / 4, 0);
  const int rows = p.q_len * p.num_heads;
  const int r0 = Fragment::Row(wg_tid, 0);
  float* const row_sum = reinterpret_cast<float*>(smem + Layout::kRowSum);

  Fp8TilesRows st;
  Segment seg_info;
  int it = 0, seg = 0;
  while (walker.Next(seg_info)) {
    SM90_TRACE(kTraceSegment, seg_info.b);
    st.m0 = st.m1 = kNegInf;
    st.l0 = st.l1 = 0.f;
#pragma unroll
    for (int i = 0; i < 128; ++i) st.o[i] = 0.f;
    const int kv_begin = seg_info.kv_begin, kv_end = seg_info.kv_end;
    // What is loaded of blocks k and k + 1, and block k + 2's table entries, read a block ahead.
    BlockLoad load{}, load_next{};
    BlockPages pages2 = {{-1, -1}};
    if (kv_begin < kv_end) load = BlockLoad::Of(p, seg_info, kv_begin);
    if (kv_begin + 1 < kv_end) load_next = BlockLoad::Of(p, seg_info, kv_begin + 1);
    if (kv_begin + 2 < kv_end) pages2 = BlockPages::Read(p, seg_info, kv_begin + 2);
    if (kv_begin < kv_end) ConvertTileInPlace(smem, tiles, it, load, wg, wg_tid);
    Barrier::wait(pipe.QFull(), seg & 1);
    SM90_TRACE(kTraceQuery, 0);
    if (wg_tid == 0 && (wg == 1 || kv_begin == kv_end)) Barrier::arrive(pipe.QEmpty());
    if (wg == 0) {
      Fp8TilesBlocks<0>(smem, args, seg_info, it, mtile, load, load_next, pages2, st);
    } else {
      Fp8TilesBlocks<1>(smem, args, seg_info, it, mtile, load, load_next, pages2, st);
    }
    it += kv_end - kv_begin;
    SM90_TRACE(kTraceStoreBegin, seg_info.whole);
    const int gr0 = mtile * kBlockM + r0;
    StorePlain(p, seg_info, part, args.num_parts, rows, wg, lane, r0, gr0, gr0 + 8, st.o, st.l0,
               st.l1, st.m0, st.m1, args.scale_log2, args.bf16_partials, row_sum,
               smem + Layout::kP + warp * kBounceBytes);
    SM90_TRACE(kTraceStoreEnd, 0);
    ++seg;
  }
}

}  // namespace detail

// fp8 cache, 33-128 query rows (64-row tiles): see the top of this file. kv_map: the fp8 cache as
// bytes [rows, kFp8RowBytes], boxes of 128 bytes x 32 rows, 128-byte swizzle; scale_map: the same
// bytes, boxes of 16 bytes x 32 rows, no swizzle.
__global__ void __launch_bounds__(kThreads, 1)
DecodeFp8TilesKernel(const __grid_constant__ CUtensorMap q_map,
                     const __grid_constant__ CUtensorMap kv_map,
                     const __grid_constant__ CUtensorMap scale_map, const DecodeKernelArgs args) {
  using Layout = Fp8TilesSmemLayout;
  using namespace detail;
  extern __shared__ uint8_t smem_raw[];
  const uint32_t raw_addr = SmemAddr(smem_raw);
  uint8_t* smem = smem_raw + ((kSmemAlign - (raw_addr & (kSmemAlign - 1))) & (kSmemAlign - 1));
  const DecodeParams& p = args.p;
  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int m_tiles = NumMTiles(p.q_len, p.num_heads);
  const int mtile = blockIdx.x % m_tiles;
  const int part = blockIdx.x / m_tiles;
  SetUpCta<1, Layout>(smem, args.q_box_rows, tid);
  if (tid == 0) {
    TileBarriers::At(smem).Init();
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  if (warp >= kConsumerThreads / 32) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegisters>();
    GridDependencyWait();
    GridDependencyLaunchDependents();
    if (warp == kConsumerThreads / 32 && tid % 32 == 0) {
      SegmentWalker walker(ScheduleView::Load(p, args.num_parts), part, p.seq_lens, p.max_pages,
                           p.page_size);
      ProduceFp8Tiles(q_map, kv_map, scale_map, args, smem, walker, mtile);
    }
    return;
  }
  GridDependencyWait();
  GridDependencyLaunchDependents();
  cutlass::arch::warpgroup_reg_alloc<kConsumerRegisters>();
  SM90_TRACE(kTraceStart, 0);
  SegmentWalker walker(ScheduleView::Load(p, args.num_parts), part, p.seq_lens, p.max_pages,
                       p.page_size);
  ConsumeFp8Tiles(smem, args, walker, mtile, part);
}

}  // namespace sm90
}  // namespace jax_mla
