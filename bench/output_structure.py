"""Which outputs a model returns when output_attentions / output_hidden_states is asked for only after
plain calls: eager, Dynamo alone (torch.compile(backend="eager")), transfuse without and with CUDA graphs.
Found by family_sweep --extra: MBart's decoder_hidden_states vanish under Dynamo alone as under transfuse.

    PYTHONPATH=src python3 bench/output_structure.py
"""
import copy, sys, torch, transformers
sys.path.insert(0, "bench")
import family_sweep as fs
import transfuse
transformers.logging.set_verbosity_error()

def shape(o):
    out = {}
    for k, v in o.items():
        if isinstance(v, tuple):
            out[k] = f"tuple{len(v)}:" + ",".join("N" if t is None else "T" for t in v)
        elif v is None:
            out[k] = "None"
        elif isinstance(v, torch.Tensor):
            out[k] = "T"
        else:
            out[k] = type(v).__name__
    return out

for family, extra in (("t5", "output_attentions"), ("mbart", "output_hidden_states")):
    u = fs.Unit(family, "fp16", "cuda", lambda r: None)
    ref, eager, ours, saved, attn = u.build()
    kw = u.inputs(13)
    variants = {"eager": eager, "dynamo": torch.compile(copy.deepcopy(eager), backend="eager", dynamic=True),
                "nographs": transfuse.optimize(copy.deepcopy(eager), cuda_graphs=False), "ours": transfuse.optimize(ours)}
    for name, m in variants.items():
        with torch.no_grad():
            for i in range(3):
                a = m(**kw)
            b = m(**kw, **{extra: True})
            c = m(**kw, **{extra: True})
        print(family, name, "plain:", shape(a)); print(family, name, "extra1:", shape(b)); print(family, name, "extra2:", shape(c), flush=True)
