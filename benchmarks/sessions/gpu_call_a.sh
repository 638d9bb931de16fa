#!/usr/bin/env bash
# H200 call A of the 2026-12-01 session (~9.5 min): GPU tests of everything merged without a GPU run (kernels after
# the tiles.py refactor, KIVI, multi-turn, prune/kvzip, n > 1 sampling), the #20 KIVI targets (kivi_bench --quick),
# and 2-layer smoke runs of the scripts calls B and C run at full size (multiturn, prefill LLM rows, user path).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPARSECOMPILE_CACHE=/tmp/sc-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/env_a.txt" 2>&1
timeout 290 python3 -m pytest -q -p no:cacheprovider -rf --durations=25 tests/gpu --ignore=tests/gpu/test_tp_cuda.py \
  > "$OUT/gpu_tests_a.log" 2>&1; echo "rc=$?" >> "$OUT/gpu_tests_a.log"; grep -E "passed|failed|rc=" "$OUT/gpu_tests_a.log" | tail -3
timeout 140 python3 benchmarks/kivi_bench.py --quick --out "$OUT/kivi_h200.jsonl" > "$OUT/kivi_a.log" 2>&1
echo "kivi rc=$?"; tail -14 "$OUT/kivi_a.log"
timeout 60 python3 benchmarks/multiturn.py --quick --layers 2 --conversations 2 --turns 3 --methods vanilla,snapkv,h2o,quest \
  --kvzip-cost 4096 --out "$OUT/multiturn_smoke.jsonl" > "$OUT/multiturn_smoke.log" 2>&1; echo "multiturn smoke rc=$?"
tail -12 "$OUT/multiturn_smoke.log"
timeout 40 python3 benchmarks/prefill.py --layers 2 --contexts 8192 --batches 1,4 --chunk-sizes 0 \
  --methods vanilla,pyramidkv,omnikv,streamingllm --tag _smoke --fresh --out "$OUT" > "$OUT/prefill_smoke.log" 2>&1
echo "prefill smoke rc=$?"; tail -5 "$OUT/prefill_smoke.log"
timeout 40 python3 benchmarks/user_path.py --layers 2 --methods h2o,pyramidkv,streamingllm,omnikv --points 8192x1 \
  --new-tokens 17 --steps 16 --tag _smoke --out "$OUT" > "$OUT/user_path_smoke.log" 2>&1
echo "user_path smoke rc=$?"; tail -8 "$OUT/user_path_smoke.log"
