#!/usr/bin/env bash
# One call on the two-GPU kind, two jobs side by side on separate GPUs (each alone on its GPU, so neither's timings
# are shared): GPU 0 runs the TP 1 stage of #18 (benchmarks/tp_session.sh tp1); GPU 1 checks the eviction kernels
# (move_slots' Triton kernel, first run on a GPU) and then runs next.sh's prefill stage (#13). ~9.5 min.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/tp" "$OUT/single"
nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
(CUDA_VISIBLE_DEVICES=0 SPARSECOMPILE_CACHE=/tmp/sc-cache TP_TIMEOUT=545 RESULTS="$OUT/tp" \
  bash benchmarks/tp_session.sh tp1 > "$OUT/tp1_stage.log" 2>&1) &
(export CUDA_VISIBLE_DEVICES=1 OUT="$OUT/single"
 timeout -s INT 60 python3 -m pytest -q -p no:cacheprovider tests/test_eviction_kernels.py > "$OUT/kernels.log" 2>&1
 timeout -s INT 520 bash benchmarks/sessions/next.sh prefill > "$OUT/stage.log" 2>&1) &
wait
tail -3 "$OUT/single/kernels.log"; cat "$OUT/single/stage.log"; tail -25 "$OUT/tp/tp1.log"
