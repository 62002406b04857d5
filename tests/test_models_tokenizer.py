"""varbench.models.tokenizer: the char-level tokenizer (fixed ids, markup tags, coverage)."""

from __future__ import annotations

import pytest

from varbench.models import MARKUP, build_tokenizer, check_tokenizer_covers
from varbench.tasks import get_task, task_names


def test_tokenizer_round_trip_and_fixed_ids():
    tok = build_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "<sum>3+5=<call>3+5</call><out>8</out><ans>8"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    for m in MARKUP:  # markup tags are single tokens
        assert len(tok(m, add_special_tokens=False)["input_ids"]) == 1
    assert len(tok("12 3", add_special_tokens=False)["input_ids"]) == 4
    for name in task_names():  # one vocabulary serves every task
        check_tokenizer_covers(tok, get_task(name).alphabet, what=name)
    with pytest.raises(ValueError, match=r"cannot represent \['x', 'Y'\]"):
        check_tokenizer_covers(tok, "1xY", what="test")
