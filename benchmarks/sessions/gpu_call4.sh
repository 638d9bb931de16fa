#!/usr/bin/env bash
# Fourth call (2 x H200): the smallest AOTI load check in a fresh process, then the tensor-parallel GPU tests.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/aoti
timeout 110 python3 benchmarks/aoti_min.py build /tmp/aoti > "$OUT/aoti_min.log" 2>&1; echo "build rc=$?" >> "$OUT/aoti_min.log"
timeout 70 python3 -X faulthandler benchmarks/aoti_min.py load /tmp/aoti >> "$OUT/aoti_min.log" 2>&1; echo "load rc=$?" >> "$OUT/aoti_min.log"
grep -v Warning "$OUT/aoti_min.log" | tail -12
timeout 260 python3 -m pytest -q -p no:cacheprovider -rA tests/gpu/test_tp_cuda.py > "$OUT/tp_tests.log" 2>&1; echo "rc=$?" >> "$OUT/tp_tests.log"
grep -E "PASSED|FAILED|ERROR|passed|failed|rc=" "$OUT/tp_tests.log" | tail -20
