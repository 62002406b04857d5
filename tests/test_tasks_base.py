"""varbench.tasks.base: the registry, seeded disjoint splits, garbage-proof scoring and
enumeration, and the Task contract every registered task meets."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from varbench.models import build_tokenizer, check_tokenizer_covers
from varbench.tasks import Prompt, get_task, task_names
from varbench.tasks.base import _parse_int

pytestmark = pytest.mark.usefixtures("one_thread")


ALL = [(name, r) for name in ("sort", "arith", "toolsum") for r in get_task(name).rewards]


def _p(data, target=None):
    return Prompt(text="", answer=target or "".join(map(str, sorted(data))),
                  meta={"data": tuple(data)})


def test_registry_lists_the_three_kinds():
    assert set(task_names()) >= {"sort", "arith", "toolsum"}
    kinds = {n: (get_task(n).fixed_length, get_task(n).multi_turn) for n in task_names()}
    assert kinds["sort"] == (True, False)
    assert kinds["arith"] == (False, False)
    assert kinds["toolsum"] == (False, True)


@pytest.mark.parametrize("name", ["sort", "arith", "toolsum"])
def test_prompts_seeded_and_splits_disjoint(name):
    t = get_task(name)
    a = t.prompts(50, seed=3)
    assert a == t.prompts(50, seed=3)
    assert a != t.prompts(50, seed=4)
    train = {p.data for p in t.prompts(400, split="train", seed=0)}
    held = {p.data for p in t.prompts(200, split="heldout", seed=0)}
    assert train and held and not (train & held)


def test_splits_disjoint_when_space_is_too_large_to_list():
    t = get_task("arith", digits=4)  # 10**8 problems: split by hash, not by listing
    assert t.split_size("train") is None
    train = {p.data for p in t.prompts(300, split="train", seed=1)}
    held = {p.data for p in t.prompts(300, split="heldout", seed=1)}
    assert not (train & held)
    assert all(t._in_heldout(d) for d in held) and not any(t._in_heldout(d) for d in train)


def test_small_space_split_exactly():
    t = get_task("sort", n=2, max_value=3)  # 12 ordered pairs
    assert t.split_size("train") + t.split_size("heldout") == 12
    assert t.split_size("heldout") >= 1
    assert len({p.data for p in t.prompts(t.split_size("train"), seed=0)}) == t.split_size(
        "train")


@pytest.mark.parametrize("name", ["sort", "arith", "toolsum"])
def test_demonstration_is_correct_and_tokenizer_covers_alphabet(name):
    t = get_task(name)
    tok = build_tokenizer()
    check_tokenizer_covers(tok, t.alphabet, what=name)
    for p in t.prompts(20, seed=1):
        demo = t.demonstration(p)
        assert t.score(p, demo) == 1.0
        symbols = set(t.alphabet)
        ids = tok(p.text + demo, add_special_tokens=False)["input_ids"]
        assert all(tok.convert_ids_to_tokens(i) in symbols for i in ids)


@settings(max_examples=150, deadline=None)
@given(text=st.text(max_size=40), idx=st.integers(0, len(ALL) - 1))
def test_score_never_raises_on_garbage(text, idx):
    name, reward = ALL[idx]
    t = get_task(name)
    p = t.prompts(1, seed=0)[0]
    v = t.score(p, text, reward)
    assert isinstance(v, float) and math.isfinite(v) and v >= 0


@pytest.mark.parametrize("text", ["", "   ", "<ans>", "<ans>-", "<ans>²", "1e3", "<ans>00011",
                                  "9" * 50, "<ans>" + "9" * 50])
def test_unparseable_scores_zero(text):
    for name in task_names():
        t = get_task(name)
        p = t.prompts(1, seed=0)[0]
        assert t.score(p, text, t.rewards[0]) == 0.0


def test_parse_int_rejects_unicode_digits():
    assert _parse_int(" 12 ") == 12 and _parse_int("-3") == -3
    assert _parse_int("²") is None and _parse_int("1 2") is None and _parse_int("") is None


def test_max_new_tokens_fits_demonstrations():
    tok = build_tokenizer()
    for name in ("sort", "arith"):
        t = get_task(name)
        for p in t.prompts(100, seed=0):
            n = len(tok(t.demonstration(p), add_special_tokens=False)["input_ids"])
            assert n + (0 if t.fixed_length else 1) <= t.max_new_tokens


def test_enumerate_responses_is_the_whole_space():
    t = get_task("sort", n=2, max_value=3)
    p = t.prompts(1)[0]
    rows = t.enumerate_responses(p, vocab_size=7)
    assert rows.shape == (49, 2) and rows.dtype == torch.long
    assert len({tuple(r) for r in rows.tolist()}) == 49
    assert rows.min() == 0 and rows.max() == 6
    with pytest.raises(ValueError, match="variable-length"):
        get_task("arith").enumerate_responses(p, 7)
    with pytest.raises(ValueError, match="too many"):
        get_task("sort", n=9).enumerate_responses(p, 30)


def test_bad_input_names_value_and_choices():
    with pytest.raises(ValueError, match=r"task='nope'.*sort"):
        get_task("nope")
    with pytest.raises(ValueError, match=r"no knob 'm'.*max_value"):
        get_task("sort", m=3)
    with pytest.raises(ValueError, match=r"reward='bogus'.*positional"):
        get_task("sort").score(_p([1, 2]), "12", "bogus")
    with pytest.raises(ValueError, match="distinct"):
        get_task("sort", n=5, max_value=3)
    with pytest.raises(ValueError, match="split"):
        get_task("sort").prompts(2, split="test")
    with pytest.raises(ValueError, match="n=0"):
        get_task("sort").prompts(0)
    with pytest.raises(ValueError, match="single-turn"):
        get_task("sort").env_step(_p([1]), "x")
