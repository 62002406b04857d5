"""Task protocol and registry: seeded prompts, disjoint splits, reward programs, env steps.

A task owns everything about a problem family: how prompts look, how a response is scored
(rewards never raise; unparseable text scores 0), a correct demonstration for warm start, and for
multi-turn tasks the environment step that appends tool output. Splits are disjoint by
construction: a problem's split is a pure function of its canonical key (a hash), independent of
the seed, so train and held-out never share a problem.
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from varbench._util.checks import UsageError, UsageTypeError, check_choice, check_positive_int

SPLITS = ("train", "heldout")
DIGITS = "0123456789"
_HELDOUT_PERCENT = 20
_ENUMERATE_LIMIT = 50_000  # problem spaces up to this size are listed and split exactly
# Listing and hashing a space costs milliseconds; tasks are rebuilt often (CLI, tests), so the
# split of each (task, knobs) is computed once per process. Entries are never mutated.
_SPLIT_CACHE: dict[tuple, dict[str, list[tuple[int, ...]]]] = {}


@dataclass(frozen=True)
class Prompt:
    """One problem: ``text`` is fed to the policy, ``answer`` is what a verifier checks against,
    ``meta`` is free metadata (a toy task's integer problem under ``"data"``; a dataset task's
    row index, demonstration, source row).

    Equality and hashing use ``text`` and ``answer`` only.
    """

    text: str
    answer: str
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise UsageTypeError(f"Prompt text must be a str, got {type(self.text).__name__}")
        if not isinstance(self.answer, str):
            raise UsageTypeError(f"Prompt answer must be a str, got {type(self.answer).__name__}")

    @property
    def data(self) -> tuple[int, ...]:
        """A toy task's integer problem (``meta["data"]``); ``()`` for text problems."""
        return tuple(self.meta.get("data", ()))


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

    def bind(self, tokenizer) -> None:
        """Adapt prompts to the policy's tokenizer (a dataset task applies its chat template);
        called once the policy is built. Toy tasks need nothing."""

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Strings (or single tokens) that end a response besides the policy's eos tokens (the
        sampler's stop set, :func:`varbench.rollout.sampler.stop_set`); a dataset task's
        ``stop`` knob. Default: none."""
        return ()

    def scoring_hint(self) -> str:
        """What a user should check when every reward is 0 (a dataset task names its verifier
        and prompt format); ``""``: say nothing (a toy task at random init scores 0)."""
        return ""

    @property
    def has_demonstrations(self) -> bool:
        """Whether :meth:`demonstration` gives a correct response (warm start needs it)."""
        return True

    def fingerprint(self) -> str:
        """What results computed on this task depend on: its name and knobs (a dataset task adds
        a hash of its data). Cache keys use it."""
        knobs = ",".join(f"{k}={v!r}" for k, v in sorted(self.knobs.items()))
        return f"{type(self).__module__}.{type(self).__qualname__}:{self.name}:{knobs}"

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


_REGISTRY: dict[str, type[Task] | Any] = {}
ENTRY_POINT_GROUP = "varbench.tasks"


def register_task(cls: type[Task] | None = None, *, name: str | None = None, replace=False):
    """Add a Task subclass (or a factory returning a Task) to the registry.

    As a class decorator ``@register_task`` (registered under ``cls.name``) or called as
    ``register_task(factory, name="mytask")``. ``replace=True`` overwrites an existing entry;
    otherwise a taken or empty name is a UsageError.
    """
    if cls is None:
        return lambda c: register_task(c, name=name, replace=replace)
    key = name or getattr(cls, "name", "")
    if not isinstance(key, str) or not key:
        raise UsageError(f"register_task: {cls!r} has no name; set the class attribute name or "
                         "pass name=")
    if key in _REGISTRY and not replace:
        raise UsageError(f"task name {key!r} is already registered; choose another name or pass "
                         "replace=True")
    if not ((isinstance(cls, type) and issubclass(cls, Task)) or callable(cls)):
        raise UsageTypeError(f"register_task: {cls!r} is neither a Task subclass nor a factory")
    _REGISTRY[key] = cls
    return cls


def _entry_points() -> dict[str, Any]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def task_names() -> list[str]:
    """Registered task names, then names installed packages declare under the ``varbench.tasks``
    entry-point group (loaded only when used)."""
    return list(dict.fromkeys([*_REGISTRY, *_entry_points()]))


def _check_type(obj: Any, knobs: dict[str, Any], spec: str) -> None:
    """Refuse what cannot give a Task with these knobs, without calling any of its code: a
    Task instance given knobs, a class that is not a Task subclass, a non-callable, a Task
    subclass without one of the knobs, a factory whose signature cannot take them."""
    if isinstance(obj, Task):
        if knobs:
            raise UsageError(f"task={spec!r} is a Task instance: it takes no knobs "
                             f"(got {sorted(knobs)})")
        return
    if isinstance(obj, type) and not issubclass(obj, Task):
        raise UsageTypeError(f"task={spec!r} names the class {obj.__name__}, which is not a "
                             "varbench Task subclass")
    if not callable(obj):
        raise UsageTypeError(f"task={spec!r} names a {type(obj).__name__}, not a Task subclass "
                             "or a factory returning a Task")
    if isinstance(obj, type):
        defaults = getattr(obj, "knob_defaults", None)
        unknown = sorted(set(knobs) - set(defaults)) if isinstance(defaults, dict) else []
        if unknown and obj.__init__ is Task.__init__:  # an own __init__ may take other knobs
            raise UsageError(f"task {spec!r} has no knob {unknown[0]!r}; valid knobs: "
                             f"{sorted(defaults)}")
        return
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):  # a builtin without a signature: found out when called
        return
    try:
        sig.bind(**knobs)
    except TypeError as err:
        raise UsageError(f"task={spec!r}: the factory cannot take the knobs {sorted(knobs)} "
                         f"({err})") from None


def _instantiate(obj: Any, knobs: dict[str, Any], spec: str) -> Task:
    """A Task from a Task subclass, a factory, or (without knobs) a Task instance."""
    _check_type(obj, knobs, spec)
    if isinstance(obj, Task):
        return obj
    task = obj(**knobs)
    if not isinstance(task, Task):
        raise UsageTypeError(f"task={spec!r}: the factory returned {type(task).__name__}, not a "
                             "varbench Task")
    return task


def get_task(spec: str, **knobs: Any) -> Task:
    """The task ``spec`` names, with ``knobs`` applied. ``spec`` is one of

    - a registered name (``sort``, ``arith``, ``toolsum``, a ``register_task`` name, or an
      installed package's ``varbench.tasks`` entry point);
    - ``MODULE:ATTR``: a user's Task subclass or a factory returning a Task (imported only
      because it is named here);
    - a local data file (.jsonl, .json, .csv, .parquet) or a ``datasets`` save_to_disk
      directory: a :class:`~varbench.tasks.dataset.DatasetTask`.

    Bad input (unknown name, missing file, import failure, not a Task) raises UsageError naming
    the spec and the choices.
    """
    from varbench._util.imports import import_object, is_reference

    if isinstance(spec, Task):
        return _instantiate(spec, knobs, repr(spec))
    if not isinstance(spec, str) or not spec:
        raise UsageTypeError(f"task must be a non-empty string, got {spec!r}")
    if spec in _REGISTRY:
        return _instantiate(_REGISTRY[spec], knobs, spec)
    if is_reference(spec):
        return _instantiate(import_object(spec, what="task"), knobs, spec)
    if spec in _entry_points():
        return _instantiate(_load_entry_point(spec), knobs, spec)
    from varbench.tasks.dataset import DatasetTask, looks_like_data

    if looks_like_data(spec):
        return DatasetTask(spec, **knobs)
    raise UsageError(f"task={spec!r} is not valid; choose one of {sorted(task_names())}, give "
                     "MODULE:ATTR (a Task subclass or factory), or a data file (.jsonl, .json, "
                     ".csv, .parquet) or a datasets directory")


def check_task(spec: str, **knobs: Any) -> Task | None:
    """Validate the task ``spec`` with ``knobs`` without calling a user's code.

    varbench's own tasks (``sort``, ``arith``, ``toolsum``) and data files (a
    :class:`~varbench.tasks.dataset.DatasetTask`; a ``MODULE:FUNCTION`` verifier knob is
    imported, not called) are built and returned, so their knobs are checked now. Anything
    else names user code: a ``MODULE:ATTR`` is imported, an entry point loaded, a
    ``register_task`` entry looked up, and each is checked by type only (a Task subclass and
    its knob names, a Task instance without knobs, or a callable whose signature takes the
    knobs); it is never called, and None is returned. Errors are those of :func:`get_task`.
    """
    from varbench._util.imports import import_object, is_reference

    if isinstance(spec, Task):
        _check_type(spec, knobs, repr(spec))
        return None
    if not isinstance(spec, str) or not spec:
        raise UsageTypeError(f"task must be a non-empty string, got {spec!r}")
    if spec in _REGISTRY:
        obj = _REGISTRY[spec]
        if isinstance(obj, type) and issubclass(obj, Task) and obj.__module__.startswith(
                "varbench."):
            return _instantiate(obj, knobs, spec)
        _check_type(obj, knobs, spec)
        return None
    if is_reference(spec):
        _check_type(import_object(spec, what="task"), knobs, spec)
        return None
    if spec in _entry_points():
        _check_type(_load_entry_point(spec), knobs, spec)
        return None
    return get_task(spec, **knobs)  # a data file (library code) or the error naming choices


def _load_entry_point(spec: str) -> Any:
    eps = _entry_points()
    try:
        return eps[spec].load()
    except Exception as err:  # noqa: BLE001 - a broken plugin: name it, keep our traceback
        raise UsageError(f"task={spec!r}: cannot load entry point {eps[spec].value!r} of "
                         f"group {ENTRY_POINT_GROUP!r} ({err})") from err


def _parse_int(text: str) -> int | None:
    """Integer in ``text`` (surrounding spaces allowed), else None."""
    t = text.strip()
    body = t[1:] if t.startswith("-") else t
    # ASCII digits only: str.isdigit() accepts symbols like '²' that int() rejects.
    if not body or len(body) > 12 or any(c not in DIGITS for c in body):
        return None
    return int(t)
