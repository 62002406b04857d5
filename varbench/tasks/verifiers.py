"""Verifiers of dataset tasks: ``(question, response, answer) -> score`` in [0, 1].

Built in (``--knob verifier=NAME``):

- ``exact``: the response, stripped, equals the answer, stripped.
- ``number``: the last number in the response equals the answer's last number (as exact
  rationals: ``3``, ``3.0`` and ``3.00`` agree; thousands separators ``1,234`` are read as
  1234).
- ``math``: final-answer equivalence by the ``math-verify`` package (``pip install
  'varbench[math]'``): LaTeX, fractions, ``\\boxed{..}`` and plain numbers are parsed and
  compared symbolically.
- ``choice``: the last standalone letter A-E of the response equals the answer's letter.

A user's verifier is named ``MODULE:FUNCTION`` and called as ``fn(question, response, answer)``
with the raw question text (before any chat template); it returns a number. A verifier that
raises, or returns something that is not a finite number, scores 0: the task counts the
error (``DatasetTask.verifier_errors``) and :func:`error_counts` keeps a process-wide tally
that the application reports after each command or suite case.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable
from fractions import Fraction

from varbench._util.checks import UsageError

Verifier = Callable[[str, str, str], float]

VERIFIERS = ("exact", "number", "math", "choice")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_LETTER = re.compile(r"(?<![A-Za-z])([A-E])(?![A-Za-z])")
# process-wide tally of verifier failures: reference -> count, and the first message of each
_ERRORS: Counter = Counter()
_FIRST: dict[str, str] = {}


def last_number(text: str) -> Fraction | None:
    """The last number in ``text`` as an exact Fraction (``1,234.5``, ``-3``, ``2/3``), or None."""
    found = _NUMBER.findall(str(text))
    if not found:
        return None
    raw = found[-1].replace(",", "")
    try:
        return Fraction(raw)
    except (ValueError, ZeroDivisionError):
        return None


def verify_exact(question: str, response: str, answer: str) -> float:
    """1 if the stripped response equals the stripped answer."""
    return float(str(response).strip() == str(answer).strip())


def verify_number(question: str, response: str, answer: str) -> float:
    """1 if the last number of the response equals the answer's last number."""
    want = last_number(answer)
    got = last_number(response)
    return float(want is not None and got is not None and got == want)


def verify_choice(question: str, response: str, answer: str) -> float:
    """1 if the last standalone letter A-E of the response is the answer's letter."""
    want = _LETTER.findall(str(answer).strip().upper())
    got = _LETTER.findall(str(response))
    return float(bool(want) and bool(got) and got[-1] == want[-1])


def _math_verifier() -> Verifier:
    try:
        from math_verify import parse, verify
    except ImportError:
        raise UsageError("verifier='math' needs the math-verify package; install it with "
                         "pip install 'varbench[math]' (or pip install math-verify), or "
                         "choose one of ['choice', 'exact', 'number']") from None

    def verify_math(question: str, response: str, answer: str) -> float:
        """1 if math-verify finds the response's final answer equivalent to the answer."""
        gold = parse(str(answer))
        if not gold:  # a bare answer like "42" parses as an expression once wrapped in $..$
            gold = parse(f"${answer}$")
        pred = parse(str(response))
        return float(bool(gold) and bool(pred) and verify(gold, pred))

    return verify_math


def resolve_verifier(name: str) -> Verifier:
    """The verifier ``name`` names: a built-in name or a user's ``MODULE:FUNCTION``."""
    from varbench._util.imports import import_object, is_reference

    if name == "exact":
        return verify_exact
    if name == "number":
        return verify_number
    if name == "choice":
        return verify_choice
    if name == "math":
        return _math_verifier()
    if is_reference(name):
        fn = import_object(name, what="verifier")
        if not callable(fn):
            raise UsageError(f"verifier={name!r} is not callable; give MODULE:FUNCTION with "
                             "fn(question, response, answer) -> float")
        return fn
    raise UsageError(f"verifier={name!r} is not valid; choose one of {list(VERIFIERS)} or give "
                     "MODULE:FUNCTION (fn(question, response, answer) -> float)")


def safe_score(fn: Verifier, ref: str, question: str, response: str, answer: str
               ) -> tuple[float, str | None]:
    """``(score, error)``: ``fn``'s score, or ``(0.0, message)`` when it raises or returns a
    value that is not a finite number; failures are added to the process-wide tally."""
    try:
        value = fn(question, response, answer)
        score = float(value)
        if not math.isfinite(score):
            raise ValueError(f"returned {value!r}, not a finite number")
    except Exception as err:  # noqa: BLE001 - a user's verifier may raise anything: score 0
        msg = f"{type(err).__name__}: {err}"
        _ERRORS[ref] += 1
        _FIRST.setdefault(ref, msg)
        return 0.0, msg
    return score, None


def error_counts() -> dict[str, tuple[int, str]]:
    """``{verifier: (failures so far in this process, first message)}``."""
    return {k: (n, _FIRST.get(k, "")) for k, n in _ERRORS.items()}


def describe_errors(before: dict[str, tuple[int, str]]) -> list[str]:
    """Lines naming the verifier failures since the snapshot ``before`` of :func:`error_counts`."""
    out = []
    for ref, (n, first) in error_counts().items():
        new = n - before.get(ref, (0, ""))[0]
        if new > 0:
            out.append(f"verifier {ref!r} raised on {new} response(s), scored 0 "
                       f"(first error: {first})")
    return out
