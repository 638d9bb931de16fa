#!/usr/bin/env bash
# The one-GPU call that closed the 2026-12-01 session (the two-GPU kind was no longer lent), ~9.5 min:
#   side by side (correctness only, nothing timed): the eviction kernel tests on CUDA; tp_noise.py (#18's bf16
#   noise floor); then alone on the GPU, #15's missing rows: the h2o chain arm, then quest none / prefix.
# Everything lands in one tarball ($OUT/all.tgz): a call returns at most 8 files.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPARSECOMPILE_CACHE=/tmp/sc-cache
R=/tmp/res; mkdir -p $R; OUT=${OUT:-/tmp/out}
python3 benchmarks/sessions/compile_cache.py restore .carry/cc > /dev/null
(timeout -s INT 60 python3 -m pytest -q -p no:cacheprovider tests/test_eviction_kernels.py > $R/kernels.log 2>&1) &
(timeout 170 python3 benchmarks/tp_noise.py --reference benchmarks/results/tp/tp_reference.pt --out $R \
  > $R/noise.log 2>&1) &
wait
left=$((565 - SECONDS))
timeout -s INT $((left * 6 / 10)) python3 benchmarks/multiturn.py --quick --methods h2o --arms chain --arm-timeout 120 \
  --out $R/multiturn_h200_h2o.jsonl > $R/multiturn_h2o.log 2>&1; echo "h2o rc=$?"
timeout -s INT $((570 - SECONDS)) python3 benchmarks/multiturn.py --quick --methods quest --arm-timeout 90 \
  --out $R/multiturn_h200_quest.jsonl > $R/multiturn_quest.log 2>&1; echo "quest rc=$?"
tar czf "$OUT/all.tgz" -C $R .
tail -3 $R/kernels.log; grep '^{' $R/noise.log | cut -c1-420; tail -3 $R/noise.log | cut -c1-300
grep -h '^{"method"' $R/multiturn_*.log | cut -c1-330; tail -2 $R/multiturn_h2o.log $R/multiturn_quest.log | cut -c1-300
