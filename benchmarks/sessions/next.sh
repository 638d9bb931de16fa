#!/usr/bin/env bash
# The next H200 session, one stage per call (each under the 10-minute call limit). Sizes from the 2026-12-01 calls:
# a decode compile of the 8B shape takes 35-50 s on a fresh machine (h2o: over 150 s, inductor autotuning), a
# multi-turn arm 20-60 s, the GPU tests of test_cuda_engine + test_eviction_cuda about 290 s cold.
#   bash benchmarks/sessions/next.sh prefill    # #13 after the page-bookkeeping fix: 32K/128K vs HF, gaps, 8K, b4  ~8 min
#   bash benchmarks/sessions/next.sh verify     # every GPU test but export / TP (-v: names of what passed)         ~9 min
#   bash benchmarks/sessions/next.sh arms       # #15: quest none/prefix, h2o chain (one invocation each)          ~9 min
#   bash benchmarks/sessions/next.sh profile    # #14: user_path snapkv + vanilla (generate vs engine, same run)   ~6 min
#   bash benchmarks/sessions/next.sh export     # #17 export tests of the five methods not re-run after the fix    ~7 min
#   bash benchmarks/sessions/next.sh kivi       # #20 decode points and largest batches (kivi_bench.py --quick)     ~8 min
# Results go to $OUT; copy them to benchmarks/results/ and commit. Compile caches travel between calls: each stage
# restores .carry/cc (when carried) and saves its cache to $OUT/cc; copy those pieces to .carry/cc here and pass
# carry=[".carry"] to the next call (compile_cache.py). Fire calls back to back: an idle machine is released in 30 s.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPARSECOMPILE_CACHE=/tmp/sc-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
P="python3 -m pytest -v -p no:cacheprovider -rf --durations=15 --tb=short"  # -v: a timeout still names what passed
python3 benchmarks/sessions/compile_cache.py restore .carry/cc
trap 'python3 benchmarks/sessions/compile_cache.py save "$OUT/cc"' EXIT
case "${1:-}" in
prefill)
  timeout -s INT 330 python3 benchmarks/prefill.py --systems hf_sdpa,sparsecompile --methods vanilla,snapkv \
    --contexts 32768,131072 --batches 1 --chunk-sizes 0 --out "$OUT" --tag _h200 > "$OUT/prefill.log" 2>&1
  echo "rc=$?"; grep '"system"' "$OUT/prefill.log" | cut -c1-200
  timeout -s INT 60 python3 benchmarks/gpu_gaps.py --method vanilla --context 32768 --hf --out "$OUT" > /dev/null 2>&1
  echo "gaps rc=$?"; grep -v "^  +" "$OUT/gpu_gaps_vanilla_32768.txt"
  timeout -s INT 120 python3 benchmarks/prefill.py --systems hf_sdpa,sparsecompile --methods vanilla \
    --contexts 8192 --batches 1,4 --chunk-sizes 0 --out "$OUT" --tag _h200 > "$OUT/prefill_8k.log" 2>&1
  echo "8K rc=$?"; grep '"system"' "$OUT/prefill_8k.log" | cut -c1-200 ;;
verify)
  timeout -s INT 540 $P tests/gpu tests/test_eviction_kernels.py --ignore=tests/gpu/test_export_cuda.py --ignore=tests/gpu/test_tp_cuda.py \
    > "$OUT/gpu_tests_verify.log" 2>&1
  echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests_verify.log" | tail -12 ;;
arms)
  timeout -s INT 200 python3 benchmarks/multiturn.py --quick --methods quest --arm-timeout 90 \
    --out "$OUT/multiturn_h200_quest.jsonl" > "$OUT/multiturn_quest.log" 2>&1; echo "rc=$?"; tail -5 "$OUT/multiturn_quest.log"
  timeout -s INT 340 python3 benchmarks/multiturn.py --quick --methods h2o --arms chain --arm-timeout 90 \
    --out "$OUT/multiturn_h200_h2o.jsonl" > "$OUT/multiturn_h2o.log" 2>&1; echo "rc=$?"; tail -4 "$OUT/multiturn_h2o.log" ;;
profile)
  timeout -s INT 540 python3 benchmarks/user_path.py --methods snapkv,vanilla --points 32768x1 --new-tokens 65 \
    --steps 64 --out "$OUT" > "$OUT/user_path.log" 2>&1; echo "rc=$?"; tail -8 "$OUT/user_path.log" | cut -c1-250 ;;
kivi)
  timeout 560 python3 benchmarks/kivi_bench.py --quick --stage points --out "$OUT/kivi_h200.jsonl" \
    > "$OUT/kivi.log" 2>&1; echo "rc=$?"; tail -16 "$OUT/kivi.log" ;;
export)
  timeout -s INT 400 $P tests/gpu/test_export_cuda.py -k "not vanilla and not exported_form" > "$OUT/gpu_tests_export.log" 2>&1
  echo "export rc=$?"; grep -E "FAILED|passed|failed" "$OUT/gpu_tests_export.log" | tail -8 ;;
*) echo "usage: $0 prefill|verify|arms|profile|export|kivi"; exit 2 ;;
esac
