#!/usr/bin/env bash
# The next H200 session's first call (one H200, ~9 minutes): everything merged without a GPU run since the last one.
#   1. GPU tests of the merged work: kernels after the tiles.py refactor, KIVI, multi-turn (chains, prefix cache,
#      prune, kvzip), n > 1 sampling.
#   2. Kernel timings after the refactor (same rows as kernels.jsonl / prefill_attention_h200.jsonl), to compare.
#   3. #20 KIVI targets (kivi_bench.py) and #15 / #19 multiturn arms with the KVzip prefill-cost rows.
# Tensor parallelism needs the x2 kind: benchmarks/tp_session.sh (the GPU tests there want > 260 s).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPARSECOMPILE_CACHE=/tmp/sc-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
timeout 170 python3 -m pytest -q -p no:cacheprovider -rf tests/gpu --ignore=tests/gpu/test_tp_cuda.py \
  > "$OUT/gpu_tests_next.log" 2>&1; echo "rc=$?" >> "$OUT/gpu_tests_next.log"; tail -6 "$OUT/gpu_tests_next.log"
timeout 70 python3 benchmarks/kernels.py --quick --only attention --out "$OUT" > "$OUT/kernels_next.log" 2>&1
timeout 50 python3 benchmarks/prefill_attention.py --quick --out "$OUT" > "$OUT/prefill_attention_next.log" 2>&1
tail -3 "$OUT/kernels_next.log" "$OUT/prefill_attention_next.log"
timeout 90 python3 benchmarks/kivi_bench.py --quick --out "$OUT" > "$OUT/kivi_next.log" 2>&1; tail -12 "$OUT/kivi_next.log"
timeout 150 python3 benchmarks/multiturn.py --quick --kvzip-cost 8192,32768 --arm-timeout 60 --out "$OUT/multiturn.jsonl" \
  > "$OUT/multiturn_next.log" 2>&1; tail -14 "$OUT/multiturn_next.log"
