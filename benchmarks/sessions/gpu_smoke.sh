#!/usr/bin/env bash
# First H200 call of a session: kernel correctness at real sizes, kernel timings that choose implementations, and a
# quick look at generate() beside the engine step. Every stage has its own timeout so each one's output returns.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 SPARSECOMPILE_CACHE=/tmp/sc-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_prefill_attention_cuda.py tests/gpu/test_mass_cuda.py 2>&1 | tail -25 > "$OUT/gpu_tests_kernels.log"; tail -8 "$OUT/gpu_tests_kernels.log"
timeout 150 python3 benchmarks/prefill_attention.py --quick --out "$OUT" > "$OUT/prefill_attention.log" 2>&1; tail -25 "$OUT/prefill_attention.log"
timeout 80 python3 benchmarks/kernel_bench.py --only mass --quick --out "$OUT" > "$OUT/kernels_mass.log" 2>&1; tail -14 "$OUT/kernels_mass.log"
timeout 170 python3 benchmarks/user_path.py --methods vanilla,h2o --points 32768x1 --new-tokens 65 --steps 64 --out "$OUT" --tag _smoke > "$OUT/user_path_smoke.log" 2>&1; tail -6 "$OUT/user_path_smoke.log"
