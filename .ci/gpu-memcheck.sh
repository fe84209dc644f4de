#!/usr/bin/env bash
# compute-sanitizer memcheck over the bad-value cases on every GPU backend and plan mode
# (tests/test_bad_values.py::sanitize_program), in the environment .ci/gpu-h200.sh prepares:
#   .ci/gpu-h200.sh cmd .ci/gpu-memcheck.sh      (or run it directly: it calls gpu-h200.sh itself)
# One buffer per allocation (no pool), so memcheck sees the true bounds of every XLA buffer; no
# command buffers. Log: $OUT/memcheck-bad-values.log; exit status 0 only with 0 errors.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jax_mla_out}; mkdir -p "$OUT"
if [ -z "${JAX_MLA_FFI_LIB:-}" ]; then exec .ci/gpu-h200.sh cmd "$0" "$@"; fi
export PYTHONPATH="$PWD/tests:$PWD${PYTHONPATH:+:$PYTHONPATH}" XLA_PYTHON_CLIENT_PREALLOCATE=false
XLA_PYTHON_CLIENT_ALLOCATOR=platform XLA_FLAGS=--xla_gpu_enable_command_buffer= \
  timeout 900 compute-sanitizer --tool memcheck --error-exitcode 9 \
  python3 -c "import test_bad_values; test_bad_values.sanitize_program()" \
  > "$OUT/memcheck-bad-values.log" 2>&1
rc=$?
echo "memcheck over the bad-value cases: rc=$rc $(grep -E 'ERROR SUMMARY' "$OUT/memcheck-bad-values.log" | tail -1)"
grep -c "^ok " "$OUT/memcheck-bad-values.log" | sed 's/^/cases passed: /'
exit $rc
