"""Every family of bench/family_sweep.py in eval under CPU bf16 autocast (the family sweep casts models
with .to(dtype) instead): transfuse's logits on the unpadded positions against fp32 eager's, within
2x the error of eager under the same autocast + 1e-3.

    TRITON_INTERPRET=1 PYTHONPATH=src:. python3 bench/infer_autocast_sweep.py families,comma,separated
"""
import copy
import sys
import time

import torch
import transformers

import transfuse
from family_sweep import FAMILIES, _spread_weights  # this script's folder is on sys.path
names = sys.argv[1].split(",")
for spec in FAMILIES:
    name, kind, config_cls, model_cls, config, attn = spec
    if name not in names: continue
    t0 = time.time()
    try:
        cfg = getattr(transformers, config_cls)(**config)
        if attn is not None: cfg._attn_implementation = attn
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(cfg).eval(); _spread_weights(model)
        ref, eager = copy.deepcopy(model), copy.deepcopy(model)
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(3, 90, (2, 11), generator=g); mask = torch.ones_like(ids)
        if kind == "dec": mask[1, :3] = 0
        else: mask[1, 8:] = 0
        kw = dict(input_ids=ids, attention_mask=mask)
        if kind == "s2s": kw["decoder_input_ids"] = torch.randint(3, 90, (2, 5), generator=g)
        transfuse.optimize(model)
        outs = []
        for m, ac in ((model, True), (ref, False), (eager, True)):
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=ac):
                out = m(**kw)
            t = out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state
            keep = mask.bool() if t.shape[1] == mask.shape[1] else torch.ones(t.shape[:2], dtype=torch.bool)
            outs.append(t.float()[keep])
        e_ours = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
        e_eager = ((outs[2] - outs[1]).norm() / outs[1].norm()).item()
        ok = e_ours <= 2 * e_eager + 1e-3
        print(f"{'PASS' if ok else 'FAIL'} {name:14s} ours {e_ours:.2e} eager {e_eager:.2e} eager_reason={model._transfuse_state.eager_reason} {time.time()-t0:.0f}s", flush=True)
    except Exception as e:
        print(f"ERROR {name:14s} {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
