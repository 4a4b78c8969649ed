#!/usr/bin/env bash
# Session 40, device call b: the GPU test suite and the fp16 family sweep on this tree.
export PYTHONPATH=src PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
timeout 300 python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider tests > $OUT/gpu-tests.log 2>&1
tail -3 $OUT/gpu-tests.log
F=gpt2,gpt_neo,opt,bloom,falcon,falcon:mq,llama,llama:hd80,mistral,mixtral,qwen2,qwen3,gemma,gemma2,phi,phi3,starcoder2,gpt_bigcode,cohere,olmo2,bert,roberta,distilbert,albert,deberta-v2,modernbert,t5,t5-v1.1,bart,mbart,marian,pegasus,whisper,vit,clip
timeout 200 python3 bench/family_sweep.py --device cuda --dtypes fp16 --only $F --jobs 12 --time-limit 170 --unit-timeout 120 --out $OUT/sweep > $OUT/sweep.log 2>&1
grep -E "PASS|FAIL|ERROR" $OUT/sweep.log | grep -v "PASS$" | head -20
echo "PASS units: $(grep -cE "PASS$" $OUT/sweep.log)"
tail -3 $OUT/sweep.log
