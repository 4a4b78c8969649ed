"""runtime/decode_loop.py's first length at which a row can stop: the loop skips its looks at "all
rows finished" before it, so it must never be later than the first EOS Hugging Face could choose."""

from types import SimpleNamespace

from transfuse.runtime.decode_loop import _first_stop_length


def _processor(name: str, **fields):
    return type(name, (), {})() if not fields else type(name, (SimpleNamespace,), {})(**fields)


def test_min_new_tokens_blocks_eos_until_its_length():
    p = _processor("MinNewTokensLengthLogitsProcessor", prompt_length_to_skip=6, min_new_tokens=10, eos_token_id=[2])
    assert _first_stop_length([2], [p], [[2]]) == 16


def test_every_eos_id_must_be_blocked():
    p = _processor("MinLengthLogitsProcessor", min_length=9, eos_token_id=[2])
    assert _first_stop_length([2, 3], [p], [[2]]) == 0       # 3 may end a row at any length
    q = _processor("MinLengthLogitsProcessor", min_length=12, eos_token_id=[3])
    assert _first_stop_length([2, 3], [p, q], [[2], [3]]) == 9   # the earlier of the two
    both = _processor("MinLengthLogitsProcessor", min_length=12, eos_token_id=[2, 3])
    assert _first_stop_length([2, 3], [p, both], [[2], [2, 3]]) == 12  # 2 blocked until the later one


def test_no_eos_or_a_forced_token_means_no_skipping():
    p = _processor("MinLengthLogitsProcessor", min_length=9, eos_token_id=[2])
    assert _first_stop_length([], [p], [[2]]) == 0
    forced = _processor("ForcedEOSTokenLogitsProcessor", eos_token_id=[2], max_length=20)
    assert _first_stop_length([2], [p, forced], [[2]]) == 0
    assert _first_stop_length([2], [], []) == 0
