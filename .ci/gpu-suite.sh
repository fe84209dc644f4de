#!/usr/bin/env bash
# The whole GPU test suite on one H200 within one 10-minute call, in the environment
# .ci/gpu-h200.sh prepares:
#   .ci/gpu-h200.sh cmd .ci/gpu-suite.sh      (or run it directly: it calls gpu-h200.sh itself)
# Eight pytest processes side by side (compilation is what takes the time, and it runs on the CPU
# cores), XLA's autotuning off (it only costs compile time here), JAX_MLA_REQUIRE_GPU=1 (a GPU
# test that cannot run fails), each under SUITE_TIMEOUT seconds (default 540). The multi-GPU
# tests are left to .ci/gpu-h200-x2.sh. Logs: $OUT/t-*.log; a summary line per log is printed.
# SUITE_PACK=1 packs the logs into $OUT/suite-logs.tgz instead (one file where a runner returns
# only a few files from $OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jax_mla_out}; mkdir -p "$OUT"
if [ -z "${JAX_MLA_FFI_LIB:-}" ]; then exec .ci/gpu-h200.sh cmd "$0" "$@"; fi
limit=${SUITE_TIMEOUT:-540}
run() {  # LOG, pytest args...
  local log=$1; shift
  JAX_MLA_REQUIRE_GPU=1 XLA_FLAGS=--xla_gpu_autotune_level=0 timeout "$limit" \
    python3 -m pytest -q -rfEs -p no:cacheprovider "$@" >"$OUT/$log" 2>&1
}
own="tests/test_decode.py tests/test_sm90.py tests/test_bad_values.py tests/test_gpu.py
     tests/test_device_plan.py tests/test_readme.py tests/test_example.py tests/test_require_gpu.py
     tests/test_ffi.py tests/test_fp8_cache.py tests/test_sm90_fp8.py tests/test_e4m3_cache.py
     tests/test_sharding.py
     tests/test_torch_view.py"
ignore=$(for f in $own; do printf -- '--ignore=%s ' "$f"; done)
run t-decode-xla.log tests/test_decode.py -k "not (fa3 or fa2 or sm90 or Sm90)" &
run t-decode-fa.log tests/test_decode.py -k "fa3 or fa2" &
run t-sm90.log tests/test_sm90.py tests/test_decode.py -k "sm90 or Sm90" &
run t-guard-gpu.log tests/test_bad_values.py tests/test_gpu.py tests/test_device_plan.py &
run t-commands.log tests/test_readme.py tests/test_example.py tests/test_require_gpu.py &
run t-ffi-fp8.log tests/test_ffi.py tests/test_fp8_cache.py tests/test_sm90_fp8.py \
  tests/test_e4m3_cache.py &
run t-sharding-view.log tests/test_sharding.py tests/test_torch_view.py -m "not multi_gpu" &
# shellcheck disable=SC2086  # a word list on purpose
run t-rest.log tests $ignore -m "not multi_gpu" &
wait
for f in "$OUT"/t-*.log; do
  printf '%-20s %s\n' "$(basename "$f")" "$(grep -E ' in [0-9.]+s( |$)' "$f" | tail -1)"
done
grep -hE '^(FAILED|ERROR) ' "$OUT"/t-*.log | head -20
if [ "${SUITE_PACK:-0}" = 1 ]; then
  (cd "$OUT" && tar czf suite-logs.tgz t-*.log && rm -f t-*.log)
fi
