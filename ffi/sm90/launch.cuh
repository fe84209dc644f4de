// Host launchers of the SM90 MLA decode.
//
// Per step:   LaunchSchedule(params, stream)   (reads seq_lens, writes params.schedule)
// Per layer:  LaunchDecode(params, stream)     (decode kernel, then combine kernel)
// Both only enqueue work (no host sync, no allocation): safe inside CUDA graph capture and XLA
// command buffers. The caller owns the schedule (int32 [batch + 1]) and the workspace
// (WorkspaceBytes(...) bytes) and must keep batch, max_pages and page_size equal between the
// schedule and the decodes of a step, and give each decode every request's length as the schedule
// saw it or 0 (the combine finds a request's splits from its length and the schedule together).
// Include this header from exactly one translation unit compiled with
//   -gencode arch=compute_90a,code=sm_90a -I<cutlass>/include --expt-relaxed-constexpr
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include <cmath>
#include <mutex>

#include "combine_kernel.cuh"
#include "decode_fp8_regs_kernel.cuh"
#include "decode_fp8_split_kernel.cuh"
#include "decode_kernel.cuh"
#include "decode_params.h"
#include "schedule.cuh"

namespace jax_mla {
namespace sm90 {

// Knobs that benchmarks/sm90_harness.cu times against each other (docs/sm90-kernel.md has the
// outcome). Production callers pass nothing and get the defaults. The kernels that only other
// options select (timing experiments, and the variants the defaults replaced) and the launch
// without the combine are compiled only where JAX_MLA_SM90_EXPERIMENTS is defined (the harness,
// the launch-option test); elsewhere, as in the FFI library, LaunchDecode refuses those options.
struct LaunchOptions {
  bool early_release = true;  // see DecodeKernel's kEarlyRelease
  int kv_l2_promotion = -1;   // L2 promotion of the bf16 cache's tensor map, in bytes: 0, 128 or
                              // 256; -1 (default) where KvL2Promotion picks it
  int kv_evict_first = -1;    // -1: evict-first hint when each KV tile is read by one CTA only
  int experiment = 0;         // DecodeKernel's kSkip bits (timing experiments, wrong results)
  int cluster = -1;           // 2: pairs of M-tile CTAs share each KV tile by multicast (needs an
                              // even number of M tiles); -1 (default) where ClusterSize picks
                              // it; 1 never; other values rejected
  int transposed_scores = -1; // DecodeKernel's kScoreN path: -1 (default) where q_len * num_heads
                              // <= 32 (N = 16 up to 16 rows, else 32); 0 never; other values
                              // rejected
  int wide_combine = -1;      // CombineKernelWide (several warps per output row) instead of
                              // CombineKernel: -1 (default) where requests are split over many
                              // parts (UseWideCombine), 1 always, 0 never
  int split_release = -1;     // DecodeKernel's kSplitRelease in the bf16 cache's 64-row tiles:
                              // 1 always; -1 (default) and 0 never
  int bf16_partials = -1;     // split requests' partial outputs in bf16 instead of fp32:
                              // -1 (default) and 1 in 64-row tiles (1 elsewhere is rejected);
                              // 0 never
  int combine_rows_in_flight = -1;  // CombineKernelWide's partial rows in flight per lane: -1
                                    // (default) the most of 32 and 16 whose kernel's grid is
                                    // resident at once (CombineRowsInFlight), else 8; 8, 16 or
                                    // 32 always (and the loading kernel unless
                                    // staged_combine = 1); other values rejected
  int staged_combine = -1;    // the wide combine's partial rows staged in shared memory by bulk
                              // copies (CombineKernelStaged) instead of loaded by each lane: -1
                              // (default) where its grid fits the SMs in one wave, 1 wherever the
                              // wide combine runs, 0 never
  int fp8_registers = -1;     // the fp8 cache up to 32 query rows in the register-operand
                              // kernels (DecodeFp8RegsKernel up to 16, DecodeFp8SplitKernel
                              // 17-32) instead of DecodeKernel's transposed path: -1 (default)
                              // and 1 yes, 0 no
  int column_halves = -1;     // DecodeKernel's kColumnHalves in the 64-row tiles
                              // (not with the split release or experiments): -1 (default) where
                              // UseColumnHalves' rule takes it, 1 always, 0 never
  int block_to_split_cost = -1;  // SplitUnits' ratio in the schedule the kernels read: -1
                                 // (default) the kernel's (ScheduleAsRead), else at least 1
  bool combine = true;        // false: no combine kernel (timing experiments: split and empty
                              // requests' results are wrong)
};

namespace detail {

inline PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* ptr = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &ptr, 12000, cudaEnableDefault,
                                         &status) == cudaSuccess &&
        status == cudaDriverEntryPointSuccess) {
      fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(ptr);
    }
  });
  return fn;
}

