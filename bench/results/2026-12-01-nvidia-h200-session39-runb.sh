#!/usr/bin/env bash
# Session 39, device call 2: GPU suite on the final tree, then the 500-request stream (issue 3).
export PYTHONPATH=src PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee $OUT/env.txt
timeout 300 python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider tests 2>&1 | tail -12 | tee $OUT/gpu-tests.log
C=$(mktemp -d); export TRITON_CACHE_DIR=$C/triton TRANSFUSE_CACHE_DIR=$C/transfuse
timeout 280 python3 -m transfuse.bench --dynamic --providers transfuse,compile-ro,eager --out $OUT/dyn --no-progress 2>&1 | tail -30 | tee $OUT/dynamic.log
ls $OUT/dyn
