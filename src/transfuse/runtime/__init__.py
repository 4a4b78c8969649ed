"""What runs the rewritten graph: merged-weight guards, CUDA-graph capture and replay."""
