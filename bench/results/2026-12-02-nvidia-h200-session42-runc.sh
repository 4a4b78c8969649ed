#!/usr/bin/env bash
# Session 42, device call c: the norm inside the few-rows GEMM (norm_few_rows_fwd: rms_norm_linear /
# layer_norm_linear at 3-32 rows where the dispatcher picks few_rows). The GPU test suite on this
# tree, then Llama-1.1B decode steps at batch 8 on this tree and on .ab/head (57ea153, before),
# alternating processes (new old new old).
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
PYTHONPATH=src timeout 290 python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider tests > $OUT/gpu-tests.log 2>&1
tail -4 $OUT/gpu-tests.log
for v in new old new old; do
  dir=.; [ $v = old ] && dir=.ab/head
  (cd $dir && PYTHONPATH=src timeout 65 python3 bench/decode_step_time.py --batch 8 --label "b8-$v" 2>&1 | grep -v Warn | tail -1) >> $OUT/decode-step-ab.log
done
cat $OUT/decode-step-ab.log
