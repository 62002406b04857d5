"""varbench.tasks.sort: golden rewards (positional, exact, inclusion_adjacency)."""

from __future__ import annotations

import pytest

from varbench.tasks import Prompt, get_task

pytestmark = pytest.mark.usefixtures("one_thread")


def _p(data, target=None):
    return Prompt(text="", answer=target or "".join(map(str, sorted(data))),
                  meta={"data": tuple(data)})


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
    assert t.score(p, p.answer) == 1.0