// 2-D bf16 map over [rows, 576] row-major, box of 64 columns x box_rows rows, 128-byte swizzle.
inline bool EncodeRowMap(CUtensorMap* map, const void* base, uint64_t rows, uint32_t box_rows,
                         CUtensorMapL2promotion promotion = CU_TENSOR_MAP_L2_PROMOTION_L2_256B) {
  auto encode = TensorMapEncoder();
  if (encode == nullptr) return false;
  cuuint64_t dims[2] = {static_cast<cuuint64_t>(kHeadDim), static_cast<cuuint64_t>(rows)};
  cuuint64_t strides[1] = {static_cast<cuuint64_t>(kHeadDim) * 2};
  cuuint32_t box[2] = {static_cast<cuuint32_t>(kChunkCols), box_rows};
  cuuint32_t elem_strides[2] = {1, 1};
  CUresult r = encode(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void*>(base), dims,
                      strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                      CU_TENSOR_MAP_SWIZZLE_128B, promotion,
                      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS;
}

inline bool ValidL2PromotionBytes(int bytes) {
  return bytes == 0 || bytes == 128 || bytes == 256;
}

inline CUtensorMapL2promotion L2PromotionOfBytes(int bytes) {
  return bytes == 0     ? CU_TENSOR_MAP_L2_PROMOTION_NONE
         : bytes == 128 ? CU_TENSOR_MAP_L2_PROMOTION_L2_128B
                        : CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
}

inline bool ValidShape(const DecodeParams& p) {
  if (p.batch < 1 || p.q_len < 1 || p.num_heads < 1 || p.num_pages < 1 || p.max_pages < 1) {
    return false;
  }
  if (p.page_size != 32 && p.page_size != 64) return false;
  if (static_cast<long long>(p.num_pages) * p.page_size >= (1ll << 31)) return false;
  // As jax_mla checks at trace time; ForEachPrefetchHalf indexes the block table in int.
  if (static_cast<long long>(p.max_pages) * p.page_size >= (1ll << 30)) return false;
  if (static_cast<long long>(p.batch) * p.q_len * p.num_heads >= (1ll << 31)) return false;
  if (!(p.softmax_scale > 0.f) || p.num_sms < 1 || p.schedule == nullptr) return false;
  if (p.fixed_cost_blocks < 0 || p.min_blocks_per_part < 1) return false;
  if ((reinterpret_cast<uintptr_t>(p.query) | reinterpret_cast<uintptr_t>(p.kv_cache) |
       reinterpret_cast<uintptr_t>(p.out) | reinterpret_cast<uintptr_t>(p.workspace)) & 15) {
    return false;
  }
  return true;
}

inline cudaError_t LaunchEx(const void* kernel, dim3 grid, dim3 block, size_t smem, bool pdl,
                            cudaStream_t stream, void** args, int cluster = 1) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster;
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  config.attrs = attr;
  config.numAttrs = n;
  return cudaLaunchKernelExC(&config, kernel, args);
}

}  // namespace detail

// Builds the split-KV schedule from seq_lens into p.schedule (once per step). Reads only
// seq_lens, batch, max_pages, page_size, schedule, fixed_cost_blocks and enable_pdl of p.
inline cudaError_t LaunchSchedule(const DecodeParams& p, cudaStream_t stream) {
  if (p.batch < 1 || p.max_pages < 1 || (p.page_size != 32 && p.page_size != 64) ||
      p.seq_lens == nullptr || p.schedule == nullptr || p.fixed_cost_blocks < 0) {
    return cudaErrorInvalidValue;
  }
  const int32_t* seq_lens = p.seq_lens;
  int batch = p.batch, max_pages = p.max_pages, page_size = p.page_size;
  int fixed_cost = p.fixed_cost_blocks;
  int32_t* schedule = p.schedule;
  void* args[] = {&seq_lens, &batch, &max_pages, &page_size, &fixed_cost, &schedule};
  return detail::LaunchEx(reinterpret_cast<const void*>(&ScheduleKernel), dim3(1),
                          dim3(kScheduleThreads), 0, p.enable_pdl, stream, args);
}

