#!/usr/bin/env bash
# Issue 14's and 15's points through jax_mla.decode beside fa3 (the first section of
# benchmarks/results/<gpu>-sm90.md) and one and two requests in 61-layer steps, within one
# 10-minute device call, in the environment .ci/gpu-h200.sh prepares:
#   .ci/gpu-h200.sh cmd .ci/sm90-evidence.sh   (or run it directly: it calls gpu-h200.sh itself)
# Pieces, in this order (SM90_EVIDENCE picks some; default all: "h128,h16,step,h128-more"):
#   h128       12 points at 128 heads, the bf16 and fp8 caches, pages of 64 and 32, q_len 1 and 2
#   h16        19 points at 16 heads, the same methods
#   step       B = 1 and 2 at 4k and 1k tokens in 61-layer steps, sm90 beside fa3
#   h128-more  8 more 128-head points on the bf16 cache (1k tokens, 512 requests, q_len 2)
# A piece starts only while SM90_EVIDENCE_BUDGET seconds (default 560, counted from the script's
# start) leave it the room it needs, and is cut off at the budget. Outputs in $OUT: the benchmark's
# records merged into <gpu>-sm90-gpu-time.json (`python -m benchmarks.sm90_table FILE` renders
# them), a log per piece (bench-sm90-gpu-time-<piece>.log, step-column-halves.log), and a line per
# piece last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/jax_mla_out}; mkdir -p "$OUT"
if [ -z "${JAX_MLA_FFI_LIB:-}" ]; then exec .ci/gpu-h200.sh cmd "$0" "$@"; fi
start=$SECONDS
budget=${SM90_EVIDENCE_BUDGET:-560}
pieces=",${SM90_EVIDENCE:-h128,h16,step,h128-more},"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'H[0-9]+' | tr 'A-Z' 'a-z')
json="$OUT/${gpu:-gpu}-sm90-gpu-time.json"
declare -a summary
left() { echo $(( budget - (SECONDS - start) )); }

piece() {  # PIECE, seconds it needs at least, LOG, command...; fails where the piece did not run
  local name=$1 need=$2 log=$3; shift 3
  [[ $pieces == *,$name,* ]] || return 1
  if [ "$(left)" -lt "$need" ]; then summary+=("$name: skipped, $(left) s left"); return 1; fi
  local t0=$SECONDS
  timeout "$(left)" "$@" > "$log" 2>&1
  summary+=("$name: rc=$? in $(( SECONDS - t0 )) s")
  return 0
}
bench() {  # PIECE, seconds it needs at least, benchmarks.decode args...
  local name=$1 need=$2 log="$OUT/bench-sm90-gpu-time-$1.log"; shift 2
  piece "$name" "$need" "$log" python3 -m benchmarks.decode \
    --grid full --fi-backends fa3 --time-limit 150 --out "$json" "$@" &&
    summary[-1]+=", $(grep -c '^\[' "$log") points"
  return 0
}

bench h128 90 --backends jax_mla_sm90,jax_mla_sm90_fp8,flashinfer --points 'B=32|128,L=4k|16k,H=128'
bench h16 120 --backends jax_mla_sm90,jax_mla_sm90_fp8,flashinfer \
  --points 'B=32,L=16k|32k,H=16;B=128|512,L=4k|16k|32k,H=16'
piece step 50 "$OUT/step-column-halves.log" python3 -m benchmarks.step_profile \
  --command-buffers default --methods sm90,fa3 --points "1,4096,128;1,4096,64;1,1024,128;2,4096,128"
bench h128-more 60 --backends jax_mla_sm90,flashinfer \
  --points 'B=512,L=1k|4k|16k,H=128,q_len=1,page_size=64;B=128,L=1k,H=128,q_len=1,page_size=64;B=128|512,L=1k|4k,H=128,q_len=2,page_size=64'
printf '%s\n' "${summary[@]}"
