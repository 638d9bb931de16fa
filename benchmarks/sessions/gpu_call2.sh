#!/usr/bin/env bash
# Second H200 call: prefill through the public API (chunk policy, HF baseline) and generate() beside the engine step.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPARSECOMPILE_CACHE=/tmp/sc-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 170 python3 benchmarks/prefill.py --systems hf_sdpa,sparsecompile --methods vanilla,snapkv,h2o,quest \
  --contexts 32768 --batches 1 --chunk-sizes 2048,8192,0 --out "$OUT" --tag _h200 > "$OUT/prefill_32k.log" 2>&1
grep -h '"system"' "$OUT/prefill_32k.log" | cut -c1-200
timeout 190 python3 benchmarks/prefill.py --systems hf_sdpa,sparsecompile --methods vanilla,snapkv,h2o \
  --contexts 131072 --batches 1 --chunk-sizes 8192,0 --out "$OUT" --tag _h200 > "$OUT/prefill_128k.log" 2>&1
grep -h '"system"' "$OUT/prefill_128k.log" | cut -c1-200
timeout 200 python3 benchmarks/user_path.py --methods vanilla,quest,snapkv,h2o --points 32768x1 --new-tokens 65 \
  --steps 64 --out "$OUT" > "$OUT/user_path.log" 2>&1; tail -7 "$OUT/user_path.log"
