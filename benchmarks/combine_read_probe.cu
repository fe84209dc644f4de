// How long the wide combine's reads of the split partials take at B = 1: the probe behind
// CombineKernelStaged (docs/sm90-kernel.md, "The wide combine's reads staged by bulk copies", has
// what the trace build's per-CTA stamps and this probe measured).
//
// A writer kernel stands in for the decode: CTA (split, M tile) spins for --spin-us (the decode's
// blocks) and then stores its 64 rows of bf16 partials (64 KB, 16-byte stores) and their LSEs in
// the decode's workspace layout: split s, row r at (s * rows_pad + r) * 512 bf16, rows_pad = 128.
// Readers stand in for the combine, each merging output rows of every split:
//   R rows x G groups  Reader<R, G>, CombineKernelWide's loads: a block of R rows, each by 4 column
//                      warps (4 columns a lane) times G split groups; a lane loads its rows of up
//                      to 32 splits at once (8 bytes each) and the LSEs of splits lane, lane + 32,
//                      ..., reduces the LSEs over the warp, accumulates, loads the next 32; the
//                      groups' sums are added through shared memory; "warmed": the whole merge
//                      run once before the wait as well (instruction cache and address
//                      translation warm), its result dropped
//   bulk, R rows       BulkReader<R>: warp 0's lanes copy the block's rows of every split into
//                      shared memory by cp.async.bulk (one mbarrier), the warps read the LSEs
//                      meanwhile, then accumulate from shared memory
// Thread 0 of each reader CTA stamps %globaltimer at its start, when its dependency wait returns,
// when its LSEs are reduced, when its first 32 rows are accumulated (bulk: when the copies have
// landed) and when it is done.
//
// Cases (each the median over the reader's CTAs, then over 5 launches after a warm-up):
//   pdl        writer, reader launched behind it with programmatic dependent launch (as the decode
//              and the combine are)
//   pdl+touch  the same, the reader's lanes first asking L2 (prefetch.global.L2) for one line of
//              each of their rows before the wait (address translation before the data exists)
//   again      the reader launched a second time after the first completed, on the same data
//
//   nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a benchmarks/combine_read_probe.cu \
//        -o .gpu/combine_read_probe
//   .gpu/combine_read_probe [--splits 64] [--rows 128] [--spin-us 8]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "check_cuda.h"

namespace {

constexpr int kCols = 512;
constexpr int kRowsPad = 128;
constexpr int kStamps = 5;  // start, wait returned, LSEs reduced, first 32 rows, all rows
constexpr int kMaxCtas = 256;

__device__ uint64_t g_stamps[kMaxCtas][kStamps];

__device__ __forceinline__ uint64_t Now(float after = 0.f) {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t) : "f"(after));
  return t;
}

struct Layout {
  __nv_bfloat16* out;  // [splits, rows_pad, 512] with split_stride elements between splits
  float* lse;          // [splits, rows_pad]
  size_t split_stride;
  int splits, rows;
};

__global__ void Writer(Layout l, long long spin_ns) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const uint64_t t0 = Now();
  while (Now() - t0 < static_cast<uint64_t>(spin_ns)) {
  }
  const int split = blockIdx.x / (kRowsPad / 64), tile = blockIdx.x % (kRowsPad / 64);
  for (int i = threadIdx.x; i < 64 * kCols / 8; i += blockDim.x) {
    const int row = tile * 64 + i / (kCols / 8), col = i % (kCols / 8) * 8;
    if (row >= l.rows) continue;
    const float v = 0.001f * (split + row + col);
    __nv_bfloat162 h = __floats2bfloat162_rn(v, v);
    uint4 w;
    w.x = w.y = w.z = w.w = *reinterpret_cast<uint32_t*>(&h);
    *reinterpret_cast<uint4*>(l.out + split * l.split_stride +
                              static_cast<size_t>(row) * kCols + col) = w;
  }
  if (threadIdx.x < 64 && tile * 64 + static_cast<int>(threadIdx.x) < l.rows) {
    l.lse[split * kRowsPad + tile * 64 + threadIdx.x] = 0.01f * split;
  }
}

struct alignas(8) Bf16x4 {
  __nv_bfloat162 lo, hi;
};

// Lane j's LSEs of row `row` of splits j, j + 32, j + 64, j + 96 (-1e30 past the last) into lse,
// and their maximum over the warp.
__device__ __forceinline__ float LoadRowLses(const Layout& l, int row, int lane, float (&lse)[4]) {
#pragma unroll
  for (int g = 0; g < 4; ++g) {
    const int s = 32 * g + lane;
    lse[g] = s < l.splits ? l.lse[s * kRowsPad + row] : -1e30f;
  }
  float m = fmaxf(fmaxf(lse[0], lse[1]), fmaxf(lse[2], lse[3]));
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, d));
  return m;
}

