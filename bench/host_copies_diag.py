"""Which host-to-device copies each family's graphs keep after transfuse's passes (the graphs that then run
without CUDA graphs), with the host chain each copies and the source line that wrote it.

    PYTHONPATH=src python3 bench/host_copies_diag.py gemma2,phimoe,mpnet
"""
import sys
from pathlib import Path

import torch
sys.path.insert(0, str(Path(__file__).parent))
import family_sweep as fs
import transfuse, transfuse.backend as be
from transfuse.passes import host_tensors as ht

orig = be.host_copies
def spy(gm):
    copies = orig(gm)
    for c in copies:
        found = ht._chain(c.args[0])
        print("  LEFT COPY:", c.format_node()[:180], flush=True)
        if found:
            chain, sym = found
            print("    chain symbolic=%s:" % sym, [n.format_node()[:120] for n in chain])
            outside = [(n.name, u.format_node()[:100]) for n in chain for u in n.users if u not in set(chain) and u is not c]
            print("    other readers:", outside[:5])
        else:
            print("    chain: None")
        print("    stack:", (c.meta.get("stack_trace") or "")[-700:])
    return copies
be.host_copies = spy
for fam in sys.argv[1].split(","):
    print("=====", fam, flush=True)
    u = fs.Unit(fam, "fp16", "cuda", lambda r: None)
    ref, eager, ours, saved, attn = u.build()
    ours = transfuse.optimize(ours)
    with torch.no_grad():
        for seq in (13, 37):
            try:
                ours(**u.inputs(seq))
            except Exception as e:
                print("  fwd raised", type(e).__name__, str(e)[:200])
        try:
            kw = u.inputs(13); kw.pop("decoder_input_ids", None)
            ours.generate(**kw, max_new_tokens=6, do_sample=False)
        except Exception as e:
            print("  gen raised", type(e).__name__, str(e)[:200])
