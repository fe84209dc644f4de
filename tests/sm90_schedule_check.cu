// The sm90 kernel's split-KV schedule on the host (tests/test_sm90_schedule.py builds and runs it):
// ScheduleKernel's prefix of RequestCost, then every part's SegmentWalker, the same code the
// decode and combine kernels run, with their lengths (RequestLengths). For each case it checks that
// the parts' segments cover every KV block of every request exactly once and in order, that a
// request's segments lie in parts PartOf(b, 0) .. PartOf(b, n - 1), one per part, that `whole`
// marks exactly the requests one part holds, that the partial-result slots b + part are distinct
// and below batch + parts, and that FirstSplitAt (the combine kernel's boundary grid) names each
// split request exactly once. With planned lengths (an Sm90Plan's) the prefix is built from them;
// the kernels then compare each length with its planned one (plan_lens), and a request of length 0
// is in no segment (the boundary grid may still name it, from its planned cost; the combine then
// writes its empty rows). Mode 2 builds the prefix from the planned lengths but walks without them,
// as a kernel not told the plan's lengths would: the control for why it must be.
//
// stdin, one case a line: batch parts max_pages page_size fixed_cost min_blocks split_cost q_len
// fail_closed
// mode (0: no plan, 1: planned, 2: planned but not compared), then batch lengths, then with mode
// 1 or 2 batch planned lengths. stdout, a line a case: "ok SEGMENTS LEN..." (the kernels' length
// of each request) or "FAIL reason".
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "ffi/sm90/schedule.cuh"

using namespace jax_mla::sm90;

static std::string Check(int batch, int parts, const RequestLengths& rule,
                         const std::vector<int32_t>& planned, int fixed_cost, int min_blocks,
                         int split_cost) {
  const int max_pages = rule.max_pages, page_size = rule.page_size;
  std::vector<int> kernel_len(batch);
  for (int b = 0; b < batch; ++b) kernel_len[b] = rule.Get(b);
  std::vector<int32_t> prefix(batch + 1, 0);
  for (int b = 0; b < batch; ++b) {
    prefix[b + 1] = prefix[b] + RequestCost(planned[b], max_pages, page_size, fixed_cost);
  }
  DecodeParams p{};
  p.schedule = prefix.data();
  p.batch = batch;
  p.fixed_cost_blocks = fixed_cost;
  p.min_blocks_per_part = min_blocks;
  p.block_to_split_cost = split_cost;
  const ScheduleView view = ScheduleView::Load(p, parts);
  std::vector<int> next_block(batch, 0), segments_of(batch, 0), last_part(batch, -1);
  std::set<long long> slots;
  int segments = 0;
  for (int part = 0; part < parts; ++part) {
    SegmentWalker walker(view, part, rule);
    Segment s;
    while (walker.Next(s)) {
      const int n = NumKvBlocks(kernel_len[s.b]);
      if (s.kv_begin != next_block[s.b] || s.kv_end <= s.kv_begin || s.kv_end > n) {
        return "request " + std::to_string(s.b) + " segment [" + std::to_string(s.kv_begin) + ", " +
               std::to_string(s.kv_end) + ") out of order or range (n " + std::to_string(n) + ")";
      }
      if (part < view.PartOf(s.b, 0) || part > view.PartOf(s.b, n - 1) || part == last_part[s.b]) {
        return "request " + std::to_string(s.b) + " in part " + std::to_string(part);
      }
      if (s.whole != (view.PartOf(s.b, 0) == view.PartOf(s.b, n - 1))) return "whole flag";
      if (s.len != kernel_len[s.b]) return "length";
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
    const int n = NumKvBlocks(kernel_len[b]);
    const bool split = n > 0 && view.PartOf(b, 0) != view.PartOf(b, n - 1);
    if (n > 0 && named[b] != (split ? 1 : 0)) {
      return "request " + std::to_string(b) + " named by " + std::to_string(named[b]) +
             " boundaries";
    }
  }
  for (int b = 0; b < batch; ++b) {
    const int n = NumKvBlocks(kernel_len[b]);
    if (next_block[b] != n) return "request " + std::to_string(b) + " not covered";
    if (n > 0 && segments_of[b] != view.PartOf(b, n - 1) - view.PartOf(b, 0) + 1) {
      return "request " + std::to_string(b) + " segment count";
    }
  }
  std::string ok = "ok " + std::to_string(segments);
  for (int len : kernel_len) ok += " " + std::to_string(len);
  return ok;
}

int main() {
  int batch, parts, max_pages, page_size, fixed_cost, min_blocks, split_cost, q_len, fail_closed,
      mode;
  while (std::cin >> batch >> parts >> max_pages >> page_size >> fixed_cost >> min_blocks >>
         split_cost >> q_len >> fail_closed >> mode) {
    std::vector<int32_t> lens(batch);
    for (int32_t& len : lens) std::cin >> len;
    std::vector<int32_t> planned = lens;
    if (mode != 0) {
      for (int32_t& len : planned) std::cin >> len;
    }
    const RequestLengths rule{lens.data(), mode == 1 ? planned.data() : nullptr, max_pages,
                              page_size, q_len, fail_closed != 0};
    std::printf("%s\n",
                Check(batch, parts, rule, planned, fixed_cost, min_blocks, split_cost).c_str());
  }
  return 0;
}
