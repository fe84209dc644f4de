// Standalone check and timing harness of the SM90 MLA decode kernel (ffi/sm90), no Python.
//
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I. \
//        -I<CUTLASS include dir> --expt-relaxed-constexpr \
//        benchmarks/sm90_harness.cu -o .gpu/sm90_harness
//   .gpu/sm90_harness check            # correctness suite against a GPU fp32 reference (and the
//                                      # combine's warp-wide request search against FindRequest)
//   .gpu/sm90_harness sanitize         # small cases, for compute-sanitizer
//   .gpu/sm90_harness check-fp8 | sanitize-fp8   # the same for the fp8 cache
//   .gpu/sm90_harness combines-agree[-fp8]  # the staged and the loading wide combine give the
//                                      # same bytes on every case of the check suite
//   .gpu/sm90_harness time-fp8 [iters] # the fp8 cache beside the bf16 cache, same problems
//   .gpu/sm90_harness time [iters] [default|cluster|exp|transposed|combine|release|partials|all]
//                                      # timing grid (graph replay, rotating caches), with the
//                                      # default launch and the named LaunchOptions variants
//                                      # (variants other than default, transposed and combine
//                                      # take the plain-score kernel also where q_len * H <= 32)
//   .gpu/sm90_harness profile B L H [q_len]   # two decodes of one problem (for ncu)
//   .gpu/sm90_harness clusters         # clusters of 1-16 decode CTAs the device holds at once
//   .gpu/sm90_harness one --B 8 --L 4096 --H 16 --q-len 1 --page 64 [--dist fixed|uniform|skew]
//                         [--variants default|cluster|exp|segments|transposed|combine|release|
//                                     partials|l2|fp8-kernels|halves|all]
//                         [--bad] [--fp8] [--iters N] [--check-only] [--ref-requests N]
//   .gpu/sm90_harness trace --B 8 --L 4096 --H 16 ...   # one decode's event timeline per CTA
//                         (the options of `one`; needs a build with -DJAX_MLA_SM90_TRACE)
//   --cluster2 / --cluster1 (any mode): checks and default timings use LaunchOptions::cluster = 2
//   where the number of M tiles is even / cluster = 1 everywhere (default: the launcher's choice).
//   --fixed-cost N, --min-blocks N (any mode): the schedule's cost model (DecodeParams'
//   fixed_cost_blocks and min_blocks_per_part) for every check and timing of the run;
//   --split-cost N (any mode): LaunchOptions::block_to_split_cost of every launch.
//   --no-pdl (any mode): DecodeParams::enable_pdl = false (no programmatic dependent launch).
//   --stream (timings): the launches timed on the stream, as XLA issues them without command
//   buffers, instead of replayed from a CUDA graph of them.
//   --child-graphs (timings): the graph built as XLA's command buffer records custom calls: the
//   schedule and each layer's decode and combine captured into a graph of their own, added to the
//   replayed graph as a child node after the one before.
//   --fp8-transposed (checks only): LaunchOptions::fp8_registers = 0 (the fp8 cache up to 32 rows
//   in DecodeKernel's transposed path instead of the register-operand kernels).
//   --plain-scores, --wide-combine, --narrow-combine, --staged-combine, --loaded-combine,
//   --split-release, --whole-release, --fp32-partials, --bf16-partials (checks only):
//   LaunchOptions' transposed_scores = 0, wide_combine = 1, wide_combine = 0, staged_combine = 1,
//   staged_combine = 0, split_release = 1, split_release = 0, bf16_partials = 0, bf16_partials = 1
//   (in 64-row tiles; the transposed kernels keep the default).
//   --column-halves, --whole-columns (checks, sanitize and trace): LaunchOptions::column_halves =
//   1 (wherever the 64-row tiles run), 0.
//
// Inputs: random bf16 query and cache (or fp8 cache rows quantised from random values, each latent
// group of its own magnitude), page ids shuffled, every cache byte not holding a token (unused
// pages, page tails) 0xFF (NaN in bf16, e4m3 and the f32 scales), block-table padding garbage (out-of-range ids and ids of
// NaN pages). --bad adds out-of-range page ids inside the lengths and lengths of 0, < q_len and
// over the table's capacity. The reference treats them as the kernel documents: lengths clamped
// to [0, capacity], tokens of out-of-range pages masked, rows that see nothing give 0 and -inf.
// The launcher's experiment kernels (LaunchOptions) are compiled in here.
#define JAX_MLA_SM90_EXPERIMENTS
#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include <cuda_fp8.h>

#include "ffi/sm90/launch.cuh"

using namespace jax_mla::sm90;

static int g_cluster = -1;  // LaunchOptions::cluster of checks and default timings (--cluster2/1)
static int g_fixed_cost = kFixedCostBlocks;   // "--fixed-cost N"
static int g_min_blocks = kMinBlocksPerPart;  // "--min-blocks N"
static int g_split_cost = -1;  // LaunchOptions::block_to_split_cost ("--split-cost N")
static bool g_pdl = true;      // DecodeParams::enable_pdl ("--no-pdl": false)
static bool g_stream = false;  // timings launch on the stream instead of replaying a graph
static bool g_child_graphs = false;  // the replayed graph holds each call as a child graph
static int g_fp8_registers = -1;  // LaunchOptions::fp8_registers of checks ("--fp8-transposed": 0)
static int g_transposed = -1;  // LaunchOptions::transposed_scores of checks ("--plain-scores": 0)
static int g_wide_combine = -1;  // LaunchOptions::wide_combine of checks ("--wide-combine": 1,
                                 // "--narrow-combine": 0)
static int g_staged_combine = -1;  // LaunchOptions::staged_combine of checks ("--staged-combine":
                                   // 1, "--loaded-combine": 0)
static int g_split_release = -1;  // LaunchOptions::split_release of checks ("--split-release": 1,
                                  // "--whole-release": 0)
static int g_bf16_partials = -1;  // LaunchOptions::bf16_partials of checks ("--fp32-partials": 0,
                                  // "--bf16-partials": 1)
static int g_column_halves = -1;  // LaunchOptions::column_halves of checks ("--column-halves": 1,
                                  // "--whole-columns": 0)
static bool g_fail_closed = false;  // DecodeParams::fail_closed of every launch ("--fail-closed")

#define CHECK_CUDA(call)                                                                  \
  do {                                                                                    \
    cudaError_t status_ = (call);                                                         \
    if (status_ != cudaSuccess) {                                                         \
      printf("CUDA error %s at %s:%d\n", cudaGetErrorString(status_), __FILE__, __LINE__); \
      exit(2);                                                                            \
    }                                                                                     \
  } while (0)

// ------------------------------------------------------------------------------ device helpers
__device__ __forceinline__ uint32_t Hash(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}
__device__ __forceinline__ float RandUniform(uint64_t seed, uint64_t i) {
  return (Hash(seed * 0x9E3779B97F4A7C15ull + i) >> 8) * (2.0f / 16777216.0f) - 1.0f;
}

__global__ void FillRandom(__nv_bfloat16* x, size_t n, uint64_t seed, float amp) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
       i += (size_t)gridDim.x * blockDim.x) {
    x[i] = __float2bfloat16(amp * RandUniform(seed, i));
  }
}

// Writes the fp8 cache row of random values x (times `gain`) as write_kv does (docs/fp8-cache.md):
// per latent group of 128 channels (magnitude 2^(group - 1)) the power-of-two scale
// 2^ceil(log2(max|x| / 448)) and e4m3(x / scale), then the bf16 rope (one warp per row).
__device__ void WriteFp8Row(uint8_t* row_bytes, size_t row, uint64_t seed, float gain) {
  const int lane = threadIdx.x % 32;
  for (int g = 0; g < kLatentDim / kFp8GroupSize; ++g) {
    float x[kFp8GroupSize / 32];
    float amax = 0.f;
    for (int i = 0; i < kFp8GroupSize / 32; ++i) {
      const int c = g * kFp8GroupSize + 32 * i + lane;
      x[i] = gain * ldexpf(RandUniform(seed, row * kHeadDim + c), g - 1);
      amax = fmaxf(amax, fabsf(x[i]));
    }
    for (int d = 16; d > 0; d /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, d));
    int exponent = 0;
    const float mantissa = frexpf(amax, &exponent);  // amax = mantissa 2^exponent, [0.5, 1)
    // 448 = 0.875 x 2^9: the smallest k with amax <= 448 x 2^k.
    const float scale = amax > 0.f ? ldexpf(1.f, exponent - 9 + (mantissa > 0.875f)) : 1.f;
    for (int i = 0; i < kFp8GroupSize / 32; ++i) {
      row_bytes[g * kFp8GroupSize + 32 * i + lane] =
          __nv_cvt_float_to_fp8(x[i] / scale, __NV_SATFINITE, __NV_E4M3);
    }
    if (lane == 0) memcpy(row_bytes + kFp8ScalesOffset + 4 * g, &scale, 4);
  }
  for (int c = lane; c < kRopeDim; c += 32) {
    const __nv_bfloat16 v =
        __float2bfloat16(gain * RandUniform(seed, row * kHeadDim + kLatentDim + c));
    memcpy(row_bytes + kFp8RopeOffset + 2 * c, &v, 2);
  }
}

