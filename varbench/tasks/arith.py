"""`arith`: multi-digit addition; the answer has a variable length and ends with EOS.

Prompt ``<add>4+8=``, correct response ``12`` followed by the tokenizer's EOS; the sampler
stops a response at EOS, so responses in one group differ in length. Knobs: ``digits`` (operand
size, default 1: a ``tiny`` policy warm-starts in a few hundred steps; 2-digit addition written
most-significant digit first did not reach 10% in 600 steps) and ``reverse`` (write the sum
units digit first). Rewards:

- ``exact``: 1 if the response is the sum's decimal string (reversed if ``reverse``), else 0.
- ``digit_match``: fraction of the sum's digits reproduced, aligned from the right (a response
  of a different length is compared digit by digit from the units; extra digits count against
  it via the max length).
"""

from __future__ import annotations

import itertools
import random

from varbench._util.checks import UsageError
from varbench.tasks.base import DIGITS, Prompt, Task, register_task


@register_task
class ArithTask(Task):
    name = "arith"
    rewards = ("exact", "digit_match")
    knob_defaults = {"digits": 1, "reverse": False}
    knob_help = {
        "digits": "operands have up to this many digits (difficulty)",
        "reverse": "write the sum units digit first (learnable by tiny models)",
    }

    def _validate(self) -> None:
        d = self.knobs["digits"]
        if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= 9:
            raise UsageError(f"arith knob digits={d!r} is not valid; expected an integer 1..9")
        if not isinstance(self.knobs["reverse"], bool):
            raise UsageError(f"arith knob reverse={self.knobs['reverse']!r} is not valid; "
                             "expected true or false")

    @property
    def _hi(self) -> int:
        return 10 ** self.knobs["digits"]

    def _draw(self, rng: random.Random) -> tuple[int, ...]:
        return (rng.randrange(self._hi), rng.randrange(self._hi))

    def _space_size(self) -> int:
        return self._hi**2

    def _space(self):
        return itertools.product(range(self._hi), repeat=2)

    def _make_prompt(self, data: tuple[int, ...]) -> Prompt:
        a, b = data
        total = str(a + b)
        target = total[::-1] if self.knobs["reverse"] else total
        return Prompt(text=f"<add>{a}+{b}=", answer=target, meta={"data": data})

    @property
    def max_new_tokens(self) -> int:
        return self.knobs["digits"] + 2  # longest sum, one spare, EOS

    @property
    def alphabet(self) -> tuple[str, ...]:
        return ("<add>", "+", "=", *DIGITS)

    def demonstration(self, prompt: Prompt) -> str:
        return prompt.answer

    def score(self, prompt: Prompt, response: str, reward: str | None = None) -> float:
        reward = self.check_reward(reward)
        text = str(response).strip()
        if reward == "exact":
            return float(text == prompt.answer)
        truth = prompt.answer
        if not text or any(c not in DIGITS for c in text):
            return 0.0
        if self.knobs["reverse"]:  # align units with units
            text, truth = text[::-1], truth[::-1]
        hits = sum(a == b for a, b in zip(reversed(text), reversed(truth), strict=False))
        return hits / max(len(truth), len(text))
