#!/usr/bin/env bash
# Session 41, device call c: issue 4's benchmark on the tree with RotaryCacheAttention, HF's static
# cache (its own torch.compile) and transfuse in one process, batch 1 and 8 (session 28's command).
export PYTHONPATH=src PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
timeout 480 python3 -m transfuse.bench --model llama-1.1b --batches 1,8 --providers static,transfuse --out $OUT > $OUT/bench.log 2>&1
grep -v Warn $OUT/bench.log | tail -22