// Writes random values into the cache rows of every token < the clamped length (valid pages),
// token t's times gain (1 + growth * t): bf16 rows of 576, or fp8 rows of kFp8RowBytes.
__global__ void FillTokens(void* cache, bool fp8, const int* block_tables, const int* seq_lens,
                           int max_pages, int page_size, int num_pages, uint64_t seed,
                           float growth, float gain0) {
  const int b = blockIdx.y;
  const long long cap = (long long)max_pages * page_size;
  const int len = (int)std::min<long long>(std::max(seq_lens[b], 0), cap);
  for (int t = blockIdx.x; t < len; t += gridDim.x) {
    const int page = block_tables[(size_t)b * max_pages + t / page_size];
    if (page < 0 || page >= num_pages) continue;
    const size_t row = (size_t)page * page_size + t % page_size;
    const float gain = gain0 * (1.f + growth * t);
    if (fp8) {
      if (threadIdx.x < 32) {
        WriteFp8Row(static_cast<uint8_t*>(cache) + row * kFp8RowBytes, row, seed, gain);
      }
      continue;
    }
    __nv_bfloat16* rows = static_cast<__nv_bfloat16*>(cache);
    for (int c = threadIdx.x; c < kHeadDim; c += blockDim.x) {
      rows[row * kHeadDim + c] = __float2bfloat16(gain * RandUniform(seed, row * kHeadDim + c));
    }
  }
}

// Channel c of cache row `row` as float: bf16, or the fp8 cache's e4m3 x scale (latent) and bf16
// (rope).
__device__ __forceinline__ float CacheValue(const void* cache, bool fp8, size_t row, int c) {
  if (!fp8) return __bfloat162float(static_cast<const __nv_bfloat16*>(cache)[row * kHeadDim + c]);
  const uint8_t* r = static_cast<const uint8_t*>(cache) + row * kFp8RowBytes;
  if (c >= kLatentDim) {
    __nv_bfloat16 v;
    memcpy(&v, r + kFp8RopeOffset + 2 * (c - kLatentDim), 2);
    return __bfloat162float(v);
  }
  float scale;
  memcpy(&scale, r + kFp8ScalesOffset + 4 * (c / kFp8GroupSize), 4);
  const __half_raw h = __nv_cvt_fp8_to_halfraw(r[c], __NV_E4M3);
  return __half2float(__half(h)) * scale;
}

// fp32 reference: one block per (query row, request).
constexpr int kRefThreads = 256;
__global__ void __launch_bounds__(kRefThreads)
ReferenceKernel(const __nv_bfloat16* q, const void* cache, bool fp8, const int* block_tables,
                const int* seq_lens, int q_len, int num_heads, int num_pages, int page_size,
                int max_pages, float softmax_scale, float output_scale, float* scores,
                size_t scores_stride, float* out, float* lse) {
  const int rows = q_len * num_heads;
  const int row = blockIdx.x, b = blockIdx.y;
  const size_t gr = (size_t)b * rows + row;
  __shared__ float qs[kHeadDim];
  __shared__ float red[kRefThreads];
  for (int c = threadIdx.x; c < kHeadDim; c += blockDim.x) {
    qs[c] = __bfloat162float(q[gr * kHeadDim + c]);
  }
  __syncthreads();
  const long long cap = (long long)max_pages * page_size;
  const int len = (int)std::min<long long>(std::max(seq_lens[b], 0), cap);
  const int n_vis = std::max(0, len - q_len + row / num_heads + 1);
  float* sc = scores + (size_t)blockIdx.x * scores_stride + (size_t)blockIdx.y * gridDim.x * scores_stride;
  float local_max = -INFINITY;
  for (int t = threadIdx.x; t < n_vis; t += blockDim.x) {
    const int page = block_tables[(size_t)b * max_pages + t / page_size];
    float s = -INFINITY;
    if (page >= 0 && page < num_pages) {
      const size_t kv_row = (size_t)page * page_size + t % page_size;
      float acc = 0.f;
      for (int c = 0; c < kHeadDim; ++c) acc += qs[c] * CacheValue(cache, fp8, kv_row, c);
      s = acc * softmax_scale;
    }
    sc[t] = s;
    local_max = fmaxf(local_max, s);
  }
  red[threadIdx.x] = local_max;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + w]);
    __syncthreads();
  }
  const float mx = red[0];
  __syncthreads();
  float local_sum = 0.f;
  for (int t = threadIdx.x; t < n_vis; t += blockDim.x) {
    const float p = mx == -INFINITY ? 0.f : expf(sc[t] - mx);
    sc[t] = p;
    local_sum += p;
  }
  red[threadIdx.x] = local_sum;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
    __syncthreads();
  }
  const float sum = red[0];
  for (int c = threadIdx.x; c < kLatentDim; c += blockDim.x) {
    float acc = 0.f;
    for (int t = 0; t < n_vis; ++t) {
      const float p = sc[t];
      if (p == 0.f) continue;
      const int page = block_tables[(size_t)b * max_pages + t / page_size];
      acc += p * CacheValue(cache, fp8, (size_t)page * page_size + t % page_size, c);
    }
    out[gr * kLatentDim + c] = sum > 0.f ? acc / sum * output_scale : 0.f;
  }
  if (threadIdx.x == 0) lse[gr] = sum > 0.f ? mx + logf(sum) : -INFINITY;
}

