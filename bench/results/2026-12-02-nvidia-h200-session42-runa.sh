#!/usr/bin/env bash
# Session 42, device call a: the GPU test suite on session 41's final source (the BART size-query fix
# 6d1bc14 and the review cleanup 7db7df8 were CPU-tested only), then the decode step of bart-base and
# t5-base with KVCacheAttention and with `--disable cache_write_attention` (bench/profile_step_replay.py:
# ms per step of generate(), GPU time of one step's CUDA-graph replay), alternating processes.
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee $OUT/env.txt
PYTHONPATH=src timeout 345 python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider tests > $OUT/gpu-tests.log 2>&1
tail -3 $OUT/gpu-tests.log
for v in new old new old; do
  d=""; [ $v = old ] && d="--disable cache_write_attention"
  echo "== $v $d" >> $OUT/step-replay-ab.log
  PYTHONPATH=src timeout 60 python3 bench/profile_step_replay.py --models bart-base,t5-base $d 2>&1 | grep -v Warn | tail -3 >> $OUT/step-replay-ab.log
done
cat $OUT/step-replay-ab.log
