#!/usr/bin/env bash
# Session 41, device call a: the GPU test suite and the fp16 family sweep on KeyPadding's code
# (317a688, never GPU-tested), then bench/profile_compare.py with transfuse alone at batch 1 on this
# tree and on 30e4e21 (.ab/head, before KeyPadding): kernels per call, GPU time.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee $OUT/env.txt
PYTHONPATH=src timeout 270 python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider tests > $OUT/gpu-tests.log 2>&1
tail -3 $OUT/gpu-tests.log
F=gpt2,gpt_neo,opt,bloom,falcon,falcon:mq,llama,llama:hd80,mistral,mixtral,qwen2,qwen3,gemma,gemma2,phi,phi3,starcoder2,gpt_bigcode,cohere,olmo2,bert,roberta,distilbert,albert,deberta-v2,modernbert,t5,t5-v1.1,bart,mbart,marian,pegasus,whisper,vit,clip
PYTHONPATH=src timeout 190 python3 bench/family_sweep.py --device cuda --dtypes fp16 --only $F --jobs 12 --time-limit 170 --unit-timeout 120 --out $OUT/sweep > $OUT/sweep.log 2>&1
grep -E "PASS|FAIL|ERROR" $OUT/sweep.log | grep -v "PASS$" | head -20
echo "PASS units: $(grep -cE "PASS$" $OUT/sweep.log)"
tail -2 $OUT/sweep.log
for tree in new old; do
  dir=.; [ $tree = old ] && dir=.ab/head
  mkdir -p $OUT/$tree
  echo "== $tree" >> $OUT/profile-compare-ab.log
  (cd $dir && PYTHONPATH=src timeout 55 python3 bench/profile_compare.py --providers transfuse --shapes 1x16,1x128 --out $OUT/$tree 2>&1 | grep -v Warn | tail -4) >> $OUT/profile-compare-ab.log
done
cat $OUT/profile-compare-ab.log