// ------------------------------------------------------------------------------ host side
static float Bf16ToFloat(uint16_t v) {
  uint32_t u = (uint32_t)v << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

struct CaseSpec {
  std::string name;
  int batch = 1, q_len = 1, heads = 128, page = 64, L = 4096;
  std::string dist = "uniform";  // fixed | uniform (U[L/2, 3L/2]) | skew (1..L) | tiny (1..L)
  bool bad = false;
  bool fp8 = false;              // the fp8 cache instead of bf16
  int ref_requests = -1;         // requests checked against the reference (-1: all)
  int min_blocks = -1;           // DecodeParams::min_blocks_per_part (-1: --min-blocks' value)
  float growth = 0.f;            // token t's cache values times 1 + growth * t (rising scores)
  float cache_gain = 1.f;        // every cache value times this and softmax_scale over it (the
                                 // same scores; fp8 group scales about cache_gain / 2^7 larger)
  uint64_t seed = 1;
};

static int DeviceSmCount() {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  return prop.multiProcessorCount;
}

struct Problem {
  CaseSpec spec;
  int max_pages = 0, num_pages = 0, copies = 1;
  std::vector<int> lens;
  std::vector<std::vector<int>> tables;  // per copy, batch * max_pages
  __nv_bfloat16 *q = nullptr, *out = nullptr;
  void* cache = nullptr;
  float* lse = nullptr;
  int *d_lens = nullptr;
  std::vector<int*> d_tables;
  int32_t* schedule = nullptr;  // int32 [batch + 1]
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  long long sum_len = 0;  // sum of clamped lengths
  int num_sms = 0;
  size_t cache_bytes = 0;

  int rows() const { return spec.q_len * spec.heads; }
  int row_bytes() const { return spec.fp8 ? kFp8RowBytes : kHeadDim * 2; }

  DecodeParams Params(int copy) const {
    DecodeParams p{};
    p.query = q;
    p.kv_cache = cache;
    p.block_tables = d_tables[copy];
    p.seq_lens = d_lens;
    p.schedule = schedule;
    p.fixed_cost_blocks = g_fixed_cost;
    p.min_blocks_per_part = spec.min_blocks > 0 ? spec.min_blocks : g_min_blocks;
    p.out = out;
    p.lse = lse;
    p.workspace = workspace;
    p.batch = spec.batch;
    p.q_len = spec.q_len;
    p.num_heads = spec.heads;
    p.num_pages = num_pages;
    p.page_size = spec.page;
    p.max_pages = max_pages;
    p.softmax_scale = 1.0f / sqrtf((float)kHeadDim) / spec.cache_gain;
    p.output_scale = 1.0f;
    p.num_sms = num_sms;
    p.enable_pdl = g_pdl;
    p.kv_fp8 = spec.fp8;
    p.fail_closed = g_fail_closed;
    return p;
  }

  // The lengths the reference decodes with: each request's, but with --fail-closed 0 for one
  // whose length lies outside [q_len, capacity] or that reads a page id outside [0, num_pages)
  // (copy 0's table): such a request gets out 0 and lse -inf.
  std::vector<int> ReferenceLengths() const {
    std::vector<int> ref = lens;
    if (!g_fail_closed) return ref;
    const long long cap = (long long)max_pages * spec.page;
    for (int b = 0; b < spec.batch; ++b) {
      bool usable = lens[b] >= spec.q_len && lens[b] <= cap;
      for (int i = 0; usable && i < (lens[b] + spec.page - 1) / spec.page; ++i) {
        const int page = tables[0][(size_t)b * max_pages + i];
        usable = page >= 0 && page < num_pages;
      }
      if (!usable) ref[b] = 0;
    }
    return ref;
  }

  void Build(const CaseSpec& s, int want_copies) {
    spec = s;
    std::mt19937_64 rng(s.seed);
    num_sms = DeviceSmCount();
    lens.resize(s.batch);
    for (int b = 0; b < s.batch; ++b) {
      int L = s.L;
      if (s.dist == "uniform") {
        L = std::uniform_int_distribution<int>(std::max(1, s.L / 2), std::max(1, 3 * s.L / 2))(rng);
      } else if (s.dist == "skew" || s.dist == "tiny") {
        // lengths spread over 1..L, a few long ones dominating
        double u = std::uniform_real_distribution<double>(0, 1)(rng);
        L = std::max(1, (int)(s.L * u * u * u));
        if (b == 0) L = s.L;
      }
      if (L < s.q_len && !s.bad) L = s.q_len;
      lens[b] = L;
    }
    int max_len = *std::max_element(lens.begin(), lens.end());
    int extra_pad = 3;
    max_pages = (max_len + s.page - 1) / s.page + extra_pad;
    if (s.bad) {
      // Over-capacity, zero and sub-q_len lengths.
      lens[0 % s.batch] = max_pages * s.page + 1000;
      if (s.batch > 1) lens[1] = 0;
      if (s.batch > 2) lens[2] = std::max(0, s.q_len - 1);
      if (s.batch > 3) lens[3] = -5;
    }
    long long cap = (long long)max_pages * s.page;
    std::vector<int> pages_needed(s.batch);
    int total_needed = 0;
    sum_len = 0;
    for (int b = 0; b < s.batch; ++b) {
      long long le = std::min<long long>(std::max(lens[b], 0), cap);
      sum_len += le;
      pages_needed[b] = (int)((le + s.page - 1) / s.page);
      total_needed += pages_needed[b];
    }
    copies = std::max(1, want_copies);
    int unused = total_needed / 8 + 8;
    num_pages = total_needed * copies + unused;
    std::vector<int> perm(num_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng);
    tables.assign(copies, std::vector<int>((size_t)s.batch * max_pages));
    size_t next = 0;
    for (int c = 0; c < copies; ++c) {
      for (int b = 0; b < s.batch; ++b) {
        for (int i = 0; i < max_pages; ++i) {
          int v;
          if (i < pages_needed[b]) {
            v = perm[next++];
          } else {
            // garbage padding: out-of-range ids and ids of NaN (unused) pages
            int kind = (int)(rng() % 4);
            if (kind == 0) v = -1 - (int)(rng() % 1000);
            else if (kind == 1) v = num_pages + (int)(rng() % 1000);
            else if (kind == 2) v = (int)(rng() & 0x7fffffff);
            else v = perm[total_needed * copies + (int)(rng() % unused)];
          }
          tables[c][(size_t)b * max_pages + i] = v;
        }
        if (s.bad && pages_needed[b] > 2 && b % 2 == 0) {
          // out-of-range ids inside the length
          tables[c][(size_t)b * max_pages + 1] = num_pages + 7;
          tables[c][(size_t)b * max_pages + pages_needed[b] - 1] = -3;
        }
      }
    }
    size_t q_elems = (size_t)s.batch * rows() * kHeadDim;
    cache_bytes = (size_t)num_pages * s.page * row_bytes();
    CHECK_CUDA(cudaMalloc(&q, q_elems * 2));
    CHECK_CUDA(cudaMalloc(&cache, cache_bytes));
    CHECK_CUDA(cudaMalloc(&out, (size_t)s.batch * rows() * kLatentDim * 2));
    CHECK_CUDA(cudaMalloc(&lse, (size_t)s.batch * rows() * 4));
    CHECK_CUDA(cudaMalloc(&d_lens, s.batch * 4));
    CHECK_CUDA(cudaMemcpy(d_lens, lens.data(), s.batch * 4, cudaMemcpyHostToDevice));
    d_tables.resize(copies);
    for (int c = 0; c < copies; ++c) {
      CHECK_CUDA(cudaMalloc(&d_tables[c], tables[c].size() * 4));
      CHECK_CUDA(cudaMemcpy(d_tables[c], tables[c].data(), tables[c].size() * 4,
                            cudaMemcpyHostToDevice));
    }
    workspace_bytes = WorkspaceBytes(s.batch, s.q_len, s.heads, num_sms);
    CHECK_CUDA(cudaMalloc(&schedule, (s.batch + 1) * sizeof(int32_t)));
    CHECK_CUDA(cudaMemset(schedule, 0xFF, (s.batch + 1) * sizeof(int32_t)));
    CHECK_CUDA(cudaMalloc(&workspace, workspace_bytes));
    CHECK_CUDA(cudaMemset(workspace, 0xFF, workspace_bytes));
    FillRandom<<<1024, 256>>>(q, q_elems, s.seed * 7 + 1, 3.0f);
    CHECK_CUDA(cudaGetLastError());
    CHECK_CUDA(cudaMemset(cache, 0xFF, cache_bytes));  // NaN in bf16, e4m3 and f32
    for (int c = 0; c < copies; ++c) {
      FillTokens<<<dim3(std::min(max_len + 1, 4096), s.batch), 128>>>(
          cache, s.fp8, d_tables[c], d_lens, max_pages, s.page, num_pages, s.seed * 13 + c,
          s.growth, s.cache_gain);
      CHECK_CUDA(cudaGetLastError());
    }
    CHECK_CUDA(cudaDeviceSynchronize());
  }

  void Free() {
    cudaFree(q);
    cudaFree(cache);
    cudaFree(out);
    cudaFree(lse);
    cudaFree(d_lens);
    for (auto t : d_tables) cudaFree(t);
    cudaFree(schedule);
    cudaFree(workspace);
  }
};

static cudaStream_t CheckStream() {
  static cudaStream_t stream = nullptr;
  if (stream == nullptr) CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return stream;
}

// LaunchOptions::cluster as --cluster2 / --cluster1 ask for it (unchanged without either flag).
static void ApplyClusterFlag(LaunchOptions& opt, int q_len, int heads) {
  if (g_cluster == 1 || (g_cluster == 2 && NumMTiles(q_len, heads) % 2 == 0)) {
    opt.cluster = g_cluster;
  }
}

// LaunchOptions::block_to_split_cost as --split-cost gives it (unchanged without the flag): the
// schedule's parts, for every launch of the run.
static void ApplySplitCostFlag(LaunchOptions& opt) {
  if (g_split_cost > 0) opt.block_to_split_cost = g_split_cost;
}

// Whether LaunchDecode runs this problem in 64-row tiles with these options (the tiles that take
// bf16_partials = 1), by the launcher's own choice of cluster and transposed path.
static bool In64RowTiles(const LaunchOptions& opt, const Problem& pb) {
  const int cluster = detail::ClusterSize(opt, pb.Params(0));
  return detail::TransposedScoreRows(opt, cluster, pb.rows()) == 0;
}

static void RunOnce(const Problem& pb, int copy) {
  DecodeParams p = pb.Params(copy);
  CHECK_CUDA(LaunchSchedule(p, CheckStream()));
  CHECK_CUDA(cudaGetLastError());
  LaunchOptions opt;
  ApplyClusterFlag(opt, pb.spec.q_len, pb.spec.heads);
  ApplySplitCostFlag(opt);
  opt.transposed_scores = g_transposed;
  opt.fp8_registers = g_fp8_registers;
  opt.wide_combine = g_wide_combine;
  opt.staged_combine = g_staged_combine;
  opt.split_release = g_split_release;
  opt.bf16_partials = g_bf16_partials;
  opt.column_halves = g_column_halves;
  // --bf16-partials forces them where the launcher takes them: 64-row tiles only.
  if (g_bf16_partials == 1 && !In64RowTiles(opt, pb)) opt.bf16_partials = -1;
  CHECK_CUDA(LaunchDecode(p, CheckStream(), opt));
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaStreamSynchronize(CheckStream()));
}

struct CheckResult {
  double max_rel = 0, max_lse_err = 0;
  int worst_req = -1;
  bool nan = false, deterministic = true, empty_ok = true, pass = true;
  int checked = 0;
};

// One decode's outputs (bf16 out and f32 LSE, as bytes: NaN patterns compare too), the output
// buffers set to 0xFF before it.
struct Outputs {
  std::vector<uint16_t> out;
  std::vector<float> lse;

