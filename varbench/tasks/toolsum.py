"""`toolsum`: sum k numbers through a two-operand calculator tool (multi-turn).

Prompt ``<sum>3+5+2=``. The policy calls the tool with ``<call>a+b</call>``; the environment
appends ``<out>s</out>`` (context tokens, mask 0) or ``<out>?</out>`` for a malformed call; the
policy ends with ``<ans>N`` and EOS. The demonstration makes k - 1 calls, so the horizon grows
with k. The calculator adds exactly two non-negative integers, so skipping calls means adding in
one's head. After ``2k`` calls the environment ends the episode (``env_step`` returns None).
Reward ``exact``: the integer after the last ``<ans>`` equals the sum.
"""

from __future__ import annotations

import itertools
import random

from varbench._util.checks import UsageError
from varbench.tasks.base import DIGITS, Prompt, Task, _parse_int, register_task

CALL, END_CALL, OUT, END_OUT, ANS = "<call>", "</call>", "<out>", "</out>", "<ans>"


@register_task
class ToolSumTask(Task):
    name = "toolsum"
    rewards = ("exact",)
    multi_turn = True
    turn_end = END_CALL
    knob_defaults = {"k": 3, "max_value": 9}
    knob_help = {
        "k": "how many numbers to sum (horizon: k - 1 tool calls)",
        "max_value": "numbers are drawn from 0..max_value",
    }

    def _validate(self) -> None:
        k, m = self.knobs["k"], self.knobs["max_value"]
        if isinstance(k, bool) or not isinstance(k, int) or not 2 <= k <= 20:
            raise UsageError(f"toolsum knob k={k!r} is not valid; expected an integer 2..20")
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= 99:
            raise UsageError(f"toolsum knob max_value={m!r} is not valid; expected 1..99")

    def _draw(self, rng: random.Random) -> tuple[int, ...]:
        return tuple(rng.randint(0, self.knobs["max_value"]) for _ in range(self.knobs["k"]))

    def _space_size(self) -> int:
        return (self.knobs["max_value"] + 1) ** self.knobs["k"]

    def _space(self):
        return itertools.product(range(self.knobs["max_value"] + 1), repeat=self.knobs["k"])

    def _make_prompt(self, data: tuple[int, ...]) -> Prompt:
        return Prompt(text="<sum>" + "+".join(map(str, data)) + "=", answer=str(sum(data)),
                      meta={"data": data})

    @property
    def max_new_tokens(self) -> int:
        k = self.knobs["k"]
        d = len(str(k * self.knobs["max_value"]))
        per_call = 2 + 2 * d + 1 + 2 + d  # <call>a+b</call> then <out>s</out>
        return (k - 1) * per_call + 2 + d + 4  # <ans>N EOS plus a little slack

    @property
    def alphabet(self) -> tuple[str, ...]:
        return ("<sum>", "+", "=", "?", CALL, END_CALL, OUT, END_OUT, ANS, *DIGITS)

    @staticmethod
    def _tool(expr: str) -> str:
        parts = expr.split("+")
        vals = [_parse_int(p) for p in parts] if len(parts) == 2 else [None]
        if any(v is None or v < 0 for v in vals):
            return f"{OUT}?{END_OUT}"
        return f"{OUT}{sum(vals)}{END_OUT}"

    def env_step(self, prompt: Prompt, transcript: str) -> str | None:
        """Answer the call that ``transcript`` ends with; None ends the episode."""
        transcript = str(transcript)
        if not transcript.endswith(END_CALL):
            return None
        if transcript.count(END_CALL) > 2 * self.knobs["k"]:
            return None
        body = transcript[: -len(END_CALL)]
        start = body.rfind(CALL)
        if start < 0 or END_OUT in body[start:]:
            return f"{OUT}?{END_OUT}"
        return self._tool(body[start + len(CALL):])

    def demonstration(self, prompt: Prompt) -> str:
        parts, acc = [], prompt.data[0]
        for x in prompt.data[1:]:
            parts.append(f"{CALL}{acc}+{x}{END_CALL}{OUT}{acc + x}{END_OUT}")
            acc += x
        return "".join(parts) + f"{ANS}{acc}"

    def score(self, prompt: Prompt, response: str, reward: str | None = None) -> float:
        self.check_reward(reward)
        text = str(response)
        if ANS not in text:
            return 0.0
        ans = text.rsplit(ANS, 1)[1]
        return float(_parse_int(ans) == int(prompt.answer) and ans.strip() == prompt.answer)
