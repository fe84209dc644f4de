// CombineKernelStaged's ring (StagedRing, ffi/sm90/decode_params.h) on the host, under random
// interleavings (tests/test_sm90_staged_ring.py builds and runs it). The producer warp's 32 lanes
// and the consumer warps run the kernel's program over the ring, each lane and warp scheduled on
// its own, and every bulk copy lands at a random later step; the mbarriers follow PTX's rules (a
// phase completes when its pending arrivals and transaction bytes both reach zero; a parity wait
// passes once the phase of that parity has completed). For every split count from 2 to 140 and 4
// or 8 consumer warps it checks that nothing deadlocks, that every consumer reads each of its
// group's splits after the split's copy landed and before the next copy into that slot, and that
// every copy and read happens exactly once.
//
// argv[1], optional, plants a bug in this check's copy of the program so that the test can see it
// fail: "parity" (consumers wait for the other parity), "no-empty" (the producer never waits for a
// slot to be read), "arrivals" (a group's `full` expects one arrival fewer).
// stdout: one line per failing case, then "ring: CASES cases, FAILURES failures".
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "ffi/sm90/decode_params.h"

using jax_mla::sm90::kStagedGroups;
using jax_mla::sm90::kStagedGroupSplits;
using Ring = jax_mla::sm90::StagedRing;

namespace {

constexpr int kBytes = 1;  // a copy's transaction bytes (the kernel's kStagedSlotBytes)

struct MBarrier {
  int arrivals = 0, pending = 0, tx = 0, completed = 0;

  void Init(int n) { arrivals = pending = n; }
  void Complete() {
    if (pending == 0 && tx == 0) {
      ++completed;
      pending = arrivals;
    }
  }
  void Arrive(int expect_tx) {  // mbarrier.arrive.expect_tx: the bytes first, then the arrival
    tx += expect_tx;
    --pending;
    Complete();
  }
  void CompleteTx(int bytes) {
    tx -= bytes;
    Complete();
  }
  bool Passed(uint32_t parity) const { return static_cast<uint32_t>(completed & 1) != parity; }
};

struct Copy {
  int slot, split, group;
};

struct Sim {
  std::string bug;
  int count, warps;
  std::vector<MBarrier> full, empty;
  std::vector<int> content, reads_left;  // per slot: the split it holds, reads it still awaits
  std::vector<int> reads_of_split;
  std::vector<Copy> in_flight;
  std::string failure;

  // Producer lane state: its issue k0 and the step within it (0 wait, 1 arrive, 2 copy).
  struct Lane {
    int k0 = 0, step = 0;
    bool done = false;
  };
  std::vector<Lane> lanes;
  // Consumer warp state: its group k and whether it has passed that group's wait.
  struct Warp {
    int k = 0;
    bool done = false;
  };
  std::vector<Warp> consumers;

  Sim(int count_, int warps_, const std::string& bug_) : bug(bug_), count(count_), warps(warps_) {
    full.resize(kStagedGroups);
    empty.resize(kStagedGroups);
    for (auto& b : full) b.Init(kStagedGroupSplits - (bug == "arrivals" ? 1 : 0));
    for (auto& b : empty) b.Init(warps);
    content.assign(kStagedGroups * kStagedGroupSplits, -1);
    reads_left.assign(content.size(), 0);
    reads_of_split.assign(count, 0);
    lanes.resize(32);
    consumers.resize(warps);
  }

  int Groups() const { return Ring::Groups(count); }

  // One step of lane `l`, if it can take one: true if it did.
  bool StepLane(int l) {
    Lane& s = lanes[l];
    if (s.done) return false;
    if (s.k0 >= Groups()) {
      s.done = true;
      return true;
    }
    const int k = Ring::IssuedGroup(s.k0, l), j = Ring::IssuedSplit(s.k0, l);
    if (k >= Groups()) {  // no such group
      s.k0 += Ring::kGroupsPerIssue;
      return true;
    }
    const int g = Ring::Group(k);
    if (s.step == 0) {
      if (Ring::WaitsForEmpty(k) && bug != "no-empty" && !empty[g].Passed(Ring::EmptyParity(k))) {
        return false;
      }
      s.step = 1;
    } else if (s.step == 1) {
      full[g].Arrive(j < count ? kBytes : 0);
      s.step = 2;
    } else {
      if (j < count) in_flight.push_back({Ring::Slot(k, l % kStagedGroupSplits), j, g});
      s.step = 0;
      s.k0 += Ring::kGroupsPerIssue;
    }
    return true;
  }