// kRows output rows per CTA, each by 4 column warps times kGroups split groups: group g
// accumulates the splits [g S / kGroups, (g + 1) S / kGroups), 32 at a time, with the weights of
// all S splits (every warp reduces all LSEs), and the groups' sums are added in group order
// through shared memory.
template <int kRows, int kGroups, bool kTouch, bool kWarm = false>
__global__ void __launch_bounds__(kRows * 4 * kGroups * 32) Reader(Layout l, float* result) {
  const uint64_t start = Now();
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row = blockIdx.x * kRows + warp / (4 * kGroups);
  const int col_warp = warp % 4, group = warp / 4 % kGroups;
  const int col0 = col_warp * 128 + lane * 4;
  const int s_begin = group * l.splits / kGroups, s_end = (group + 1) * l.splits / kGroups;
  auto row_ptr = [&](int s) {
    return reinterpret_cast<const Bf16x4*>(l.out + s * l.split_stride +
                                           static_cast<size_t>(row) * kCols + col0);
  };
  if (kTouch) {
    for (int s = s_begin + lane; s < s_end; s += 32) {
      asm volatile("prefetch.global.L2 [%0];" ::"l"(row_ptr(s) - lane) : "memory");
    }
  }
  uint64_t waited = 0, reduced = 0, first_group = 0;
  float4 acc;
  // kWarm: the whole merge runs once before the wait (on whatever the buffer holds; its result
  // is dropped), then again after it; the code is one loop body, not two copies.
#pragma unroll 1
  for (int pass = kWarm ? 0 : 1; pass < 2; ++pass) {
  if (pass == 1) {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    waited = Now();
  }
  Bf16x4 v[32];
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    if (s_begin + i < s_end) v[i] = *row_ptr(s_begin + i);
  }
  float lse[4];
  const float m = LoadRowLses(l, row, lane, lse);
  reduced = Now(m);
  acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int base = s_begin; base < s_end; base += 32) {
    if (base > s_begin) {
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        if (base + i < s_end) v[i] = *row_ptr(base + i);
      }
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      if (base + i < s_end) {
        const float w = __shfl_sync(0xffffffffu, lse[(base / 32) & 3], i) - m;
        const float2 lo = __bfloat1622float2(v[i].lo), hi = __bfloat1622float2(v[i].hi);
        acc.x = fmaf(w, lo.x, acc.x);
        acc.y = fmaf(w, lo.y, acc.y);
        acc.z = fmaf(w, hi.x, acc.z);
        acc.w = fmaf(w, hi.y, acc.w);
      }
    }
    if (base == s_begin) first_group = Now(acc.x + acc.y + acc.z + acc.w);
  }
  if (pass == 0 && acc.x == 1.2345e-30f) result[0] = acc.y;  // keeps pass 0's loads
  }
  if (kGroups > 1) {
    __shared__ float4 sums[kGroups][kRows * 4][32];
    const int slot = warp / (4 * kGroups) * 4 + col_warp;
    sums[group][slot][lane] = acc;
    __syncthreads();
    if (group != 0) return;
    for (int g = 1; g < kGroups; ++g) {
      const float4 o = sums[g][slot][lane];
      acc.x += o.x;
      acc.y += o.y;
      acc.z += o.z;
      acc.w += o.w;
    }
  }
  const uint64_t done = Now(acc.x + acc.y + acc.z + acc.w);
  reinterpret_cast<float4*>(result)[static_cast<size_t>(row) * (kCols / 4) + col0 / 4] = acc;
  if (threadIdx.x == 0 && blockIdx.x < kMaxCtas) {
    const uint64_t s[kStamps] = {start, waited, reduced, first_group, done};
    for (int k = 0; k < kStamps; ++k) g_stamps[blockIdx.x][k] = s[k];
  }
}

