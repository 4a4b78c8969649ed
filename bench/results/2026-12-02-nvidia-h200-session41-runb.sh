#!/usr/bin/env bash
# Session 41, device call b: RotaryCacheAttention (the rotary + cache write inside the decode
# attention) on the GPU: its kernel, pass and model tests, then Llama-1.1B decode steps with it and
# with `--disable rotary_cache_attention` in alternating processes (batch 8: A B A B; batch 32: A B).
export PYTHONPATH=src PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
timeout 200 python3 -m pytest -q -n 12 -p no:cacheprovider tests/kernels/test_attention_rotary_cache.py \
  tests/kernels/test_attention_decode.py tests/kernels/test_attention_decode_gpu.py tests/kernels/test_kv_cache.py \
  tests/kernels/test_qkv_rotary_cache.py tests/passes/test_rotary_cache_attention_pass.py \
  tests/models/test_decoders_gpu.py tests/models/test_golden_counts_gpu.py > $OUT/gpu-tests.log 2>&1
tail -3 $OUT/gpu-tests.log
for b in 8 32; do
  for v in new old new old; do
    [ $b = 32 ] && [ -s $OUT/b32.done ] && break
    d=""; [ $v = old ] && d="--disable rotary_cache_attention"
    timeout 75 python3 bench/decode_step_time.py --batch $b $d --label "b$b-$v" 2>&1 | grep -v Warn | tail -1 >> $OUT/decode-step-ab.log
    [ $b = 32 ] && [ $v = old ] && echo 1 > $OUT/b32.done
  done
done
cat $OUT/decode-step-ab.log
