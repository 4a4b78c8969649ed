"""bench/profile_train.py (nanoGPT, transfuse) with the norm backward's launch shape patched, to time its
candidates inside a real training step, where the kernel runs between the step's GEMMs:

    PYTHONPATH=src python3 bench/profile_train_norm_programs.py PROGRAMS_PER_SM ELEMS

PROGRAMS_PER_SM replaces kernels.norm_backward._PROGRAMS_PER_SM; each program's row tile holds ELEMS
elements (BLOCK_M = max(1, min(ELEMS // BLOCK_N, 16)); norm_bwd_config's own rule is 2048)."""
import runpy
import sys

import triton

from transfuse.kernels import norm_backward as nb
pps, elems = int(sys.argv[1]), int(sys.argv[2])
nb._PROGRAMS_PER_SM = pps
orig = nb.norm_bwd_config
def cfg(n_rows, n_cols, max_programs):
    c = orig(n_rows, n_cols, max_programs)
    bm = max(1, min(elems // c.BLOCK_N, 16, triton.next_power_of_2(max(n_rows, 1))))
    return nb.NormBwdConfig(BLOCK_N=c.BLOCK_N, BLOCK_M=bm, num_warps=c.num_warps,
                            n_programs=max(1, min(triton.cdiv(max(n_rows, 1), bm), max_programs)))
nb.norm_bwd_config = cfg
sys.argv = ["profile_train.py", "--arch", "nanogpt", "--provider", "transfuse", "--rows", "40"]
runpy.run_path("bench/profile_train.py", run_name="__main__")