  bool LandCopy(size_t i) {
    const Copy c = in_flight[i];
    in_flight.erase(in_flight.begin() + static_cast<long>(i));
    if (reads_left[c.slot] != 0 && failure.empty()) {
      failure = "copy of split " + std::to_string(c.split) + " overwrote slot " +
                std::to_string(c.slot) + " before every consumer read it";
    }
    content[c.slot] = c.split;
    reads_left[c.slot] = warps;
    full[c.group].CompleteTx(kBytes);
    return true;
  }

  bool StepWarp(int w) {
    Warp& s = consumers[w];
    if (s.done) return false;
    if (s.k >= Groups()) {
      s.done = true;
      return true;
    }
    const int g = Ring::Group(s.k);
    const uint32_t parity = Ring::FullParity(s.k) ^ (bug == "parity" ? 1u : 0u);
    if (!full[g].Passed(parity)) return false;
    for (int i = 0; i < kStagedGroupSplits; ++i) {
      const int j = s.k * kStagedGroupSplits + i;
      if (j >= count) continue;  // a stale slot, read and dropped
      const int slot = Ring::Slot(s.k, i);
      if (content[slot] != j && failure.empty()) {
        failure = "consumer " + std::to_string(w) + " read slot " + std::to_string(slot) +
                  " holding split " + std::to_string(content[slot]) + " for split " +
                  std::to_string(j);
      }
      --reads_left[slot];
      ++reads_of_split[j];
    }
    empty[g].Arrive(0);
    ++s.k;
    return true;
  }

  // Runs to the end under the order `rng` draws; "" or what went wrong.
  std::string Run(std::mt19937& rng) {
    const int actors = 32 + warps;
    for (long steps = 0; failure.empty(); ++steps) {
      if (steps > 10000000) return "no end";
      std::vector<int> order(actors + static_cast<int>(in_flight.size()));
      for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
      std::shuffle(order.begin(), order.end(), rng);
      bool moved = false;
      for (int a : order) {
        if (a < 32) moved = StepLane(a);
        else if (a < actors) moved = StepWarp(a - 32);
        else moved = LandCopy(static_cast<size_t>(a - actors));
        if (moved) break;
      }
      if (!moved) break;
    }
    if (!failure.empty()) return failure;
    for (const Lane& l : lanes) {
      if (!l.done) return "deadlock: a producer lane waits";
    }
    for (const Warp& w : consumers) {
      if (!w.done) return "deadlock: a consumer warp waits at group " + std::to_string(w.k);
    }
    if (!in_flight.empty()) return "copies left in flight";
    for (int j = 0; j < count; ++j) {
      if (reads_of_split[j] != warps) {
        return "split " + std::to_string(j) + " read " + std::to_string(reads_of_split[j]) +
               " times";
      }
    }
    return "";
  }
};

}  // namespace

int main(int argc, char** argv) {
  const std::string bug = argc > 1 ? argv[1] : "";
  int cases = 0, failures = 0;
  for (int warps : {4, 8}) {
    for (int count = 2; count <= 140; ++count) {
      for (int seed = 0; seed < 16; ++seed) {
        std::mt19937 rng(static_cast<uint32_t>(count * 131 + warps * 7 + seed));
        Sim sim(count, warps, bug);
        const std::string result = sim.Run(rng);
        ++cases;
        if (!result.empty()) {
          ++failures;
          std::printf("FAIL splits=%d warps=%d seed=%d: %s\n", count, warps, seed, result.c_str());
        }
      }
    }
  }
  std::printf("ring: %d cases, %d failures\n", cases, failures);
  return 0;
}