  static Outputs Of(const Problem& pb) {
    const size_t rows = static_cast<size_t>(pb.spec.batch) * pb.rows();
    Outputs o{std::vector<uint16_t>(rows * kLatentDim), std::vector<float>(rows)};
    CHECK_CUDA(cudaMemset(pb.out, 0xFF, o.out.size() * 2));
    CHECK_CUDA(cudaMemset(pb.lse, 0xFF, o.lse.size() * 4));
    CHECK_CUDA(cudaDeviceSynchronize());
    RunOnce(pb, 0);
    CHECK_CUDA(cudaDeviceSynchronize());
    CHECK_CUDA(cudaMemcpy(o.out.data(), pb.out, o.out.size() * 2, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(o.lse.data(), pb.lse, o.lse.size() * 4, cudaMemcpyDeviceToHost));
    return o;
  }
  bool SameBytes(const Outputs& other) const {
    return memcmp(out.data(), other.out.data(), out.size() * 2) == 0 &&
           memcmp(lse.data(), other.lse.data(), lse.size() * 4) == 0;
  }
};

static CheckResult Check(Problem& pb, double tol) {
  const CaseSpec& s = pb.spec;
  const int rows = pb.rows();
  const size_t out_elems = (size_t)s.batch * rows * kLatentDim;
  const Outputs first = Outputs::Of(pb), second = Outputs::Of(pb);
  const std::vector<uint16_t>& out1 = first.out;
  const std::vector<float>& lse1 = first.lse;
  CheckResult r;
  r.deterministic = first.SameBytes(second);
  for (size_t i = 0; i < out_elems; ++i) {
    if (std::isnan(Bf16ToFloat(out1[i]))) { r.nan = true; break; }
  }
  for (float v : lse1) if (std::isnan(v)) r.nan = true;

  const int nref = s.ref_requests < 0 ? s.batch : std::min(s.batch, s.ref_requests);
  r.checked = nref;
  int max_len = 0;
  for (int b = 0; b < nref; ++b) max_len = std::max(max_len, std::max(pb.lens[b], 0));
  max_len = std::min<long long>(max_len, (long long)pb.max_pages * s.page);
  size_t stride = std::max(1, max_len);
  float *d_scores, *d_ref, *d_ref_lse;
  CHECK_CUDA(cudaMalloc(&d_scores, (size_t)nref * rows * stride * 4));
  CHECK_CUDA(cudaMalloc(&d_ref, (size_t)nref * rows * kLatentDim * 4));
  CHECK_CUDA(cudaMalloc(&d_ref_lse, (size_t)nref * rows * 4));
  DecodeParams p = pb.Params(0);
  const std::vector<int> ref_lens = pb.ReferenceLengths();
  int* d_ref_lens;
  CHECK_CUDA(cudaMalloc(&d_ref_lens, ref_lens.size() * 4));
  CHECK_CUDA(cudaMemcpy(d_ref_lens, ref_lens.data(), ref_lens.size() * 4, cudaMemcpyHostToDevice));
  ReferenceKernel<<<dim3(rows, nref), kRefThreads>>>(
      pb.q, pb.cache, s.fp8, pb.d_tables[0], d_ref_lens, s.q_len, s.heads, pb.num_pages, s.page,
      pb.max_pages, p.softmax_scale, p.output_scale, d_scores, stride, d_ref, d_ref_lse);
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaDeviceSynchronize());
  cudaFree(d_ref_lens);
  std::vector<float> ref((size_t)nref * rows * kLatentDim), ref_lse((size_t)nref * rows);
  CHECK_CUDA(cudaMemcpy(ref.data(), d_ref, ref.size() * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(ref_lse.data(), d_ref_lse, ref_lse.size() * 4, cudaMemcpyDeviceToHost));
  cudaFree(d_scores);
  cudaFree(d_ref);
  cudaFree(d_ref_lse);
  for (int b = 0; b < nref; ++b) {
    double max_ref = 0, max_err = 0;
    for (size_t i = (size_t)b * rows * kLatentDim; i < (size_t)(b + 1) * rows * kLatentDim; ++i) {
      max_ref = std::max(max_ref, (double)fabsf(ref[i]));
      double e = fabs((double)Bf16ToFloat(out1[i]) - ref[i]);
      if (std::isnan(e)) e = INFINITY;
      max_err = std::max(max_err, e);
    }
    double rel = max_ref > 0 ? max_err / max_ref : (max_err == 0 ? 0 : INFINITY);
    if (max_ref == 0 && max_err != 0) r.empty_ok = false;
    if (rel > r.max_rel) { r.max_rel = rel; r.worst_req = b; }
    for (int i = b * rows; i < (b + 1) * rows; ++i) {
      double e;
      if (std::isinf(ref_lse[i]) || std::isinf(lse1[i])) {
        e = (ref_lse[i] == lse1[i]) ? 0 : INFINITY;
        if (e != 0) r.empty_ok = false;
      } else {
        e = fabs(ref_lse[i] - lse1[i]);
      }
      if (std::isnan(e)) e = INFINITY;
      r.max_lse_err = std::max(r.max_lse_err, e);
    }
  }
  r.pass = !r.nan && r.deterministic && r.empty_ok && r.max_rel <= tol && r.max_lse_err <= 5e-3;
  return r;
}

static void PrintCheckHeader() {
  printf("| case | B | q_len | H | page | lengths | max rel err (worst req) | max LSE abs err | NaN | "
         "deterministic | empty rows | result |\n");
  printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
}

static bool RunCheck(const CaseSpec& s, double tol) {
  Problem pb;
  pb.Build(s, 1);
  CheckResult r = Check(pb, tol);
  int mn = *std::min_element(pb.lens.begin(), pb.lens.end());
  int mx = *std::max_element(pb.lens.begin(), pb.lens.end());
  printf("| %s | %d | %d | %d | %d | %s %d..%d%s | %.2e (%d) | %.2e | %s | %s | %s | %s |\n",
         s.name.c_str(), s.batch, s.q_len, s.heads, s.page, s.dist.c_str(), mn, mx,
         s.bad ? " bad" : "", r.max_rel, r.worst_req, r.max_lse_err, r.nan ? "YES" : "no",
         r.deterministic ? "yes" : "NO", r.empty_ok ? "ok" : "BAD", r.pass ? "PASS" : "FAIL");
  fflush(stdout);
  pb.Free();
  return r.pass;
}

// Collects a suite's cases; each case's seed is the suite's base plus its position.
struct Suite {
  std::vector<CaseSpec> cases;
  int seed_base;

  bool fp8 = false;

