"""varbench.tasks.verifiers: the built-in verifiers on hand-made cases, user verifiers, and
failures scored 0 and counted."""

from __future__ import annotations

from fractions import Fraction

import pytest

from varbench._util.checks import UsageError
from varbench.tasks.verifiers import (
    describe_errors,
    error_counts,
    last_number,
    resolve_verifier,
    safe_score,
)


def test_last_number():
    assert last_number("3 + 4 = 7. The answer is 7.") == 7
    assert last_number("about 1,234.50 dollars") == Fraction("1234.5")
    assert last_number("-3") == -3 and last_number("2/3 of it") == Fraction(2, 3)
    assert last_number("no digits") is None


@pytest.mark.parametrize("name,response,answer,want", [
    ("exact", " 42 ", "42", 1.0), ("exact", "42.", "42", 0.0),
    ("number", "so 3 + 4 = 7", "7", 1.0), ("number", "7.00", "7", 1.0),
    ("number", "7 then 8", "7", 0.0), ("number", "none", "7", 0.0),
    ("number", "1,000", "1000", 1.0),
    ("choice", "I think (B)", "B", 1.0), ("choice", "A or C? C", "c", 1.0),
    ("choice", "Because of it, D", "B", 0.0), ("choice", "no letter", "B", 0.0),
])
def test_builtin_verifiers(name, response, answer, want):
    assert resolve_verifier(name)("q", response, answer) == want


def test_math_verifier_uses_math_verify():
    pytest.importorskip("math_verify")
    v = resolve_verifier("math")
    assert v("q", "The answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert v("q", "so x = 0.5", "$\\frac{1}{2}$") == 1.0
    assert v("q", "The answer is \\boxed{3}", "4") == 0.0


def test_user_verifier_and_refusals():
    assert resolve_verifier("_plugin_tasks:raising_verifier")("q", "ab", "x") == 1.0
    with pytest.raises(UsageError, match=r"verifier='nope' is not valid; choose one of "
                                         r"\['auto', 'exact', 'number', 'math', 'choice'\]"):
        resolve_verifier("nope")
    with pytest.raises(UsageError, match=r"verifier='_plugin_tasks:NOT_A_TASK' is not "
                                         "callable"):
        resolve_verifier("_plugin_tasks:NOT_A_TASK")


def test_failures_score_zero_and_are_tallied():
    before = error_counts()

    def bad(q, r, a):
        raise KeyError("boom")

    def nan(q, r, a):
        return float("nan")

    assert safe_score(bad, "t:bad", "q", "r", "a") == (0.0, "KeyError: 'boom'")
    score, err = safe_score(nan, "t:nan", "q", "r", "a")
    assert score == 0.0 and "not a finite number" in err
    assert safe_score(lambda q, r, a: 0.25, "t:ok", "q", "r", "a") == (0.25, None)
    lines = describe_errors(before)
    assert lines == ["verifier 't:bad' raised on 1 response(s), scored 0 (first error: "
                     "KeyError: 'boom')",
                     "verifier 't:nan' raised on 1 response(s), scored 0 (first error: "
                     "ValueError: returned nan, not a finite number)"]


# ---- issue 29: number knows GSM8K's #### and LaTeX fractions; auto picks by the answers
@pytest.mark.parametrize("response,answer,want", [
    ("so x = \\frac{3}{2}", "\\frac{1}{2}", 0.0),  # read as 2 and 2 before: a false match
    ("so x = \\frac{1}{2}", "\\frac{1}{2}", 1.0),
    ("x = $-\\dfrac{3}{2}$", "-1.5", 1.0),
    ("The answer is \\boxed{7}", "7", 1.0),
    ("3 + 3 = 6\n#### 6", "Janet has 3 + 3 = 6 eggs.\n#### 6", 1.0),
    ("#### 1,234", "#### 1234", 1.0),
    ("#### 5", "She adds 2 + 4 = 6.\n#### 6", 0.0),
])
def test_number_reads_gsm8k_and_latex_fractions(response, answer, want):
    assert resolve_verifier("number")("q", response, answer) == want


def test_number_never_reads_a_number_out_of_latex_it_does_not_know(monkeypatch):
    from varbench.tasks import verifiers as vf

    for text in ("\\sqrt{2}", "x^{2}", "\\frac{\\pi}{2}", "\\boxed{2\\sqrt{3}}", "\\frac12"):
        with pytest.raises(vf.UnreadableNumber):
            vf.final_number(text)
    monkeypatch.setattr(vf, "has_math_verify", lambda: False)
    with pytest.raises(vf.UnreadableNumber, match="use verifier=math"):
        vf.verify_number("q", "\\sqrt{4}", "2")
    score, err = safe_score(vf.verify_number, "number", "q", "\\sqrt{4}", "2")
    assert score == 0.0 and "cannot read LaTeX" in err


def test_number_hands_unreadable_latex_to_math_verify():
    pytest.importorskip("math_verify")
    v = resolve_verifier("number")
    assert v("q", "\\boxed{2\\sqrt{3}}", "$2\\sqrt{3}$") == 1.0
    assert v("q", "\\boxed{3\\sqrt{3}}", "$2\\sqrt{3}$") == 0.0


def test_auto_picks_by_the_answer_column(monkeypatch):
    from varbench.tasks import verifiers as vf

    assert vf.pick_verifier(["A", "(c)", "B."]) == "choice"
    assert vf.pick_verifier(["7", "worked: 3 + 4 = 7\n#### 7"]) == "number"
    assert vf.pick_verifier(["Paris", "Lima"]) == "exact"
    monkeypatch.setattr(vf, "has_math_verify", lambda: True)
    assert vf.pick_verifier(["7", "\\frac{1}{2}"]) == "math"
    monkeypatch.setattr(vf, "has_math_verify", lambda: False)
    assert vf.pick_verifier(["7", "\\frac{1}{2}"]) == "number"


def test_every_reward_zero_and_truncation_are_described():
    from types import SimpleNamespace

    from varbench.tasks import verifiers as vf

    task = SimpleNamespace(name="t29", scoring_hint=lambda: "verifier 'exact' on answers")
    before = error_counts()
    vf.note_responses(task, n=8, n_zero=8, n_truncated=8, max_new_tokens=3)
    lines = describe_errors(before)
    assert any(x.startswith("warning: task 't29': 8 of 8 responses (100%) reached "
                            "max_new_tokens=3") for x in lines), lines
    assert any("every reward of task 't29' is 0 on 8 responses; likely cause: responses cut "
               "off at max_new_tokens=3 (8 of 8); or verifier 'exact'" in x for x in lines), lines
    before = error_counts()
    vf.note_responses(task, n=20, n_zero=3, n_truncated=1, max_new_tokens=3)
    assert describe_errors(before) == ["task 't29': 1 of 20 responses (5%) reached "
                                       "max_new_tokens=3 without a stop token and were scored "
                                       "cut off"]
