// The sm90 kernel's split-KV schedule on the host (tests/test_sm90_schedule.py builds and runs it):
// ScheduleKernel's prefix of RequestCost, then every part's SegmentWalker, the same code the
// decode and combine kernels run. For each case it checks that the parts' segments cover every KV
// block of every request exactly once and in order, that a request's segments lie in parts
// PartOf(b, 0) .. PartOf(b, n - 1), one per part, that `whole` marks exactly the requests one part
// holds, that the partial-result slots b + part are distinct and below batch + parts, and that
// FirstSplitAt (the combine kernel's boundary grid) names each split request exactly once.
// With planned lengths (an Sm90Plan's), the prefix is built from them while the parts walk the
// kernel's lengths, each the planned one or 0 (Sm90Plan.lengths_for): the same holds for every
// request with blocks, and a request of length 0 is in no segment (the boundary grid may still
// name it, from its planned cost; the combine then writes its empty rows).
//
// stdin, one case a line: batch parts max_pages page_size fixed_cost min_blocks planned, then
// batch lengths, then with planned = 1 batch planned lengths. stdout, a line a case:
// "ok SEGMENTS" or "FAIL reason".
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ffi/sm90/schedule.cuh"

using namespace jax_mla::sm90;

static std::string Check(int batch, int parts, const std::vector<int32_t>& lens,
                         const std::vector<int32_t>& planned, int max_pages, int page_size,
                         int fixed_cost, int min_blocks) {
  std::vector<int32_t> prefix(batch + 1, 0);
  for (int b = 0; b < batch; ++b) {
    prefix[b + 1] = prefix[b] + RequestCost(planned[b], max_pages, page_size, fixed_cost);
  }
  DecodeParams p{};
  p.schedule = prefix.data();
  p.batch = batch;
  p.fixed_cost_blocks = fixed_cost;
  p.min_blocks_per_part = min_blocks;
  const ScheduleView view = ScheduleView::Load(p, parts);
  std::vector<int> next_block(batch, 0), segments_of(batch, 0), last_part(batch, -1);
  std::set<long long> slots;
  int segments = 0;
  for (int part = 0; part < parts; ++part) {
    SegmentWalker walker(view, part, lens.data(), max_pages, page_size);
    Segment s;
    while (walker.Next(s)) {
      const int n = NumKvBlocks(EffectiveLength(lens[s.b], max_pages, page_size));
      if (s.kv_begin != next_block[s.b] || s.kv_end <= s.kv_begin || s.kv_end > n) {
        return "request " + std::to_string(s.b) + " segment [" + std::to_string(s.kv_begin) + ", " +
               std::to_string(s.kv_end) + ") out of order or range (n " + std::to_string(n) + ")";
      }
      if (part < view.PartOf(s.b, 0) || part > view.PartOf(s.b, n - 1) || part == last_part[s.b]) {
        return "request " + std::to_string(s.b) + " in part " + std::to_string(part);
      }
      if (s.whole != (view.PartOf(s.b, 0) == view.PartOf(s.b, n - 1))) return "whole flag";
      if (s.len != EffectiveLength(lens[s.b], max_pages, page_size)) return "length";
      const long long slot = static_cast<long long>(s.b) + part;
      if (slot >= static_cast<long long>(batch) + parts || !slots.insert(slot).second) {
        return "slot " + std::to_string(slot);
      }
      next_block[s.b] = s.kv_end;
      last_part[s.b] = part;
      ++segments_of[s.b];
      ++segments;
    }
  }
  // The combine kernel's boundary grid: FirstSplitAt names every split request exactly once.
  std::vector<int> named(batch, 0);
  for (int y = 0; y + 1 < parts; ++y) {
    if (view.BoundaryUnit(y) >= view.Total()) continue;
    const int b = view.FindRequest(static_cast<int>(view.BoundaryUnit(y)));
    if (view.FirstSplitAt(b, y)) ++named[b];
  }
  for (int b = 0; b < batch; ++b) {
    const int n = NumKvBlocks(EffectiveLength(lens[b], max_pages, page_size));
    const bool split = n > 0 && view.PartOf(b, 0) != view.PartOf(b, n - 1);
    if (n > 0 && named[b] != (split ? 1 : 0)) {
      return "request " + std::to_string(b) + " named by " + std::to_string(named[b]) +
             " boundaries";
    }
  }
  for (int b = 0; b < batch; ++b) {
    const int n = NumKvBlocks(EffectiveLength(lens[b], max_pages, page_size));
    if (next_block[b] != n) return "request " + std::to_string(b) + " not covered";
    if (n > 0 && segments_of[b] != view.PartOf(b, n - 1) - view.PartOf(b, 0) + 1) {
      return "request " + std::to_string(b) + " segment count";
    }
  }
  return "ok " + std::to_string(segments);
}

int main() {
  int batch, parts, max_pages, page_size, fixed_cost, min_blocks, has_planned;
  while (std::cin >> batch >> parts >> max_pages >> page_size >> fixed_cost >> min_blocks >>
         has_planned) {
    std::vector<int32_t> lens(batch);
    for (int32_t& len : lens) std::cin >> len;
    std::vector<int32_t> planned = lens;
    if (has_planned) {
      for (int32_t& len : planned) std::cin >> len;
    }
    std::printf("%s\n", Check(batch, parts, lens, planned, max_pages, page_size, fixed_cost,
                              min_blocks).c_str());
  }
  return 0;
}
