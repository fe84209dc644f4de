// Per-CTA event timeline of the decode kernel, for the standalone harness's `trace` mode only.
//
// Compiled in with -DJAX_MLA_SM90_TRACE: thread 0 of each CTA (consumer warpgroup 0, the one that
// scores), or the thread -DJAX_MLA_SM90_TRACE_THREAD=t names (128: warpgroup 1's first), appends
// (%globaltimer, tag, argument) records to g_trace at the points SM90_TRACE marks. Without the
// macro SM90_TRACE expands to nothing and the kernels are unchanged.
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
#else
#define SM90_TRACE(tag, arg) ((void)0)
#endif

}  // namespace sm90
}  // namespace jax_mla
