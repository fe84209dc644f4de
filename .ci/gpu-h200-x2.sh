#!/usr/bin/env bash
# Evidence run on the two-GPU H200 machine, inside .ci/gpu-h200.sh's prepared environment:
#
#   .ci/gpu-h200.sh cmd bash .ci/gpu-h200-x2.sh [--tests] [--gpu0 "ARGS"] [--gpu1 "ARGS"]
#
#   --tests       GPU 1: the GPU test suite, in three pytest processes side by side (t-*.log;
#                 GPU 0 runs the sm90 backend's tests, t-sm90.log, after the two-GPU tests;
#                 XLA's autotuning off, as it only costs compile time there);
#                 both GPUs first: the multi_gpu tests and the example with --tp 2 (t-multi.log).
#                 JAX_MLA_REQUIRE_GPU (1; 2 for the multi_gpu run) makes GPU tests that cannot run fail.
#   --gpu0 ARGS   GPU 0, after the two-GPU tests: python3 -m benchmarks.decode ARGS; repeat it to run
#                 several benchmarks one after another. Output lines go to bench.log as "[gpu0] ...".
#   --gpu1 ARGS   GPU 1, after its tests, likewise ("[gpu1] ...").
#   --deadline S  stop benchmarks S seconds after this script starts (default 540; a benchmark
#                 writes its JSON after every point, so a stopped one loses only its current point).
#
# A benchmark has its GPU to itself; tests share theirs. Logs go to $OUT, of which 8 files come
# back: env.txt (printed) is removed, leaving room for three benchmark JSONs (--out $OUT/X.json).
set -uo pipefail
tests=0 gpu0=() gpu1=() deadline=540
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) tests=1; shift ;;
    --gpu0) gpu0+=("$2"); shift 2 ;;
    --gpu1) gpu1+=("$2"); shift 2 ;;
    --deadline) deadline=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
bench_on() {  # GPU, LOG, ARGS strings (one benchmark each)...
  local gpu=$1 log=$2 args; shift 2
  for args in "$@"; do
    local left=$((deadline - SECONDS))
    [ $left -gt 30 ] || { echo "deadline: not started: $args" >>"$OUT/$log"; continue; }
    # shellcheck disable=SC2086  # ARGS is a word list on purpose
    CUDA_VISIBLE_DEVICES=$gpu timeout $left python3 -m benchmarks.decode $args --time-limit $((left - 20)) \
      2>&1 | sed -u "s/^/[gpu$gpu] /" >>"$OUT/$log"
  done
}
pytest_gpu1() {  # LOG, pytest args...
  pytest_on 1 "$@"
}
pytest_on() {  # GPU, LOG, pytest args...
  local gpu=$1 log=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu JAX_MLA_REQUIRE_GPU=1 XLA_FLAGS=--xla_gpu_autotune_level=0 \
    python3 -m pytest -q -rs -p no:cacheprovider "$@" >"$OUT/$log" 2>&1
}

gpu1_chain() {
  if [ $tests = 1 ]; then
    pytest_gpu1 t-decode-xla.log tests/test_decode.py -k xla &
    pytest_gpu1 t-decode-fa.log tests/test_decode.py -k "fa3 or fa2" &
    pytest_gpu1 t-rest.log tests --ignore=tests/test_decode.py --ignore=tests/test_sm90.py \
      -m "not multi_gpu" &
    wait
  fi
  bench_on 1 bench.log "${gpu1[@]}"
}

rm -f "$OUT/env.txt"  # printed by gpu-h200.sh already
gpu1_chain &
if [ $tests = 1 ]; then
  { JAX_MLA_REQUIRE_GPU=2 python3 -m pytest -q -rs -p no:cacheprovider tests/test_sharding.py -m multi_gpu
    python3 examples/deepseek_layer.py --tp 2; } >"$OUT/t-multi.log" 2>&1
  # GPU 0, after the two-GPU tests: jax_mla's own kernel (the sm90 backend).
  pytest_on 0 t-sm90.log tests/test_sm90.py tests/test_decode.py -k "sm90 or Sm90"
fi
bench_on 0 bench.log "${gpu0[@]}"
wait
for f in "$OUT"/t-*.log; do
  printf '%-22s %s\n' "$(basename "$f")" "$(grep -E ' (passed|failed|errors?)' "$f" | tail -1)"
done
grep -E '^\[gpu.\] (wrote|time limit|[0-9]+ point)' "$OUT/bench.log" 2>/dev/null
