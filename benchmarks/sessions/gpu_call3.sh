#!/usr/bin/env bash
# Third H200 call: GPU tests of this session's paths, prefill memory after the pool-bucket change, generate() for
# more methods, and a new process with warm compile caches.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPARSECOMPILE_CACHE=/tmp/sc-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_prefill_attention_cuda.py::test_op_dispatch_with_host_vouched_lengths \
  tests/gpu/test_prefill_no_sync.py tests/gpu/test_sampling_cuda.py tests/gpu/test_eviction_cuda.py 2>&1 | tail -15 > "$OUT/gpu_tests_call3.log"
tail -4 "$OUT/gpu_tests_call3.log"
timeout 100 python3 benchmarks/prefill.py --systems hf_sdpa,sparsecompile --methods vanilla --contexts 32768,131072 \
  --batches 1 --chunk-sizes 0 --out "$OUT" --tag _h200 > "$OUT/prefill_mem.log" 2>&1
grep -h '"system"' "$OUT/prefill_mem.log" | cut -c1-200
timeout 200 python3 benchmarks/user_path.py --methods snapkv,h2o,omnikv --points 32768x1 --new-tokens 65 --steps 64 \
  --out "$OUT" > "$OUT/user_path3.log" 2>&1; grep '^{' "$OUT/user_path3.log" | cut -c1-330
timeout 130 python3 benchmarks/user_path.py --methods vanilla --points 32768x1 --new-tokens 65 --no-engine \
  --warm-process --child-timeout 100 --out "$OUT" --tag _warm > "$OUT/user_path_warm.log" 2>&1; grep '^{' "$OUT/user_path_warm.log" | cut -c1-330
