// LaunchDecode's argument checks on the host (tests/test_sm90_launch_options.py builds and runs it):
// launch options outside their documented values, option combinations no kernel implements and
// shapes the kernels do not take must come back as cudaErrorInvalidValue before any CUDA call, so
// the buffers here are placeholders that nothing reads. stdout, a line a case: "NAME invalid" when
// LaunchDecode returned cudaErrorInvalidValue, else "NAME returned CODE"; then the same checks
// passing on valid shapes and options ("NAME passes" or "NAME fails", from detail::CheckLaunch,
// which launches nothing); then the launcher's per-kernel defaults (DEFAULTS in tests/test_sm90_launch_options.py).
#include <cstdint>
#include <cstdio>
#include <functional>

// Built as the harness is (its experiment kernels in), or without them, as the FFI library is:
// JAX_MLA_SM90_EXPERIMENTS given or not on the command line.
#include "ffi/sm90/launch.cuh"

using namespace jax_mla::sm90;

namespace {

alignas(256) char placeholder[256];

DecodeParams ValidParams() {
  DecodeParams p{};
  p.query = placeholder;
  p.kv_cache = placeholder;
  p.block_tables = reinterpret_cast<const int32_t*>(placeholder);
  p.seq_lens = reinterpret_cast<const int32_t*>(placeholder);
  p.out = placeholder;
  p.lse = reinterpret_cast<float*>(placeholder);
  p.schedule = reinterpret_cast<int32_t*>(placeholder);
  p.workspace = placeholder;
  p.batch = 4;
  p.q_len = 1;
  p.num_heads = 16;
  p.num_pages = 64;
  p.page_size = 64;
  p.max_pages = 16;
  p.softmax_scale = 0.1f;
  p.output_scale = 1.f;
  p.num_sms = 132;
  p.enable_pdl = true;
  return p;
}

void Run(const char* name, const std::function<void(DecodeParams&, LaunchOptions&)>& change) {
  DecodeParams p = ValidParams();
  LaunchOptions options;
  change(p, options);
  const cudaError_t status = LaunchDecode(p, nullptr, options);
  if (status == cudaErrorInvalidValue) {
    std::printf("%s invalid\n", name);
  } else {
    std::printf("%s returned %d\n", name, static_cast<int>(status));
  }
}

// Valid shapes and options: "NAME passes" when LaunchDecode's checks let them through.
void Pass(const char* name, const std::function<void(DecodeParams&, LaunchOptions&)>& change) {
  DecodeParams p = ValidParams();
  LaunchOptions options;
  change(p, options);
  const cudaError_t status = detail::CheckLaunch(p, options);
  std::printf("%s %s\n", name, status == cudaSuccess ? "passes" : "fails");
}

// The same at 128 heads (two M tiles: the 64-row tiles, clusters of two).
void RunH128(const char* name, const std::function<void(DecodeParams&, LaunchOptions&)>& change) {
  Run(name, [&](DecodeParams& p, LaunchOptions& o) {
    p.num_heads = 128;
    change(p, o);
  });
}

}  // namespace

