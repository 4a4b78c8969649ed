#!/usr/bin/env bash
# Session 39, device call 1: first-call A/B (stand-in vs math), recompile probe, GPU suite.
export PYTHONPATH=src PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
python3 -c "import torch, triton, transformers; print(torch.cuda.get_device_name(), 'torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee $OUT/env.txt
C=$(mktemp -d); export TRITON_CACHE_DIR=$C/triton TRANSFUSE_CACHE_DIR=$C/transfuse
{
echo "empty(auto) $(python3 bench/first_call_phases.py 2>/dev/null | tail -1)"
for i in 1 2 3; do
  echo "warm math   $(TRANSFUSE_TRACE_SDPA=math python3 bench/first_call_phases.py 2>/dev/null | tail -1)"
  echo "warm auto   $(python3 bench/first_call_phases.py 2>/dev/null | tail -1)"
done
} 2>&1 | tee $OUT/first-call-ab.log
timeout 150 python3 bench/recompile_probe.py 2>&1 | tail -15 | tee $OUT/recompile-probe.log
timeout 330 python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider tests 2>&1 | tail -15 | tee $OUT/gpu-tests.log
