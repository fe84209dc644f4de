// The decode's L2 prefetch before its dependency wait, on the host (tests/test_sm90_prefetch.py
// builds and runs it): ForEachPrefetchHalf from ffi/sm90/schedule.cuh, the code
// PrefetchFirstKvBlocks runs, fed through a load that checks every address it is given.
//
// Inputs the decode may see before its wait are whatever the buffers hold, so on random cases
// (valid schedules, and schedules, lengths and block tables of arbitrary values) it checks that
// every read lies inside the schedule (batch + 1), seq_lens or plan_lens (batch) or block table
// (batch x max_pages), and that every cache range it asks for lies inside one page of the cache
// and holds 1..32 tokens, at most max_halves of them. With a valid schedule it also checks that
// the ranges are the part's first halves below the requests' lengths as the kernels take them
// (RequestLengths: with or without planned lengths, failing closed or not; Expected).
//
// Args: CASES SEED. stdout: a line per failure ("FAIL case N: reason"), then
// "checked CASES cases, VISITS ranges, FAILURES failures".
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "ffi/sm90/schedule.cuh"

using namespace jax_mla::sm90;

namespace {

struct Case {
  std::vector<int32_t> prefix, lens, tables;
  std::vector<int32_t> planned;  // the lengths the schedule was built from; empty: lens
  int batch, max_pages, page_size, num_pages, num_parts, fixed_cost, min_blocks, split_cost, q_len;
  bool valid;  // prefix is ScheduleKernel's for these lengths (planned, if given)
  bool fail_closed;
};

struct Range {
  int row, tokens;
  bool operator==(const Range& o) const { return row == o.row && tokens == o.tokens; }
};

int Pick(std::mt19937& rng, std::initializer_list<int> values) {
  std::uniform_int_distribution<size_t> d(0, values.size() - 1);
  return values.begin()[d(rng)];
}

int32_t AnyValue(std::mt19937& rng, int32_t typical) {
  switch (std::uniform_int_distribution<int>(0, 5)(rng)) {
    case 0: return INT32_MIN;
    case 1: return INT32_MAX;
    case 2: return -std::uniform_int_distribution<int32_t>(1, 1000)(rng);
    case 3: return static_cast<int32_t>(rng());
    default: return std::uniform_int_distribution<int32_t>(0, typical)(rng);
  }
}

Case MakeCase(std::mt19937& rng, bool valid) {
  Case c;
  c.batch = Pick(rng, {1, 2, 3, 5, 8, 16});
  c.page_size = Pick(rng, {32, 64});
  c.max_pages = Pick(rng, {1, 3, 16, 130});
  c.num_pages = Pick(rng, {1, 7, 64, 4096});
  c.num_parts = Pick(rng, {1, 2, 33, 66, 132});
  c.fixed_cost = Pick(rng, {0, 1, 2, 4});
  c.min_blocks = Pick(rng, {1, 2, 3, 8});
  c.split_cost = Pick(rng, {1, 14, 24, 1000000});
  c.q_len = Pick(rng, {1, 2, 4});
  c.fail_closed = Pick(rng, {0, 1}) == 1;
  c.valid = valid;
  const int capacity = c.max_pages * c.page_size;
  c.lens.resize(c.batch);
  for (int32_t& len : c.lens) {
    len = valid && std::uniform_int_distribution<int>(0, 3)(rng) > 0
              ? std::uniform_int_distribution<int32_t>(-5, capacity + 100)(rng)
              : AnyValue(rng, capacity);
  }
  if (Pick(rng, {0, 1}) == 1) {
    // Planned lengths, the call's own or others.
    c.planned = c.lens;
    for (int32_t& len : c.planned) {
      if (Pick(rng, {0, 1}) == 1) {
        len = std::uniform_int_distribution<int32_t>(-5, capacity + 100)(rng);
      }
    }
  }
  const std::vector<int32_t>& scheduled = c.planned.empty() ? c.lens : c.planned;
  c.tables.resize(static_cast<size_t>(c.batch) * c.max_pages);
  for (int32_t& page : c.tables) {
    page = std::uniform_int_distribution<int>(0, 9)(rng) > 0
               ? std::uniform_int_distribution<int32_t>(0, c.num_pages - 1)(rng)
               : AnyValue(rng, c.num_pages + 5);
  }
  c.prefix.assign(c.batch + 1, 0);
  for (int b = 0; b < c.batch; ++b) {
    c.prefix[b + 1] = valid ? c.prefix[b] + RequestCost(scheduled[b], c.max_pages, c.page_size,
                                                        c.fixed_cost)
                            : AnyValue(rng, 4 * capacity);
  }
  if (!valid) c.prefix[0] = AnyValue(rng, 4 * capacity);
  return c;
}

DecodeParams ParamsOf(const Case& c) {
  DecodeParams p{};
  p.schedule = const_cast<int32_t*>(c.prefix.data());
  p.seq_lens = c.lens.data();
  p.plan_lens = c.planned.empty() ? nullptr : c.planned.data();
  p.q_len = c.q_len;
  p.fail_closed = c.fail_closed;
  p.block_tables = c.tables.data();
  p.batch = c.batch;
  p.max_pages = c.max_pages;
  p.page_size = c.page_size;
  p.num_pages = c.num_pages;
  p.fixed_cost_blocks = c.fixed_cost;
  p.min_blocks_per_part = c.min_blocks;
  p.block_to_split_cost = c.split_cost;
  return p;
}

// The halves a valid schedule should have asked for: from the block of the request holding the
// part's first cost unit (a linear search; the block is 0 where that unit is part of the request's
// fixed cost) through that request, then the next request, max_halves at most, dealt to the M
// tiles in turn; those whose page id is out of range are dealt but not asked for. Where the part
// has a segment of that request (SegmentWalker), the first block is the segment's first.
std::vector<Range> Expected(const Case& c, const DecodeParams& p, int part, int mtile,
                            int m_tiles, int max_halves, std::string* error) {
  std::vector<Range> out;
  const ScheduleView view = ScheduleView::Load(p, c.num_parts);
  const long long x0 = static_cast<long long>(part) * view.units_per_part;
  int first_b = -1;
  for (int b = 0; b < c.batch; ++b) {
    if (c.prefix[b] <= x0 && x0 < c.prefix[b + 1]) first_b = b;
  }
  if (first_b < 0) return out;
  const int first_block =
      static_cast<int>(std::max(x0 - c.prefix[first_b] - c.fixed_cost, 0ll));
  SegmentWalker walker(view, part, RequestLengths::Of(p));
  Segment s;
  if (walker.Next(s) && s.b == first_b && s.kv_begin != first_block) {
    *error = "the part's first segment starts at block " + std::to_string(s.kv_begin);
  }
  int half = 0;
  for (int b = first_b; b < c.batch && b <= first_b + 1 && half < max_halves; ++b) {
    const int len = RequestLengths::Of(p).Get(b);
    for (int token = b == first_b ? first_block * kBlockN : 0; token < len && half < max_halves;
         token += kHalfN, ++half) {
      const int page = c.tables[static_cast<size_t>(b) * c.max_pages + token / c.page_size];
      if (half % m_tiles != mtile || page < 0 || page >= c.num_pages) continue;
      out.push_back({page * c.page_size + token % c.page_size, std::min(kHalfN, len - token)});
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const int cases = argc > 1 ? std::atoi(argv[1]) : 2000;
  std::mt19937 rng(argc > 2 ? std::atoi(argv[2]) : 1);
  long long visits = 0;
  int failures = 0;
  for (int n = 0; n < cases; ++n) {
    const Case c = MakeCase(rng, n % 2 == 0);
    const DecodeParams p = ParamsOf(c);
    std::string error;
    auto load = [&](const int32_t* x) -> int32_t {
      auto inside = [&](const std::vector<int32_t>& v) {
        return x >= v.data() && x < v.data() + v.size();
      };
      const bool ok = inside(c.prefix) || inside(c.lens) || inside(c.planned) || inside(c.tables);
      if (!ok && error.empty()) error = "read outside the schedule, lengths and block table";
      return ok ? *x : 0;
    };
    for (int m_tiles : {1, 2, 4}) {
      for (int mtile = 0; mtile < m_tiles; ++mtile) {
        for (int part = 0; part < c.num_parts && error.empty(); ++part) {
          const int max_halves = 2 * kStages;
          std::vector<Range> got;
          ForEachPrefetchHalf(p, c.num_parts, part, mtile, m_tiles, max_halves, load,
                              [&](int row, int tokens) { got.push_back({row, tokens}); });
          visits += static_cast<long long>(got.size());
          for (const Range& r : got) {
            const long long page = r.row / c.page_size;
            if (r.row < 0 || page >= c.num_pages || r.tokens < 1 || r.tokens > kHalfN ||
                r.row % c.page_size + r.tokens > c.page_size) {
              error = "range row " + std::to_string(r.row) + " tokens " +
                      std::to_string(r.tokens) + " outside a page of the cache";
            }
          }
          if (static_cast<int>(got.size()) > max_halves) error = "more than max_halves ranges";
          if (c.valid && error.empty() &&
              !(got == Expected(c, p, part, mtile, m_tiles, max_halves, &error))) {
            error = "part " + std::to_string(part) + " M tile " + std::to_string(mtile) + "/" +
                    std::to_string(m_tiles) + ": not the part's first halves";
          }
        }
      }
    }
    if (!error.empty()) {
      ++failures;
      std::printf("FAIL case %d (%s schedule, batch %d): %s\n", n, c.valid ? "valid" : "arbitrary",
                  c.batch, error.c_str());
    }
  }
  std::printf("checked %d cases, %lld ranges, %d failures\n", cases, visits, failures);
  return failures == 0 ? 0 : 1;
}
