#!/usr/bin/env bash
# The next H200 session, one stage per call (each under the 10-minute call limit; on the two-GPU kind two stages
# side by side, one per GPU through CUDA_VISIBLE_DEVICES, as sessions/x2_call1.sh did). Sizes from the 2026-12-01
# calls: a decode compile of the 8B shape takes 35-55 s on a fresh machine, a multi-turn arm 20-60 s, the GPU tests
# of test_cuda_engine + test_eviction_cuda 190 s. A call returns at most 8 files: tar $OUT when more.
#   bash benchmarks/sessions/next.sh prefill    # #13 after the pinning fix: 32K/128K b1, every method vs HF; gaps   ~7 min
#   bash benchmarks/sessions/next.sh prefill4   # #13 batch 4 (8K, 32K), hf_generate and LLM rows                    ~6 min
#   bash benchmarks/sessions/next.sh e2e_hf     # #13 128K + 256 tokens: HF eager, HF static cache + compile          ~4 min
#   bash benchmarks/sessions/next.sh e2e_a      # #13 128K + 256 tokens: vanilla, snapkv, quest, h2o                  ~7 min
#   bash benchmarks/sessions/next.sh e2e_b      # #13 128K + 256 tokens: pyramidkv, omnikv, streamingllm              ~5 min
#   bash benchmarks/sessions/next.sh ops        # kernels.py --only ops: topk_select r1 vs r8 (radix bits), quest scores ~2 min
#   bash benchmarks/sessions/next.sh verify     # every GPU test but export / TP (-v: names of what passed)         ~9 min
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
  timeout -s INT 60 python3 benchmarks/gpu_gaps.py --method vanilla --context 32768 --hf --out "$OUT" > /dev/null 2>&1
  echo "gaps rc=$?"; grep -v "^  +" "$OUT/gpu_gaps_vanilla_32768.txt"
  timeout -s INT 420 python3 benchmarks/prefill.py --systems hf_sdpa,sparsecompile --contexts 32768,131072 \
    --batches 1 --chunk-sizes 0 --out "$OUT" --tag _h200 > "$OUT/prefill.log" 2>&1
  echo "rc=$?"; grep '"system"' "$OUT/prefill.log" | cut -c1-200 ;;
prefill4)
  timeout -s INT 250 python3 benchmarks/prefill.py --systems hf_sdpa,hf_generate,sparsecompile,sparsecompile_llm \
    --methods vanilla,snapkv,quest --contexts 8192,32768 --batches 1,4 --chunk-sizes 0 --out "$OUT" --tag _h200 \
    > "$OUT/prefill4.log" 2>&1; echo "rc=$?"; grep '"system"' "$OUT/prefill4.log" | cut -c1-200
  timeout -s INT 280 python3 benchmarks/prefill.py --systems sparsecompile --methods vanilla,snapkv \
    --contexts 32768 --batches 1 --chunk-sizes 2048,8192,16384 --out "$OUT" --tag _h200 > "$OUT/prefill_chunks.log" 2>&1
  echo "chunks rc=$?"; grep '"system"' "$OUT/prefill_chunks.log" | cut -c1-200 ;;
e2e_hf|e2e_a|e2e_b)
  case "$1" in e2e_hf) sys=hf_eager,hf_static_compile; m=vanilla ;; e2e_a) sys=sparsecompile; m=vanilla,snapkv,quest,h2o ;;
    *) sys=sparsecompile; m=pyramidkv,omnikv,streamingllm ;; esac
  timeout -s INT 560 python3 benchmarks/prefill.py --e2e --systems $sys --methods $m --out "$OUT" --tag _h200_e2e \
    > "$OUT/$1.log" 2>&1; echo "rc=$?"; grep '"system"' "$OUT/$1.log" | cut -c1-220 ;;
ops)
  timeout -s INT 200 python3 benchmarks/kernels.py --only ops --out "$OUT" > "$OUT/kernels_ops.log" 2>&1
  echo "rc=$?"; grep -E "topk|quest" "$OUT/kernels_ops.log" | cut -c1-220 ;;
verify)
  timeout -s INT 540 $P tests/gpu tests/test_eviction_kernels.py --ignore=tests/gpu/test_export_cuda.py --ignore=tests/gpu/test_tp_cuda.py \
    > "$OUT/gpu_tests_verify.log" 2>&1
  echo "tests rc=$?"; grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests_verify.log" | tail -12 ;;
profile)
  timeout -s INT 540 python3 benchmarks/user_path.py --methods snapkv,vanilla --points 32768x1 --new-tokens 65 \
    --steps 64 --out "$OUT" > "$OUT/user_path.log" 2>&1; echo "rc=$?"; tail -8 "$OUT/user_path.log" | cut -c1-250 ;;
kivi)
  timeout 560 python3 benchmarks/kivi_bench.py --quick --stage points --out "$OUT/kivi_h200.jsonl" \
    > "$OUT/kivi.log" 2>&1; echo "rc=$?"; tail -16 "$OUT/kivi.log" ;;
export)
  timeout -s INT 400 $P tests/gpu/test_export_cuda.py -k "not vanilla and not exported_form" > "$OUT/gpu_tests_export.log" 2>&1
  echo "export rc=$?"; grep -E "FAILED|passed|failed" "$OUT/gpu_tests_export.log" | tail -8 ;;
*) echo "usage: $0 prefill|prefill4|e2e_hf|e2e_a|e2e_b|ops|verify|profile|export|kivi"; exit 2 ;;
esac