namespace detail {

struct KernelInfo {
  const void* kernel = nullptr;
  int device = -1;
  int max_clusters = 0;   // co-resident clusters of kCluster CTAs (0 when kCluster == 1)
  int blocks_per_sm = 0;  // blocks resident on one SM at once
};

// How many clusters of `cluster` CTAs of `kernel` (kThreads threads, smem_bytes of dynamic shared
// memory, its limit already raised) the device holds at once.
inline cudaError_t MaxActiveClusters(const void* kernel, int cluster, int smem_bytes,
                                     int* clusters) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(cluster);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem_bytes;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  return cudaOccupancyMaxActiveClusters(clusters, kernel, &config);
}

// Raises the shared-memory limit once per instantiation and device (function attributes are per
// device) and reads how many blocks of `threads` threads fit on an SM at once and, for cluster
// launches, how many clusters fit on the device at once (before any graph capture uses the
// kernel).
inline cudaError_t Prepare(const void* kernel, int threads, int cluster, int smem_bytes,
                           KernelInfo* info) {
  static std::mutex mutex;
  static KernelInfo cache[64];
  int device = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status != cudaSuccess) return status;
  std::lock_guard<std::mutex> lock(mutex);
  for (const KernelInfo& k : cache) {
    if (k.kernel == kernel && k.device == device) {
      *info = k;
      return cudaSuccess;
    }
  }
  status = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (status != cudaSuccess) return status;
  KernelInfo k;
  k.kernel = kernel;
  k.device = device;
  status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&k.blocks_per_sm, kernel, threads,
                                                         smem_bytes);
  if (status != cudaSuccess) return status;
  if (cluster > 1) {
    status = MaxActiveClusters(kernel, cluster, smem_bytes, &k.max_clusters);
    if (status != cudaSuccess) return status;
  }
  for (KernelInfo& slot : cache) {
    if (slot.kernel == nullptr) {
      slot = k;
      break;
    }
  }
  *info = k;
  return cudaSuccess;
}

// kScoreN of DecodeKernel for these options and q_len * num_heads rows (0: scores not transposed).
inline int TransposedScoreRows(const LaunchOptions& options, int cluster, int rows) {
  if (options.transposed_scores == 0 || cluster != 1 || options.experiment != 0 ||
      !options.early_release) {
    return 0;
  }
  if (rows <= 16) return 16;
  return rows <= 32 ? 32 : 0;
}

// Whether there are at least kCombineWarpsPerRow parts per request: few requests, each split many
// ways.
inline bool FewRequestsSplitWide(int batch, int parts) {
  return static_cast<long long>(batch) * kCombineWarpsPerRow <= parts;
}

// The default combine: CombineKernelWide where few requests are split wide (its parallel reads of
// the splits pay off), else CombineKernel (fewer, cheaper CTAs for the many requests that are
// mostly handled whole).
inline bool UseWideCombine(const LaunchOptions& options, int batch, int parts) {
  if (options.wide_combine >= 0) return options.wide_combine != 0;
  return FewRequestsSplitWide(batch, parts);
}

// Whether split requests' partial outputs are stored in bf16 (DecodeKernelArgs::bf16_partials;
// both combine kernels read either): by default in the 64-row tiles (score_n == 0), whose
// partial stores are whole 16-byte chunks, not in the transposed kernels, whose stores are
// scattered 2-byte ones (docs/sm90-kernel.md, "Measurements").
inline bool UseBf16Partials(const LaunchOptions& options, int score_n) {
  if (options.bf16_partials >= 0) return options.bf16_partials != 0;
  return score_n == 0;
}

// The bf16 cache's tensor-map L2 promotion for `batch` requests over `parts` parts: by default 128
// bytes for the transposed kernel of up to 16 query rows, and for the one of up to 32 where few
// requests are split wide (FewRequestsSplitWide), 256 bytes elsewhere (docs/sm90-kernel.md, "L2
// promotion of the KV map").
inline CUtensorMapL2promotion KvL2Promotion(const LaunchOptions& options, int score_n, int batch,
                                            int parts) {
  const bool promote_128 =
      score_n == 16 || (score_n == 32 && FewRequestsSplitWide(batch, parts));
  return L2PromotionOfBytes(options.kv_l2_promotion >= 0 ? options.kv_l2_promotion
                                                        : (promote_128 ? 128 : 256));
}

// Whether the fp8 cache's kernel for kScoreN score_n is a register-operand one: DecodeFp8RegsKernel
// at 16, DecodeFp8SplitKernel at 32.
inline bool UseFp8Registers(const LaunchOptions& options, bool fp8, int score_n) {
  return fp8 && (score_n == 16 || score_n == 32) && options.fp8_registers != 0;
}

