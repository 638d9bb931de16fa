#!/usr/bin/env bash
# The last call of the 2026-12-01 two-GPU session, three jobs side by side (none timed against another's GPU use
# except the multi-turn arms, which share GPU 1 with a tiny-model test rank: noted with their results):
#   both GPUs: tests/gpu/test_tp_cuda.py (compiled CUDA-graph decode under TP 2, every method; LLM at TP 2)
#   GPU 1:     the eviction kernel tests on CUDA (rows of the test view made disjoint), then next.sh's arms (#15)
#   GPU 0:     tp_noise.py, the bf16 noise floor of tp.py's equality check (HF SDPA / eager vs TP 1's reference)
# Everything lands in one tarball ($OUT/all.tgz): a call returns at most 8 files.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
R=/tmp/res; mkdir -p $R/arms
OUT=${OUT:-/tmp/out}
(timeout -s INT 560 python3 -m pytest -v -p no:cacheprovider -rf --durations=10 --tb=short tests/gpu/test_tp_cuda.py \
  > $R/gpu_tp_tests.log 2>&1; echo "rc=$?" >> $R/gpu_tp_tests.log) &
(export CUDA_VISIBLE_DEVICES=1
 timeout -s INT 40 python3 -m pytest -q -p no:cacheprovider tests/test_eviction_kernels.py > $R/kernels.log 2>&1
 OUT=$R/arms timeout -s INT 520 bash benchmarks/sessions/next.sh arms > $R/arms.log 2>&1; rm -rf $R/arms/cc) &
(CUDA_VISIBLE_DEVICES=0 timeout 300 python3 benchmarks/tp_noise.py --reference benchmarks/results/tp/tp_reference.pt \
  --out $R > $R/noise.log 2>&1) &
wait
tar czf "$OUT/all.tgz" -C $R .
tail -4 $R/kernels.log; cat $R/noise.log | grep '^{' | cut -c1-400; cat $R/arms.log; grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" $R/gpu_tp_tests.log | tail -25