  void add(const char* name, int B, int q, int H, int page, int L, const char* dist,
           bool bad = false) {
    CaseSpec s;
    s.name = name; s.batch = B; s.q_len = q; s.heads = H; s.page = page; s.L = L; s.dist = dist;
    s.bad = bad; s.fp8 = fp8; s.seed = seed_base + static_cast<int>(cases.size());
    cases.push_back(s);
  }
  // Cache values growing along each request (times 1 + t / 256 at token t), so that running
  // maxima (and the fp8 cache's group scales) move every few blocks of a segment: the softmax's
  // rescaling path between blocks that skip it.
  void add_rising(const char* name, int B, int q, int H) {
    add(name, B, q, H, 64, 4096, "fixed");
    cases.back().growth = 1.f / 256;
  }
  // Cache values 2^14 times larger, softmax_scale over it: the same scores, and on the fp8 cache
  // group scales of 2^5 to 2^8 (write_kv's reach 2^119), either side of 2^7, the largest that
  // e4m3's bit-field conversion takes.
  void add_large(const char* name, int B, int q, int H) {
    add(name, B, q, H, 64, 3000, "uniform");
    cases.back().cache_gain = 16384.f;
  }
};

static std::vector<CaseSpec> CheckSuite() {
  Suite v{{}, 1000};
  v.add("b1-4k-h128", 1, 1, 128, 64, 4096, "fixed");
  v.add("b1-4k-h128-p32", 1, 1, 128, 32, 4096, "fixed");
  // Three and four requests: the wide combine's 32-row kernel two blocks an SM; five and six:
  // its 16-row kernel three blocks an SM.
  v.add("b3-4k-h128", 3, 1, 128, 64, 4096, "uniform");
  v.add("b4-1k-h128-p32", 4, 1, 128, 32, 1024, "uniform");
  v.add("b6-2k-h128", 6, 1, 128, 64, 2048, "uniform");
  // The 16-row kernel on fp32 partials (two blocks an SM): 17-33 requests of 16 rows and 9-16 of
  // 32; on bf16 partials at 64 rows 9-12.
  v.add("b24-4k-h16", 24, 1, 16, 64, 4096, "uniform");
  v.add("b12-h32-p32", 12, 1, 32, 32, 3000, "uniform");
  v.add("b10-h64", 10, 1, 64, 64, 3000, "uniform");
  v.add("skew-20k-h16", 8, 1, 16, 64, 20000, "skew");
  v.add("skew-20k-h16-p32", 8, 1, 16, 32, 20000, "skew");
  v.add("q2-h128", 4, 2, 128, 64, 4096, "uniform");
  v.add("q2-h128-p32", 4, 2, 128, 32, 4096, "uniform");
  v.add("h8", 3, 1, 8, 64, 3000, "uniform");
  v.add("h8-p32", 3, 1, 8, 32, 3000, "uniform");
  v.add("b32-4k-h128", 32, 1, 128, 64, 4096, "uniform");
  v.add("h32-q4", 5, 4, 32, 64, 2000, "uniform");
  v.add("h64-q3-p32", 3, 3, 64, 32, 2500, "uniform");
  v.add("h64", 6, 1, 64, 64, 5000, "uniform");
  v.add("h16-q4", 7, 4, 16, 32, 1500, "uniform");
  v.add("h8-q3", 4, 3, 8, 64, 700, "uniform");
  v.add("tiny-h128", 16, 1, 128, 64, 70, "tiny");
  v.add("tiny-q4-h16", 16, 4, 16, 32, 9, "tiny");
  v.add("many-short-h16", 300, 1, 16, 64, 600, "tiny");
  v.add("long-128k-h16", 2, 1, 16, 64, 131072, "fixed");
  v.add("bad-h16-q2-p32", 6, 2, 16, 32, 3000, "uniform", true);
  v.add("bad-h128-p64", 6, 1, 128, 64, 2000, "uniform", true);
  // Many requests a part: the epilogue of many segments a CTA; over four requests a part
  // boundary, the combine's grid indexes the boundaries (CombineByBoundary).
  v.add("b128-1k-h128", 128, 1, 128, 64, 1024, "uniform");
  v.add("b300-1k-h128", 300, 1, 128, 64, 1024, "uniform");
  v.add("bad-b600-h16-p32", 600, 1, 16, 32, 500, "uniform", true);
  // No request split or empty, so no combine CTA has anything to merge or write: one request per
  // part; and every request in part 0, whose CTA decodes long after the others have exited.
  v.add("whole-parts-h16", NumParts(DeviceSmCount(), 1, 16), 1, 16, 64, 8192, "fixed");
  v.add("one-part-h128", 8, 1, 128, 64, 4096, "uniform");
  v.cases.back().min_blocks = 1 << 20;
  v.add_rising("rising-h16", 64, 1, 16);
  v.add_rising("rising-h16-q2", 64, 2, 16);
  v.add_rising("rising-h128", 16, 1, 128);
  return v.cases;
}

// Up to kFp8TransposedRows query rows the fp8 cache runs the transposed-score kernels, above in
// 64-row tiles.
static std::vector<CaseSpec> CheckSuiteFp8() {
  Suite v{{}, 3000, true};
  v.add("b1-4k-h16", 1, 1, 16, 64, 4096, "fixed");
  v.add("b1-4k-h16-p32", 1, 1, 16, 32, 4096, "fixed");
  v.add("skew-20k-h16", 8, 1, 16, 64, 20000, "skew");
  v.add("skew-20k-h16-p32", 8, 1, 16, 32, 20000, "skew");
  v.add("q2-h16", 4, 2, 16, 64, 4096, "uniform");
  v.add("q2-h16-p32", 4, 2, 16, 32, 4096, "uniform");
  v.add("h8", 3, 1, 8, 64, 3000, "uniform");
  v.add("h8-p32", 3, 1, 8, 32, 3000, "uniform");
  v.add("b32-4k-h16", 32, 1, 16, 64, 4096, "uniform");
  v.add("b12-q2-h16", 12, 2, 16, 64, 3000, "uniform");
  v.add("b10-h64", 10, 1, 64, 64, 3000, "uniform");
  v.add("h32", 5, 1, 32, 64, 2000, "uniform");
  v.add("h8-q4-p32", 3, 4, 8, 32, 2500, "uniform");
  v.add("h8-q3", 4, 3, 8, 64, 700, "uniform");
  v.add("h4-q4", 4, 4, 4, 64, 900, "uniform");
  v.add("tiny-q2-h16", 16, 2, 16, 32, 9, "tiny");
  v.add("many-short-h16", 300, 1, 16, 64, 600, "tiny");
  v.add("long-128k-h16", 2, 1, 16, 64, 131072, "fixed");
  v.add("bad-h16-q2-p32", 6, 2, 16, 32, 3000, "uniform", true);
  v.add("bad-h8-p64", 6, 1, 8, 64, 2000, "uniform", true);
  v.add("b1-4k-h128", 1, 1, 128, 64, 4096, "fixed");
  v.add("b3-4k-h128", 3, 1, 128, 64, 4096, "uniform");
  v.add("skew-20k-h128-p32", 8, 1, 128, 32, 20000, "skew");
  v.add("b32-4k-h128", 32, 1, 128, 64, 4096, "uniform");
  v.add("h64", 6, 1, 64, 64, 5000, "uniform");
  v.add("h64-q3-p32", 3, 3, 64, 32, 2500, "uniform");
  v.add("h32-q2", 4, 2, 32, 64, 3000, "uniform");
  v.add("h16-q3", 5, 3, 16, 64, 1500, "uniform");
  v.add("h128-q4-p32", 2, 4, 128, 32, 1200, "uniform");
  v.add("tiny-h128", 16, 1, 128, 64, 70, "tiny");
  v.add("long-128k-h64", 1, 1, 64, 64, 131072, "fixed");
  v.add("bad-h128-p64", 6, 1, 128, 64, 2000, "uniform", true);
  v.add("bad-h64-q2-p32", 6, 2, 64, 32, 3000, "uniform", true);
  v.add_rising("rising-h16", 64, 1, 16);
  v.add_rising("rising-h16-q2", 64, 2, 16);
  v.add_rising("rising-h128", 16, 1, 128);
  v.add_large("large-h16", 6, 1, 16);
  v.add_large("large-h16-q2", 6, 2, 16);
  v.add_large("large-h128", 6, 1, 128);
  return v.cases;
}

static std::vector<CaseSpec> SanitizeSuiteFp8() {
  Suite v{{}, 4000, true};
  v.add("b1-h16", 1, 1, 16, 64, 1000, "fixed");
  v.add("skew-h16", 6, 1, 16, 64, 1500, "skew");
  v.add("q2-h16-p32", 3, 2, 16, 32, 700, "uniform");
  v.add("h8", 3, 1, 8, 64, 500, "uniform");
  v.add("h32-b8", 8, 1, 32, 64, 600, "uniform");
  v.add("h16-b20", 20, 1, 16, 64, 600, "uniform");
  v.add("bad-q2-p32", 6, 2, 16, 32, 500, "uniform", true);
  v.add("b1-h128", 1, 1, 128, 64, 1000, "fixed");
  v.add("b4-h128", 4, 1, 128, 64, 1000, "uniform");
  v.add("b6-h128", 6, 1, 128, 64, 1000, "uniform");
  v.add("skew-h64", 6, 1, 64, 64, 1500, "skew");
  v.add("q2-h128-p32", 3, 2, 128, 32, 700, "uniform");
  v.add("bad-h128-q2-p64", 6, 2, 128, 64, 500, "uniform", true);
  return v.cases;
}

static std::vector<CaseSpec> SanitizeSuite() {
  Suite v{{}, 2000};
  v.add("b1-h128", 1, 1, 128, 64, 1000, "fixed");
  v.add("skew-h16", 6, 1, 16, 64, 1500, "skew");
  v.add("q2-h128-p32", 3, 2, 128, 32, 700, "uniform");
  v.add("h8", 3, 1, 8, 64, 500, "uniform");
  v.add("h128-b8", 8, 1, 128, 64, 600, "uniform");
  v.add("h128-b4", 4, 1, 128, 64, 600, "uniform");
  v.add("h128-b5", 5, 1, 128, 64, 600, "uniform");
  v.add("h16-b20", 20, 1, 16, 64, 600, "uniform");
  v.add("h64-b10", 10, 1, 64, 64, 500, "uniform");
  v.add("bad-q2-p32", 6, 2, 16, 32, 500, "uniform", true);
  v.add("bad-b270-h128", 270, 1, 128, 64, 200, "uniform", true);
  // Several segments per CTA on the transposed kernels: the owned rows' statistics handed over
  // between warpgroups at every segment's end.
  v.add("segments-q2-h16", 300, 2, 16, 64, 300, "uniform");
  v.add("segments-h16-p32", 300, 1, 16, 32, 300, "uniform");
  return v.cases;
}

struct Variant {
  const char* name;
  LaunchOptions options;
};

// The default launch with one knob changed by `set`.
template <class Set>
static LaunchOptions With(Set set) {
  LaunchOptions options;
  set(options);
  return options;
}

static std::vector<Variant> CombineVariants() {
  return {{"combine-narrow", With([](LaunchOptions& o) { o.wide_combine = 0; })},
          {"combine-wide", With([](LaunchOptions& o) { o.wide_combine = 1; })},
          {"combine-staged", With([](LaunchOptions& o) {
             o.wide_combine = 1;
             o.staged_combine = 1;
           })},
          {"combine-loaded", With([](LaunchOptions& o) {
             o.wide_combine = 1;
             o.staged_combine = 0;
           })}};
}

static std::vector<Variant> PartialsVariants() {
  return {{"fp32-partials", With([](LaunchOptions& o) { o.bf16_partials = 0; })},
          {"bf16-partials", With([](LaunchOptions& o) { o.bf16_partials = 1; })},
          {"combine-8-rows", With([](LaunchOptions& o) { o.combine_rows_in_flight = 8; })},
          {"combine-16-rows", With([](LaunchOptions& o) { o.combine_rows_in_flight = 16; })},
          {"combine-32-rows", With([](LaunchOptions& o) { o.combine_rows_in_flight = 32; })}};
}

static std::vector<Variant> ColumnHalvesVariants() {
  return {{"columns-whole", With([](LaunchOptions& o) { o.column_halves = 0; })},
          {"columns-halves", With([](LaunchOptions& o) { o.column_halves = 1; })}};
}

static std::vector<Variant> ReleaseVariants() {
  return {{"release-whole", With([](LaunchOptions& o) { o.split_release = 0; })},
          {"release-split", With([](LaunchOptions& o) { o.split_release = 1; })}};
}

static std::vector<Variant> TransposedVariants() {
  return {{"scores-not-transposed", With([](LaunchOptions& o) { o.transposed_scores = 0; })}};
}

static std::vector<Variant> Fp8KernelVariants() {
  return {{"fp8-transposed", With([](LaunchOptions& o) { o.fp8_registers = 0; })}};
}

static std::vector<Variant> L2PromotionVariants() {
  return {{"l2-promo-256", With([](LaunchOptions& o) { o.kv_l2_promotion = 256; })},
          {"l2-promo-128", With([](LaunchOptions& o) { o.kv_l2_promotion = 128; })},
          {"l2-promo-none", With([](LaunchOptions& o) { o.kv_l2_promotion = 0; })}};
}

static std::vector<Variant> ClusterVariants() {
  return {{"cluster-1", With([](LaunchOptions& o) { o.cluster = 1; })},
          {"cluster-2", With([](LaunchOptions& o) { o.cluster = 2; })}};
}

// A timing experiment: DecodeKernel's kSkip bits, without clusters (results wrong by design).
static Variant Experiment(const char* name, int bits) {
  LaunchOptions e;
  e.experiment = bits;
  e.cluster = 1;
  return {name, e};
}

// Timing experiments: kernels that skip parts of the work.
static std::vector<Variant> ExperimentVariants() {
  std::vector<Variant> v = {Experiment("x-noqk", 1), Experiment("x-nopv", 2),
                            Experiment("x-nosoftmax", 4), Experiment("x-nomma", 3),
                            Experiment("x-none", 7), Experiment("x-noload", 32)};
  v.push_back({"x-none-cluster-2", With([](LaunchOptions& o) {
                  o.experiment = 7;
                  o.cluster = 2;
                })});
  return v;
}

// What a request segment costs: the combine left out, clusters off, the KV loads left out,
// everything but the loads left out.
static std::vector<Variant> SegmentVariants() {
  return {{"no-combine", With([](LaunchOptions& o) { o.combine = false; })},
          ClusterVariants().front(), Experiment("x-noload", 32), Experiment("x-none", 7)};
}

// "default" first, then the named set's variants; any other name: every variant but the
// experiments.
static std::vector<Variant> AllVariants(const std::string& which) {
  std::vector<Variant> v{{"default", LaunchOptions()}};
  auto append = [&v](const std::vector<Variant>& more) {
    v.insert(v.end(), more.begin(), more.end());
  };
  if (which == "default") return v;
  if (which == "combine") append(CombineVariants());
  else if (which == "transposed") append(TransposedVariants());
  else if (which == "release") append(ReleaseVariants());
  else if (which == "cluster") append(ClusterVariants());
  else if (which == "exp") append(ExperimentVariants());
  else if (which == "segments") append(SegmentVariants());
  else if (which == "partials") append(PartialsVariants());
  else if (which == "fp8-kernels") append(Fp8KernelVariants());
  else if (which == "l2") append(L2PromotionVariants());
  else if (which == "halves") append(ColumnHalvesVariants());
  else {
    append({{"late-release", With([](LaunchOptions& o) {
               o.early_release = false;
               o.cluster = 1;
             })},
           });
    append(L2PromotionVariants());
    append(ClusterVariants());
    // kv_evict_first = 2 is replaced per problem by the opposite of the default choice.
    append({{"evict-flip", With([](LaunchOptions& o) { o.kv_evict_first = 2; })}});
    append(TransposedVariants());
    append(CombineVariants());
    append(ReleaseVariants());
    append(PartialsVariants());
    append(ColumnHalvesVariants());
  }
  return v;
}

// Launches calls `first` .. `end` - 1 on `stream`: call -1 is the schedule, call i >= 0 a decode of
// cache copy i % copies.
static void LaunchCalls(const Problem& pb, const LaunchOptions& opt, int first, int end,
                        cudaStream_t stream) {
  for (int i = first; i < end; ++i) {
    if (i < 0) CHECK_CUDA(LaunchSchedule(pb.Params(0), stream));
    else CHECK_CUDA(LaunchDecode(pb.Params(i % pb.copies), stream, opt));
  }
}

// A graph of those calls (LaunchCalls) captured from `stream`.
static cudaGraph_t CaptureCalls(const Problem& pb, const LaunchOptions& opt, int first, int end,
                                cudaStream_t stream) {
  cudaGraph_t graph;
  CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  LaunchCalls(pb, opt, first, end, stream);
  CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
  return graph;
}

// The schedule and `iters` decodes as XLA's command buffer records custom calls: each captured
// into a graph of its own and added as a child node that depends on the one before, so an edge
// between two calls waits for all of the earlier call (programmatic dependent launch stays inside
// each call).
static cudaGraph_t CaptureAsChildGraphs(const Problem& pb, const LaunchOptions& opt, int iters,
                                        cudaStream_t stream) {
  cudaGraph_t parent;
  CHECK_CUDA(cudaGraphCreate(&parent, 0));
  cudaGraphNode_t before = nullptr;
  for (int i = -1; i < iters; ++i) {
    cudaGraph_t call = CaptureCalls(pb, opt, i, i + 1, stream);
    cudaGraphNode_t node;
    CHECK_CUDA(cudaGraphAddChildGraphNode(&node, parent, before ? &before : nullptr,
                                          before ? 1 : 0, call));
    CHECK_CUDA(cudaGraphDestroy(call));
    before = node;
  }
  return parent;
}

// Per-layer time: a CUDA graph of one schedule and `iters` decodes rotating among cache copies,
// replayed 3 times untimed, then the median of 5 timed replays (with --stream, the launches issued
// on the stream instead; with --child-graphs, the graph of child graphs CaptureAsChildGraphs
// builds).
static void RunTime(const CaseSpec& s, int iters, const std::vector<Variant>& variants) {
  Problem pb;
  // Rotate among enough copies that the bytes touched per round exceed 4x the L2.
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  const int row_bytes = s.fp8 ? kFp8RowBytes : kHeadDim * 2;
  const double one_copy = (double)s.batch * s.L * row_bytes;
  int copies = (int)std::min(32.0, std::max(1.0, std::ceil(4.0 * prop.l2CacheSize / one_copy)));
  pb.Build(s, copies);
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const double bytes = (double)pb.sum_len * row_bytes;
  const double flops = 2.0 * (kHeadDim + kLatentDim) * s.heads * s.q_len * (double)pb.sum_len;
  // The floor model of benchmarks/problem.py (FLOOR_MODELS): the H100 80GB HBM3's measured rates
  // there, the H200's elsewhere.
  const bool h100 = std::strcmp(prop.name, "NVIDIA H100 80GB HBM3") == 0;
  const double floor_us =
      std::max(bytes / (h100 ? 3.03e12 : 4.3e12), flops / (h100 ? 796e12 : 790e12)) * 1e6;
  const int rows = pb.rows();
  for (const Variant& var : variants) {
    LaunchOptions opt = var.options;
    if (opt.cluster == 2 && NumMTiles(s.q_len, s.heads) % 2 != 0) continue;  // needs even M tiles
    if (opt.bf16_partials == 1 && !In64RowTiles(opt, pb)) continue;
    // The fp8 cache's kernels have no experiments, clusters or late release (launch.cuh).
    if (s.fp8 && (opt.experiment != 0 || opt.cluster == 2 || !opt.early_release)) continue;
    if (std::string(var.name) == "default") ApplyClusterFlag(opt, s.q_len, s.heads);
    ApplySplitCostFlag(opt);
    if (opt.kv_evict_first == 2) opt.kv_evict_first = NumMTiles(s.q_len, s.heads) == 1 ? 0 : 1;
    for (int i = 0; i < 3; ++i) {
      DecodeParams p = pb.Params(i % pb.copies);
      CHECK_CUDA(LaunchSchedule(p, stream));
      CHECK_CUDA(LaunchDecode(p, stream, opt));
    }
    CHECK_CUDA(cudaStreamSynchronize(stream));
    cudaGraph_t graph = g_child_graphs ? CaptureAsChildGraphs(pb, opt, iters, stream)
                                       : CaptureCalls(pb, opt, -1, iters, stream);
    cudaGraphExec_t exec;
    CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int warm = 0; warm < 3; ++warm) CHECK_CUDA(cudaGraphLaunch(exec, stream));
    CHECK_CUDA(cudaStreamSynchronize(stream));
    cudaEvent_t e0, e1;
    CHECK_CUDA(cudaEventCreate(&e0));
    CHECK_CUDA(cudaEventCreate(&e1));
    std::vector<float> times;
    for (int rep = 0; rep < 5; ++rep) {
      CHECK_CUDA(cudaEventRecord(e0, stream));
      if (g_stream) {
        LaunchCalls(pb, opt, -1, iters, stream);
      } else {
        CHECK_CUDA(cudaGraphLaunch(exec, stream));
      }
      CHECK_CUDA(cudaEventRecord(e1, stream));
      CHECK_CUDA(cudaEventSynchronize(e1));
      float ms;
      CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
      times.push_back(ms * 1000.f / iters);
    }
    CHECK_CUDA(cudaGetLastError());
    std::sort(times.begin(), times.end());
    const double us = times[times.size() / 2];
    std::vector<uint16_t> out((size_t)s.batch * rows * kLatentDim);
    CHECK_CUDA(cudaMemcpy(out.data(), pb.out, out.size() * 2, cudaMemcpyDeviceToHost));
    bool nan = false;
    for (auto v : out) if (std::isnan(Bf16ToFloat(v))) { nan = true; break; }
    printf("| %d | %d | %d | %d | %d | %s%s | %.1f | %.1f | %.2f | %.0f | %.0f%% | %.1f..%.1f | %d | %s |\n",
           s.heads, s.batch, s.L, s.q_len, s.page, s.fp8 ? "fp8 " : "", var.name, us, floor_us, bytes / us / 1e6,
           flops / us / 1e6, 100.0 * floor_us / us, times.front(), times.back(), pb.copies,
           nan ? "NaN!" : "ok");
    fflush(stdout);
    CHECK_CUDA(cudaEventDestroy(e0));
    CHECK_CUDA(cudaEventDestroy(e1));
    CHECK_CUDA(cudaGraphExecDestroy(exec));
    CHECK_CUDA(cudaGraphDestroy(graph));
  }
  CHECK_CUDA(cudaStreamDestroy(stream));
  pb.Free();
}

