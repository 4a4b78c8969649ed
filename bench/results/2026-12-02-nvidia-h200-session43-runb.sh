#!/usr/bin/env bash
# Session 43, device call b: PDL level 2 (every kernel lets the next one launch once it has waited)
# and, on top of it, the few-rows GEMM's L2 prefetch of its weight rows before its PDL wait
# (TRANSFUSE_PREFETCH_WEIGHTS=1). The few-rows GPU tests with both on, then Llama-1.1B decode steps
# at batch 8: L1 (committed default), L2, L2 + prefetch, alternating processes, two rounds.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
TRANSFUSE_PDL=2 TRANSFUSE_PREFETCH_WEIGHTS=1 PYTHONPATH=src timeout 100 python3 -m pytest -q -n 8 -m gpu -p no:cacheprovider \
  tests/kernels/test_gemm_few_rows_gpu.py > $OUT/few-rows-gpu-tests-prefetch.log 2>&1
tail -2 $OUT/few-rows-gpu-tests-prefetch.log
for round in 1 2; do
  for v in L1 L2 L2P; do
    case $v in L1) env="TRANSFUSE_PDL=1";; L2) env="TRANSFUSE_PDL=2";; L2P) env="TRANSFUSE_PDL=2 TRANSFUSE_PREFETCH_WEIGHTS=1";; esac
    env $env PYTHONPATH=src timeout 70 python3 bench/decode_step_time.py --batch 8 --label "b8-$v" 2>&1 | grep -v Warn | tail -1 >> $OUT/decode-step-ab.log
  done
done
cat $OUT/decode-step-ab.log
