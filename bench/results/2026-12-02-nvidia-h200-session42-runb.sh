#!/usr/bin/env bash
# Session 42, device call b: the fp16 family sweep over every family on session 41's final source,
# then issue 4's benchmark a second time (session 41's command: HF's static cache with its own
# torch.compile and transfuse in one process, llama-1.1b, batch 1 and 8).
export PYTHONPATH=src PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
F=gpt2,gpt_neo,opt,bloom,falcon,falcon:mq,llama,llama:hd80,mistral,mixtral,qwen2,qwen3,gemma,gemma2,phi,phi3,starcoder2,gpt_bigcode,cohere,olmo2,bert,roberta,distilbert,albert,deberta-v2,modernbert,t5,t5-v1.1,bart,mbart,marian,pegasus,whisper,vit,clip
timeout 190 python3 bench/family_sweep.py --device cuda --dtypes fp16 --only $F --jobs 12 --time-limit 170 --unit-timeout 120 --out $OUT/sweep > $OUT/sweep.log 2>&1
grep -E "PASS|FAIL|ERROR" $OUT/sweep.log | grep -v "PASS$" | head -20
echo "PASS units: $(grep -cE "PASS$" $OUT/sweep.log)"
tail -2 $OUT/sweep.log
timeout 390 python3 -m transfuse.bench --model llama-1.1b --batches 1,8 --providers static,transfuse --out $OUT > $OUT/bench.log 2>&1
grep -v Warn $OUT/bench.log | tail -22