// Dynamic shared memory of the kernel SelectKernel picks for kScoreN score_n.
inline int KernelSmemBytes(const LaunchOptions& options, bool fp8, int score_n) {
  if (!fp8) return SmemLayout<false>::kBytes;
  if (UseFp8Registers(options, fp8, score_n)) {
    return score_n == 16 ? Fp8RegsSmemLayout::kBytes : Fp8SplitSmemLayout::kBytes;
  }
  return score_n > 0 ? KernelSmemLayout<true, kFp8TransposedRows>::kBytes
                     : KernelSmemLayout<true, 0>::kBytes;
}

// Block tables of at most this many tokens in all (batch x max_pages x page_size) run the 64-row
// tiles without clusters: the host sees only the table's capacity, and the few KV blocks a part
// that a small one allows gain less from multicast than the pair costs (docs/sm90-kernel.md,
// "Clusters at small tables").
constexpr long long kUnclusteredTableTokens = 24576;

// The cluster size for these options: by default 2 (the M-tile pair multicasting each KV tile)
// where the bf16 cache's 64-row tiles come in an even number of M tiles, the block table holds
// more than kUnclusteredTableTokens tokens and no experiment or late release is asked for.
// Multicast halves the tiles' traffic out of L2 (docs/sm90-kernel.md, "Power", says when that
// pays).
inline int ClusterSize(const LaunchOptions& options, const DecodeParams& p) {
  if (options.cluster >= 1) return options.cluster;
  const long long table_tokens = static_cast<long long>(p.batch) * p.max_pages * p.page_size;
  return !p.kv_fp8 && options.early_release && options.experiment == 0 &&
                 NumMTiles(p.q_len, p.num_heads) % 2 == 0 && table_tokens > kUnclusteredTableTokens
             ? 2
             : 1;
}

// Whether the bf16 cache's 64-row tiles release each stage in two parts (DecodeKernel's
// kSplitRelease): only where asked for. By default each stage goes back whole (docs/sm90-kernel.md,
// "The stage released whole").
inline bool UseSplitRelease(const LaunchOptions& options) { return options.split_release == 1; }

#ifdef JAX_MLA_SM90_EXPERIMENTS
#define JAX_MLA_SM90_EXPERIMENT_KERNEL(...) reinterpret_cast<const void*>(&__VA_ARGS__)
#else
#define JAX_MLA_SM90_EXPERIMENT_KERNEL(...) nullptr
#endif

// DecodeKernel with kColumnHalves for a cluster of 1 or 2 CTAs (the fp8 cache: 1).
inline const void* ColumnHalvesKernel(int cluster, bool fp8) {
  if (fp8) return reinterpret_cast<const void*>(&DecodeKernel<true, 0, 1, 0, true, false, true>);
  if (cluster == 2) {
    return reinterpret_cast<const void*>(&DecodeKernel<true, 0, 2, 0, false, false, true>);
  }
  return reinterpret_cast<const void*>(&DecodeKernel<true, 0, 1, 0, false, false, true>);
}

