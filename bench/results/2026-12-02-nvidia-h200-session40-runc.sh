#!/usr/bin/env bash
# Session 40, device call c: the GEMM GPU tests after their update for gated units timed above 64
# rows, and a second Llama-1.1B prefill A/B at 2,048 tokens (the old tree first this time).
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
PYTHONPATH=src timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_gemm_gpu.py > $OUT/gemm-gpu-tests.log 2>&1
tail -2 $OUT/gemm-gpu-tests.log
for tree in old new; do
  dir=.; [ $tree = old ] && dir=.ab/head
  echo "== $tree" >> $OUT/prefill-ab.log
  (cd $dir && PYTHONPATH=src timeout 120 python3 bench/profile_prefill.py --prompt 2048 2>&1 | grep -v Warning | head -3) >> $OUT/prefill-ab.log
done
cat $OUT/prefill-ab.log
