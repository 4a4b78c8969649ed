#!/usr/bin/env bash
# Session 43, device call a: the gated few-rows GEMM (every batched SwiGLU gate-up) at 4 warps, as
# committed, against 8 warps (ptxas for sm_90a: 684 bytes/thread of spills at 4 warps with triton
# 3.6, none at 8). Kernel times (bench/norm_few_rows_time.py), then Llama-1.1B decode steps at batch
# 8 with the committed config (w4) and with _GATED's num_warps set to 8 in a copy of src (w8),
# alternating processes (w4 w8 w4 w8).
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
PYTHONPATH=src timeout 60 python3 bench/norm_few_rows_time.py 2>&1 | grep -v Warn > $OUT/norm-few-rows-time.log
cat $OUT/norm-few-rows-time.log
mkdir -p /tmp/w8 && cp -r src bench /tmp/w8/
sed -i 's/^_GATED = FewRowsConfig(64, 128, 1, 3, 4)$/_GATED = FewRowsConfig(64, 128, 1, 3, 8)/' /tmp/w8/src/transfuse/kernels/gemm_few_rows.py
grep -n '^_GATED' /tmp/w8/src/transfuse/kernels/gemm_few_rows.py
for v in w4 w8 w4 w8; do
  dir=.; [ $v = w8 ] && dir=/tmp/w8
  (cd $dir && PYTHONPATH=src timeout 70 python3 bench/decode_step_time.py --batch 8 --label "b8-$v" 2>&1 | grep -v Warn | tail -1) >> $OUT/decode-step-ab.log
done
cat $OUT/decode-step-ab.log
