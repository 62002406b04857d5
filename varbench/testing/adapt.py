"""Turn what a user hands ``check_estimator`` into one varbench-shaped advantage function.

Accepted: a registered scheme name; ``"MODULE:FUNCTION"`` (imported by name, nothing else is
evaluated); or a callable of one of two shapes, told apart by its signature:

- varbench: ``fn(rewards[P, G], mask[P, G, T], **options) -> advantages[P, G, T]``;
- verl: ``fn(token_level_rewards[B, T], response_mask[B, T], index[B], **kw)
  -> (advantages[B, T], returns[B, T])`` with groups given by ``index`` (B = P * G, b = p * G + i).

Errors are :class:`EstimatorInputError` (a ValueError, so the CLI exits 2) saying which input
was bad: module not found, no such function, not callable, wrong signature.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

VARBENCH_SHAPE = "fn(rewards[P,G], mask[P,G,T], **options) -> advantages[P,G,T]"
VERL_SHAPE = (
    "fn(token_level_rewards[B,T], response_mask[B,T], index[B], **kw) -> (advantages, returns)"
)
# Per-token statistics the check can hand an estimator that asks for them by name (or **kw).
TOKEN_OPTIONS = ("logprobs", "sum_pi_sq")


class EstimatorInputError(ValueError):
    """The estimator could not be loaded or has a signature the checker cannot call."""


@dataclass
class Estimator:
    """A loaded estimator: ``call(rewards, mask, **token_options)`` returns ``[P, G, T]``."""

    name: str
    shape: str  # "varbench" | "verl" | "scheme"
    call: Callable[..., torch.Tensor]


def load(fn_or_name: Any, options: dict[str, Any] | None = None) -> Estimator:
    """Resolve a scheme name, ``MODULE:FUNCTION`` or callable into an :class:`Estimator`.

    ``options`` are fixed keyword options passed on every call (e.g. ``k`` for topk).
    """
    options = dict(options or {})
    if isinstance(fn_or_name, str):
        if ":" in fn_or_name:
            fn = import_function(fn_or_name)
            name = fn_or_name
        else:
            return _scheme(fn_or_name, options)
    elif callable(fn_or_name):
        fn = fn_or_name
        name = getattr(fn, "__qualname__", repr(fn))
    else:
        raise EstimatorInputError(
            f"estimator={fn_or_name!r} is not valid; pass a registered scheme name, "
            "'MODULE:FUNCTION' or a callable"
        )
    shape = detect_shape(fn, name)
    accepted = _accepted_options(fn)
    if shape == "varbench":
        return Estimator(name, shape, _varbench_call(fn, options, accepted))
    return Estimator(name, shape, _verl_call(fn, options))


def import_function(ref: str) -> Callable:
    """Import ``MODULE:FUNCTION`` by name (only the module's own import runs)."""
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise EstimatorInputError(f"estimator reference {ref!r} is not valid; use MODULE:FUNCTION")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise EstimatorInputError(
            f"module not found: {module_name!r} (from {ref!r}): {err}; is it on PYTHONPATH?"
        ) from err
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EstimatorInputError(f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise EstimatorInputError(f"{ref!r} is a {type(obj).__name__}, not a function")
    return obj


def detect_shape(fn: Callable, name: str = "estimator") -> str:
    """"varbench" or "verl" from the parameter names (or, unnamed, the required count)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as err:
        raise EstimatorInputError(f"wrong signature: cannot inspect {name}: {err}") from err
    params = list(sig.parameters.values())
    names = [p.name for p in params]
    if {"token_level_rewards", "response_mask", "index"} <= set(names):
        return "verl"
    positional = [
        p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    required = [p for p in positional if p.default is p.empty]
    if names[:2] == ["rewards", "mask"] or (len(required) == 2 and len(positional) >= 2):
        return "varbench"
    if len(required) == 3:
        return "verl"
    raise EstimatorInputError(
        f"wrong signature: {name}{sig} matches neither {VARBENCH_SHAPE} (varbench) nor "
        f"{VERL_SHAPE} (verl)"
    )


def _accepted_options(fn: Callable) -> set[str] | None:
    """Keyword names ``fn`` accepts, or None when it takes ``**kwargs`` (accepts anything)."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}


def _varbench_call(fn: Callable, options: dict, accepted: set[str] | None) -> Callable:
    def call(rewards: torch.Tensor, mask: torch.Tensor, **token_options: Any) -> torch.Tensor:
        kw = {
            k: v for k, v in token_options.items() if accepted is None or k in accepted
        }
        return fn(rewards, mask, **kw, **options)

    return call


def _verl_call(fn: Callable, options: dict) -> Callable:
    # The [P,G,T] <-> [B,T] + index layout of varbench.estimators.adapters (row b = p * G + i,
    # index a numpy array like verl's uids, outcome reward on the last valid token). Not routed
    # through from_flat: that registers a scheme, and advantages() would zero masked positions,
    # hiding the very leaks the contract checks look for.
    from varbench.estimators import outcome_to_token_rewards

    def call(rewards: torch.Tensor, mask: torch.Tensor, **_: Any) -> torch.Tensor:
        P, G, T = mask.shape
        tlr = outcome_to_token_rewards(rewards, mask).reshape(P * G, T)
        index = np.repeat(np.arange(P), G)
        out = fn(tlr, mask.to(rewards.dtype).reshape(P * G, T), index, **options)
        adv = out[0] if isinstance(out, (tuple, list)) else out
        if not isinstance(adv, torch.Tensor):
            raise TypeError(f"verl-shaped estimator returned {type(adv).__name__}, not a tensor")
        return adv.reshape(P, G, T) if adv.numel() == P * G * T else adv

    return call


def _scheme(name: str, options: dict) -> Estimator:
    from varbench import estimators

    advantages, schemes = estimators.advantages, estimators.schemes

    if name not in schemes():
        raise EstimatorInputError(
            f"estimator={name!r} is not a registered scheme; choose one of {schemes()} "
            "or pass MODULE:FUNCTION"
        )

    def call(rewards: torch.Tensor, mask: torch.Tensor, **token_options: Any) -> torch.Tensor:
        return advantages(name, rewards, mask, **token_options, **options)

    return Estimator(name, "scheme", call)
