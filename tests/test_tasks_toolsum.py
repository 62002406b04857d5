"""varbench.tasks.toolsum: the tool environment's replies and the horizon."""

from __future__ import annotations

import pytest

from varbench.models import build_tokenizer
from varbench.tasks import Prompt, get_task

pytestmark = pytest.mark.usefixtures("one_thread")


def test_toolsum_env_and_horizon():
    t = get_task("toolsum", k=3)
    p = Prompt("<sum>3+5+2=", "10", {"data": (3, 5, 2)})
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
