// Parameters, tunables and workspace layout of the SM90 (Hopper) MLA decode kernels.
//
// Shared by the host launcher (launch.cuh) and the device code (schedule/decode/combine kernels).
// Plain C++: no CUDA or CUTLASS headers needed to fill a DecodeParams or to size the workspace.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jax_mla {
namespace sm90 {

// Problem geometry (absorbed MLA: K row = 512 latent + 64 rope; V = the first 512 columns).
constexpr int kLatentDim = 512;
constexpr int kRopeDim = 64;
constexpr int kHeadDim = kLatentDim + kRopeDim;  // 576

// The fp8 cache's row of one token (docs/fp8-cache.md): kLatentDim e4m3 channels, one f32 scale per
// kFp8GroupSize of them, then the bf16 rope.
constexpr int kFp8GroupSize = 128;
constexpr int kFp8ScalesOffset = kLatentDim;
constexpr int kFp8RopeOffset = kFp8ScalesOffset + 4 * (kLatentDim / kFp8GroupSize);  // 528
constexpr int kFp8RowBytes = kFp8RopeOffset + 2 * kRopeDim;                        // 656
// Query rows (q_len * num_heads) up to which the fp8 cache runs a kernel with a query tile of this
// many rows (the register-operand kernels; DecodeKernel's transposed scores when asked for);
// more rows run in 64-row tiles.
constexpr int kFp8TransposedRows = 32;

// Tiling.
constexpr int kBlockM = 64;                       // query rows (q_len * heads, packed) per CTA tile
constexpr int kBlockN = 64;                       // KV tokens per pipeline stage
constexpr int kHalfN = kBlockN / 2;               // tokens per consumer warpgroup in QK^T
constexpr int kChunkCols = 64;                    // bf16 columns per 128-byte swizzle chunk
constexpr int kNumChunks = kHeadDim / kChunkCols; // 9 chunks per 576-wide row
constexpr int kNumVChunks = kLatentDim / kChunkCols;  // 8 chunks hold V
constexpr int kStages = 2;                        // KV pipeline depth
constexpr int kConsumerWarpgroups = 2;            // each owns 256 of the 512 output columns
constexpr int kConsumerThreads = 128 * kConsumerWarpgroups;
constexpr int kProducerThreads = 128;             // one warpgroup; its first thread issues the loads
constexpr int kThreads = kConsumerThreads + kProducerThreads;
// setmaxnreg budgets. The CTA keeps the registers it was launched with (kThreads x the entry cap
// of __launch_bounds__(kThreads, 1), 168): what the producer gives up must cover what the
// consumers take, or setmaxnreg.inc waits forever.
constexpr int kConsumerRegisters = 232;
constexpr int kProducerRegisters = 40;
constexpr int kEntryRegisters = (65536 / kThreads) / 8 * 8;
static_assert(kConsumerThreads * kConsumerRegisters + kProducerThreads * kProducerRegisters <=
                  kThreads * kEntryRegisters,
              "setmaxnreg budgets exceed the CTA's register allocation");

// Schedule cost model (defaults of DecodeParams' schedule fields): a request costs
// fixed_cost_blocks + (its KV blocks) units; parts get contiguous ranges of ceil(total / parts)
// units, but never fewer than SplitUnits of the mean cost of a request (schedule.cuh) nor fewer
// than min_blocks_per_part.
constexpr int kFixedCostBlocks = 2;
constexpr int kMinBlocksPerPart = 1;
// What a KV block costs a part over what one more split of a request costs the epilogues and the
// combine (SplitUnits; docs/sm90-kernel.md, "How many parts a request is split over"): for the
// bf16 cache's kernels and the fp8 cache's register-operand kernels; for the bf16 cache's
// transposed kernel of up to 16 query rows (score_n 16) instead; for the fp8 cache's 64-row
// tiles, whose blocks also convert the tile.
constexpr int kBlockToSplitCost = 14;
constexpr int kBlockToSplitCostScores16 = 12;
constexpr int kBlockToSplitCostFp8Tiles = 24;
// The fewest blocks a part takes where the combine does not merge in one wave of CTAs (the wide
// combine with 32 rows in flight): there a split costs more the more requests there are.
constexpr int kMinBlocksPerPartBeyondOneWave = 2;

// Combine kernels: CombineKernel has one warp per output row; CombineKernelWide has
// kCombineWarpsPerRow warps per row and kCombineWideRowsPerBlock rows per block.
constexpr int kCombineRowsPerBlock = 8;
// CombineKernelWide's LSEs of a request's splits held per lane (32 splits a group): 160 splits,
// more parts than an SM90 GPU has SMs.
constexpr int kCombineLseGroups = 5;
constexpr int kCombineWarpsPerRow = 4;
constexpr int kCombineWideRowsPerBlock = 2;
constexpr int kCombineWideThreads = kCombineWideRowsPerBlock * kCombineWarpsPerRow * 32;
// CombineKernelStaged's ring in shared memory: kStagedGroups groups of kStagedGroupSplits slots,
// each slot one split's rows of a block (StagedShape), and a full and an empty mbarrier per group.
constexpr int kStagedSlotBytes = 2048;
constexpr int kStagedGroupSplits = 8;
constexpr int kStagedGroups = 8;

// The bookkeeping both sides of CombineKernelStaged's ring share (tests/sm90_staged_ring_check.cu
// runs it under every interleaving it draws). A request's splits, counted from its first, go in
// groups of kStagedGroupSplits: group k sits in ring group k % kStagedGroups, and its use number
// k / kStagedGroups gives the parity of the `full` phase its consumers wait for; from the second
// use on, the producer first waits for the `empty` phase of the use before. The producer warp
// issues kGroupsPerIssue groups at a time, lane j copying split 8 k0 + j, of group k0 + j / 8.
struct StagedRing {
  static constexpr int kGroupsPerIssue = 32 / kStagedGroupSplits;