// kRows output rows per CTA, each by 4 column warps: the CTA's rows of every split (kRows KB,
// contiguous in the layout) copied into shared memory by bulk asynchronous copies (cp.async.bulk,
// the copy engine's path, not the load units'), issued by warp 0's lanes after the wait and
// completed on one mbarrier; the LSEs are read and reduced meanwhile; then each warp accumulates
// its columns of every split from shared memory.
template <int kRows>
__global__ void __launch_bounds__(kRows * 4 * 32) BulkReader(Layout l, float* result) {
  extern __shared__ __align__(128) uint8_t stage[];
  __shared__ __align__(8) uint64_t full;
  const uint64_t start = Now();
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = blockIdx.x * kRows, row = row0 + warp / 4;
  const int col0 = warp % 4 * 128 + lane * 4;
  const uint32_t full_addr = static_cast<uint32_t>(__cvta_generic_to_shared(&full));
  const uint32_t stage_addr = static_cast<uint32_t>(__cvta_generic_to_shared(stage));
  constexpr uint32_t kSplitBytes = kRows * kCols * 2;
  if (threadIdx.x == 0) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(full_addr) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  asm volatile("griddepcontrol.wait;" ::: "memory");
  const uint64_t waited = Now();
  if (warp == 0) {
    if (lane == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(full_addr),
                   "r"(kSplitBytes * l.splits)
                   : "memory");
    }
    __syncwarp();
    for (int s = lane; s < l.splits; s += 32) {
      const __nv_bfloat16* src = l.out + s * l.split_stride + static_cast<size_t>(row0) * kCols;
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, "
          "[%3];" ::"r"(stage_addr + s * kSplitBytes),
          "l"(src), "r"(kSplitBytes), "r"(full_addr)
          : "memory");
    }
  }
  float lse[4];
  const float m = LoadRowLses(l, row, lane, lse);
  const uint64_t reduced = Now(m);
  uint32_t ready = 0;
  while (!ready) {
    asm volatile(
        "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0; selp.u32 %0, 1, 0, "
        "p; }"
        : "=r"(ready)
        : "r"(full_addr)
        : "memory");
  }
  const uint64_t landed = Now();
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  const uint8_t* mine = stage + (warp / 4) * kCols * 2 + col0 * 2;
  for (int s = 0; s < l.splits; ++s) {
    const Bf16x4 v = *reinterpret_cast<const Bf16x4*>(mine + s * kSplitBytes);
    const int g = s / 32;
    const float mine_lse = g == 0 ? lse[0] : g == 1 ? lse[1] : g == 2 ? lse[2] : lse[3];
    const float w = __shfl_sync(0xffffffffu, mine_lse, s % 32) - m;
    const float2 lo = __bfloat1622float2(v.lo), hi = __bfloat1622float2(v.hi);
    acc.x = fmaf(w, lo.x, acc.x);
    acc.y = fmaf(w, lo.y, acc.y);
    acc.z = fmaf(w, hi.x, acc.z);
    acc.w = fmaf(w, hi.y, acc.w);
  }
  const uint64_t done = Now(acc.x + acc.y + acc.z + acc.w);
  reinterpret_cast<float4*>(result)[static_cast<size_t>(row) * (kCols / 4) + col0 / 4] = acc;
  if (threadIdx.x == 0 && blockIdx.x < kMaxCtas) {
    const uint64_t st[kStamps] = {start, waited, reduced, landed, done};
    for (int k = 0; k < kStamps; ++k) g_stamps[blockIdx.x][k] = st[k];
  }
}

struct ReaderShape {
  const char* name;
  const void* kernel;
  const void* touch_kernel;  // the same reader asking L2 first (pdl+touch), or nullptr
  int rows, groups;
  bool bulk;  // BulkReader: dynamic shared memory of splits x rows KB
};
template <int kRows, int kGroups, bool kTouch = false, bool kWarm = false>
const void* ReaderFn() {
  return reinterpret_cast<const void*>(&Reader<kRows, kGroups, kTouch, kWarm>);
}
const ReaderShape kShapes[] = {
    {"2 rows x 1 group", ReaderFn<2, 1>(), ReaderFn<2, 1, true>(), 2, 1, false},
    {"1 row x 1 group", ReaderFn<1, 1>(), ReaderFn<1, 1, true>(), 1, 1, false},
    {"1 row x 2 groups", ReaderFn<1, 2>(), nullptr, 1, 2, false},
    {"2 rows x 2 groups", ReaderFn<2, 2>(), nullptr, 2, 2, false},
    {"1 row x 4 groups", ReaderFn<1, 4>(), nullptr, 1, 4, false},
    {"2 rows x 1 group, warmed", ReaderFn<2, 1, false, true>(), nullptr, 2, 1, false},
    {"1 row x 2 groups, warmed", ReaderFn<1, 2, false, true>(), nullptr, 1, 2, false},
    {"bulk, 2 rows", reinterpret_cast<const void*>(&BulkReader<2>), nullptr, 2, 1, true},
    {"bulk, 1 row", reinterpret_cast<const void*>(&BulkReader<1>), nullptr, 1, 1, true},
};

void Launch(const void* kernel, int grid, int block, bool pdl, void** args, size_t smem = 0) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attr;
  config.numAttrs = pdl ? 1 : 0;
  CHECK_CUDA(cudaLaunchKernelExC(&config, kernel, args));
}

