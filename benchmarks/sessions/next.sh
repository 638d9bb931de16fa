#!/usr/bin/env bash
# The next H200 session, one stage per call (each under the 10-minute call limit; sizes from the 2026-12-01 calls:
# a decode compile of the 8B shape takes 35-50 s on a fresh machine, a multi-turn arm 30-60 s).
#   bash benchmarks/sessions/next.sh verify     # GPU tests of this stop's changes + the KIVI kernel sweep      ~8 min
#   bash benchmarks/sessions/next.sh export     # export tests of the five methods not re-run after the fix     ~7 min
#   bash benchmarks/sessions/next.sh multiturn  # #15 / #19: vanilla none/prefix, snapkv none/chain/prune        ~7 min
#   bash benchmarks/sessions/next.sh arms       # h2o none/chain, quest none/prefix (same trace)                 ~7 min
#   bash benchmarks/sessions/next.sh kivi       # #20 decode points and largest batches (kivi_bench.py --quick)  ~8 min
#   bash benchmarks/sessions/next.sh profile    # #14 host time of generate() decode steps, snapkv and vanilla   ~4 min
# Results go to $OUT; copy them to benchmarks/results/ and commit. Compile caches travel between calls: each stage
# restores .carry/cc (when carried) and saves its cache to $OUT/cc; copy those pieces to .carry/cc here and pass
# carry=[".carry"] to the next call (compile_cache.py).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPARSECOMPILE_CACHE=/tmp/sc-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="python3 -m pytest -q -p no:cacheprovider -rf --durations=12 --tb=short"
python3 benchmarks/sessions/compile_cache.py restore .carry/cc
trap 'python3 benchmarks/sessions/compile_cache.py save "$OUT/cc"' EXIT
case "${1:-}" in
verify)
  timeout 290 $P tests/gpu/test_cuda_engine.py tests/gpu/test_eviction_cuda.py tests/gpu/test_kivi_cuda.py \
    tests/gpu/test_multiturn_cuda.py > "$OUT/gpu_tests_verify.log" 2>&1
  echo "tests rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/gpu_tests_verify.log" | tail -8
  timeout 120 python3 benchmarks/kernels.py --quick --sweep --only kivi --out "$OUT" > "$OUT/kivi_sweep.log" 2>&1
  echo "sweep rc=$?"; grep -E "best_of_sweep|\"default\"" "$OUT/kivi_sweep.log" | cut -c1-300 ;;
multiturn)
  timeout 560 python3 benchmarks/multiturn.py --quick --methods vanilla,snapkv --arm-timeout 100 \
    --out "$OUT/multiturn_h200.jsonl" > "$OUT/multiturn.log" 2>&1; echo "rc=$?"; tail -16 "$OUT/multiturn.log" ;;
arms)
  timeout 560 python3 benchmarks/multiturn.py --quick --methods h2o,quest --arm-timeout 100 \
    --out "$OUT/multiturn_h200_arms.jsonl" > "$OUT/multiturn_arms.log" 2>&1; echo "rc=$?"; tail -12 "$OUT/multiturn_arms.log" ;;
kivi)
  timeout 560 python3 benchmarks/kivi_bench.py --quick --stage points --out "$OUT/kivi_h200.jsonl" \
    > "$OUT/kivi.log" 2>&1; echo "rc=$?"; tail -16 "$OUT/kivi.log" ;;
export)
  timeout 400 $P tests/gpu/test_export_cuda.py -k "not vanilla and not exported_form" > "$OUT/gpu_tests_export.log" 2>&1
  echo "export rc=$?"; grep -E "^FAILED|passed|failed" "$OUT/gpu_tests_export.log" | tail -8 ;;
profile)
  for method in snapkv vanilla; do
    timeout 200 python3 benchmarks/generate_profile.py --method $method --out "$OUT" > "$OUT/profile_$method.log" 2>&1
    echo "$method rc=$?"; tail -2 "$OUT/profile_$method.log"
  done ;;
*) echo "usage: $0 verify|export|multiturn|arms|kivi|profile"; exit 2 ;;
esac
