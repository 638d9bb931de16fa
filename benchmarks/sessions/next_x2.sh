#!/usr/bin/env bash
# #18 on the two-GPU kind, three calls (ask `status` first; fire them back to back, an idle machine goes in 30 s):
#   bash benchmarks/sessions/next_x2.sh tp1     # GPU 0: tp.py at TP 1 (equality bf16 + fp32, 128K decode, prefill,
#                                               #   largest batches); GPU 1 meanwhile: next.sh prefill (#13)  ~9 min
#   bash benchmarks/sessions/next_x2.sh tp2     # both GPUs: tp.py at TP 2 against tp1's files (kept in /tmp/tpres
#                                               #   on the warm machine; also returned, carry them if it went)  ~8 min
#   bash benchmarks/sessions/next_x2.sh tests   # both GPUs: tests/gpu/test_tp_cuda.py (fp32 tiny model, compiled
#                                               #   CUDA-graph decode of every method, LLM at TP 2)          ~5-9 min
# Everything returned is one tarball, $OUT/x2_<stage>.tgz (a call returns at most 8 files).
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export SPARSECOMPILE_CACHE=/tmp/sc-cache RESULTS=/tmp/tpres
OUT=${OUT:-/tmp/out}; R=/tmp/x2; mkdir -p "$R" "$RESULTS"
[ -d .carry/tpres ] && cp -n .carry/tpres/* "$RESULTS"/ 2>/dev/null
case "${1:-}" in
tp1)
  (CUDA_VISIBLE_DEVICES=0 TP_TIMEOUT=560 bash benchmarks/tp_session.sh tp1 > "$R/tp1_stage.log" 2>&1) &
  (CUDA_VISIBLE_DEVICES=1 OUT="$R/single" timeout -s INT 560 bash benchmarks/sessions/next.sh prefill \
    > "$R/prefill_stage.log" 2>&1; rm -rf "$R/single/cc") &
  wait ;;
tp2) TP_TIMEOUT=570 bash benchmarks/tp_session.sh tp2 > "$R/tp2_stage.log" 2>&1 ;;
tests) timeout -s INT 570 python3 -m pytest -v -p no:cacheprovider -rf --durations=10 --tb=short \
    tests/gpu/test_tp_cuda.py > "$R/gpu_tp_tests.log" 2>&1; echo "rc=$?" >> "$R/gpu_tp_tests.log" ;;
*) echo "usage: $0 tp1|tp2|tests"; exit 2 ;;
esac
cp "$RESULTS"/* "$R/" 2>/dev/null
tar czf "$OUT/x2_$1.tgz" -C "$R" .
tail -n 25 "$RESULTS"/tp*.log 2>/dev/null; grep -h '"system"' "$R"/single/*.log 2>/dev/null | cut -c1-200
grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" "$R/gpu_tp_tests.log" 2>/dev/null | tail -25
