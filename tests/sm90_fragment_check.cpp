// The sm90 kernel's accumulator-fragment and transposed-score index math (ffi/sm90/
// fragment_layout.h) on the host; tests/test_sm90_fragment.py builds and runs it. For N = 16 and
// 32 it checks that a warpgroup's threads hold every (token, query row) of S^T exactly once in
// distinct elements, that a thread's two tokens lie in the same 32-token half (one page-id check
// covers both), that the two warpgroups' P writes cover every (row, token) of the tile once, that
// a warpgroup's four O^T tiles hold every (column of its 256, query row) once, and that lanes 0-3
// of its first warp (the LSE writers) hold every query row once. Then the fp8 path's permuted
// query columns (PermutedQuery): a permutation of each 64-column chunk, every lane's A fragment of
// every k step four consecutive channels from FragmentChannel, and the word-level permutation the
// kernel applies the same as the column-level one. Then the fp8 register-operand kernels' query
// channels and output columns (RegsOperands), and their P stores at 16 and 32 rows (RegsPStore).
// stdout: "ok N" or "FAIL N: reason", a line per N, then "ok permuted-query", "ok
// register-operands", "ok p-store 16" and "ok p-store 32" or their FAIL lines.
#include <cstdio>
#include <set>
#include <string>
#include <utility>

#include "ffi/sm90/fragment_layout.h"

using jax_mla::sm90::PermutedQuery;
using jax_mla::sm90::RegsOperands;
using jax_mla::sm90::RegsPStore;
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
  // Each (token, query row) of P is owned by one warpgroup's thread, and a warpgroup's owned
  // values are its threads' elements [wg rows_t, wg rows_t + rows_t) in OwnedRow's order.
  std::set<std::pair<int, int>> written;
  for (int wg = 0; wg < 2; ++wg) {
    for (int t = 0; t < 128; ++t) {
      for (int k = 0; k < rows_per_thread / 2; ++k) {
        const int i = TransposedScores::OwnedRow(wg, k, rows_per_thread);
        if (i < 0 || i >= rows_per_thread) return "owned row out of range";
        if (!TransposedScores::Owns(wg, i, rows_per_thread) ||
            TransposedScores::Owns(1 - wg, i, rows_per_thread) ||
            TransposedScores::OwnedIndex(i, rows_per_thread) != k) {
          return "Owns / OwnedIndex not OwnedRow's inverse";
        }
        // RowValue reads the other warpgroup's row i from the slot its owner published it at.
        if (TransposedScores::OwnedRow(wg, 0, rows_per_thread) +
                TransposedScores::OwnedIndex(i, rows_per_thread) != i) {
          return "an owner's rows not consecutive from its first";
        }
        for (int half = 0; half < 2; ++half) {
          if (TransposedScores::Element(i, half) !=
              wg * rows_per_thread + TransposedScores::Element(k, half)) {
            return "owned values not contiguous in Element's order";
          }
          const int token = TransposedScores::Token(t, half);
          if (!written.insert({TransposedScores::QueryRow(t % 32, i), token}).second) {
            return "P element owned twice";
          }
        }
      }
    }
  }
  if (static_cast<int>(written.size()) != 64 * n) return "P not covered";
  return "";
}

static std::string CheckPermutedQuery() {
  std::set<int> channels;
  for (int j = 0; j < 4; ++j) {
    for (int c = 0; c < 16; ++c) {
      const int channel = PermutedQuery::Channel(j, c);
      if (channel < 0 || channel >= 64 || !channels.insert(channel).second) {
        return "column " + std::to_string(16 * j + c) + " repeats or leaves the chunk";
      }
    }
    for (int lane = 0; lane < 32; ++lane) {
      const int first = PermutedQuery::FragmentChannel(lane, j);
      const int q = lane % 4;
      // The fragment's columns 2q, 2q + 1 hold its first two channels, 2q + 8, 2q + 9 the others.
      for (int e = 0; e < 2; ++e) {
        if (PermutedQuery::Channel(j, 2 * q + e) != first + e ||
            PermutedQuery::Channel(j, 2 * q + 8 + e) != first + 2 + e) {
          return "lane " + std::to_string(lane) + ", k step " + std::to_string(j) +
                 ": fragment not four consecutive channels";
        }
      }
    }
    for (int w = 0; w < 8; ++w) {
      const int source = PermutedQuery::SourceWord(j, w);
      if (PermutedQuery::Channel(j, 2 * w) != 2 * source ||
          PermutedQuery::Channel(j, 2 * w + 1) != 2 * source + 1) {
        return "word " + std::to_string(8 * j + w) + " differs from its columns";
      }
    }
  }
  return "";
}

