#!/usr/bin/env bash
# H200 call B (2026-12-01): the failures of call A with their tracebacks (export tests, KIVI graph decode), the GPU
# tests call A's timeout did not reach, and the KIVI kernel stage (#20: % of HBM bandwidth).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPARSECOMPILE_CACHE=/tmp/sc-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="python3 -m pytest -q -p no:cacheprovider -rf --durations=15 --tb=short"
timeout 130 $P -x "tests/gpu/test_export_cuda.py::test_a_fresh_process_serves_the_8b_shape_artifact_token_for_token[vanilla]" \
  > "$OUT/gpu_export_b.log" 2>&1; echo "export rc=$?"; tail -c 2500 "$OUT/gpu_export_b.log"
timeout 80 $P tests/gpu/test_kivi_cuda.py -k graphs > "$OUT/gpu_kivi_b.log" 2>&1; echo "kivi rc=$?"
grep -E "^E |Error|passed|failed" "$OUT/gpu_kivi_b.log" | head -30
timeout 250 $P tests/gpu/test_mass_cuda.py tests/gpu/test_multiturn_cuda.py tests/gpu/test_prefill_attention_cuda.py \
  tests/gpu/test_prefill_no_sync.py tests/gpu/test_sampling_cuda.py tests/gpu/test_selection_cuda.py \
  > "$OUT/gpu_tests_b.log" 2>&1; echo "rest rc=$?"; grep -E "^E |^FAILED|passed|failed" "$OUT/gpu_tests_b.log" | head -30
timeout 60 python3 benchmarks/kivi_bench.py --quick --stage kernels --out "$OUT/kivi_kernels_h200.jsonl" > "$OUT/kivi_kernels_b.log" 2>&1
echo "kivi kernels rc=$?"; tail -8 "$OUT/kivi_kernels_b.log"
