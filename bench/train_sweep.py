"""Training sweep: every family of bench/family_sweep.py in train mode (dropouts, drop paths,
LayerDrop and router jitter 0), left padding for decoders and right padding for encoder inputs,
through transfuse.optimize(training_graphs=...): the loss of a weighted square of the logits (or
hidden states) on the unpadded positions and every parameter's gradient against eager fp32
(relative norm < 1e-4, key biases' exact-zero gradients skipped); with bf16, under CPU autocast,
within 2x eager-bf16's error plus 1e-2.

    TRITON_INTERPRET=1 PYTHONPATH=src:. python3 bench/train_sweep.py [families,comma,separated] [1|0] [fp32|bf16] \
        [cpu|cuda] [labels]

On a GPU (`cuda`, no TRITON_INTERPRET) the same comparison runs on the GPU's kernels and CUDA graphs,
autocast on CUDA. `labels`: decoders also get labels=input_ids, and the loss backpropagated is the
model's own loss plus the weighted square of its returned logits (the LM head's fused loss, and the
gradient of logits returned next to it).

Vision and audio families (kinds img, vl, asr, wav) take family_sweep's own inputs at batch 2 (pixel
values, CLIP's text with right padding, Whisper's features, wav2vec2's masked waveforms); their loss
is over every position of the main output (logits, last hidden state, or CLIP's image-text logits).
They run only when named: `bench/train_sweep.py vit,clip,whisper,wav2vec2`.

An exception in the comparison is an ERROR, unless eager alone (a fresh model, the same inputs and
autocast) raises too: a SKIP (Flaubert's pre-norm layers index their cache in train mode; YOSO's
kernels take no bf16).
"""
import copy
import os
import sys
import time
import traceback

import torch
import transformers

import transfuse
from family_sweep import FAMILIES, MEDIA, SEQS, Unit, _logits, _spread_weights  # this script's folder is on sys.path

# text families only: the vision and audio kinds take pixels, features or waveforms, not input_ids
names = (sys.argv[1].split(",") if len(sys.argv) > 1 and sys.argv[1]
         else [f[0] for f in FAMILIES if f[1] in ("dec", "enc", "s2s")])
graphs = (sys.argv[2] if len(sys.argv) > 2 else "1") == "1"
autocast = len(sys.argv) > 3 and sys.argv[3] == "bf16"
device = torch.device(sys.argv[4] if len(sys.argv) > 4 else "cpu")
with_labels = len(sys.argv) > 5 and sys.argv[5] == "labels"
# TRAIN_SWEEP_DISABLE=attention,rms_norm: passes left out (names as in passes/manager.py), to bisect a FAIL
DISABLED = tuple(n for n in os.environ.get("TRAIN_SWEEP_DISABLE", "").split(",") if n)


def _no_random_draws(cfg) -> None:
    """Dropouts, stochastic depth (Swin's drop_path_rate), LayerDrop (wav2vec2's layerdrop) and
    routers' jitter noise (Switch Transformers multiplies the router input by uniform noise in
    training) set to 0: random draws that differ between the models compared. Sub-configs too (an
    EncoderDecoderModel's encoder and decoder, a vision tower)."""
    for k, v in list(vars(cfg).items()):
        if isinstance(v, transformers.PretrainedConfig):
            _no_random_draws(v)
            continue
        drawn = any(word in k for word in ("dropout", "pdrop", "drop_path", "layerdrop", "jitter"))
        if isinstance(v, float) and (drawn or k.endswith("_drop")):
            setattr(cfg, k, 0.0)


