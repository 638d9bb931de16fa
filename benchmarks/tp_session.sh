#!/usr/bin/env bash
# Tensor-parallel runs on one host (issue #18), one stage per device call (each call is limited to 10 minutes).
# TP 1 runs on GPU 0; TP 2 needs 2 GPUs. The TP 2 run reads the TP 1 run's tp1.jsonl and tp_reference.pt
# (< 1 MB) from $RESULTS: when the device keeps no folder between calls, bring them back into the working tree
# ($RESULTS, default benchmarks/results/tp) before the TP 2 call. With $DEST set, each stage also copies
# $RESULTS to $DEST. Extra arguments go to benchmarks/tp.py (e.g. to split a stage that runs out of time:
# `tp2 --parts equality,decode,prefill` then `tp2 --parts capacity --append`).
#
#   bash benchmarks/tp_session.sh tests    # tests/gpu/test_tp_cuda.py (2 GPUs)                              ~3-5 min
#   bash benchmarks/tp_session.sh tp1      # equality reference, 128K x 4 decode, 128K prefill, largest batches ~7-9 min
#   bash benchmarks/tp_session.sh tp2      # the same at TP 2 (2 GPUs), compared with TP 1; the targets table ~6-8 min
#   bash benchmarks/tp_session.sh quick    # both sizes at 4 layers / 32K in $RESULTS/quick (a smoke run)
#
# TP_TIMEOUT (seconds, default 580) bounds each torchrun. NVLink multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1).
set -uo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
RESULTS=${RESULTS:-benchmarks/results/tp}
mkdir -p "$RESULTS"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install -q --no-deps -e .
nvidia-smi --query-gpu=index,name,memory.total --format=csv >"$RESULTS/gpu.txt" 2>&1
tp() {  # tp <ranks> <log> <tp.py arguments...>
  local ranks=$1 log=$2
  shift 2
  timeout "${TP_TIMEOUT:-580}" torchrun --standalone --nproc-per-node "$ranks" benchmarks/tp.py --out "$RESULTS" "$@" \
    >>"$RESULTS/$log" 2>&1
  echo "rc=$?" >>"$RESULTS/$log"
}
case "${1:?stage}" in
  tests)
    timeout 580 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_tp_cuda.py >"$RESULTS/gpu_tp_tests.log" 2>&1
    echo "rc=$?" >>"$RESULTS/gpu_tp_tests.log"
    ;;
  tp1) shift; tp 1 tp1.log "$@" ;;
  tp2) shift; tp 2 tp2.log "$@" ;;
  quick)  # a smoke run of both sizes (4 layers, 32K) in $RESULTS/quick: minutes, not the targets
    RESULTS="$RESULTS/quick" && mkdir -p "$RESULTS" && tp 1 quick1.log --quick && tp 2 quick2.log --quick ;;
esac
if [ -n "${DEST:-}" ]; then mkdir -p "$DEST" && cp -r "$RESULTS" "$DEST/"; fi
tail -n 30 "$RESULTS"/*.log