static void PrintTimeHeader() {
  printf("| H | B | L | q_len | page | variant | µs/layer | floor µs | TB/s | TFLOP/s | %% of floor | "
         "spread µs | copies | output |\n");
  printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
}

static void PrintDevice() {
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  printf("device: %s, %d SMs, L2 %d MB, smem/block optin %zu, driver %d, runtime %d\n", prop.name,
         prop.multiProcessorCount, prop.l2CacheSize >> 20, prop.sharedMemPerBlockOptin, driver,
         runtime);
  printf("kernel: %d threads, %d B dynamic smem (fp8 cache: %d B transposed, %d B 64-row tiles, "
         "%d B up to 16 rows, %d B 17-32 rows), parts(H=128,q=1)=%d\n",
         kThreads, SmemLayout<false>::kBytes, KernelSmemLayout<true, kFp8TransposedRows>::kBytes,
         KernelSmemLayout<true, 0>::kBytes, Fp8RegsSmemLayout::kBytes, Fp8SplitSmemLayout::kBytes,
         NumParts(prop.multiProcessorCount, 1, 128));
}

#ifdef JAX_MLA_SM90_TRACE
// The decode's and the combine's CTAs on one clock (g_kernel_trace): when they started, when their
// grid dependency wait returned, the wide combines' steps and when they were done, in µs from the
// first decode CTA's start; the earliest, median and latest CTA of each.
static void PrintKernelStamps(const std::vector<uint64_t>& stamps) {
  auto at = [&](int kernel, int cta, int event) {
    return stamps[(static_cast<size_t>(kernel) * kTraceCtas + cta) * kKernelEvents + event];
  };
  uint64_t t0 = ~0ull;
  for (int c = 0; c < kTraceCtas; ++c) {
    const uint64_t start = at(kTracedDecode, c, kKernelEntry);
    if (start != 0) t0 = std::min(t0, start);
  }
  const char* kernels[] = {"decode", "combine"};
  const char* events[] = {"start", "wait returned", "LSEs merged", "first splits accumulated",
                          "done"};
  printf("| kernel | event | CTAs | first µs | median µs | last µs |\n");
  printf("|---|---|---|---|---|---|\n");
  for (int k = 0; k < kTracedKernels; ++k) {
    for (int e = 0; e < kKernelEvents; ++e) {
      std::vector<double> t;
      for (int c = 0; c < kTraceCtas; ++c) {
        if (at(k, c, e) != 0) t.push_back((static_cast<double>(at(k, c, e)) - t0) * 1e-3);
      }
      if (t.empty()) continue;
      std::sort(t.begin(), t.end());
      printf("| %s | %s | %zu | %.2f | %.2f | %.2f |\n", kernels[k], events[e], t.size(), t.front(),
             t[t.size() / 2], t.back());
    }
  }
}
#endif

