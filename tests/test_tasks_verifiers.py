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
                                         r"\['exact', 'number', 'math', 'choice'\]"):
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
