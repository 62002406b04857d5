"""The bounds of every numeric knob, declared once: read by the CLI, the suite schema, the
configs (TrainConfig, later the analyses' configs) and the library entry points.

A knob is known by its name wherever it appears (``G`` is the group size of ``sample``,
``train``, ``check``, a suite case and :class:`~varbench.train.TrainConfig` alike), so one
:class:`Bound` per name says its type and range. The upper bounds on sizes are sizes no run on
one machine could allocate (a typo like ``M = 3200000000``), not tuning advice; a size inside
them can still be too large for this machine, which :func:`check_memory` says before the work
(from a lower bound of what the work must hold at once, against this machine's RAM or the
device's memory). Errors name the argument, the value and the range (:class:`UsageError`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from varbench._util.checks import UsageError, UsageTypeError

# A seed is drawn into derived seeds such as ``seed * 1_000_003 + step``: at most 2^32 - 1 keeps
# those inside torch's 64-bit seeds for any step count the bounds below admit.
SEED_MAX = (1 << 32) - 1


@dataclass(frozen=True)
class Bound:
    """Type and range of one knob: an integer or a finite number in ``[lo, hi]`` (an end
    excluded when its ``*_open`` flag is set; None: unbounded on that side)."""

    kind: type  # int or float
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def describe(self) -> str:
        """``"an integer >= 1 and <= 65536"``, ``"a finite number in (0, 1)"``, ..."""
        if self.kind is float:
            if self.lo is None and self.hi is None:
                return "a finite number"
            lo = "-inf" if self.lo is None else _num(self.lo)
            hi = "inf" if self.hi is None else _num(self.hi)
            return (f"a finite number in {'(' if self.lo_open or self.lo is None else '['}{lo}, "
                    f"{hi}{')' if self.hi_open or self.hi is None else ']'}")
        parts = []
        if self.lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {_num(self.lo)}")
        if self.hi is not None:
            parts.append(f"{'<' if self.hi_open else '<='} {_num(self.hi)}")
        return " and ".join([f"an integer {parts[0]}", *parts[1:]]) if parts else "an integer"

    def admits(self, value: Any) -> bool:
        """Whether ``value`` has the knob's type and lies in its range."""
        if isinstance(value, bool):
            return False
        if self.kind is int:
            if not isinstance(value, int):
                return False
        elif not isinstance(value, (int, float)) or not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return self.hi is None or not (value >= self.hi if self.hi_open else value > self.hi)

    def problem(self, value: Any) -> str:
        """What is wrong with ``value``, as the end of a message (``"is too large; expected
        an integer >= 1 and <= 65536"``); ``""`` when it is admitted."""
        if self.admits(value):
            return ""
        big = (self.kind is int and isinstance(value, int) and not isinstance(value, bool)
               and self.hi is not None and value > self.hi)
        return f"is {'too large' if big else 'not valid'}; expected {self.describe()}"

    def check(self, arg: str, value: Any) -> Any:
        """``value`` (an int, or a float for a float knob); UsageError naming ``arg``."""
        problem = self.problem(value)
        if problem:
            typed = not isinstance(value, bool) and isinstance(
                value, int if self.kind is int else (int, float))
            raise (UsageError if typed else UsageTypeError)(f"{arg}={value!r} {problem}")
        return float(value) if self.kind is float else value


def _num(x: float) -> str:
    if isinstance(x, int) or float(x).is_integer() and abs(x) < 1 << 53:
        return str(int(x))
    return repr(x)


def _ints(lo: int, hi: int | None = None) -> Bound:
    return Bound(int, lo, hi)


_SIZE = 1 << 20  # counts of prompts, groups, draws: more than any single-machine run holds
_GROUP = 1 << 16  # responses per prompt
_STEPS = 1 << 27  # steps, sampled steps of a bias test