// One decode of the problem with the kernel's event timeline (ffi/sm90/trace.cuh; a build with
// -DJAX_MLA_SM90_TRACE): where each CTA's time goes, summed per CTA, mean and max over the CTAs.
static int RunTrace(const CaseSpec& s) {
#ifndef JAX_MLA_SM90_TRACE
  (void)s;
  printf("trace: this harness was built without -DJAX_MLA_SM90_TRACE\n");
  return 2;
#else
  Problem pb;
  pb.Build(s, 1);
  for (int i = 0; i < 3; ++i) RunOnce(pb, 0);
  std::vector<int> counts(kTraceCtas, 0);
  CHECK_CUDA(cudaMemcpyToSymbol(g_trace_count, counts.data(), sizeof(int) * kTraceCtas));
  std::vector<uint64_t> stamps(static_cast<size_t>(kTracedKernels) * kTraceCtas * kKernelEvents, 0);
  CHECK_CUDA(cudaMemcpyToSymbol(g_kernel_trace, stamps.data(), sizeof(uint64_t) * stamps.size()));
  RunOnce(pb, 0);
  CHECK_CUDA(cudaMemcpyFromSymbol(stamps.data(), g_kernel_trace, sizeof(uint64_t) * stamps.size()));
  std::vector<TraceRecord> records(static_cast<size_t>(kTraceCtas) * kTraceRecords);
  CHECK_CUDA(cudaMemcpyFromSymbol(counts.data(), g_trace_count, sizeof(int) * kTraceCtas));
  CHECK_CUDA(cudaMemcpyFromSymbol(records.data(), g_trace, sizeof(TraceRecord) * records.size()));
  // Phases between consecutive records of one CTA, in µs, named by the pair of tags.
  // A kernel that marks its blocks' scores and P splits "block compute" into its three parts.
  const char* names[] = {"setup", "segment->query", "query->block", "block compute",
                         "block->next block", "last block->store", "store", "store->segment",
                         "store->end", "block scores", "block softmax+P", "block PV"};
  constexpr int kPhases = 12;
  auto phase_of = [](uint32_t from, uint32_t to) {
    if (from == kTraceStart) return 0;
    if (from == kTraceSegment) return 1;
    if (from == kTraceQuery) return 2;
    if (from == kTraceBlockReady) return to == kTraceScoresDone ? 9 : 3;
    if (from == kTraceScoresDone) return 10;
    if (from == kTracePStored) return 11;
    if (from == kTraceBlockDone) return to == kTraceBlockReady ? 4 : 5;
    if (from == kTraceStoreBegin) return 6;
    if (from == kTraceStoreEnd) return to == kTraceSegment ? 7 : 8;
    return -1;
  };
  uint64_t t0 = ~0ull;
  int ctas = 0;
  for (int c = 0; c < kTraceCtas; ++c) {
    if (counts[c] == 0) continue;
    ++ctas;
    t0 = std::min(t0, records[static_cast<size_t>(c) * kTraceRecords].time_ns);
  }
  std::vector<double> sum(kPhases + 3, 0.0), worst(kPhases + 3, 0.0);
  for (int c = 0; c < kTraceCtas; ++c) {
    const int n = std::min(counts[c], kTraceRecords);
    if (n == 0) continue;
    const TraceRecord* r = &records[static_cast<size_t>(c) * kTraceRecords];
    std::vector<double> cta(kPhases + 3, 0.0);
    int segments = 0, blocks = 0;
    for (int i = 0; i + 1 < n; ++i) {
      const int ph = phase_of(r[i].tag, r[i + 1].tag);
      if (ph >= 0) cta[ph] += (r[i + 1].time_ns - r[i].time_ns) * 1e-3;
    }
    for (int i = 0; i < n; ++i) {
      segments += r[i].tag == kTraceSegment;
      blocks += r[i].tag == kTraceBlockReady;
    }
    cta[kPhases] = (r[n - 1].time_ns - t0) * 1e-3;  // end, from the first CTA's start
    cta[kPhases + 1] = segments;
    cta[kPhases + 2] = blocks;
    for (int k = 0; k < kPhases + 3; ++k) {
      sum[k] += cta[k];
      worst[k] = std::max(worst[k], cta[k]);
    }
  }
  printf("trace: H=%d B=%d L=%d q_len=%d page=%d %s, %d CTAs (records of thread %d, µs per CTA)\n",
         s.heads, s.batch, s.L, s.q_len, s.page, s.dist.c_str(), ctas, kTraceThread);
  printf("| | ");
  for (int k = 0; k < kPhases; ++k) printf("%s | ", names[k]);
  printf("end | segments | blocks |\n|");
  for (int k = 0; k < kPhases + 4; ++k) printf("---|");
  printf("\n");
  for (int which = 0; which < 2; ++which) {
    printf("| %s | ", which == 0 ? "mean" : "max");
    for (int k = 0; k < kPhases + 3; ++k) {
      printf("%.2f | ", which == 0 ? sum[k] / std::max(ctas, 1) : worst[k]);
    }
    printf("\n");
  }
  PrintKernelStamps(stamps);
  pb.Free();
  return 0;
#endif
}

// FindRequestInWarp (the combine's warp-wide search) against ScheduleView::FindRequest on
// non-decreasing prefixes with runs of equal entries (empty requests), for every x below the total.
__global__ void FindRequestCompareKernel(const int32_t* prefix, int batch, int* mismatches) {
  ScheduleView view{};
  view.prefix = prefix;
  view.batch = batch;
  const int lane = threadIdx.x % 32;
  for (int x = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; x < prefix[batch];
       x += gridDim.x * (blockDim.x / 32)) {
    if (FindRequestInWarp(view, x, lane) != view.FindRequest(x) && lane == 0) {
      atomicAdd(mismatches, 1);
    }
  }
}

