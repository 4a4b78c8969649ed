#!/usr/bin/env bash
# Session 40, device call a: host time per bert-base call, this tree against ba28b00 (.ab/head) in
# alternating processes (the address check once per call); Llama-1.1B prefill forward at 2,048
# tokens on both (gate_up timed against Triton above 64 rows).
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee $OUT/env.txt
for round in 1 2; do
  for tree in new old; do
    dir=.; [ $tree = old ] && dir=.ab/head
    echo "== $tree (round $round)" >> $OUT/host-layers-ab.log
    (cd $dir && PYTHONPATH=src timeout 150 python3 bench/host_layers.py --shapes 1x16,1x128,8x128 --iters 300 2>&1 | tail -4) >> $OUT/host-layers-ab.log
  done
done
for tree in new old; do
  dir=.; [ $tree = old ] && dir=.ab/head
  echo "== $tree" >> $OUT/prefill-ab.log
  (cd $dir && PYTHONPATH=src timeout 150 python3 bench/profile_prefill.py --prompt 2048 2>&1 | grep -v Warning | head -8) >> $OUT/prefill-ab.log
done
cat $OUT/host-layers-ab.log $OUT/prefill-ab.log