// The decode kernel for these options, rows and cache format; nullptr for a combination that has
// none (the fp8 cache has no experiments, clusters or late release) or whose kernel this build
// leaves out (JAX_MLA_SM90_EXPERIMENT_KERNEL).
inline const void* SelectKernel(const LaunchOptions& options, int cluster, int rows, bool fp8) {
  if (fp8) {
    if (cluster != 1 || options.experiment != 0 || !options.early_release) return nullptr;
    const int score_n = TransposedScoreRows(options, cluster, rows);
    if (UseFp8Registers(options, fp8, score_n)) {
      return score_n == 16 ? reinterpret_cast<const void*>(&DecodeFp8RegsKernel)
                           : reinterpret_cast<const void*>(&DecodeFp8SplitKernel);
    }
    switch (score_n) {
      case 16: return JAX_MLA_SM90_EXPERIMENT_KERNEL(DecodeKernel<true, 0, 1, 16, true>);
      case 32: return JAX_MLA_SM90_EXPERIMENT_KERNEL(DecodeKernel<true, 0, 1, 32, true>);
      default: return reinterpret_cast<const void*>(&DecodeKernel<true, 0, 1, 0, true>);
    }
  }
  switch (TransposedScoreRows(options, cluster, rows)) {
    case 16: return reinterpret_cast<const void*>(&DecodeKernel<true, 0, 1, 16>);
    case 32: return reinterpret_cast<const void*>(&DecodeKernel<true, 0, 1, 32>);
    default: break;
  }
  if (cluster == 2) {
    if (!options.early_release) return nullptr;
    switch (options.experiment) {
      case 0: return UseSplitRelease(options)
                         ? JAX_MLA_SM90_EXPERIMENT_KERNEL(DecodeKernel<true, 0, 2, 0, false, true>)
                         : reinterpret_cast<const void*>(&DecodeKernel<true, 0, 2>);
      case 7: return JAX_MLA_SM90_EXPERIMENT_KERNEL(DecodeKernel<true, 7, 2>);
      default: return nullptr;
    }
  }
  if (options.early_release && UseSplitRelease(options)) {
    switch (options.experiment) {
      case 0: return JAX_MLA_SM90_EXPERIMENT_KERNEL(DecodeKernel<true, 0, 1, 0, false, true>);
      case 32: return JAX_MLA_SM90_EXPERIMENT_KERNEL(DecodeKernel<true, 32, 1, 0, false, true>);
      default: break;
    }
  }
  switch (options.experiment) {
    case 0: return options.early_release ? reinterpret_cast<const void*>(&DecodeKernel<true, 0>)
                                         : JAX_MLA_SM90_EXPERIMENT_KERNEL(DecodeKernel<false, 0>);
    case 1: return JAX_MLA_SM90_EXPERIMENT_KERNEL(DecodeKernel<true, 1>);
    case 2: return JAX_MLA_SM90_EXPERIMENT_KERNEL(DecodeKernel<true, 2>);
    case 3: return JAX_MLA_SM90_EXPERIMENT_KERNEL(DecodeKernel<true, 3>);
    case 4: return JAX_MLA_SM90_EXPERIMENT_KERNEL(DecodeKernel<true, 4>);
    case 7: return JAX_MLA_SM90_EXPERIMENT_KERNEL(DecodeKernel<true, 7>);
    case 32: return JAX_MLA_SM90_EXPERIMENT_KERNEL(DecodeKernel<true, 32>);
    default: return nullptr;
  }
}

// CombineKernelWide's instance for its rows in flight and the partials' type; nullptr for rows in
// flight it has no instance for (other than 32, 16 and 8).
inline const void* WideCombineKernel(int rows_in_flight, bool bf16_partials) {
  switch (rows_in_flight) {
    case 32:
      return bf16_partials ? reinterpret_cast<const void*>(&CombineKernelWide<32, true>)
                           : reinterpret_cast<const void*>(&CombineKernelWide<32, false>);
    case 16:
      return bf16_partials ? reinterpret_cast<const void*>(&CombineKernelWide<16, true>)
                           : reinterpret_cast<const void*>(&CombineKernelWide<16, false>);
    case 8:
      return bf16_partials ? reinterpret_cast<const void*>(&CombineKernelWide<8, true>)
                           : reinterpret_cast<const void*>(&CombineKernelWide<8, false>);
    default:
      return nullptr;
  }
}

// What LaunchDecode launches for a problem and its options.
struct KernelChoice {
  int rows = 0;        // query rows, q_len * num_heads
  int m_tiles = 0;     // 64-row tiles of those rows
  int cluster = 1;     // CTAs a cluster
  int score_n = 0;     // DecodeKernel's kScoreN (0: 64-row tiles)
  const void* kernel = nullptr;
};

// LaunchDecode's argument checks, made before any CUDA call, and its kernel: cudaErrorInvalidValue
// for shapes the kernels do not take, options outside their documented values and combinations
// no kernel implements; cudaSuccess otherwise, with *choice filled in.
inline cudaError_t ChooseKernel(const DecodeParams& p, const LaunchOptions& options,
                                KernelChoice* choice) {
  if (!ValidShape(p)) return cudaErrorInvalidValue;
  const int rows = p.q_len * p.num_heads;
  const int m_tiles = NumMTiles(p.q_len, p.num_heads);
  if (options.cluster < -1 || options.cluster == 0 || options.transposed_scores < -1 ||
      options.transposed_scores > 0 || options.wide_combine < -1 || options.wide_combine > 1 ||
      options.split_release < -1 || options.split_release > 1 || options.bf16_partials < -1 ||
      options.bf16_partials > 1 || options.fp8_registers < -1 || options.fp8_registers > 1 ||
      options.staged_combine < -1 || options.staged_combine > 1 ||
      options.column_halves < -1 || options.column_halves > 1 ||
      (options.kv_l2_promotion != -1 && !detail::ValidL2PromotionBytes(options.kv_l2_promotion)) ||
      (options.combine_rows_in_flight != -1 &&
       WideCombineKernel(options.combine_rows_in_flight, false) == nullptr) ||
      (options.block_to_split_cost != -1 && options.block_to_split_cost < 1)) {
    return cudaErrorInvalidValue;
  }
#ifndef JAX_MLA_SM90_EXPERIMENTS
  if (!options.combine) return cudaErrorInvalidValue;
#endif
  const int cluster = ClusterSize(options, p);
  if (cluster != 1 && (cluster != 2 || m_tiles % 2 != 0)) return cudaErrorInvalidValue;
  const void* kernel = SelectKernel(options, cluster, rows, p.kv_fp8);
  const int score_n = TransposedScoreRows(options, cluster, rows);
  if (kernel == nullptr || (options.bf16_partials == 1 && score_n != 0)) {
    return cudaErrorInvalidValue;
  }
  *choice = {rows, m_tiles, cluster, score_n, kernel};
  return cudaSuccess;
}

