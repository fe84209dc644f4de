// The sm90 kernel's accumulator-fragment and transposed-score index math (ffi/sm90/
// fragment_layout.h) on the host; tests/test_sm90_fragment.py builds and runs it. For N = 16 and
// 32 it checks that a warpgroup's threads hold every (token, query row) of S^T exactly once in
// distinct elements, that a thread's two tokens lie in the same 32-token half (one page-id check
// covers both), that the two warpgroups' P writes cover every (row, token) of the tile once, that
// a warpgroup's four O^T tiles hold every (column of its 256, query row) once, and that lanes 0-3
// of its first warp (the LSE writers) hold every query row once.
// stdout: "ok N" or "FAIL N: reason", a line per N.
#include <cstdio>
#include <set>
#include <string>
#include <utility>

#include "ffi/sm90/fragment_layout.h"

using jax_mla::sm90::TransposedScores;

static std::string Check(int n) {
  const int rows_per_thread = n / 4;
  std::set<std::pair<int, int>> held;
  for (int t = 0; t < 128; ++t) {
    const int lane = t % 32;
    std::set<int> elements;
    if (TransposedScores::Token(t, 0) / 32 != TransposedScores::Token(t, 1) / 32) {
      return "thread " + std::to_string(t) + "'s tokens straddle two halves";
    }
    for (int i = 0; i < rows_per_thread; ++i) {
      const int row = TransposedScores::QueryRow(lane, i);
      if (row < 0 || row >= n) return "query row out of range";
      for (int half = 0; half < 2; ++half) {
        const int token = TransposedScores::Token(t, half);
        const int element = TransposedScores::Element(i, half);
        if (token < 0 || token >= 64 || element < 0 || element >= n / 2) return "out of range";
        if (!elements.insert(element).second) return "element used twice in a thread";
        if (!held.insert({token, row}).second) return "(token, row) held twice";
      }
    }
  }
  if (static_cast<int>(held.size()) != 64 * n) return "S^T not covered";
  // O^T: tile t of a warpgroup holds its columns [64 t, 64 t + 64); the kernel stores element
  // Element(i, half) of tile t at column 64 t + Token(thread, half), query row QueryRow(lane, i).
  std::set<std::pair<int, int>> output;
  for (int t = 0; t < 128; ++t) {
    for (int tile = 0; tile < 4; ++tile) {
      for (int i = 0; i < rows_per_thread; ++i) {
        for (int half = 0; half < 2; ++half) {
          const int col = 64 * tile + TransposedScores::Token(t, half);
          if (!output.insert({col, TransposedScores::QueryRow(t % 32, i)}).second) {
            return "O^T element held twice";
          }
        }
      }
    }
  }
  if (static_cast<int>(output.size()) != 256 * n) return "O^T not covered";
  std::set<int> lse_rows;
  for (int t = 0; t < 4; ++t) {
    for (int i = 0; i < rows_per_thread; ++i) {
      if (!lse_rows.insert(TransposedScores::QueryRow(t, i)).second) return "LSE row written twice";
    }
  }
  if (static_cast<int>(lse_rows.size()) != n) return "LSE rows not covered";
  std::set<std::pair<int, int>> written;
  for (int wg = 0; wg < 2; ++wg) {
    for (int t = 0; t < 128; ++t) {
      for (int i = 0; i < rows_per_thread; ++i) {
        for (int half = 0; half < 2; ++half) {
          const int token = TransposedScores::Token(t, half);
          if (!TransposedScores::WritesToken(wg, token)) continue;
          if (!written.insert({TransposedScores::QueryRow(t % 32, i), token}).second) {
            return "P element written twice";
          }
        }
      }
    }
  }
  if (static_cast<int>(written.size()) != 64 * n) return "P not covered";
  return "";
}

int main() {
  for (int n : {16, 32}) {
    const std::string failure = Check(n);
    if (failure.empty()) {
      std::printf("ok %d\n", n);
    } else {
      std::printf("FAIL %d: %s\n", n, failure.c_str());
    }
  }
  return 0;
}
