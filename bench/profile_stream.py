"""Where a cold request stream's seconds go (transfuse only): cProfile around `transfuse bench --dynamic`.

    TRITON_CACHE_DIR=$(mktemp -d) TRANSFUSE_CACHE_DIR=$(mktemp -d) PYTHONPATH=src python3 bench/profile_stream.py
"""

import cProfile
import pstats
import sys

from transfuse.bench import main

profile = cProfile.Profile()
profile.runcall(main, ["--dynamic", "--providers", "transfuse", "--skip-cold-start", "--no-save"])
stats = pstats.Stats(profile, stream=sys.stdout).sort_stats("cumulative")
stats.print_stats(r"jit.py.*\((_do_compile|run)\)|compiler.py.*\(compile\)|ops/gemm.py.*(_measure|_gpu_times_ms|_choose)"
                  r"|cuda_graphs.py.*__init__|buckets.py.*(_capture|__call__)|symbolic_convert.py.*\(run\)"
                  r"|kernels/(attention|norm|gemm).py.*(_fwd|linear_fwd)|graphs.py.*(capture_end|__exit__|replay)", 30)
print("---- by own time")
stats.sort_stats("tottime").print_stats(25)
