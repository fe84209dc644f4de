// Per-CTA event timeline of the decode kernel, for the standalone harness's `trace` mode only.
//
// Compiled in with -DJAX_MLA_SM90_TRACE: thread 0 of each CTA (consumer warpgroup 0, the one that
// scores), or the thread -DJAX_MLA_SM90_TRACE_THREAD=t names (128: warpgroup 1's first), appends
// (%globaltimer, tag, argument) records to g_trace at the points SM90_TRACE marks. Thread 0 of
// each decode and combine CTA also stamps when it starts, when its grid dependency wait returns,
// the steps KernelEvent names and when it is done into g_kernel_trace (SM90_TRACE_KERNEL), which
// places the two kernels on one clock. Without the macro both expand to nothing and the kernels
// are unchanged.
#pragma once

#include <cstdint>

namespace jax_mla {
namespace sm90 {

enum TraceTag : uint32_t {
  kTraceStart = 1,       // after the grid dependency wait
  kTraceSegment,         // a segment begins (argument: its request)
  kTraceQuery,           // the segment's query tile has landed
  kTraceBlockReady,      // a KV block has landed (argument: the block)
  kTraceBlockDone,       // the block's scores, softmax and PV are issued (and waited for)
  kTraceStoreBegin,      // the segment's epilogue begins (argument: 1 if the request is whole)
  kTraceStoreEnd,        // ... and has issued its stores
  kTraceEnd,             // the consumer is done
  kTraceScoresDone,      // a block's scores are in registers (kernels that mark it)
  kTracePStored,         // ... and its P tile is stored, before PV
};

struct TraceRecord {
  uint64_t time_ns;
  uint32_t tag;
  int32_t arg;
};

// g_kernel_trace's kernels and events.
enum TracedKernel { kTracedDecode, kTracedCombine, kTracedKernels };
enum KernelEvent {
  kKernelEntry,
  kKernelWaited,
  kKernelStep1,  // the wide combines: the splits' LSEs merged
  kKernelStep2,  // the wide combines: their first splits' rows accumulated (32 loaded, 8 staged)
  kKernelExit,
  kKernelEvents
};

constexpr int kTraceCtas = 264;     // at least the decode grid
constexpr int kTraceRecords = 4096; // per CTA; later records are dropped

#ifndef JAX_MLA_SM90_TRACE_THREAD
#define JAX_MLA_SM90_TRACE_THREAD 0
#endif
constexpr int kTraceThread = JAX_MLA_SM90_TRACE_THREAD;

#ifdef JAX_MLA_SM90_TRACE
__device__ TraceRecord g_trace[kTraceCtas][kTraceRecords];
__device__ int g_trace_count[kTraceCtas];

__device__ __forceinline__ void TraceEvent(uint32_t tag, int arg) {
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  const int cta = blockIdx.x;
  if (cta >= kTraceCtas) return;
  const int i = g_trace_count[cta];
  if (i >= kTraceRecords) return;
  g_trace[cta][i] = TraceRecord{now, tag, arg};
  g_trace_count[cta] = i + 1;
}
#define SM90_TRACE(tag, arg) \
  (threadIdx.x == ::jax_mla::sm90::kTraceThread ? ::jax_mla::sm90::TraceEvent((tag), (arg)) \
                                                  : (void)0)

// %globaltimer of (kernel, CTA by its linear index in the grid, event); 0 where not reached.
__device__ uint64_t g_kernel_trace[kTracedKernels][kTraceCtas][kKernelEvents];

// `after`: a value the stamp waits for (the clock is read once it is computed).
__device__ __forceinline__ void KernelTraceEvent(int kernel, int event, float after = 0.f) {
  const int cta = blockIdx.y * gridDim.x + blockIdx.x;
  if (threadIdx.x != 0 || cta >= kTraceCtas) return;
  uint64_t now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now) : "f"(after));
  g_kernel_trace[kernel][cta][event] = now;
}
// Stamps kKernelExit wherever the scope that declares it is left.
struct KernelTraceExit {
  int kernel;
  __device__ ~KernelTraceExit() { KernelTraceEvent(kernel, kKernelExit); }
};
#define SM90_TRACE_KERNEL(kernel, event) ::jax_mla::sm90::KernelTraceEvent((kernel), (event))
#define SM90_TRACE_KERNEL_AFTER(kernel, event, value) \
  ::jax_mla::sm90::KernelTraceEvent((kernel), (event), (value))
#define SM90_TRACE_KERNEL_EXIT_SCOPE(kernel) \
  const ::jax_mla::sm90::KernelTraceExit sm90_trace_exit_{(kernel)}
#else
#define SM90_TRACE(tag, arg) ((void)0)
#define SM90_TRACE_KERNEL(kernel, event) ((void)0)
#define SM90_TRACE_KERNEL_AFTER(kernel, event, value) ((void)0)
#define SM90_TRACE_KERNEL_EXIT_SCOPE(kernel) ((void)0)
#endif

}  // namespace sm90
}  // namespace jax_mla
