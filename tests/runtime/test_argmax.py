"""kernels/argmax.py: exactly torch.argmax's index (first maximum, NaN the largest) for the decode
loop's logits, under the interpreter on CPU and on a GPU alike. (A kernel test: it lives here
because kernels/ tests belong to another owner at the time of writing.)"""

import pytest
import torch

from transfuse.kernels.argmax import BLOCK_V, argmax_fwd, argmax_partials


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    """The oracle: torch's own argmax, in fp32 on the CPU (fp16/bf16 values widen exactly)."""
    return torch.argmax(x.float().cpu(), dim=-1)


# (rows, vocab): one chunk, one chunk exactly, several chunks with a ragged last one, a real vocabulary
SHAPES = [(1, 97), (3, BLOCK_V), (5, 3 * BLOCK_V + 123), (2, 32000)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,vocab", SHAPES)
def test_argmax_matches_torch(rows, vocab, dtype, device):
    x = torch.randn(rows, vocab, device=device).to(dtype)
    assert torch.equal(argmax_fwd(x).cpu(), argmax_ref(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_argmax_ties_nan_inf_and_signed_zero(dtype, device):
    vocab = 2 * BLOCK_V + 7
    x = torch.full((8, vocab), -5.0, device=device, dtype=dtype)
    x[0, [5, BLOCK_V + 3, 2 * BLOCK_V + 1]] = 3.0          # ties across chunks: the first
    x[1, [BLOCK_V + 9, 2 * BLOCK_V + 2]] = float("nan")    # NaN wins, the first NaN
    x[1, 0] = float("inf")
    x[2, :] = float("-inf")                                # all -inf: index 0
    x[3, [7, 1]] = torch.tensor([0.0, -0.0], dtype=dtype, device=device)  # -0.0 == 0.0: the first of them
    x[3, 2:] = -1.0
    x[4, [11, BLOCK_V + 1]] = float("inf")                 # +inf ties
    x[5, :] = float("nan")                                 # all NaN: index 0
    x[6, -1] = 1.0                                         # the very last element
    x[7, [3, BLOCK_V]] = torch.tensor([2.0, float("nan")], dtype=dtype, device=device)
    assert torch.equal(argmax_fwd(x).cpu(), argmax_ref(x))
    assert argmax_fwd(x).tolist()[:4] == [5, BLOCK_V + 9, 0, 1]


def test_argmax_of_a_strided_view(device):
    """The decode loop passes logits[:, -1] of (batch, seq, vocab): rows a seq * vocab stride apart."""
    logits = torch.randn(3, 4, BLOCK_V + 50, device=device, dtype=torch.float16)
    view = logits[:, -1]
    assert torch.equal(argmax_fwd(view).cpu(), argmax_ref(view))
    columns = torch.randn(BLOCK_V + 50, 3, device=device).t()  # a column stride too
    assert torch.equal(argmax_fwd(columns).cpu(), argmax_ref(columns))


def test_argmax_partials_are_each_chunks_first_maximum(device):
    x = torch.randn(2, 2 * BLOCK_V + 5, device=device)
    values, indices = argmax_partials(x)
    assert values.shape == indices.shape == (2, 3)
    for c in range(3):
        chunk = x[:, c * BLOCK_V:(c + 1) * BLOCK_V].cpu()
        assert torch.equal(values[:, c].cpu(), chunk.max(dim=-1).values)
        assert torch.equal(indices[:, c].long().cpu(), chunk.argmax(dim=-1) + c * BLOCK_V)


def test_argmax_rejects_what_it_does_not_handle(device):
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        argmax_fwd(torch.zeros(2, 5, dtype=torch.float64, device=device))
    with pytest.raises(ValueError, match="rows, vocab"):
        argmax_fwd(torch.zeros(5, device=device))


@pytest.mark.parametrize("length", [3, 5, 9])
def test_argmax_partials_with_min_length_blocking(length, device):
    """Hugging Face's min-length processors folded in: ids of blocked[p] score -inf while
    length < thresholds[p]. Each processor's ids sit on its row's maximum, so a block that is ignored
    (or applied when it should not be) changes the answer."""
    vocab = 2 * BLOCK_V + 9
    x = torch.randn(3, vocab, device=device, dtype=torch.float16)
    blocked = torch.zeros(2, vocab, dtype=torch.bool, device=device)
    blocked[0, [7, BLOCK_V + 1]] = True     # threshold 4: blocked while length < 4
    blocked[1, [2 * BLOCK_V + 3]] = True    # threshold 8
    x[:, 7] = 9.0
    x[:, 2 * BLOCK_V + 3] = 8.0
    x[1, BLOCK_V + 1] = 10.0
    x[2, 2 * BLOCK_V + 3] = 11.0
    thresholds = torch.tensor([4, 8], device=device)
    cur_len = torch.tensor(length, device=device)
    values, indices = argmax_partials(x, blocked, thresholds, cur_len)
    active = (cur_len < thresholds).cpu()
    ref_scores = x.float().cpu()
    for p in range(2):
        if active[p]:
            ref_scores = ref_scores.masked_fill(blocked[p].cpu(), float("-inf"))
    chunk_best = values.cpu().argmax(dim=-1)  # the first chunk holding the maximum
    chosen = indices.cpu().gather(1, chunk_best[:, None]).squeeze(1).long()
    assert torch.equal(chosen, ref_scores.argmax(dim=-1))
    if length > 3:  # the second block alone (5), or none (9)
        assert chosen.tolist() == [7, BLOCK_V + 1, 7 if length == 5 else 2 * BLOCK_V + 3]


def test_argmax_partials_rejects_a_malformed_block(device):
    x = torch.randn(1, 50, device=device)
    with pytest.raises(ValueError, match="blocked"):
        argmax_partials(x, torch.zeros(1, 49, dtype=torch.bool, device=device), torch.zeros(1, dtype=torch.long,
                        device=device), torch.tensor(0, device=device))