KNOBS: dict[str, Bound] = {
    # sizes: at least 1
    "G": _ints(1, _GROUP), "hacking_G": _ints(1, _GROUP), "eval_samples": _ints(1, _GROUP),
    "M": _ints(1, _SIZE), "variance_M": _ints(1, _SIZE), "M_cap": _ints(1, _SIZE),
    "n_prompts": _ints(1, _SIZE), "prompts": _ints(1, _SIZE),
    "prompts_per_step": _ints(1, _SIZE), "eval_prompts": _ints(1, _SIZE),
    "variance_prompts": _ints(1, _SIZE), "groups_per_call": _ints(1, _SIZE),
    "batch_size": _ints(1, _SIZE),
    "n_ref": _ints(1, 1 << 24), "n_boot": _ints(1, _SIZE),  # 0 draws: no interval
    "n_bins": _ints(1, _SIZE), "top_tokens": _ints(1, _SIZE), "topk_k": _ints(1, _SIZE),
    "table_limit": _ints(1, _SIZE), "eval_responses": _ints(1, _SIZE),
    "steps": _ints(1, _STEPS), "num_steps": _ints(3, _STEPS), "max_steps": _ints(1, _STEPS),
    "epochs": _ints(1, _SIZE), "minibatches": _ints(1, _SIZE), "eval_every": _ints(1, _STEPS),
    "keep_checkpoints": _ints(1, _SIZE), "surge_window": _ints(1, _SIZE),
    "max_new_tokens": _ints(1, _SIZE),
    # counts where 0 means "none" / "off"
    "token_budget": _ints(0), "checkpoint_every": _ints(0, _STEPS),
    "warmup_steps": _ints(0, _STEPS), "sketch_dim": _ints(0, 1 << 24),
    "min_responses": _ints(0, 1 << 24), "inner_steps": _ints(0, _SIZE),
    # seeds
    "seed": _ints(0, SEED_MAX), "warm_start_seed": _ints(0, SEED_MAX),
    "eval_seed": _ints(0, SEED_MAX), "sketch_seed": _ints(0, SEED_MAX),
    "seeds": _ints(0, SEED_MAX), "hacking_seeds": _ints(0, SEED_MAX),
    # a seed handed to a torch generator as it is (sample's: the analyses pass derived ones)
    "generator_seed": _ints(0, (1 << 64) - 1),
    # sampling
    "temperature": Bound(float, 0, None, lo_open=True),
    "top_p": Bound(float, 0, 1, lo_open=True),
    "top_k": _ints(1),
    # optimisation (TrainConfig)
    "lr": Bound(float, 0, None, lo_open=True), "adam_eps": Bound(float, 0, None, lo_open=True),
    "surge_factor": Bound(float, 0, None, lo_open=True),
    "clip_low": Bound(float, 0, 1, hi_open=True), "clip_high": Bound(float, 0),
    "kl_coef": Bound(float, 0), "weight_decay": Bound(float, 0), "grad_clip": Bound(float, 0),
    "adam_beta1": Bound(float, 0, 1, hi_open=True),
    "adam_beta2": Bound(float, 0, 1, hi_open=True),
    "entropy_floor": Bound(float, 0, 1, hi_open=True),
    # statistical thresholds
    "level": Bound(float, 0, 1, lo_open=True, hi_open=True),
    "alpha": Bound(float, 0, 1, lo_open=True, hi_open=True),
    "target_rel_se": Bound(float, 0, None, lo_open=True),
    "tolerance": Bound(float, 0), "rel_tolerance": Bound(float, 0),
    "abs_tolerance": Bound(float, 0),
    "logprob_tol": Bound(float, 0, None, lo_open=True),  # rollouts: behaviour vs checkpoint
    "max_variance_ratio": Bound(float, 0, None, lo_open=True),
    # validate: the threshold acc0 + frac x (1 - acc0) lies above the warm start, at most at 1
    "threshold_frac": Bound(float, 0, 1, lo_open=True),
}

# list knobs: each element is bounded by KNOBS[ELEMENT_OF[key]]; the list must be non-empty
ELEMENT_OF: dict[str, str] = {"Gs": "G", "inner_steps": "inner_steps", "seeds": "seeds",
                              "hacking_seeds": "hacking_seeds"}
NONEMPTY = frozenset({"schemes", "Gs", "modes", "states", "tasks", "ratios", "transforms",
                      "inner_steps", "seeds", "hacking_seeds", "hacking_rewards"})


def check_knob(key: str, value: Any, *, arg: str | None = None, minimum: int | None = None):
    """``value`` checked against the declaration of the knob ``key`` (errors name ``arg``,
    default ``key``). ``minimum`` tightens the lower bound where a caller needs more (the
    variance analysis needs G >= 2); it never loosens it."""
    bound = KNOBS[key]
    if minimum is not None and (bound.lo is None or minimum > bound.lo):
        bound = Bound(bound.kind, minimum, bound.hi, False, bound.hi_open)
    return bound.check(arg or key, value)


def argtype(key: str, flag: str) -> Callable[[str], Any]:
    """An argparse ``type=`` for the knob ``key`` spelled ``flag`` on the command line: the
    string parsed as the knob's type and checked against its bounds (argparse's error, exit 2,
    with the bound's message)."""
    bound = KNOBS[key]

    def convert(text: str) -> Any:
        import argparse

        try:  # argparse shows the message of an ArgumentTypeError only
            value = int(text) if bound.kind is int else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag}={text!r} is not valid; expected {bound.describe()}") from None
        try:
            return bound.check(flag, value)
        except UsageError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = bound.kind.__name__  # argparse names the type in its own messages
    return convert


def memory_limit(device: Any = "cpu") -> tuple[int, str]:
    """``(bytes, description)``: the memory a computation on ``device`` can at most hold (the
    device's total memory for CUDA, else this machine's physical RAM); ``(0, ...)`` unknown."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        try:
            return int(torch.cuda.get_device_properties(dev).total_memory), f"{dev} memory"
        except (RuntimeError, AssertionError):
            return 0, f"{dev} memory"
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "this machine's RAM"
    except (ValueError, OSError, AttributeError):  # not POSIX: no estimate
        return 0, "this machine's RAM"


def check_memory(arg: str, value: Any, need_bytes: float, device: Any = "cpu", *,
                 what: str = "") -> None:
    """UsageError when ``need_bytes`` (a lower bound of what the work holds at once) exceeds
    :func:`memory_limit` of ``device``: the refusal names ``arg``, its ``value``, the estimate
    (``what`` it is made of) and the limit. Unknown limits refuse nothing."""
    limit, where = memory_limit(device)
    if limit and need_bytes > limit:
        made = f" ({what})" if what else ""
        raise UsageError(f"{arg}={value!r} needs at least {_gib(need_bytes)}{made}, more than "
                         f"{where} ({_gib(limit)}); use a smaller {arg}")


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB"
