"""Triton kernels and their launchers, one file per op family. Launchers check, allocate, pick the
grid and launch; they do no autograd and register no ops (that is ops/)."""
