#!/usr/bin/env bash
# H200 call C (2026-12-01): the fixes of call A/B's failures (export fusion under torch 2.11, per-engine dynamo
# caches, the multi-turn test's token count, KIVI graph test in fp32), multi-page KIVI tiles with a launch sweep
# (#20), and the multi-turn agent trace (#15 / #19: vanilla none/prefix, snapkv none/chain/prune; KVzip cost rows).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPARSECOMPILE_CACHE=/tmp/sc-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="python3 -m pytest -q -p no:cacheprovider -rf --durations=12 --tb=short"
timeout 200 $P "tests/gpu/test_export_cuda.py::test_a_fresh_process_serves_the_8b_shape_artifact_token_for_token[vanilla]" \
  tests/gpu/test_export_cuda.py::test_the_exported_form_serves_without_aoti tests/gpu/test_kivi_cuda.py \
  tests/gpu/test_multiturn_cuda.py > "$OUT/gpu_tests_c.log" 2>&1; echo "tests rc=$?"
grep -E "^E  |^FAILED|passed|failed" "$OUT/gpu_tests_c.log" | grep -v DEBUG | head -20
timeout 120 python3 benchmarks/kernel_bench.py --quick --sweep --only kivi --out "$OUT" > "$OUT/kivi_sweep_c.log" 2>&1
echo "sweep rc=$?"; grep -E "best_of_sweep|default" "$OUT/kivi_sweep_c.log" | cut -c1-400 | tail -14
timeout 265 python3 benchmarks/multiturn.py --quick --methods vanilla,snapkv --kvzip-cost 8192,32768 --arm-timeout 60 \
  --out "$OUT/multiturn_h200.jsonl" > "$OUT/multiturn_c.log" 2>&1; echo "multiturn rc=$?"; tail -16 "$OUT/multiturn_c.log"
