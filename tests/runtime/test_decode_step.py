"""kernels/decode_step.py against the decode loop's bookkeeping written with torch ops (the loop ran
exactly this before the kernel): every buffer equal after a step, greedy (from argmax partials) and
sampled (from chosen tokens), with and without EOS, with and without the mask/position advance."""

import pytest
import torch

from transfuse.kernels.argmax import BLOCK_V, argmax_partials
from transfuse.kernels.decode_step import decode_step_fwd


def decode_step_ref(buffers: dict, token: torch.Tensor, eos: torch.Tensor | None, advance: bool) -> None:
    """Hugging Face's `_sample` bookkeeping on the loop's buffers, in torch ops."""
    b = buffers
    if eos is not None:
        token = torch.where(b["unfinished"], token, b["pad"])
        b["unfinished"].logical_and_(~torch.isin(token, eos))
    b["out"].index_copy_(1, b["step"], token[:, None])
    b["all_done"].copy_(~b["unfinished"].any())
    b["done"].index_copy_(0, b["step"], b["all_done"][None])
    b["tokens"].copy_(token[:, None])
    b["step"].add_(1)
    b["cur_len"].add_(1)
    if advance:
        b["mask"].index_fill_(1, b["column"], 1)
        b["column"].add_(1)
        b["positions"].add_(1)


def _buffers(batch: int, device, mask_dtype) -> dict:
    g = torch.Generator().manual_seed(batch)
    long = dict(dtype=torch.long)
    b = dict(
        tokens=torch.randint(0, 50, (batch, 1), generator=g),
        step=torch.tensor([3]),
        cur_len=torch.tensor(11),
        out=torch.randint(0, 50, (batch, 8), generator=g),
        done=torch.rand(8, generator=g) < 0.5,
        all_done=torch.tensor(False),
        unfinished=torch.rand(batch, generator=g) < 0.7,
        pad=torch.tensor(0),
        mask=(torch.rand(batch, 20, generator=g) < 0.5).to(mask_dtype),
        column=torch.tensor([12], **long),
        positions=torch.randint(5, 12, (batch, 1), generator=g),
    )
    return {k: v.to(device) for k, v in b.items()}


@pytest.mark.parametrize("batch", [1, 3, 37])
@pytest.mark.parametrize("source", ["partials", "chosen"])
@pytest.mark.parametrize("with_eos", [True, False])
@pytest.mark.parametrize("advance,mask_dtype", [(True, torch.long), (True, torch.bool), (False, torch.long)])
def test_decode_step_matches_torch_bookkeeping(batch, source, with_eos, advance, mask_dtype, device):
    logits = torch.randn(batch, BLOCK_V + 77, device=device, dtype=torch.float16)
    logits[:, 4] = 10.0  # token 4 for every row: with EOS = 4, every unfinished row finishes
    if batch > 1:
        logits[0, 4] = -10.0
    token = torch.argmax(logits, dim=-1)
    eos = torch.tensor([9, 4], device=device) if with_eos else None
    ours, ref = _buffers(batch, device, mask_dtype), _buffers(batch, device, mask_dtype)
    decode_step_ref(ref, token, eos, advance)
    kwargs = dict(partials=argmax_partials(logits)) if source == "partials" else dict(chosen=token)
    if with_eos:
        kwargs.update(pad=ours["pad"], eos=eos)
    if advance:
        kwargs.update(mask=ours["mask"], column=ours["column"], positions=ours["positions"])
    decode_step_fwd(tokens=ours["tokens"], step=ours["step"], cur_len=ours["cur_len"], out=ours["out"],
                    done=ours["done"], all_done=ours["all_done"], unfinished=ours["unfinished"], **kwargs)
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name


def test_decode_step_all_rows_finished_sets_done(device):
    """Every row past EOS: all_done and done[step] become True (the host stops on them)."""
    b = _buffers(4, device, torch.long)
    b["unfinished"].fill_(True)
    token = torch.full((4,), 9, device=device)
    decode_step_fwd(tokens=b["tokens"], step=b["step"], cur_len=b["cur_len"], out=b["out"], done=b["done"],
                    all_done=b["all_done"], unfinished=b["unfinished"], chosen=token, pad=b["pad"],
                    eos=torch.tensor([9], device=device))
    assert bool(b["all_done"]) and bool(b["done"][3]) and not b["unfinished"].any()
    assert int(b["step"]) == 4 and int(b["cur_len"]) == 12


def test_decode_step_walks_the_rows_in_blocks(device, monkeypatch):
    """More rows than one block holds: "all rows finished" still sees every row."""
    import transfuse.kernels.decode_step as decode_step

    monkeypatch.setattr(decode_step, "ELEMENTS_PER_BLOCK", 16)  # 8 rows x 2 chunk results a block
    for last_unfinished in (False, True):
        b, ref = _buffers(37, device, torch.bool), _buffers(37, device, torch.bool)
        for buffers in (b, ref):
            buffers["unfinished"].fill_(False)
            buffers["unfinished"][-1] = last_unfinished
        logits = torch.randn(37, BLOCK_V + 1, device=device)
        eos = torch.tensor([7], device=device)
        decode_step_ref(ref, torch.argmax(logits, dim=-1), eos, True)
        decode_step_fwd(tokens=b["tokens"], step=b["step"], cur_len=b["cur_len"], out=b["out"], done=b["done"],
                        all_done=b["all_done"], unfinished=b["unfinished"], partials=argmax_partials(logits),
                        pad=b["pad"], eos=eos, mask=b["mask"], column=b["column"], positions=b["positions"])
        for name in ref:
            assert torch.equal(b[name], ref[name]), name
        assert bool(b["all_done"]) is not last_unfinished
