#!/usr/bin/env bash
# sm90 backend check on the H200 machine, in the environment .ci/gpu-h200.sh prepares:
#   .ci/gpu-h200.sh cmd .ci/sm90-check.sh      (or run it directly: it calls gpu-h200.sh itself)
# 1. the built FFI library exports JaxMlaSm90Decode
# 2. python3 -m pytest -q -rs tests/test_sm90.py (JAX_MLA_REQUIRE_GPU=1: nothing may skip)
# 3. the standalone harness (benchmarks/sm90_harness.cu): nvcc build, then its `check` suite, and
#    `check` and `check-fp8` failing closed (--fail-closed: bad requests 0 and -inf)
# 4. compute-sanitizer memcheck on the jax path: one small sm90 decode through jax_mla.decode
# 5. (part "sanitize") the harness's sanitize suites (bf16, and both caches failing closed) under
#    memcheck, racecheck and synccheck, with a -lineinfo build so that reports name source lines
# 6. (part "time") the harness's timing grid: `time 30 $SM90_TIME_VARIANTS` (default "transposed")
# Logs go to $OUT (sm90-*.log); a summary table is printed last. SM90_CHECK picks the parts
# (default "tests,harness,memcheck"; all: "tests,harness,memcheck,sanitize,time"); SM90_HARNESS
# and SM90_HARNESS_LINEINFO name already built harness binaries to use; SM90_CHECK_FLAGS adds
# harness flags to the check (e.g. "--wide-combine").
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jax_mla_out}; mkdir -p "$OUT"
if [ -z "${JAX_MLA_FFI_LIB:-}" ]; then exec .ci/gpu-h200.sh cmd "$0" "$@"; fi
export PYTHONPATH="$PWD/tests:$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false
declare -A status
parts=",${SM90_CHECK:-tests,harness,memcheck},"

nm -D "$JAX_MLA_FFI_LIB" | grep " T JaxMla" > "$OUT/sm90-symbols.log"
if grep -q " T JaxMlaSm90Decode$" "$OUT/sm90-symbols.log"; then status[symbol]=ok; else status[symbol]=MISSING; fi

if [[ $parts == *,tests,* ]]; then
  JAX_MLA_REQUIRE_GPU=1 timeout 1200 python3 -m pytest -q -rs -p no:cacheprovider tests/test_sm90.py \
    > "$OUT/sm90-tests.log" 2>&1
  status[pytest]="rc=$? $(tail -1 "$OUT/sm90-tests.log")"
fi

build_harness() {  # OUTPUT [extra nvcc flags]
  local output=$1; shift
  [ -x "$output" ] && return 0
  CUTLASS=$(python3 -c "import importlib.util, os; s = importlib.util.find_spec('flashinfer'); \
print(os.path.join(s.submodule_search_locations[0], 'data', 'cutlass', 'include'))")
  { time nvcc -std=c++17 -O3 -gencode arch=compute_90a,code=sm_90a -I. -I"$CUTLASS" \
      --expt-relaxed-constexpr "$@" benchmarks/sm90_harness.cu -o "$output"; } \
    >> "$OUT/sm90-harness-build.log" 2>&1
  status[harness_build]="rc=$?"
}
harness=${SM90_HARNESS:-/tmp/sm90_harness}
if [[ $parts == *,harness,* || $parts == *,time,* ]]; then build_harness "$harness"; fi
if [[ $parts == *,harness,* && -x "$harness" ]]; then
  # shellcheck disable=SC2086  # flags are words on purpose
  timeout 900 "$harness" check ${SM90_CHECK_FLAGS:-} > "$OUT/sm90-harness-check.log" 2>&1
  status[harness_check]="rc=$? $(tail -1 "$OUT/sm90-harness-check.log")"
  for suite in check check-fp8; do
    # shellcheck disable=SC2086
    timeout 900 "$harness" "$suite" --fail-closed ${SM90_CHECK_FLAGS:-} \
      > "$OUT/sm90-harness-$suite-fail-closed.log" 2>&1
    status[harness_${suite//-/_}_fail_closed]="rc=$? $(tail -1 "$OUT/sm90-harness-$suite-fail-closed.log")"
  done
fi

# One buffer per allocation (no pool), so memcheck sees the true bounds of every XLA buffer; only
# jax_mla's sm90 kernels are instrumented; no command buffers.
memcheck() {
  XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS=--xla_gpu_enable_command_buffer= \
    timeout 1200 compute-sanitizer --tool memcheck --error-exitcode 9 "$@" \
    python3 -c "import test_sm90; test_sm90.sanitize_program()" > "$OUT/sm90-memcheck.log" 2>&1
}
if [[ $parts == *,memcheck,* ]]; then
  memcheck --kernel-name kns=jax_mla4sm90
  rc=$?
  if grep -qiE "unknown option|unrecognized|invalid.*kernel-name" "$OUT/sm90-memcheck.log"; then
    memcheck; rc=$?  # this compute-sanitizer has no kernel filter: check every kernel
  fi
  status[memcheck]="rc=$rc $(grep -E 'ERROR SUMMARY' "$OUT/sm90-memcheck.log" | tail -1)"
fi

if [[ $parts == *,sanitize,* ]]; then
  harness_li=${SM90_HARNESS_LINEINFO:-/tmp/sm90_harness_lineinfo}
  build_harness "$harness_li" -lineinfo
  for tool in memcheck racecheck synccheck; do
    for run in "sanitize" "sanitize --fail-closed" "sanitize-fp8 --fail-closed"; do
      name="${tool}_${run%% *}"
      [[ $run == *--fail-closed ]] && name+="_fail_closed"
      # shellcheck disable=SC2086  # run is words on purpose
      timeout 600 compute-sanitizer --tool "$tool" --error-exitcode 9 "$harness_li" $run \
        > "$OUT/san-$name.log" 2>&1
      rc=$?
      status[san_$name]="rc=$rc $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/san-$name.log" |
                                  tail -1)"
    done
  done
fi

if [[ $parts == *,time,* && -x "$harness" ]]; then
  timeout 600 "$harness" time 30 "${SM90_TIME_VARIANTS:-transposed}" \
    > "$OUT/sm90-harness-time.log" 2>&1
  status[harness_time]="rc=$?"
fi

{ echo "| sm90 check | result |"
  echo "|---|---|"
  for key in symbol pytest harness_build harness_check harness_check_fail_closed \
             harness_check_fp8_fail_closed memcheck harness_time; do
    echo "| $key | ${status[$key]:-not run} |"
  done
  for key in $(printf '%s\n' "${!status[@]}" | grep '^san_' | sort); do
    echo "| $key | ${status[$key]} |"
  done; } | tee "$OUT/sm90-summary.md"