// CombineKernelWide's partial rows in flight per lane: what `combine_rows_in_flight` names, else
// the most of 32 and 16 whose grid (rows / kCombineWideRowsPerBlock x batch blocks) is resident
// at once, `blocks_per_sm_32` and `blocks_per_sm_16` of that kernel's blocks an SM
// (docs/sm90-kernel.md, "The wide combine's rows in flight"), and 8 elsewhere.
inline int CombineRowsInFlight(const LaunchOptions& options, int rows, int batch, int num_sms,
                               int blocks_per_sm_32, int blocks_per_sm_16) {
  if (options.combine_rows_in_flight >= 0) return options.combine_rows_in_flight;
  const long long blocks =
      static_cast<long long>(CeilDivInt(rows, kCombineWideRowsPerBlock)) * batch;
  if (blocks <= static_cast<long long>(num_sms) * blocks_per_sm_32) return 32;
  return blocks <= static_cast<long long>(num_sms) * blocks_per_sm_16 ? 16 : 8;
}

// The combine kernel LaunchDecode runs behind the decode, and its launch shape.
struct CombineLaunch {
  const void* kernel;
  dim3 grid, block;
  int smem_bytes;
};

// CombineKernelStaged's instance for the partials' type, for `rows` output rows a request.
template <bool kBf16Partials>
inline CombineLaunch StagedLaunchOf(int rows, int batch) {
  using Shape = StagedShape<kBf16Partials>;
  return {reinterpret_cast<const void*>(&CombineKernelStaged<kBf16Partials>),
          dim3(Shape::GridX(rows), batch), dim3(Shape::kThreads), Shape::kSmemBytes};
}
inline CombineLaunch StagedCombine(bool bf16_partials, int rows, int batch) {
  return bf16_partials ? StagedLaunchOf<true>(rows, batch) : StagedLaunchOf<false>(rows, batch);
}

// Whether the wide combine is CombineKernelStaged: by default where its grid (one block per SM for
// its shared memory) fits the SMs in one wave, unless `combine_rows_in_flight` names the loading
// kernel's rows in flight.
inline bool UseStagedCombine(const LaunchOptions& options, int rows, int batch, int num_sms,
                             bool bf16_partials) {
  if (options.staged_combine >= 0) return options.staged_combine != 0;
  if (options.combine_rows_in_flight >= 0) return false;
  return static_cast<long long>(StagedCombine(bf16_partials, rows, 1).grid.x) * batch <= num_sms;
}

// The combine for these options: the wide one (staged or loading, with 32, 16 or 8 rows in
// flight) or the narrow one, as the Use* rules above choose.
inline CombineLaunch ChooseCombine(const LaunchOptions& options, const DecodeParams& p, int rows,
                                   int parts, bool wide_combine, bool bf16_partials,
                                   int rows_in_flight) {
  if (wide_combine && UseStagedCombine(options, rows, p.batch, p.num_sms, bf16_partials)) {
    return StagedCombine(bf16_partials, rows, p.batch);
  }
  if (wide_combine) {
    return {WideCombineKernel(rows_in_flight, bf16_partials),
            dim3(CeilDivInt(rows, kCombineWideRowsPerBlock), p.batch), dim3(kCombineWideThreads),
            0};
  }
  return {bf16_partials ? reinterpret_cast<const void*>(&CombineKernel<true>)
                        : reinterpret_cast<const void*>(&CombineKernel<false>),
          dim3(CeilDivInt(rows, kCombineRowsPerBlock), CombineGridRows(p.batch, parts)),
          dim3(kCombineRowsPerBlock * 32), 0};
}

