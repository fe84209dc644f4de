#!/usr/bin/env bash
# GPU evidence run on the H200 machine (no network): installs the carried FlashInfer/TVM-FFI wheels,
# builds ffi/ for sm_90a, warms FlashInfer's fa3/fa2 JIT modules (bf16 and e4m3 caches), then
# runs what is asked:
#   .ci/gpu-h200.sh tests [pytest args]   GPU test suite  -> $OUT/gpu-tests.log (JAX_MLA_REQUIRE_GPU=1:
#                                         a GPU test that cannot run fails instead of skipping)
#   .ci/gpu-h200.sh bench [benchmarks.decode args] benchmark piece -> $OUT/*.json
#   .ci/gpu-h200.sh cmd CMD...             anything else, in the prepared environment
set -uo pipefail
mode=${1:-tests}; shift || true
OUT=${OUT:-/tmp/jax_mla_out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export JAX_MLA_COMMIT=${JAX_MLA_COMMIT:-$(cat .ci/COMMIT 2>/dev/null || echo unknown)}
{ cmake -S . -B /tmp/jax_mla_build -G Ninja -DCMAKE_CUDA_ARCHITECTURES=90a >/dev/null &&
  cmake --build /tmp/jax_mla_build >/dev/null; } 2>&1 | tail -20
export JAX_MLA_FFI_LIB=/tmp/jax_mla_build/ffi/libjax_mla_ffi.so
[ -f "$JAX_MLA_FFI_LIB" ] || { echo "ffi build failed"; exit 1; }
for b in fa3 fa2; do
  for kv in bfloat16 float8_e4m3fn; do
    python3 -c "from jax_mla import gpu; gpu.fa_entry_points('$b', 512, 64, '$kv')" &
  done
done
wait
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import jax, torch, flashinfer; print('jax', jax.__version__, 'torch', torch.__version__, 'flashinfer', flashinfer.__version__, 'cuda', torch.version.cuda)"
  echo "commit $JAX_MLA_COMMIT"; } | tee "$OUT/env.txt"
case "$mode" in
  tests) JAX_MLA_REQUIRE_GPU=1 python3 -m pytest -q -rs -p no:cacheprovider tests "$@" 2>&1 | tee "$OUT/gpu-tests.log" ;;
  bench) python3 -m benchmarks.decode "$@" 2>&1 | tee "$OUT/bench.log" ;;
  cmd) "$@" ;;
esac