  __host__ __device__ static int Groups(int splits) {
    return (splits + kStagedGroupSplits - 1) / kStagedGroupSplits;
  }
  __host__ __device__ static int Group(int k) { return k % kStagedGroups; }
  // Slot i of group k (i < kStagedGroupSplits), of kStagedGroups * kStagedGroupSplits.
  __host__ __device__ static int Slot(int k, int i) { return Group(k) * kStagedGroupSplits + i; }
  __host__ __device__ static uint32_t FullParity(int k) { return (k / kStagedGroups) & 1; }
  __host__ __device__ static bool WaitsForEmpty(int k) { return k >= kStagedGroups; }
  __host__ __device__ static uint32_t EmptyParity(int k) { return (k / kStagedGroups - 1) & 1; }
  __host__ __device__ static int IssuedGroup(int k0, int lane) {
    return k0 + lane / kStagedGroupSplits;
  }
  __host__ __device__ static int IssuedSplit(int k0, int lane) {
    return k0 * kStagedGroupSplits + lane;
  }
};

struct DecodeParams {
  // Inputs.
  const void* query;         // bf16 [batch, q_len, num_heads, 576]
  const void* kv_cache;      // bf16 [num_pages, page_size, 576], or with kv_fp8 the fp8 cache,
                             // uint8 [num_pages, page_size, kFp8RowBytes]
  const int32_t* block_tables;  // [batch, max_pages]
  const int32_t* seq_lens;      // [batch]
  // The lengths the schedule was built from (an Sm90Plan's), int32 [batch]; nullptr when it was
  // built from seq_lens. A request whose length differs reads nothing (RequestLengths).
  const int32_t* plan_lens = nullptr;
  // Outputs.
  void* out;                 // bf16 [batch, q_len, num_heads, 512]
  float* lse;                // f32  [batch, q_len, num_heads], natural log
  // The step's split-KV schedule, int32 [batch + 1] (schedule.cuh): written by LaunchSchedule,
  // read by LaunchDecode. It depends only on seq_lens and the table's shape, so one schedule
  // serves every layer of a step.
  int32_t* schedule;
  // Scratch owned by the caller: WorkspaceBytes(...) bytes, 256-byte aligned (partial results).
  void* workspace;
  int batch;
  int q_len;
  int num_heads;
  int num_pages;
  int page_size;             // 32 or 64
  int max_pages;             // block table row length
  float softmax_scale;
  float output_scale;
  int num_sms;               // multiprocessors to spread the persistent grid over
  bool enable_pdl;           // programmatic dependent launch for the decode and combine kernels
  bool kv_fp8 = false;       // kv_cache is the fp8 cache
  // Fail closed (jax_mla.decode's fail_closed): a request whose length lies outside [q_len,
  // max_pages * page_size] reads nothing, and one that reads a block-table entry outside
  // [0, num_pages) gets out 0 and lse -inf. Otherwise lengths are clamped to the table's capacity
  // and such pages' tokens are left out.
  bool fail_closed = false;
  // The schedule's cost model; the schedule and the decodes that read it must use the same.
  int fixed_cost_blocks = kFixedCostBlocks;  // >= 0
  int min_blocks_per_part = kMinBlocksPerPart;  // >= 1
  // SplitUnits' cost ratio, read with the schedule by the decode and combine kernels; LaunchDecode
  // sets it for the kernel it runs (any value >= 1 gives a valid schedule).
  int block_to_split_cost = kBlockToSplitCost;
};

// What LaunchDecode passes every decode kernel besides its tensor maps.
struct DecodeKernelArgs {
  DecodeParams p;
  int num_parts;
  int q_box_rows;       // rows per query bulk-tensor box: min(64, q_len * num_heads)
  uint64_t kv_cache_hint;
  float scale_log2;     // softmax_scale * log2(e)
  bool bf16_partials;   // split requests' partial outputs in bf16 (the combines' kBf16Partials)
};

__host__ __device__ inline int CeilDivInt(int a, int b) { return (a + b - 1) / b; }

// log2 of the page size, 32 or 64 (ValidShape).
__host__ __device__ inline int PageShift(const DecodeParams& p) {
  return p.page_size == 64 ? 6 : 5;
}

__host__ __device__ inline int NumMTiles(int q_len, int num_heads) {
  return CeilDivInt(q_len * num_heads, kBlockM);
}

// Parts of the persistent split-KV grid: it has parts x M tiles CTAs, CTA part x M tiles + M tile.
__host__ __device__ inline int NumParts(int num_sms, int q_len, int num_heads) {
  int parts = num_sms / NumMTiles(q_len, num_heads);
  return parts < 1 ? 1 : parts;
}

// Byte offsets of the workspace regions.
struct WorkspaceLayout {
  size_t partial_lse;   // f32 [slots, rows_pad]
  size_t partial_out;   // [slots, rows_pad, 512]: f32, or bf16 with bf16 partials
  size_t total;
  int slots;            // batch + parts: slot of (request b, part p) is b + p
  int rows_pad;         // NumMTiles * 64
};

__host__ __device__ inline size_t AlignUp(size_t x, size_t a) { return (x + a - 1) / a * a; }

__host__ __device__ inline WorkspaceLayout MakeWorkspaceLayout(int batch, int q_len,
                                                               int num_heads, int num_parts) {
  WorkspaceLayout w;
  w.slots = batch + num_parts;
  w.rows_pad = NumMTiles(q_len, num_heads) * kBlockM;
  w.partial_lse = 0;
  w.partial_out =
      AlignUp(w.partial_lse + sizeof(float) * static_cast<size_t>(w.slots) * w.rows_pad, 256);
  w.total = AlignUp(w.partial_out + sizeof(float) * static_cast<size_t>(w.slots) * w.rows_pad *
                                        kLatentDim,
                    256);
  return w;
}

inline size_t WorkspaceBytes(int batch, int q_len, int num_heads, int num_sms) {
  return MakeWorkspaceLayout(batch, q_len, num_heads, NumParts(num_sms, q_len, num_heads)).total;
}

}  // namespace sm90
}  // namespace jax_mla