int main() {
  Run("transposed_scores=1", [](DecodeParams&, LaunchOptions& o) { o.transposed_scores = 1; });
  Run("transposed_scores=-2", [](DecodeParams&, LaunchOptions& o) { o.transposed_scores = -2; });
  Run("wide_combine=2", [](DecodeParams&, LaunchOptions& o) { o.wide_combine = 2; });
  Run("wide_combine=-2", [](DecodeParams&, LaunchOptions& o) { o.wide_combine = -2; });
  Run("split_release=2", [](DecodeParams&, LaunchOptions& o) { o.split_release = 2; });
  Run("split_release=-2", [](DecodeParams&, LaunchOptions& o) { o.split_release = -2; });
  Run("bf16_partials=2", [](DecodeParams&, LaunchOptions& o) { o.bf16_partials = 2; });
  Run("bf16_partials=-2", [](DecodeParams&, LaunchOptions& o) { o.bf16_partials = -2; });
  Run("bf16_partials=1,transposed", [](DecodeParams&, LaunchOptions& o) { o.bf16_partials = 1; });
  Run("combine_rows_in_flight=12",
      [](DecodeParams&, LaunchOptions& o) { o.combine_rows_in_flight = 12; });
  Run("combine_rows_in_flight=0",
      [](DecodeParams&, LaunchOptions& o) { o.combine_rows_in_flight = 0; });
  Run("staged_combine=2", [](DecodeParams&, LaunchOptions& o) { o.staged_combine = 2; });
  Run("staged_combine=-2", [](DecodeParams&, LaunchOptions& o) { o.staged_combine = -2; });
  Run("kv_l2_promotion=64", [](DecodeParams&, LaunchOptions& o) { o.kv_l2_promotion = 64; });
  Run("fp8_registers=2", [](DecodeParams&, LaunchOptions& o) { o.fp8_registers = 2; });
  Run("fp8_registers=-2", [](DecodeParams&, LaunchOptions& o) { o.fp8_registers = -2; });
  Run("column_halves=2", [](DecodeParams&, LaunchOptions& o) { o.column_halves = 2; });
  Run("column_halves=-2", [](DecodeParams&, LaunchOptions& o) { o.column_halves = -2; });
  RunH128("cluster=3", [](DecodeParams&, LaunchOptions& o) { o.cluster = 3; });
  RunH128("cluster=0", [](DecodeParams&, LaunchOptions& o) { o.cluster = 0; });
  RunH128("cluster=-2", [](DecodeParams&, LaunchOptions& o) { o.cluster = -2; });
  Run("cluster=2,odd_m_tiles", [](DecodeParams&, LaunchOptions& o) { o.cluster = 2; });
  RunH128("cluster=2,late_release", [](DecodeParams&, LaunchOptions& o) {
    o.cluster = 2;
    o.early_release = false;
  });
  RunH128("cluster=2,experiment=1", [](DecodeParams&, LaunchOptions& o) {
    o.cluster = 2;
    o.experiment = 1;
  });
  RunH128("experiment=5", [](DecodeParams&, LaunchOptions& o) { o.experiment = 5; });
  Run("page_size=48", [](DecodeParams& p, LaunchOptions&) { p.page_size = 48; });
  Run("max_pages_2^24,page_size=64", [](DecodeParams& p, LaunchOptions&) {
    p.max_pages = 1 << 24;
  });
  Run("batch=0", [](DecodeParams& p, LaunchOptions&) { p.batch = 0; });
  Run("softmax_scale=0", [](DecodeParams& p, LaunchOptions&) { p.softmax_scale = 0.f; });
  Run("query_misaligned", [](DecodeParams& p, LaunchOptions&) { p.query = placeholder + 8; });
  Run("no_schedule", [](DecodeParams& p, LaunchOptions&) { p.schedule = nullptr; });
  Run("min_blocks_per_part=0", [](DecodeParams& p, LaunchOptions&) { p.min_blocks_per_part = 0; });
  Run("block_to_split_cost=0", [](DecodeParams&, LaunchOptions& o) { o.block_to_split_cost = 0; });
  Run("fp8,experiment=1", [](DecodeParams& p, LaunchOptions& o) {
    p.kv_fp8 = true;
    o.experiment = 1;
  });
  Run("fp8,late_release", [](DecodeParams& p, LaunchOptions& o) {
    p.kv_fp8 = true;
    p.num_heads = 128;
    o.early_release = false;
  });
  Run("fp8,cluster=2", [](DecodeParams& p, LaunchOptions& o) {
    p.kv_fp8 = true;
    p.num_heads = 128;
    o.cluster = 2;
  });
  Pass("valid", [](DecodeParams&, LaunchOptions&) {});
  Pass("valid,h128", [](DecodeParams& p, LaunchOptions&) { p.num_heads = 128; });
  Pass("valid,page_size=32,q_len=4", [](DecodeParams& p, LaunchOptions&) {
    p.page_size = 32;
    p.q_len = 4;
  });
  Pass("valid,combine_rows_in_flight=16",
       [](DecodeParams&, LaunchOptions& o) { o.combine_rows_in_flight = 16; });
  Pass("valid,fp8,h128", [](DecodeParams& p, LaunchOptions&) {
    p.kv_fp8 = true;
    p.num_heads = 128;
  });
  // Options only the experiment kernels run: "fails" in a build without them.
  Pass("valid,h128,cluster=1,late_release", [](DecodeParams& p, LaunchOptions& o) {
    p.num_heads = 128;
    o.cluster = 1;
    o.early_release = false;
  });
  Pass("valid,h128,split_release=1", [](DecodeParams& p, LaunchOptions& o) {
    p.num_heads = 128;
    o.split_release = 1;
  });
  Pass("valid,fp8,fp8_registers=0", [](DecodeParams& p, LaunchOptions& o) {
    p.kv_fp8 = true;
    o.fp8_registers = 0;
  });
  Pass("valid,experiment=1", [](DecodeParams&, LaunchOptions& o) { o.experiment = 1; });
  Pass("valid,no_combine", [](DecodeParams&, LaunchOptions& o) { o.combine = false; });
  // The launcher's per-kernel defaults: the KV map's L2 promotion and the fp8 cache's kernel up to
  // 16 rows, "NAME VALUE" a line.
  const LaunchOptions defaults;
  auto promotion = [](CUtensorMapL2promotion p) {
    return p == CU_TENSOR_MAP_L2_PROMOTION_NONE      ? 0
           : p == CU_TENSOR_MAP_L2_PROMOTION_L2_128B ? 128
           : p == CU_TENSOR_MAP_L2_PROMOTION_L2_256B ? 256
                                                      : -1;
  };
  const int parts = NumParts(132, 1, 16);  // an H200's 132 SMs, one M tile
  for (int rows : {8, 16, 32, 128}) {
    for (int batch : {33, 34}) {
      const int score_n = detail::TransposedScoreRows(defaults, 1, rows);
      std::printf("promotion rows=%d,batch=%d %d\n", rows, batch,
                  promotion(detail::KvL2Promotion(defaults, score_n, batch, parts)));
    }
  }
  LaunchOptions none;
  none.kv_l2_promotion = 0;
  std::printf("promotion rows=16,kv_l2_promotion=0 %d\n",
              promotion(detail::KvL2Promotion(none, 16, 33, parts)));
  LaunchOptions wide;
  wide.kv_l2_promotion = 256;
  std::printf("promotion rows=32,batch=33,kv_l2_promotion=256 %d\n",
              promotion(detail::KvL2Promotion(wide, 32, 33, parts)));
  LaunchOptions transposed;
  transposed.fp8_registers = 0;
  std::printf("fp8 rows=16 registers %d\n",
              detail::SelectKernel(defaults, 1, 16, true) ==
                  reinterpret_cast<const void*>(&DecodeFp8RegsKernel));
  std::printf("fp8 rows=16,fp8_registers=0 registers %d\n",
              detail::SelectKernel(transposed, 1, 16, true) ==
                  reinterpret_cast<const void*>(&DecodeFp8RegsKernel));
  std::printf("fp8 rows=32 registers %d\n",
              detail::SelectKernel(defaults, 1, 32, true) ==
                  reinterpret_cast<const void*>(&DecodeFp8RegsKernel));
  for (int rows : {17, 32, 64}) {
    std::printf("fp8 rows=%d split %d\n", rows,
                detail::SelectKernel(defaults, 1, rows, true) ==
                    reinterpret_cast<const void*>(&DecodeFp8SplitKernel));
  }
  std::printf("fp8 rows=32,fp8_registers=0 split %d\n",
              detail::SelectKernel(transposed, 1, 32, true) ==
                  reinterpret_cast<const void*>(&DecodeFp8SplitKernel));
  std::printf("fp8 rows=32 smem %d\n",
              detail::KernelSmemBytes(defaults, true, 32) == Fp8SplitSmemLayout::kBytes);
  // The schedule as the kernels read it: the wide combine's rows in flight, each kernel's split
  // cost, and the fewest blocks a part takes with and without a combine in one wave.
  // ... the most of 32 and 16 rows whose kernel's grid is resident at once: 64 blocks a request
  // at 128 rows on 132 SMs, the 32-row kernel two blocks an SM and the 16-row one three (bf16
  // partials); 8 blocks a request at 16 rows, one and two blocks an SM (fp32 partials).
  for (int batch : {4, 5, 6, 7}) {
    std::printf("combine rows=128,batch=%d rows in flight %d\n", batch,
                detail::CombineRowsInFlight(defaults, 128, batch, 132, 2, 3));
  }
  for (int batch : {16, 17, 33, 34}) {
    std::printf("combine rows=16,batch=%d,fp32 rows in flight %d\n", batch,
                detail::CombineRowsInFlight(defaults, 16, batch, 132, 1, 2));
  }
  std::printf("combine rows=128,batch=2,one block an SM rows in flight %d\n",
              detail::CombineRowsInFlight(defaults, 128, 2, 132, 1, 1));
  // The wide combine staged in shared memory where its grid fits the SMs: two bf16 rows or one
  // fp32 row a block.
  for (int batch : {2, 3}) {
    std::printf("staged rows=128,bf16,batch=%d %d\n", batch,
                detail::UseStagedCombine(defaults, 128, batch, 132, true));
  }
  for (int batch : {8, 9}) {
    std::printf("staged rows=16,f32,batch=%d %d\n", batch,
                detail::UseStagedCombine(defaults, 16, batch, 132, false));
  }
  for (int staged : {0, 1}) {
    LaunchOptions o;
    o.staged_combine = staged;
    std::printf("staged rows=16,f32,batch=9,staged_combine=%d %d\n", staged,
                detail::UseStagedCombine(o, 16, 9, 132, false));
  }
  LaunchOptions rows8;
  rows8.combine_rows_in_flight = 8;
  std::printf("staged rows=128,bf16,batch=1,combine_rows_in_flight=8 %d\n",
              detail::UseStagedCombine(rows8, 128, 1, 132, true));
  // Clusters of two for the bf16 cache's 64-row tiles in an even number of M tiles, where the
  // block table holds more than 24,576 tokens in all.
  for (int max_pages : {384, 385}) {
    for (int heads : {64, 128}) {
      for (bool fp8 : {false, true}) {
        DecodeParams c = ValidParams();
        c.batch = 1;
        c.q_len = 1;
        c.num_heads = heads;
        c.page_size = 64;
        c.max_pages = max_pages;
        c.kv_fp8 = fp8;
        std::printf("cluster rows=%d,fp8=%d,tokens=%d %d\n", heads, fp8, max_pages * 64,
                    detail::ClusterSize(defaults, c));
      }
    }
  }
  DecodeParams p = ValidParams();
  for (int score_n : {16, 0}) {
    for (bool fp8 : {false, true}) {
      p.kv_fp8 = fp8;
      const DecodeParams sp = detail::ScheduleAsRead(p, score_n, true);
      std::printf("schedule score_n=%d,fp8=%d cost %d min %d\n", score_n, fp8,
                  sp.block_to_split_cost, sp.min_blocks_per_part);
    }
  }
  std::printf("schedule beyond one wave min %d\n",
              detail::ScheduleAsRead(p, 0, false).min_blocks_per_part);
  std::printf("schedule block_to_split_cost=5 cost %d\n",
              detail::ScheduleAsRead(p, 0, true, 5).block_to_split_cost);
  p.min_blocks_per_part = 3;
  std::printf("schedule min_blocks_per_part=3 min %d\n",
              detail::ScheduleAsRead(p, 0, true).min_blocks_per_part);
  // Column halves for the 64-row tiles of up to two requests (one on the fp8 cache) and two M
  // tiles where, were every request as long as the block table allows, half the parts would be at
  // most 5/3 as long as all of them, 3/2 on the fp8 cache (pages of 64, q_len 1, 132 SMs).
  struct HalvesCase {
    const char* name;
    int heads, batch, max_pages;
    bool fp8;
    int column_halves, split_release;
  };
  const HalvesCase halves_cases[] = {
      {"rows=128,tokens=4096", 128, 1, 64, false, -1, -1},
      {"rows=128,tokens=4288", 128, 1, 67, false, -1, -1},
      {"rows=128,tokens=12288", 128, 1, 192, false, -1, -1},
      {"rows=128,tokens=16384", 128, 1, 256, false, -1, -1},
      {"rows=128,batch=2,tokens=2048", 128, 2, 32, false, -1, -1},
      {"rows=128,batch=3,tokens=1024", 128, 3, 16, false, -1, -1},
      {"rows=256,tokens=4096", 256, 1, 64, false, -1, -1},
      {"rows=64,tokens=8192", 64, 1, 128, false, -1, -1},
      {"rows=16,tokens=4096", 16, 1, 64, false, -1, -1},
      {"rows=128,fp8,tokens=4096", 128, 1, 64, true, -1, -1},
      {"rows=128,fp8,tokens=6208", 128, 1, 97, true, -1, -1},
      {"rows=128,fp8,tokens=6272", 128, 1, 98, true, -1, -1},
      {"rows=128,fp8,batch=2,tokens=1024", 128, 2, 16, true, -1, -1},
      {"rows=128,fp8,batch=2,tokens=2048", 128, 2, 32, true, -1, -1},
      {"rows=128,fp8,batch=2,tokens=4096", 128, 2, 64, true, -1, -1},
      {"rows=128,tokens=4096,column_halves=0", 128, 1, 64, false, 0, -1},
      {"rows=128,tokens=4096,split_release=1", 128, 1, 64, false, -1, 1},
      {"rows=128,batch=512,column_halves=1", 128, 512, 64, false, 1, -1},
  };
  for (const HalvesCase& c : halves_cases) {
    DecodeParams h = ValidParams();
    h.num_heads = c.heads;
    h.batch = c.batch;
    h.max_pages = c.max_pages;
    h.kv_fp8 = c.fp8;
    LaunchOptions o;
    o.column_halves = c.column_halves;
    o.split_release = c.split_release;
    const int score_n = detail::TransposedScoreRows(o, 1, c.heads);
    std::printf("halves %s %d\n", c.name,
                detail::UseColumnHalves(o, h, score_n, NumParts(132, 1, c.heads)));
  }
  return 0;
}
