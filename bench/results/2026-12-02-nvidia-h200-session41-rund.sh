#!/usr/bin/env bash
# Session 41, device call d: the fp16 family sweep over the decoder families on the final source
# (RotaryCacheAttention; qkv_rotary_cache's op split into qkv_heads).
export PYTHONPATH=src PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
F=gpt2,gpt_neo,opt,bloom,falcon,falcon:mq,llama,llama:hd80,mistral,mixtral,qwen2,qwen3,gemma,gemma2,phi,phi3,starcoder2,gpt_bigcode,cohere,olmo2
timeout 200 python3 bench/family_sweep.py --device cuda --dtypes fp16 --only $F --jobs 12 --time-limit 170 --unit-timeout 120 --out $OUT/sweep > $OUT/sweep.log 2>&1
grep -E "PASS|FAIL|ERROR" $OUT/sweep.log | grep -v "PASS$" | head -20
echo "PASS units: $(grep -cE "PASS$" $OUT/sweep.log)"
tail -2 $OUT/sweep.log
