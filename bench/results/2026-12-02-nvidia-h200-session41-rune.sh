#!/usr/bin/env bash
# Session 41, device call e (the last ~300 s of device time): KVCacheAttention (a plain KV-cache
# write inside the decode attention: GPT-2, OPT, BART, ...) on the GPU: the kernel tests, then GPT-2
# decode steps at batch 1 and 8 with it and with `--disable cache_write_attention`, alternating.
export PYTHONPATH=src PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
timeout 80 python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_attention_cache_write.py > $OUT/gpu-tests.log 2>&1
tail -2 $OUT/gpu-tests.log
for b in 1 8; do
  for v in new old; do
    d=""; [ $v = old ] && d="--disable cache_write_attention"
    timeout 40 python3 bench/decode_step_time.py --model gpt2 --batch $b $d --label "gpt2-b$b-$v" 2>&1 | grep -v Warn | tail -1 >> $OUT/decode-step-ab.log
  done
done
cat $OUT/decode-step-ab.log