// p as the decode and combine kernels read the schedule with it: the split cost of the kernel that
// runs (score_n as ChooseKernel gives it) unless `block_to_split_cost` (LaunchOptions') names one,
// and parts of one KV block only where the combine merges in one wave (the wide combine with 32
// rows in flight).
inline DecodeParams ScheduleAsRead(const DecodeParams& p, int score_n, bool one_wave_combine,
                                   int block_to_split_cost = -1) {
  DecodeParams sp = p;
  sp.block_to_split_cost = block_to_split_cost > 0       ? block_to_split_cost
                           : p.kv_fp8 && score_n == 0 ? kBlockToSplitCostFp8Tiles
                           : !p.kv_fp8 && score_n == 16 ? kBlockToSplitCostScores16
                                                        : kBlockToSplitCost;
  if (!one_wave_combine && sp.min_blocks_per_part < kMinBlocksPerPartBeyondOneWave) {
    sp.min_blocks_per_part = kMinBlocksPerPartBeyondOneWave;
  }
  return sp;
}

// UseColumnHalves' default for one cache: at most max_batch requests, and half the parts at most
// longer_num / longer_den times as long as all of them. The fp8 cache's is tighter: both CTAs of
// a part also convert each block into their tile.
struct ColumnHalvesRule {
  int max_batch, longer_num, longer_den;
};
constexpr ColumnHalvesRule kColumnHalvesBf16{2, 5, 3};
constexpr ColumnHalvesRule kColumnHalvesFp8{1, 3, 2};
constexpr int kColumnHalvesMaxMTiles = 2;

// Whether the 64-row tiles run with kColumnHalves over `parts` / 2 parts (DecodeKernel;
// a grid of `parts` x M tiles holds two CTAs of each part): 1 always, 0 never, and by default for
// up to two requests (one on the fp8 cache) of up to kColumnHalvesMaxMTiles M tiles where, were
// every request as long as the block table allows, half the parts would be at most 5/3 as long as
// all of them, 3/2 on the fp8 cache (docs/sm90-kernel.md, "Column halves"); not with the split
// release or experiments.
inline bool UseColumnHalves(const LaunchOptions& options, const DecodeParams& p, int score_n,
                            int parts) {
  if (options.column_halves == 0 || score_n != 0 || !options.early_release ||
      UseSplitRelease(options) || options.experiment != 0 || parts < 2) {
    return false;
  }
  if (options.column_halves == 1) return true;
  const ColumnHalvesRule& rule = p.kv_fp8 ? kColumnHalvesFp8 : kColumnHalvesBf16;
  if (p.batch > rule.max_batch || NumMTiles(p.q_len, p.num_heads) > kColumnHalvesMaxMTiles) {
    return false;
  }
  const DecodeParams sp = ScheduleAsRead(p, score_n, true, options.block_to_split_cost);
  const long long most = static_cast<long long>(p.batch) *
                         RequestCost(INT32_MAX, p.max_pages, p.page_size, sp.fixed_cost_blocks);
  if (most > INT32_MAX) return false;
  const int total = static_cast<int>(most);
  return static_cast<long long>(rule.longer_den) * UnitsPerPart(sp, total, parts / 2) <=
         static_cast<long long>(rule.longer_num) * UnitsPerPart(sp, total, parts);
}

// ChooseKernel's checks alone.
inline cudaError_t CheckLaunch(const DecodeParams& p, const LaunchOptions& options) {
  KernelChoice choice;
  return ChooseKernel(p, options, &choice);
}

}  // namespace detail

