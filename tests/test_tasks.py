"""Tasks: golden rewards, disjoint seeded splits, garbage-proof scoring, env steps, enumeration."""

from __future__ import annotations

import math

import pytest
import torch
from _fixtures_foundation import one_thread  # noqa: F401
from hypothesis import given, settings
from hypothesis import strategies as st

from varbench.models import build_tokenizer, check_tokenizer_covers
from varbench.tasks import Prompt, get_task, task_names
from varbench.tasks.base import _parse_int

pytestmark = pytest.mark.usefixtures("one_thread")

ALL = [(name, r) for name in ("sort", "arith", "toolsum") for r in get_task(name).rewards]


def _p(data, target=None):
    return Prompt(text="", data=tuple(data), target=target or "".join(map(str, sorted(data))))


def test_registry_lists_the_three_kinds():
    assert set(task_names()) >= {"sort", "arith", "toolsum"}
    kinds = {n: (get_task(n).fixed_length, get_task(n).multi_turn) for n in task_names()}
    assert kinds["sort"] == (True, False)
    assert kinds["arith"] == (False, False)
    assert kinds["toolsum"] == (False, True)


def test_sort_golden_rewards():
    t = get_task("sort", n=4)
    p = _p([3, 1, 0, 2])  # sorted truth 0 1 2 3
    assert [t.score(p, r, "positional") for r in ("0 1 2 3", "2 1 3 0")] == [4.0, 1.0]
    # The issue lists `1 0 2 3` -> 1, but positions 2 and 3 match the truth: by its own
    # definition ("positions matching the sorted truth") the value is 2.
    assert t.score(p, "1 0 2 3", "positional") == 2.0
    assert t.score(p, "0123", "exact") == 1.0
    assert t.score(p, "0 1 2 3", "exact") == 1.0
    assert t.score(p, "0132", "exact") == 0.0
    # inclusion (prompt numbers present) + adjacency (neighbours in sorted order)
    assert t.score(p, "0123", "inclusion_adjacency") == 4 + 3
    assert t.score(p, "3210", "inclusion_adjacency") == 4 + 0
    assert t.score(p, "0000", "inclusion_adjacency") == 1 + 3  # the hack: repeat one number
    assert t.score(p, "9", "inclusion_adjacency") == 0.0
    assert t.score(p, "0x12", "inclusion_adjacency") == 3 + 1


def test_sort_default_reward_is_exact():
    t = get_task("sort")
    assert t.rewards[0] == "exact"
    p = t.prompts(1)[0]
    assert t.score(p, p.target) == 1.0


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


def test_arith_lengths_vary_and_digit_match():
    t = get_task("arith", digits=2)
    lens = {len(t.demonstration(p)) for p in t.prompts(200, seed=0)}
    assert len(lens) >= 2
    t = get_task("arith", digits=2)
    p = Prompt("<add>47+85=", (47, 85), "132")
    assert t.score(p, "132") == 1.0
    assert t.score(p, "0132") == 0.0
    assert t.score(p, "132", "digit_match") == 1.0
    assert t.score(p, "32", "digit_match") == pytest.approx(2 / 3)
    assert t.score(p, "9132", "digit_match") == pytest.approx(3 / 4)
    assert t.score(p, "1+2", "digit_match") == 0.0
    r = get_task("arith", digits=2, reverse=True)
    q = r._make_prompt((47, 85))
    assert q.target == "231" and r.score(q, "231") == 1.0 and r.score(q, "132") == 0.0
    assert r.score(q, "23", "digit_match") == pytest.approx(2 / 3)


def test_toolsum_env_and_horizon():
    t = get_task("toolsum", k=3)
    p = Prompt("<sum>3+5+2=", (3, 5, 2), "10")
    assert t.demonstration(p) == (
        "<call>3+5</call><out>8</out><call>8+2</call><out>10</out><ans>10")
    assert t.env_step(p, "<call>3+5</call>") == "<out>8</out>"
    assert t.env_step(p, "<call>8+2</call><out>?</out><call>12+30</call>") == "<out>42</out>"
    assert t.env_step(p, "<call>3+</call>") == "<out>?</out>"
    assert t.env_step(p, "<call>3+4+5</call>") == "<out>?</out>"
    assert t.env_step(p, "</call>") == "<out>?</out>"
    assert t.env_step(p, "<call>1+1</call>" * 7) is None  # more than 2k calls ends it
    assert t.score(p, "<call>3+5</call><out>8</out><ans>10") == 1.0
    assert t.score(p, "<ans>10<ans>11") == 0.0
    tok = build_tokenizer()
    prev = 0
    for k in (2, 3, 5, 8):
        tk = get_task("toolsum", k=k)
        n = max(len(tok(tk.demonstration(q), add_special_tokens=False)["input_ids"]) + 1
                for q in tk.prompts(50, seed=0))
        assert prev < n <= tk.max_new_tokens  # horizon grows with k and fits the budget
        prev = n


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
