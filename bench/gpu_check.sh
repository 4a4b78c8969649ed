#!/usr/bin/env bash
# One device call: GPU tests, kernel microbenchmarks, the encoder benchmark. Logs under $OUT.
# Usage (device tool, repo root): bash bench/gpu_check.sh [tests|kernels|bench|all]
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
if [[ $what == tests || $what == all ]]; then
  timeout 300 python3 -m pytest -q -x -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [[ $what == kernels || $what == all ]]; then
  for b in bench/kernels/bench_*.py; do
    echo "== $b"; timeout 120 python3 "$b" 2>&1 | tee -a "$OUT/kernels.log" | tail -40
  done
fi
if [[ $what == bench || $what == all ]]; then
  timeout 420 python3 -m transfuse.bench --out "$OUT" 2>&1 | tee "$OUT/bench.log" | tail -30
fi
