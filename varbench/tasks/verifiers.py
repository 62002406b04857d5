"""Verifiers of dataset tasks: ``(question, response, answer) -> score`` in [0, 1].

Built in (``--knob verifier=NAME``):

- ``exact``: the response, stripped, equals the answer, stripped.
- ``number``: the final number of the response equals the answer's (as exact rationals:
  ``3``, ``3.0`` and ``3.00`` agree; ``1,234`` is 1234; ``2/3`` and ``\\frac{2}{3}`` are
  fractions). The final number is read after the last ``####`` (GSM8K's marker) when there is
  one, else inside the last ``\\boxed{..}``, else it is the text's last number. LaTeX it does
  not understand (``\\sqrt{2}``, ``2^{10}``, ``\\pi``, a boxed expression) is handed to
  ``math-verify`` when installed and is otherwise an error (the response scores 0 and the
  failure is counted): never a number read from inside an expression.
- ``math``: final-answer equivalence by the ``math-verify`` package (``pip install
  'varbench[math]'``): LaTeX, fractions, ``\\boxed{..}`` and plain numbers are parsed and
  compared symbolically.
- ``choice``: the last standalone letter A-E of the response equals the answer's letter.
- ``auto`` (a dataset task's default): chosen from the answer column (:func:`pick_verifier`):
  ``choice`` when every answer is a letter A-E, ``math`` when an answer holds LaTeX (``number``
  without math-verify), ``number`` when every answer has a final number, else ``exact``.

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

VERIFIERS = ("auto", "exact", "number", "math", "choice")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:/\d+)?")
_NUM = r"-?\d+(?:\.\d+)?"
# \frac{a}{b} (and \dfrac, \tfrac) with plain numbers, optionally negated: one atom
_FRAC = re.compile(rf"(-\s*)?\\[dt]?frac\s*\{{\s*({_NUM})\s*\}}\s*\{{\s*({_NUM})\s*\}}")
_ATOM = re.compile(rf"{_FRAC.pattern}|(?P<num>{_NUMBER.pattern})")
# LaTeX spacing and thousands separators that change no number: \! \, \; \  and 1{,}234
_SPACING = re.compile(r"\\[!,;: %()\[\]]|\{,\}|\$|\\left|\\right|\\displaystyle")
_CHOICE = re.compile(r"^\(?([A-Ea-e])\)?\.?$")
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


class UnreadableNumber(UsageError):
    """Text whose final number sits inside LaTeX the ``number`` verifier does not read."""


def _boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{..}`` (balanced braces), or None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def final_number(text: str) -> Fraction | None:
    """The final number of ``text`` as an exact Fraction, or None when it has none.

    Read after the last ``####`` (GSM8K), else inside the last ``\\boxed{..}``, else the last
    number of the text; ``\\frac{a}{b}`` of plain numbers is a fraction. Raises
    :class:`UnreadableNumber` when that number touches LaTeX it does not read (``\\sqrt{2}``,
    ``x^{2}``, ``\\frac{\\pi}{2}``) or a boxed answer holds no plain number: reading the last
    digits of an expression would give a wrong number (``\\frac{1}{2}`` read as 2).
    """
    text = str(text)
    boxed = None
    if "####" in text:
        seg = text.rsplit("####", 1)[1]
    else:
        boxed = _boxed(text)
        seg = text if boxed is None else boxed
    seg = _SPACING.sub("", seg)
    atoms = list(_ATOM.finditer(seg))
    if not atoms:
        if boxed is not None or "\\" in seg:
            raise UnreadableNumber(f"no plain number in {seg.strip()[:60]!r}")
        return None
    m = atoms[-1]
    rest = seg[m.end():]
    before = seg[:m.start()].rstrip()
    after = rest.lstrip()
    # the atom is an operand of LaTeX: x^{2}, \sqrt{2}, 2\pi, {3}/... ; or of a boxed expression
    touches = (before[-1:] in ("^", "_", "{", "\\") or after[:1] in ("^", "_", "}", "\\", "{")
               or (m.group("num") is not None and before.endswith(("\\frac", "\\dfrac"))))
    if boxed is not None and (seg[:m.start()].strip(" -+=") or rest.strip(" .")):
        touches = True  # \boxed{x = 2}, \boxed{2\sqrt{3}}: an expression, not a number
    if touches:
        raise UnreadableNumber(f"the final number of {seg.strip()[-60:]!r} is part of a LaTeX "
                               "expression")
    if m.group("num") is None:  # \frac{a}{b}
        sign = -1 if m.group(1) else 1
        try:
            return sign * Fraction(m.group(2)) / Fraction(m.group(3))
        except ZeroDivisionError:
            return None
    try:
        return Fraction(m.group("num").replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def has_math_verify() -> bool:
    """Whether the math-verify package is importable."""
    import importlib.util

    return importlib.util.find_spec("math_verify") is not None


def verify_number(question: str, response: str, answer: str) -> float:
    """1 if the final number of the response equals the answer's (:func:`final_number`);
    LaTeX it cannot read goes to math-verify when installed, else raises (scored 0, counted)."""
    try:
        want = final_number(answer)
        got = final_number(response)
    except UnreadableNumber as err:
        if has_math_verify():
            return _math_verifier()(question, response, answer)
        raise UnreadableNumber(f"verifier 'number' cannot read LaTeX: {err}; use "
                               "verifier=math (pip install math-verify)") from None
    return float(want is not None and got is not None and got == want)


def pick_verifier(answers: list[str]) -> str:
    """The built-in verifier ``auto`` picks for a task whose answers are ``answers``: ``choice``
    (every answer a letter A-E), ``math`` (an answer holds LaTeX; ``number`` without
    math-verify), ``number`` (every answer has a final number, e.g. ``7`` or ``... #### 7``),
    else ``exact``."""
    answers = [str(a).strip() for a in answers]
    if answers and all(_CHOICE.match(a) for a in answers):
        return "choice"
    if any("\\" in a or "$" in a for a in answers):
        return "math" if has_math_verify() else "number"
    try:
        if answers and all(final_number(a) is not None for a in answers):
            return "number"
    except UnreadableNumber:
        return "math" if has_math_verify() else "number"
    return "exact"


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
    if name == "auto":
        raise UsageError("verifier='auto' is chosen from a task's answers; resolve it with "
                         "pick_verifier(answers) first")
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


class _Snapshot(dict):
    """``error_counts()``: a dict of verifier failures that also carries the response tally
    (``.responses``), so one snapshot serves :func:`describe_errors`."""

    responses: dict[str, tuple[int, int, int, int, str]] = {}


# task name -> [responses, scored 0, cut at max_new_tokens, max_new_tokens, scoring hint]
_RESPONSES: dict[str, list] = {}
TRUNCATION_WARN = 0.1  # warn when more than this fraction of responses is cut off


def note_responses(task, *, n: int, n_zero: int, n_truncated: int, max_new_tokens: int) -> None:
    """Add one sampling call's counts to the process-wide tally :func:`describe_errors` reads:
    ``n`` responses of ``task``, ``n_zero`` scored 0, ``n_truncated`` cut at
    ``max_new_tokens`` without a stop token."""
    row = _RESPONSES.setdefault(str(task.name), [0, 0, 0, 0, ""])
    row[0] += int(n)
    row[1] += int(n_zero)
    row[2] += int(n_truncated)
    row[3] = int(max_new_tokens)
    row[4] = task.scoring_hint()


def error_counts() -> dict[str, tuple[int, str]]:
    """``{verifier: (failures so far in this process, first message)}``; the returned dict
    also carries the response tally (``.responses``) for :func:`describe_errors`."""
    snap = _Snapshot({k: (n, _FIRST.get(k, "")) for k, n in _ERRORS.items()})
    snap.responses = {k: tuple(v) for k, v in _RESPONSES.items()}
    return snap


def describe_responses(before: dict[str, tuple]) -> list[str]:
    """Lines on the responses sampled since the tally ``before``: how many were cut off at
    max_new_tokens (a warning above :data:`TRUNCATION_WARN`), and a warning naming the likely
    causes when every reward was 0."""
    out = []
    for name, (n, zero, cut, T, hint) in _RESPONSES.items():
        b = before.get(name, (0, 0, 0, 0, ""))
        n, zero, cut = n - b[0], zero - b[1], cut - b[2]
        if n <= 0:
            continue
        if cut:
            frac = cut / n
            line = (f"task {name!r}: {cut} of {n} responses ({100 * frac:.0f}%) reached "
                    f"max_new_tokens={T} without a stop token and were scored cut off")
            if cut == n:
                out.append(f"warning: {line}: no answer fits in {T} tokens, or the policy "
                           "never emits a stop token; raise max_new_tokens or set the stop "
                           "knob")
            elif frac > TRUNCATION_WARN:
                out.append(f"warning: {line}; raise max_new_tokens")
            else:
                out.append(line)
        if zero == n and hint:
            causes = []
            if cut / n > 0.5:
                causes.append(f"responses cut off at max_new_tokens={T} ({cut} of {n})")
            causes.append(hint)
            out.append(f"warning: every reward of task {name!r} is 0 on {n} responses; likely "
                       f"cause: {'; or '.join(causes)}")
    return out


def describe_errors(before: dict[str, tuple[int, str]]) -> list[str]:
    """Lines naming the verifier failures since the snapshot ``before`` of :func:`error_counts`,
    then (when ``before`` is such a snapshot) :func:`describe_responses`."""
    out = []
    for ref, (n, first) in error_counts().items():
        new = n - before.get(ref, (0, ""))[0]
        if new > 0:
            out.append(f"verifier {ref!r} raised on {new} response(s), scored 0 "
                       f"(first error: {first})")
    if isinstance(before, _Snapshot):
        out += describe_responses(before.responses)
    return out
