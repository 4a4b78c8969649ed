#!/usr/bin/env bash
# Session 43, device call d: the GPU test suite on this session's final source (the few-rows GEMM
# back to 5d88b2e's code; session 42's norm_prologue.py, shared by the GEMV and the fused QKV +
# rotary + cache write, never GPU-tested before).
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")/../.."
PYTHONPATH=src timeout 330 python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider tests > $OUT/gpu-tests.log 2>&1
grep -E "passed|failed|error" $OUT/gpu-tests.log | tail -5