for spec in FAMILIES:
    name, kind, config_cls, model_cls, config, attn = spec
    if name not in names:
        continue
    t0 = time.time()
    try:
        cfg = getattr(transformers, config_cls)(**copy.deepcopy(config))
        _no_random_draws(cfg)
        if attn is not None:
            cfg._attn_implementation = attn
        torch.manual_seed(0)
        model = getattr(transformers, model_cls)(cfg).train()
        _spread_weights(model)
        model.to(device)
        ref = copy.deepcopy(model)
        eager = copy.deepcopy(model)
        if kind in MEDIA:
            kw = Unit(name, "fp32", device.type, lambda record: None).inputs(SEQS[0], batch=2)
            mask = None  # every position of the output
        else:
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(3, 90, (2, 11), generator=g)
            mask = torch.ones_like(ids)
            if kind == "dec":
                mask[1, :3] = 0
            else:
                mask[1, 8:] = 0
            kw = dict(input_ids=ids, attention_mask=mask)
            if kind == "s2s":
                kw["decoder_input_ids"] = torch.randint(3, 90, (2, 5), generator=g)
            if with_labels and kind == "dec":
                kw["labels"] = ids.masked_fill(mask == 0, -100)
            kw = {k: v.to(device) for k, v in kw.items()}
            mask = mask.to(device)
        transfuse.optimize(model, training_graphs=graphs, disable=DISABLED)
        losses, outs = [], []
        for m, ac in ((model, autocast), (ref, False), (eager, autocast)):
            if m is eager and not autocast:
                continue
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=ac):
                out = m(**kw)
            t = _logits(out)  # logits, else the first field (last_hidden_state, CLIP's logits_per_image)
            keep = (mask.bool() if mask is not None and t.shape[1] == mask.shape[1]
                    else torch.ones(t.shape[:-1], dtype=torch.bool, device=device))
            w = torch.linspace(-1, 1, t.shape[-1], device=device)
            loss = (t.float()[keep] * w).square().mean()
            if getattr(out, "loss", None) is not None:
                loss = loss + out.loss
            loss.backward()
            losses.append(loss.item())
        errs, eager_errs, zero_not_none = {}, {}, []
        for (n, p), (_, r), (_, e) in zip(model.named_parameters(), ref.named_parameters(), eager.named_parameters()):
            if r.grad is None and p.grad is None:
                continue
            if r.grad is None and not p.grad.any():
                # a parameter that reaches no output the loss reads (an unused pooler): AOTAutograd
                # gives it a zero gradient where eager leaves None, as torch.compile does. Named apart:
                # an optimizer still decays and steps it (AdamW skips a None gradient).
                zero_not_none.append(n)
                continue
            if (r.grad is None) != (p.grad is None):
                errs[n] = float("inf"); continue
            den = r.grad.norm().item()
            if den < 1e-6:  # exact zero gradients (key biases): noise on both sides
                continue
            errs[n] = ((p.grad - r.grad).norm() / den).item()
            if autocast:
                eager_errs[n] = ((e.grad - r.grad).norm() / den).item()
        if autocast:
            worst = max(errs, key=lambda n: errs[n] - 2 * eager_errs[n]) if errs else "-"
            ok = not errs or errs[worst] <= 2 * eager_errs[worst] + 1e-2
            loss_ok = abs(losses[0] - losses[2]) <= 2 * abs(losses[2] - losses[1]) + 1e-3 * abs(losses[1])
            ok = ok and loss_ok
        else:
            worst = max(errs, key=errs.get) if errs else "-"
            ok = abs(losses[0] - losses[1]) <= 1e-5 * max(1, abs(losses[1])) and (not errs or errs[worst] < 1e-4)
        rw = model._transfuse_state.backend.records
        print(f"{'PASS' if ok else 'FAIL'} {name:14s} loss {losses[0]:.6g}/{losses[1]:.6g}{'/%.6g' % losses[2] if autocast else ''} worst {errs.get(worst, 0):.1e} (eager {eager_errs.get(worst, 0):.1e}) {worst} "
              f"eager_reason={model._transfuse_state.eager_reason} graphs={len(rw)} {time.time()-t0:.0f}s"
              + (f" zero-not-None gradients (AOTAutograd's, as torch.compile): {','.join(zero_not_none[:4])}"
                 if zero_not_none else ""), flush=True)
    except Exception as e:
        # eager alone, on a fresh model and the same inputs: an error of its own is the family's, not ours
        status = "ERROR"
        try:
            fresh = getattr(transformers, model_cls)(cfg).train().to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                _logits(fresh(**kw)).float().square().mean().backward()
        except Exception as eager_error:  # noqa: BLE001
            status = f"SKIP (eager raises too: {type(eager_error).__name__})"
        print(f"{status} {name:14s} {type(e).__name__}: {str(e).splitlines()[0][:200]}", flush=True)
        if status == "ERROR":
            print(traceback.format_exc(), file=sys.stderr, flush=True)
