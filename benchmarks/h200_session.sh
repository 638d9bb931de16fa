#!/usr/bin/env bash
# The H200 runs behind the README's performance figures, one stage per device call (each call is limited to
# 10 minutes), all on one warm machine. Outputs go to $RESULTS (default .h200; within a stage the decode
# invocations append to one results file) and, with $DEST set, are tarred to $DEST/<stage>.tar (the device
# transfer drops files past a count limit). $RESULTS did not survive between calls in the run behind the README:
# the stages' decode_h200.jsonl files were concatenated afterwards and the plot redrawn from the whole file.
#
#   bash benchmarks/h200_session.sh tests      # tests/gpu + kernel microbenchmarks
#   bash benchmarks/h200_session.sh targets    # every #5 target point + HF baselines, with profiles
#   bash benchmarks/h200_session.sh capacity   # largest batches at 128K (profiled), 32K chunked prefill, kernels
#   bash benchmarks/h200_session.sh grid       # the rest of the default grid
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${RESULTS:-.h200}
mkdir -p "$RESULTS"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install -q --no-deps -e .
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv >"$RESULTS/gpu.txt" 2>&1
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)" \
  >>"$RESULTS/gpu.txt"
bench=(python3 benchmarks/decode.py --out "$RESULTS" --tag _h200)
case "${1:?stage}" in
  tests)
    timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu >"$RESULTS/gpu_tests.log" 2>&1
    echo "tests/gpu rc=$?" >>"$RESULTS/gpu_tests.log"
    timeout 200 python3 benchmarks/kernel_bench.py --out "$RESULTS" >"$RESULTS/kernels.log" 2>&1
    ;;
  targets)
    timeout 320 "${bench[@]}" --points 32768x1,32768x16,131072x4 --methods vanilla --max-batch "" --prefill "" \
      --profile 32768x1 --hf-static 32768x1 >"$RESULTS/targets_vanilla.log" 2>&1
    timeout 240 "${bench[@]}" --points 131072x4 --methods quest,omnikv,snapkv --no-hf --max-batch "" --prefill "" \
      --profile 131072x4 --append >"$RESULTS/targets_methods.log" 2>&1
    ;;
  capacity)
    timeout 400 "${bench[@]}" --methods "" --no-hf --max-batch vanilla,snapkv --profile-max-batch \
      --prefill vanilla,snapkv,h2o --profile-prefill --append >"$RESULTS/capacity.log" 2>&1
    timeout 150 python3 benchmarks/kernel_bench.py --out "$RESULTS" >"$RESULTS/kernels.log" 2>&1
    ;;
  grid)
    timeout 270 "${bench[@]}" --points 131072x1 --methods vanilla,quest,omnikv,snapkv --no-hf --max-batch "" \
      --prefill "" --profile "" --append >"$RESULTS/grid.log" 2>&1
    timeout 300 "${bench[@]}" --points 32768x1,32768x16 --methods quest,omnikv,snapkv --no-hf --max-batch "" \
      --prefill "" --profile "" --append >>"$RESULTS/grid.log" 2>&1
    ;;
esac
if [ -n "${DEST:-}" ]; then mkdir -p "$DEST" && tar -cf "$DEST/$1.tar" "$RESULTS"; fi
