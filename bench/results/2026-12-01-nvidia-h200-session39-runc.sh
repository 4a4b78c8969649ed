#!/usr/bin/env bash
# Session 39, device call 3: the family sweep on the GPU over families of every attention kind (the stand-in SDPA, one-KV-head MQA).
export PYTHONPATH=src PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee $OUT/env.txt
F=gpt2,gpt_neo,gptj,gpt_neox,opt,bloom,falcon,falcon:mq,llama,llama:hd80,llama:hd256,mistral,mixtral,qwen2,qwen3,gemma,gemma2,gemma3_text,phi,phi3,starcoder2,gpt_bigcode,codegen,cohere,olmo2,mpt,bert,roberta,distilbert,albert,deberta-v2,modernbert,t5,t5-v1.1,bart,mbart,marian,pegasus,led,longt5,prophetnet,gpt_oss,deepseek_v3,llama4_text,whisper,xglm,qwen3_moe,esm,vit,clip
timeout 330 python3 bench/family_sweep.py --device cuda --dtypes fp16 --only $F --jobs 12 --time-limit 240 --unit-timeout 150 --out $OUT/sweep > $OUT/sweep.log 2>&1
grep -E "PASS|FAIL|ERROR" $OUT/sweep.log | grep -v "PASS$" | head -20
echo "PASS units: $(grep -cE "PASS$" $OUT/sweep.log)"
tail -5 $OUT/sweep.log
