// Where a consumer thread's values sit in a warpgroup's 64 x N WGMMA accumulator, the
// transposed-score bookkeeping built on it (DecodeKernel's kScoreN path), and the fp8 path's
// permuted query columns. Host and device code, so
// tests/sm90_fragment_check.cu checks the index math on the CPU.
//
// A warpgroup's 64 x N fp32 accumulator spreads over its 128 threads: thread t (warp t / 32 of the
// warpgroup, lane t % 32) holds rows Row(t, 0) and Row(t, 1) = Row(t, 0) + 8, and for every group
// j < N / 8 of eight columns the columns Col(lane, j, 0) and Col(lane, j, 0) + 1; the value of
// (Row(t, h), Col(lane, j, e)) is element Element(j, e, h) of the thread's N / 2 floats.
#pragma once

#ifdef __CUDACC__
#define JAX_MLA_HD __host__ __device__ __forceinline__
#else
#define JAX_MLA_HD inline
#endif

namespace jax_mla {
namespace sm90 {

struct Fragment {
  static JAX_MLA_HD int Row(int wg_tid, int half) {
    return (wg_tid / 32) * 16 + (wg_tid % 32) / 4 + 8 * half;
  }
  static JAX_MLA_HD int Col(int lane, int j, int e) { return 8 * j + 2 * (lane % 4) + e; }
  static JAX_MLA_HD int Element(int j, int e, int half) { return 4 * j + 2 * half + e; }
};

// S^T = K Q^T (M = 64 tokens, N = kScoreN query rows): a thread's tokens are Fragment rows, its
// query rows Fragment columns, numbered i = 2 j + e (i < N / 4). The transposed output O^T (M = 64
// latent columns of a tile, N = the same query rows) is laid out alike: Token(t, half) names the
// column within the tile, Element(i, half) the value of query row QueryRow(lane, i).
struct TransposedScores {
  static JAX_MLA_HD int QueryRow(int lane, int i) { return Fragment::Col(lane, i / 2, i % 2); }
  static JAX_MLA_HD int Token(int wg_tid, int half) { return Fragment::Row(wg_tid, half); }
  static JAX_MLA_HD int Element(int i, int half) { return Fragment::Element(i / 2, i % 2, half); }
  // Of a thread's rows_t query rows, warpgroup wg owns the first half (rows 0 .. 2 rows_t - 1 of
  // the tile) if wg is 0, the second half if 1: it completes their scores, runs their softmax and
  // writes their probabilities for the thread's tokens. OwnedRow is the thread's row index i of
  // its owned row k < rows_t / 2. Their values are the contiguous elements
  // [wg rows_t, wg rows_t + rows_t) of the thread's 2 rows_t, in the order Element(k, half) gives.
  static JAX_MLA_HD int OwnedRow(int wg, int k, int rows_t) { return wg * (rows_t / 2) + k; }
  // OwnedRow's inverse: whether warpgroup wg (0 or 1) owns the thread's row i, and i's index k
  // among its owner's rows.
  static JAX_MLA_HD bool Owns(int wg, int i, int rows_t) { return (i < rows_t / 2) == (wg == 0); }
  static JAX_MLA_HD int OwnedIndex(int i, int rows_t) { return i % (rows_t / 2); }
};

// fp8 cache, QK^T from registers (DecodeKernel's kFp8 path at kScoreN 16): the query tile's columns
// are permuted within each 64-column chunk so that a lane's A fragment of k step j (columns 2q,
// 2q + 1, 2q + 8 and 2q + 9 of the step, q = lane % 4) holds four consecutive channels of a cache
// row, FragmentChannel(lane, j) and the three after it: 2q and 2q + 1 the first two, 2q + 8 and
// 2q + 9 the last two.
struct PermutedQuery {
  // The channel that permuted column 16 j + c of a chunk holds (j < 4, c < 16).
  static JAX_MLA_HD int Channel(int j, int c) {
    return 16 * (c % 8 / 2) + 4 * j + c % 2 + 2 * (c / 8);
  }
  // In 32-bit words of two channels: the word of a chunk that permuted word 8 j + w holds.
  static JAX_MLA_HD int SourceWord(int j, int w) { return 8 * (w % 4) + 2 * j + w / 4; }
  // The first of the four channels of lane's A fragment of k step j (lane: the lane, or any thread
  // index equal to it modulo 4).
  static JAX_MLA_HD int FragmentChannel(int lane, int j) { return 16 * (lane % 4) + 4 * j; }
};

// fp8 cache, DecodeFp8RegsKernel: both MMAs take the cache operand from registers loaded by
// ldmatrix from raw cache rows.
//  - Scores (A = a warp's 16 tokens x 16 channels of a k step, one 16-byte unit of each row): a
//    lane's four bytes are channels 4q .. 4q + 3 (q = lane % 4) of the unit, so the f16 query's
//    columns are permuted within each k step: column c holds channel QueryChannel(c).
//  - PV (A = V^T, ldmatrix.trans of 16 channels x 16 tokens): a lane holds channels 2r and 2r + 1
//    (r = lane / 4) of the warp's 16, as A rows r and r + 8, so element `half` of a thread's O^T
//    rows is channel OutputColumn(wg_tid, half) of its 64-column tile.
struct RegsOperands {
  static JAX_MLA_HD int QueryChannel(int c) { return 4 * (c % 8 / 2) + c % 2 + 2 * (c / 8); }
  static JAX_MLA_HD int OutputColumn(int wg_tid, int half) {
    return 16 * (wg_tid / 32) + 2 * ((wg_tid % 32) / 4) + half;
  }
};

// The register-operand kernels' P stores (StorePTiles): per latent group and pass q (16 query
// rows), one stmatrix.m8n8.x4.trans per warp. Lane l gives the address of row l % 8 of matrix
// l / 8: P row StoreRow(l, q), tokens from StoreToken(warp, l). A thread's register 2 j + h (matrix
// 2 j + h) holds its probabilities of token TransposedScores::Token(t, h) and query rows
// QueryRow(lane, i), QueryRow(lane, i + 1), i = FirstRow(q, j); transposed, they land in the
// rows of the tile at those query rows and the column of that token.
struct RegsPStore {
  static JAX_MLA_HD int StoreRow(int lane, int q) { return 16 * q + 8 * (lane / 16) + lane % 8; }
  static JAX_MLA_HD int StoreToken(int warp_in_wg, int lane) {
    return 16 * warp_in_wg + 8 * ((lane / 8) % 2);
  }
  static JAX_MLA_HD int FirstRow(int q, int j) { return 4 * q + 2 * j; }
};

}  // namespace sm90
}  // namespace jax_mla

#undef JAX_MLA_HD