// DecodeFp8RegsKernel: the f16 query's columns a permutation of each k step, a lane's A fragment
// columns 2q, 2q + 1, 2q + 8, 2q + 9 the channels 4q .. 4q + 3 of its ldmatrix word, and O^T's
// rows every column of a 64-column tile once, in pairs of adjacent columns per thread.
static std::string CheckRegsOperands() {
  std::set<int> channels;
  for (int c = 0; c < 16; ++c) {
    const int channel = RegsOperands::QueryChannel(c);
    if (channel < 0 || channel >= 16 || !channels.insert(channel).second) {
      return "query column " + std::to_string(c) + " repeats or leaves its k step";
    }
  }
  for (int lane = 0; lane < 32; ++lane) {
    const int q = lane % 4;
    const int columns[4] = {2 * q, 2 * q + 1, 2 * q + 8, 2 * q + 9};
    for (int e = 0; e < 4; ++e) {
      if (RegsOperands::QueryChannel(columns[e]) != 4 * q + e) {
        return "lane " + std::to_string(lane) + ": fragment column " + std::to_string(columns[e]) +
               " is not byte " + std::to_string(e) + " of its word";
      }
    }
  }
  std::set<int> columns;
  for (int t = 0; t < 128; ++t) {
    const int first = RegsOperands::OutputColumn(t, 0);
    if (first % 2 != 0 || RegsOperands::OutputColumn(t, 1) != first + 1) {
      return "thread " + std::to_string(t) + "'s output columns are not an aligned pair";
    }
    // The four lanes of a quad hold the same columns (different query rows).
    if (t % 4 == 0) {
      for (int half = 0; half < 2; ++half) {
        if (!columns.insert(RegsOperands::OutputColumn(t, half)).second) {
          return "output column held by two quads";
        }
      }
    }
  }
  if (columns.size() != 64 || *columns.rbegin() != 63) return "output columns not covered";
  return "";
}

// The register-operand kernels' P stores at N rows: stmatrix.m8n8.x4.trans emulated (the
// element at row r, column c of a lane's 8 x 8 fragment of matrix m, r = lane / 4, c = 2 (lane % 4)
// + e, lands in memory row c of the matrix, whose address lane 8 m + c gives, at column r), every
// (query row, token) of the warpgroup's tile written once, with the probability its thread holds
// for that row and token.
static std::string CheckRegsPStore(int n) {
  std::set<std::pair<int, int>> written;
  for (int t = 0; t < 128; ++t) {
    const int lane = t % 32, warp = t / 32;
    for (int q = 0; q < n / 16; ++q) {
      for (int m = 0; m < 4; ++m) {
        const int j = m / 2, h = m % 2;
        for (int e = 0; e < 2; ++e) {
          // The value: the thread's probability of token Token(t, h), query row QueryRow(lane, i).
          const int i = RegsPStore::FirstRow(q, j) + e;
          const int want_row = TransposedScores::QueryRow(lane, i);
          const int want_token = TransposedScores::Token(t, h);
          // Where stmatrix.trans puts it.
          const int address_lane = 8 * m + 2 * (lane % 4) + e;
          const int row = RegsPStore::StoreRow(address_lane, q);
          const int token = RegsPStore::StoreToken(warp, address_lane) + lane / 4;
          if (row != want_row || token != want_token) {
            return "thread " + std::to_string(t) + " pass " + std::to_string(q) + " matrix " +
                   std::to_string(m) + ": row " + std::to_string(row) + " token " +
                   std::to_string(token) + " instead of " + std::to_string(want_row) + ", " +
                   std::to_string(want_token);
          }
          if (row < 0 || row >= n || token < 0 || token >= 64) return "outside the tile";
          if (!written.insert({row, token}).second) return "P element written twice";
        }
      }
    }
  }
  if (static_cast<int>(written.size()) != 64 * n) return "P tile not covered";
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
  const std::string failure = CheckPermutedQuery();
  if (failure.empty()) {
    std::printf("ok permuted-query\n");
  } else {
    std::printf("FAIL permuted-query: %s\n", failure.c_str());
  }
  const std::string regs_failure = CheckRegsOperands();
  if (regs_failure.empty()) {
    std::printf("ok register-operands\n");
  } else {
    std::printf("FAIL register-operands: %s\n", regs_failure.c_str());
  }
  for (int n : {16, 32}) {
    const std::string p_failure = CheckRegsPStore(n);
    if (p_failure.empty()) {
      std::printf("ok p-store %d\n", n);
    } else {
      std::printf("FAIL p-store %d: %s\n", n, p_failure.c_str());
    }
  }
  return 0;
}
