"""`sort`: sort n single-digit numbers; the response is exactly n digits (fixed length).

Prompt ``<sort>312=``, correct response ``123``. Rewards:

- ``exact``: 1 if the response is the sorted sequence, else 0.
- ``positional``: number of positions holding the sorted truth's digit (truth ``0123``:
  ``0123`` -> 4, ``2130`` -> 1, ``1023`` -> 2).
- ``inclusion_adjacency``: prompt numbers present anywhere in the response (multiset count) plus
  neighbouring response pairs in sorted order (``a <= b``) -- a shaped reward a policy can
  game without sorting.

Spaces in a response are ignored; any other non-digit symbol occupies its position and never
matches. Small problem spaces (few numbers from a restricted range, ``max_value``) make the
whole response space enumerable: ``enumerate_responses(prompt, vocab_size)`` lists all
``V**n`` token sequences.
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter

from varbench._util.checks import UsageError
from varbench.tasks.base import DIGITS, Prompt, Task, register_task


def _digits(response: str) -> list[int | None]:
    return [int(c) if c in DIGITS else None for c in str(response) if c != " "]


@register_task
class SortTask(Task):
    name = "sort"
    rewards = ("exact", "positional", "inclusion_adjacency")
    fixed_length = True
    knob_defaults = {"n": 3, "max_value": 9, "distinct": True}
    knob_help = {
        "n": "how many numbers to sort (difficulty; response length)",
        "max_value": "numbers are drawn from 0..max_value (<= 9)",
        "distinct": "draw distinct numbers (needs n <= max_value + 1)",
    }

    def _validate(self) -> None:
        n, m = self.knobs["n"], self.knobs["max_value"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UsageError(f"sort knob n={n!r} is not valid; expected an integer >= 1")
        if isinstance(m, bool) or not isinstance(m, int) or not 0 <= m <= 9:
            raise UsageError(f"sort knob max_value={m!r} is not valid; expected 0..9")
        if self.knobs["distinct"] and n > m + 1:
            raise UsageError(
                f"sort knobs n={n}, max_value={m}, distinct=True: cannot draw {n} distinct "
                f"numbers from 0..{m}"
            )

    def _draw(self, rng: random.Random) -> tuple[int, ...]:
        pool = range(self.knobs["max_value"] + 1)
        if self.knobs["distinct"]:
            return tuple(rng.sample(pool, self.knobs["n"]))
        return tuple(rng.choice(pool) for _ in range(self.knobs["n"]))

    def _space_size(self) -> int:
        n, k = self.knobs["n"], self.knobs["max_value"] + 1
        return math.perm(k, n) if self.knobs["distinct"] else k**n

    def _space(self):
        pool = range(self.knobs["max_value"] + 1)
        if self.knobs["distinct"]:
            return itertools.permutations(pool, self.knobs["n"])
        return itertools.product(pool, repeat=self.knobs["n"])

    def _make_prompt(self, data: tuple[int, ...]) -> Prompt:
        target = "".join(str(x) for x in sorted(data))
        return Prompt(text="<sort>" + "".join(map(str, data)) + "=", answer=target,
                      meta={"data": data})

    @property
    def max_new_tokens(self) -> int:
        return self.knobs["n"]

    @property
    def alphabet(self) -> tuple[str, ...]:
        return ("<sort>", "=", *DIGITS[: self.knobs["max_value"] + 1])

    def demonstration(self, prompt: Prompt) -> str:
        return prompt.answer

    def score(self, prompt: Prompt, response: str, reward: str | None = None) -> float:
        reward = self.check_reward(reward)
        truth = sorted(prompt.data)
        got = _digits(response)
        if reward == "exact":
            return float(got == truth)
        if reward == "positional":
            return float(sum(g == t for g, t in zip(got, truth, strict=False)))
        present = Counter(x for x in got if x is not None)
        inclusion = sum((Counter(prompt.data) & present).values())
        adjacency = sum(
            a is not None and b is not None and a <= b for a, b in itertools.pairwise(got)
        )
        return float(inclusion + adjacency)
