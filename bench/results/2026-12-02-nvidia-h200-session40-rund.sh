#!/usr/bin/env bash
# Session 40, device call d (the last ~300 s of device time): KeyPadding on the GPU. The golden
# match counts on the GPU image's torch, then bench/profile_compare.py with transfuse alone at three
# small shapes on this tree and on 30e4e21 (.ab/head, before KeyPadding): kernels per call, GPU time.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
PYTHONPATH=src timeout 70 python3 -m pytest -q -n 8 -p no:cacheprovider tests/models/test_golden_counts_gpu.py > $OUT/golden-gpu.log 2>&1
tail -2 $OUT/golden-gpu.log
for tree in new old; do
  dir=.; [ $tree = old ] && dir=.ab/head
  echo "== $tree" >> $OUT/profile-compare-ab.log
  (cd $dir && PYTHONPATH=src timeout 70 python3 bench/profile_compare.py --providers transfuse --shapes 1x16,1x128,8x128 --out $OUT/$tree 2>&1 | grep -v Warn | tail -5) >> $OUT/profile-compare-ab.log
done
cat $OUT/profile-compare-ab.log
