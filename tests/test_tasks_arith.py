"""varbench.tasks.arith: variable-length answers, exact and digit-match rewards, reversed."""

from __future__ import annotations

import pytest

from varbench.tasks import Prompt, get_task

pytestmark = pytest.mark.usefixtures("one_thread")


def test_arith_lengths_vary_and_digit_match():
    t = get_task("arith", digits=2)
    lens = {len(t.demonstration(p)) for p in t.prompts(200, seed=0)}
    assert len(lens) >= 2
    t = get_task("arith", digits=2)
    p = Prompt("<add>47+85=", "132", {"data": (47, 85)})
    assert t.score(p, "132") == 1.0
    assert t.score(p, "0132") == 0.0
    assert t.score(p, "132", "digit_match") == 1.0
    assert t.score(p, "32", "digit_match") == pytest.approx(2 / 3)
    assert t.score(p, "9132", "digit_match") == pytest.approx(3 / 4)
    assert t.score(p, "1+2", "digit_match") == 0.0
    r = get_task("arith", digits=2, reverse=True)
    q = r._make_prompt((47, 85))
    assert q.answer == "231" and r.score(q, "231") == 1.0 and r.score(q, "132") == 0.0
    assert r.score(q, "23", "digit_match") == pytest.approx(2 / 3)