// Decode (and combine) one layer, reading the schedule LaunchSchedule wrote.
inline cudaError_t LaunchDecode(const DecodeParams& p, cudaStream_t stream,
                                const LaunchOptions& options = LaunchOptions()) {
  detail::KernelChoice choice;
  cudaError_t err = detail::ChooseKernel(p, options, &choice);
  if (err != cudaSuccess) return err;
  const int rows = choice.rows;
  const int m_tiles = choice.m_tiles;
  const int cluster = choice.cluster;
  const void* kernel = choice.kernel;  // replaced below with column halves
  const int score_n = choice.score_n;
  const int smem_bytes = detail::KernelSmemBytes(options, p.kv_fp8, score_n);
  detail::KernelInfo info;
  err = detail::Prepare(kernel, kThreads, cluster, smem_bytes, &info);
  if (err != cudaSuccess) return err;

  int parts = NumParts(p.num_sms, p.q_len, p.num_heads);
  if (cluster > 1) {
    const int fit = info.max_clusters * cluster / m_tiles;  // parts whose clusters all fit at once
    if (fit >= 1 && fit < parts) parts = fit;
  }
  // With column halves `parts` counts the schedule's parts, and the grid holds two CTAs of each.
  const bool column_halves = detail::UseColumnHalves(options, p, score_n, parts);
  if (column_halves) {
    parts /= 2;
    kernel = detail::ColumnHalvesKernel(cluster, p.kv_fp8);
    err = detail::Prepare(kernel, kThreads, cluster, smem_bytes, &info);
    if (err != cudaSuccess) return err;
  }
  const int grid_parts = column_halves ? 2 * parts : parts;
  const bool wide_combine = detail::UseWideCombine(options, p.batch, parts);
  const bool bf16_partials = detail::UseBf16Partials(options, score_n);
  // The 32- and 16-row wide combines' occupancy, where the wide combine runs.
  detail::KernelInfo wide_32, wide_16;
  if (wide_combine) {
    err = detail::Prepare(detail::WideCombineKernel(32, bf16_partials), kCombineWideThreads, 1, 0,
                          &wide_32);
    if (err == cudaSuccess) {
      err = detail::Prepare(detail::WideCombineKernel(16, bf16_partials), kCombineWideThreads, 1,
                            0, &wide_16);
    }
    if (err != cudaSuccess) return err;
  }
  const int rows_in_flight = detail::CombineRowsInFlight(
      options, rows, p.batch, p.num_sms, wide_32.blocks_per_sm, wide_16.blocks_per_sm);
  DecodeParams sp =
      detail::ScheduleAsRead(p, score_n, wide_combine && rows_in_flight == 32,
                             options.block_to_split_cost);
  // Chosen, and its shared memory granted, before the decode is launched: a combine that cannot
  // launch must not leave a decode behind it.
  const detail::CombineLaunch combine =
      detail::ChooseCombine(options, p, rows, parts, wide_combine, bf16_partials, rows_in_flight);
  if (combine.smem_bytes > 0) {
    detail::KernelInfo combine_info;
    err = detail::Prepare(combine.kernel, static_cast<int>(combine.block.x), 1, combine.smem_bytes,
                          &combine_info);
    if (err != cudaSuccess) return err;
  }
  DecodeKernelArgs args;
  args.p = sp;
  args.num_parts = parts;
  args.bf16_partials = bf16_partials;
  args.q_box_rows = rows < kBlockM ? rows : kBlockM;
  const bool evict_first =
      options.kv_evict_first < 0 ? (m_tiles == 1 || cluster == m_tiles) && !column_halves
                                 : options.kv_evict_first != 0;
  args.kv_cache_hint = static_cast<uint64_t>(evict_first ? cute::TMA::CacheHintSm90::EVICT_FIRST
                                                         : cute::TMA::CacheHintSm90::EVICT_NORMAL);
  args.scale_log2 = p.softmax_scale * 1.4426950408889634f;

  // The fp8 cache's rows are staged by plain bulk copies: its kernels read no cache tensor map.
  CUtensorMap q_map, kv_map = {};
  if (!detail::EncodeRowMap(&q_map, p.query, static_cast<uint64_t>(p.batch) * rows,
                            args.q_box_rows) ||
      (!p.kv_fp8 && !detail::EncodeRowMap(&kv_map, p.kv_cache,
                                          static_cast<uint64_t>(p.num_pages) * p.page_size,
                                          p.page_size == kBlockN ? kBlockN : kHalfN,
                                          detail::KvL2Promotion(options, score_n, p.batch,
                                                                parts)))) {
    return cudaErrorInvalidValue;
  }
  void* decode_args[] = {&q_map, &kv_map, &args};
  // CTA (part, M tile) is number part x m_tiles + M tile: the M tiles of a part, which read the
  // same KV tiles, start side by side (and a cluster of two is a pair of them); with column halves
  // CTA (part, M tile) of the columns' upper half is (parts + part) x m_tiles + M tile.
  err = detail::LaunchEx(kernel, dim3(grid_parts * m_tiles), dim3(kThreads), smem_bytes,
                         p.enable_pdl, stream, decode_args, cluster);
  if (err != cudaSuccess || !options.combine) return err;

  int num_parts = parts;
  void* combine_args[] = {&sp, &num_parts};
  return detail::LaunchEx(combine.kernel, combine.grid, combine.block, combine.smem_bytes,
                          p.enable_pdl, stream, combine_args);
}

}  // namespace sm90
}  // namespace jax_mla