static bool CheckFindRequestInWarp() {
  std::mt19937 rng(5);
  int failures = 0;
  for (int batch : {1, 2, 31, 32, 33, 100, 512, 1000, 1025, 4000}) {
    std::vector<int32_t> prefix(batch + 1, 0);
    for (int b = 0; b < batch; ++b) prefix[b + 1] = prefix[b] + (rng() % 3 == 0 ? 0 : rng() % 9);
    prefix[batch] += 1;  // at least one unit
    int32_t* d_prefix;
    int* d_mismatches;
    CHECK_CUDA(cudaMalloc(&d_prefix, prefix.size() * sizeof(int32_t)));
    CHECK_CUDA(cudaMalloc(&d_mismatches, sizeof(int)));
    CHECK_CUDA(cudaMemcpy(d_prefix, prefix.data(), prefix.size() * sizeof(int32_t),
                          cudaMemcpyHostToDevice));
    CHECK_CUDA(cudaMemset(d_mismatches, 0, sizeof(int)));
    FindRequestCompareKernel<<<64, 256>>>(d_prefix, batch, d_mismatches);
    int mismatches = 0;
    CHECK_CUDA(cudaMemcpy(&mismatches, d_mismatches, sizeof(int), cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaFree(d_prefix));
    CHECK_CUDA(cudaFree(d_mismatches));
    failures += mismatches != 0;
    if (mismatches) printf("FindRequestInWarp: batch %d, %d mismatches FAIL\n", batch, mismatches);
  }
  printf("FindRequestInWarp against FindRequest: %s\n", failures ? "FAIL" : "PASS");
  return failures == 0;
}

// Checks every case of a suite against the reference; the exit status of the harness.
static int RunSuite(const std::vector<CaseSpec>& suite, const char* label) {
  PrintCheckHeader();
  int fails = 0;
  for (const auto& s : suite) fails += !RunCheck(s, 2e-2);
  printf("%s: %d failures\n", label, fails);
  return fails ? 1 : 0;
}

// The staged and the loading wide combine (CombineKernelStaged, CombineKernelWide), each forced
// wherever the wide combine is forced to run, give the same bytes of out and LSE on every case of
// the suite: the same arithmetic in the same order.
static int RunCombinesAgree(const std::vector<CaseSpec>& suite, const char* label) {
  const int wide = g_wide_combine, staged = g_staged_combine;
  int differ = 0;
  for (const auto& s : suite) {
    Problem pb;
    pb.Build(s, 1);
    g_wide_combine = 1;
    g_staged_combine = 1;
    const Outputs staged_out = Outputs::Of(pb);
    g_staged_combine = 0;
    const bool same = staged_out.SameBytes(Outputs::Of(pb));
    printf("%-40s %s\n", s.name.c_str(), same ? "same bytes" : "DIFFER");
    differ += !same;
    pb.Free();
  }
  g_wide_combine = wide;
  g_staged_combine = staged;
  printf("%s: %d of %zu cases differ\n", label, differ, suite.size());
  return differ ? 1 : 0;
}

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--cluster2") g_cluster = 2;
    else if (a == "--cluster1") g_cluster = 1;
    else if (a == "--plain-scores") g_transposed = 0;
    else if (a == "--fp8-transposed") g_fp8_registers = 0;
    else if (a == "--wide-combine") g_wide_combine = 1;
    else if (a == "--narrow-combine") g_wide_combine = 0;
    else if (a == "--staged-combine") g_staged_combine = 1;
    else if (a == "--loaded-combine") g_staged_combine = 0;
    else if (a == "--split-release") g_split_release = 1;
    else if (a == "--whole-release") g_split_release = 0;
    else if (a == "--fp32-partials") g_bf16_partials = 0;
    else if (a == "--bf16-partials") g_bf16_partials = 1;
    else if (a == "--column-halves") g_column_halves = 1;
    else if (a == "--whole-columns") g_column_halves = 0;
    else if (a == "--fail-closed") g_fail_closed = true;
    else if (a == "--no-pdl") g_pdl = false;
    else if (a == "--stream") g_stream = true;
    else if (a == "--child-graphs") g_child_graphs = true;
    else if (a == "--fixed-cost" && i + 1 < argc) g_fixed_cost = atoi(argv[++i]);
    else if (a == "--min-blocks" && i + 1 < argc) g_min_blocks = atoi(argv[++i]);
    else if (a == "--split-cost" && i + 1 < argc) g_split_cost = atoi(argv[++i]);
    else args.push_back(argv[i]);
  }
  printf("schedule: fixed_cost_blocks %d, min_blocks_per_part %d, block_to_split_cost %d; "
         "fail_closed %d; programmatic dependent launch %d\n",
         g_fixed_cost, g_min_blocks, g_split_cost, g_fail_closed ? 1 : 0, g_pdl ? 1 : 0);
  argc = (int)args.size();
  argv = args.data();
  std::string mode = argc > 1 ? argv[1] : "check";
  PrintDevice();
  if (mode == "check") {
    const bool search_ok = CheckFindRequestInWarp();
    return RunSuite(CheckSuite(), "check") | (search_ok ? 0 : 1);
  }
  if (mode == "sanitize") return RunSuite(SanitizeSuite(), "sanitize suite");
  if (mode == "check-fp8") return RunSuite(CheckSuiteFp8(), "fp8 check");
  if (mode == "combines-agree") return RunCombinesAgree(CheckSuite(), "combines agree");
  if (mode == "combines-agree-fp8") {
    return RunCombinesAgree(CheckSuiteFp8(), "fp8 combines agree");
  }
  if (mode == "sanitize-fp8") return RunSuite(SanitizeSuiteFp8(), "fp8 sanitize suite");
  if (mode == "time-fp8") {
    // Each problem with the bf16 cache, then the same lengths and tables with the fp8 cache.
    int iters = argc > 2 ? atoi(argv[2]) : 50;
    PrintTimeHeader();
    const std::vector<std::tuple<int, int, int, int>> grid = {
        {16, 32, 4096, 1}, {16, 32, 16384, 1}, {16, 128, 4096, 1}, {16, 128, 16384, 1},
        {8, 128, 4096, 1}, {32, 128, 4096, 1}, {16, 64, 4096, 2}, {16, 1, 4096, 1},
        {64, 128, 4096, 1}, {128, 32, 4096, 1}, {128, 128, 4096, 1}, {128, 128, 16384, 1},
        {128, 1, 4096, 1}};
    for (auto [H, B, L, q_len] : grid) {
      for (bool fp8 : {false, true}) {
        CaseSpec s;
        s.name = "time"; s.batch = B; s.heads = H; s.L = L; s.q_len = q_len; s.page = 64;
        s.dist = B == 1 ? "fixed" : "uniform";
        s.seed = 77 + B + L + H;
        s.fp8 = fp8;
        RunTime(s, iters, AllVariants("default"));
      }
    }
    return 0;
  }
  if (mode == "time") {
    int iters = argc > 2 ? atoi(argv[2]) : 50;
    const auto variants = AllVariants(argc > 3 ? argv[3] : "default");
    PrintTimeHeader();
    for (int H : {16, 128}) {
      for (int B : {32, 128}) {
        for (int L : {4096, 16384}) {
          CaseSpec s;
          s.name = "time"; s.batch = B; s.heads = H; s.L = L; s.page = 64; s.dist = "uniform";
          s.seed = 77 + B + L + H;
          RunTime(s, iters, variants);
        }
      }
    }
    for (auto [H, B, L] : std::vector<std::tuple<int, int, int>>{{128, 1, 4096}, {64, 128, 4096}, {8, 128, 4096}}) {
      CaseSpec s;
      s.name = "time"; s.batch = B; s.heads = H; s.L = L; s.page = 64;
      s.dist = B == 1 ? "fixed" : "uniform";
      RunTime(s, iters, variants);
    }
    {
      CaseSpec s;
      s.batch = 64; s.heads = 128; s.L = 4096; s.q_len = 2; s.page = 64;
      RunTime(s, iters, variants);
    }
    return 0;
  }
  if (mode == "clusters") {
    // How many clusters of n CTAs of the 64-row bf16 decode kernel (one CTA per SM) the device
    // holds at once, n = 1..16 (above 8 a non-portable cluster size).
    const void* kernel = detail::SelectKernel(LaunchOptions(), 2, 128, false);
    const int smem = detail::KernelSmemBytes(LaunchOptions(), false, 0);
    CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    printf("| cluster size | clusters at once | CTAs at once |\n|---|---|---|\n");
    for (int n : {1, 2, 4, 6, 8, 10, 12, 14, 16}) {
      int clusters = 0;
      const cudaError_t err = detail::MaxActiveClusters(kernel, n, smem, &clusters);
      if (err != cudaSuccess) {
        printf("| %d | %s | |\n", n, cudaGetErrorString(err));
        cudaGetLastError();
        continue;
      }
      printf("| %d | %d | %d |\n", n, clusters, n * clusters);
    }
    return 0;
  }
  if (mode == "profile") {
    // One decode of a timing-grid problem (for ncu): profile B L H [q_len]
    CaseSpec s;
    s.batch = argc > 2 ? atoi(argv[2]) : 128;
    s.L = argc > 3 ? atoi(argv[3]) : 4096;
    s.heads = argc > 4 ? atoi(argv[4]) : 64;
    s.q_len = argc > 5 ? atoi(argv[5]) : 1;
    Problem pb;
    pb.Build(s, 1);
    RunOnce(pb, 0);
    RunOnce(pb, 0);
    CHECK_CUDA(cudaDeviceSynchronize());
    pb.Free();
    printf("profile: done\n");
    return 0;
  }
  if (mode == "one" || mode == "trace") {
    CaseSpec s;
    s.name = "one";
    int iters = 50;
    bool check_only = false;
    std::string variants = "default";
    for (int i = 2; i < argc; ++i) {
      std::string a = argv[i];
      auto next = [&]() { return i + 1 < argc ? argv[++i] : "0"; };
      if (a == "--B") s.batch = atoi(next());
      else if (a == "--L") s.L = atoi(next());
      else if (a == "--H") s.heads = atoi(next());
      else if (a == "--q-len") s.q_len = atoi(next());
      else if (a == "--page") s.page = atoi(next());
      else if (a == "--dist") s.dist = next();
      else if (a == "--bad") s.bad = true;
      else if (a == "--fp8") s.fp8 = true;
      else if (a == "--iters") iters = atoi(next());
      else if (a == "--check-only" || a == "--sanitize") check_only = true;
      else if (a == "--ref-requests") s.ref_requests = atoi(next());
      else if (a == "--variants") variants = next();
      else { printf("unknown argument %s\n", a.c_str()); return 2; }
    }
    if (mode == "trace") return RunTrace(s);
    PrintCheckHeader();
    bool ok = RunCheck(s, 2e-2);
    if (!check_only) {
      PrintTimeHeader();
      RunTime(s, iters, AllVariants(variants));
    }
    return ok ? 0 : 1;
  }
  printf("usage: %s check | sanitize | check-fp8 | sanitize-fp8 | time [iters] [variants] | "
         "time-fp8 [iters] | clusters | one --B .. --L .. --H .. "
         "[--variants NAME (default: the default launch alone; all: every variant but the "
         "experiments)]\n"
         "flags: --cluster2 --plain-scores --wide-combine --narrow-combine --staged-combine "
         "--loaded-combine --fixed-cost N "
         "--min-blocks N --split-cost N --fail-closed\n",
         argv[0]);
  return 2;
}
