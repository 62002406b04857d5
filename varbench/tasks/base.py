"""Task protocol and registry: seeded prompts, disjoint splits, reward programs, env steps.

A task owns everything about a problem family: how prompts look, how a response is scored
(rewards never raise; unparseable text scores 0), a correct demonstration for warm start, and for
multi-turn tasks the environment step that appends tool output. Splits are disjoint by
construction: a problem's split is a pure function of its canonical key (a hash), independent of
the seed, so train and held-out never share a problem.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from varbench._util.checks import UsageError, check_choice, check_positive_int

SPLITS = ("train", "heldout")
DIGITS = "0123456789"
_HELDOUT_PERCENT = 20
_ENUMERATE_LIMIT = 50_000  # problem spaces up to this size are listed and split exactly
# Listing and hashing a space costs milliseconds; tasks are rebuilt often (CLI, tests), so the
# split of each (task, knobs) is computed once per process. Entries are never mutated.
_SPLIT_CACHE: dict[tuple, dict[str, list[tuple[int, ...]]]] = {}


@dataclass(frozen=True)
class Prompt:
    """One problem: ``text`` is fed to the policy; ``data`` the numbers; ``target`` the answer."""

    text: str
    data: tuple[int, ...]
    target: str
    meta: dict = field(default_factory=dict, compare=False, hash=False)


class Task:
    """Base class of a verifiable task. Subclasses set the class attributes and the hooks."""

    name: ClassVar[str] = ""
    rewards: ClassVar[tuple[str, ...]] = ("exact",)  # first is the default
    multi_turn: ClassVar[bool] = False
    fixed_length: ClassVar[bool] = False  # True: exactly max_new_tokens tokens, EOS not a stop
    knob_defaults: ClassVar[dict[str, Any]] = {}
    knob_help: ClassVar[dict[str, str]] = {}
    turn_end: ClassVar[str | None] = None  # multi-turn: the symbol after which env_step runs

    def __init__(self, **knobs: Any) -> None:
        unknown = sorted(set(knobs) - set(self.knob_defaults))
        if unknown:
            raise UsageError(
                f"task {self.name!r} has no knob {unknown[0]!r}; valid knobs: "
                f"{sorted(self.knob_defaults)}"
            )
        self.knobs: dict[str, Any] = {**self.knob_defaults, **knobs}
        self._validate()
        self._split_cache: dict[str, list[tuple[int, ...]]] | None = None

    # ---- hooks -------------------------------------------------------------------------------
    def _validate(self) -> None:
        """Check knob values (raise ValueError naming the knob)."""

    def _draw(self, rng: random.Random) -> tuple[int, ...]:
        """One random problem (its numbers)."""
        raise NotImplementedError

    def _space(self) -> Iterable[tuple[int, ...]] | None:
        """Every problem, when the space is small enough to list; else None."""
        return None

    def _space_size(self) -> int:
        raise NotImplementedError

    def _make_prompt(self, data: tuple[int, ...]) -> Prompt:
        raise NotImplementedError

    def score(self, prompt: Prompt, response: str, reward: str | None = None) -> float:
        """Reward of ``response`` (decoded text) to ``prompt``; never raises on garbage."""
        raise NotImplementedError

    def demonstration(self, prompt: Prompt) -> str:
        """A correct response (multi-turn: the whole transcript, tool outputs included)."""
        raise NotImplementedError

    # ---- derived -----------------------------------------------------------------------------
    @property
    def max_new_tokens(self) -> int:
        """Response budget in tokens (multi-turn: policy and environment tokens together)."""
        raise NotImplementedError

    @property
    def alphabet(self) -> tuple[str, ...]:
        """Every symbol (characters and markup tags) prompts and demonstrations use."""
        raise NotImplementedError

    def check_reward(self, reward: str | None) -> str:
        """Return the reward name (the default when None); ValueError lists the choices."""
        if reward is None:
            return self.rewards[0]
        check_choice("reward", reward, self.rewards)
        return reward

    def env_step(self, prompt: Prompt, transcript: str) -> str | None:
        """Multi-turn only: tool output to append after ``transcript``, or None to end."""
        raise UsageError(f"task {self.name!r} is single-turn; it has no environment step")

    def enumerate_responses(self, prompt: Prompt, vocab_size: int) -> torch.Tensor:
        """Every response token sequence of a fixed-length task: LongTensor [V**T, T].

        Rows enumerate all of ``range(vocab_size) ** max_new_tokens`` in lexicographic order, so
        summing ``pi(y)`` over them gives exactly 1: an exact expectation over the policy's full
        response distribution (score rows with ``score(prompt, tokenizer.decode(row,
        skip_special_tokens=True))``). Refuses spaces above 2 million sequences.
        """
        if not self.fixed_length:
            raise UsageError(f"task {self.name!r} has variable-length responses; cannot enumerate")
        check_positive_int("vocab_size", vocab_size)
        T = self.max_new_tokens
        if vocab_size**T > 2_000_000:
            raise UsageError(
                f"enumerating vocab_size**T = {vocab_size}**{T} responses is too many; "
                "use a smaller n for the task"
            )
        grids = torch.cartesian_prod(*[torch.arange(vocab_size)] * T)
        return grids.reshape(-1, T).long()

    @staticmethod
    def _in_heldout(data: tuple[int, ...]) -> bool:
        h = hashlib.sha256(repr(tuple(data)).encode()).digest()
        return int.from_bytes(h[:8], "big") % 100 < _HELDOUT_PERCENT

    def _splits(self) -> dict[str, list[tuple[int, ...]]] | None:
        if self._space_size() > _ENUMERATE_LIMIT:
            return None
        ckey = (self.name, tuple(sorted(self.knobs.items())))
        if self._split_cache is None and ckey in _SPLIT_CACHE:
            self._split_cache = _SPLIT_CACHE[ckey]
        if self._split_cache is None:
            allp = sorted(set(self._space()))
            # Order by hash so the held-out set is a fixed pseudo-random slice of the space.
            allp.sort(key=lambda d: hashlib.sha256(repr(d).encode()).digest())
            if len(allp) < 2:
                raise UsageError(
                    f"task {self.name!r} with knobs {self.knobs} has {len(allp)} problem(s); "
                    "need at least 2 for disjoint train / heldout splits"
                )
            k = max(1, round(len(allp) * _HELDOUT_PERCENT / 100))
            self._split_cache = {"heldout": sorted(allp[:k]), "train": sorted(allp[k:])}
            _SPLIT_CACHE[ckey] = self._split_cache
        return self._split_cache

    def split_size(self, split: str) -> int | None:
        """Number of distinct problems in ``split`` (None when the space is too large to list)."""
        check_choice("split", split, SPLITS)
        s = self._splits()
        return None if s is None else len(s[split])

    def prompts(self, n: int, *, split: str = "train", seed: int = 0) -> list[Prompt]:
        """``n`` prompts from ``split`` drawn with ``random.Random(seed)``.

        Distinct when the split holds at least n problems, drawn with replacement otherwise.
        """
        check_positive_int("n", n)
        check_choice("split", split, SPLITS)
        rng = random.Random(f"{self.name}:{split}:{seed}")
        splits = self._splits()
        if splits is not None:
            pool = splits[split]
            chosen = rng.sample(pool, n) if n <= len(pool) else [rng.choice(pool) for _ in range(n)]
        else:
            want_heldout = split == "heldout"
            chosen = []
            for _ in itertools.count():
                d = self._draw(rng)
                if self._in_heldout(d) == want_heldout:
                    chosen.append(d)
                    if len(chosen) == n:
                        break
        return [self._make_prompt(tuple(d)) for d in chosen]

    def describe(self) -> str:
        """One line: name, rewards, knobs with their current values."""
        knobs = ", ".join(f"{k}={v}" for k, v in self.knobs.items())
        kind = "multi-turn" if self.multi_turn else (
            "fixed-length" if self.fixed_length else "variable-length")
        return f"{self.name} ({kind}) rewards={list(self.rewards)} knobs: {knobs}"


_REGISTRY: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    """Class decorator adding ``cls`` to the task registry under ``cls.name``."""
    if not cls.name or cls.name in _REGISTRY:
        raise UsageError(f"task name {cls.name!r} is empty or already registered")
    _REGISTRY[cls.name] = cls
    return cls


def task_names() -> list[str]:
    """Registered task names."""
    return list(_REGISTRY)


def get_task(name: str, **knobs: Any) -> Task:
    """Instantiate task ``name`` with ``knobs`` (unknown name or knob -> ValueError)."""
    check_choice("task", name, task_names())
    return _REGISTRY[name](**knobs)


def _parse_int(text: str) -> int | None:
    """Integer in ``text`` (surrounding spaces allowed), else None."""
    t = text.strip()
    body = t[1:] if t.startswith("-") else t
    # ASCII digits only: str.isdigit() accepts symbols like '²' that int() rejects.
    if not body or len(body) > 12 or any(c not in DIGITS for c in body):
        return None
    return int(t)