// Median over the CTAs of each stamp's distance from the one before, and of wait -> done.
std::vector<double> Phases(int ctas) {
  std::vector<uint64_t> st(static_cast<size_t>(kMaxCtas) * kStamps);
  CHECK_CUDA(cudaMemcpyFromSymbol(st.data(), g_stamps, sizeof(uint64_t) * st.size()));
  std::vector<double> med;
  for (int k = 1; k <= kStamps; ++k) {
    std::vector<double> d;
    for (int c = 0; c < ctas; ++c) {
      const uint64_t* s = &st[static_cast<size_t>(c) * kStamps];
      d.push_back(k < kStamps ? (s[k] - s[k - 1]) * 1e-3 : (s[kStamps - 1] - s[1]) * 1e-3);
    }
    std::sort(d.begin(), d.end());
    med.push_back(d[d.size() / 2]);
  }
  return med;
}

}  // namespace

int main(int argc, char** argv) {
  int splits = 64, rows = 128;
  double spin_us = 8;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--splits")) splits = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--rows")) rows = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--spin-us")) spin_us = atof(argv[i + 1]);
    else {
      fprintf(stderr, "unknown flag %s\n", argv[i]);
      return 2;
    }
  }
  if (splits < 1 || splits > 128 || rows < 2 || rows > kRowsPad || rows % 2 != 0) {
    fprintf(stderr, "splits 1-128, rows 2-128 and even\n");
    return 2;
  }
  Layout l{};
  l.splits = splits;
  l.rows = rows;
  CHECK_CUDA(cudaMalloc(&l.out, sizeof(__nv_bfloat16) * kRowsPad * kCols * splits));
  CHECK_CUDA(cudaMalloc(&l.lse, sizeof(float) * kRowsPad * splits));
  float* result;
  CHECK_CUDA(cudaMalloc(&result, sizeof(float) * kRowsPad * kCols));
  const long long spin_ns = static_cast<long long>(spin_us * 1e3);
  const int writer_ctas = splits * (kRowsPad / 64);

  printf("probe: %d splits, %d rows, bf16 partials, writer spins %.1f µs; median over the "
         "reader's CTAs, median of 5 launches, µs\n",
         splits, rows, spin_us);
  printf("| reader | case | CTAs | start -> wait returned | -> LSEs reduced | -> first 32 rows | "
         "-> done | wait returned -> done |\n");
  printf("|---|---|---|---|---|---|---|---|\n");
  const char* cases[] = {"pdl", "pdl+touch", "again"};
  for (const ReaderShape& shape : kShapes) {
    for (const char* name : cases) {
      const std::string c = name;
      if (c == "pdl+touch" && shape.touch_kernel == nullptr) continue;
      const void* reader = c == "pdl+touch" ? shape.touch_kernel : shape.kernel;
      l.split_stride = static_cast<size_t>(kRowsPad) * kCols;
      void* wargs[] = {&l, const_cast<long long*>(&spin_ns)};
      void* rargs[] = {&l, &result};
      const int ctas = rows / shape.rows, threads = shape.rows * 4 * shape.groups * 32;
      const size_t smem = shape.bulk ? static_cast<size_t>(splits) * shape.rows * kCols * 2 : 0;
      if (shape.bulk) {
        CHECK_CUDA(cudaFuncSetAttribute(reader, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(smem)));
      }
      std::vector<std::vector<double>> runs;
      for (int it = 0; it < 6; ++it) {
        Launch(reinterpret_cast<const void*>(&Writer), writer_ctas, 256, false, wargs);
        if (c == "again") CHECK_CUDA(cudaDeviceSynchronize());
        Launch(reader, ctas, threads, c != "again", rargs, smem);
        if (c == "again") {
          CHECK_CUDA(cudaDeviceSynchronize());
          Launch(reader, ctas, threads, false, rargs, smem);
        }
        CHECK_CUDA(cudaDeviceSynchronize());
        if (it > 0) runs.push_back(Phases(ctas));
      }
      printf("| %s | %s | %d |", shape.name, name, ctas);
      for (int k = 0; k < kStamps; ++k) {
        std::vector<double> v;
        for (const auto& r : runs) v.push_back(r[k]);
        std::sort(v.begin(), v.end());
        printf(" %.2f |", v[v.size() / 2]);
      }
      printf("\n");
    }
  }
  CHECK_CUDA(cudaFree(l.out));
  CHECK_CUDA(cudaFree(l.lse));
  CHECK_CUDA(cudaFree(result));
  return 0;
}
