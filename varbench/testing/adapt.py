"""Turn what a user hands ``check_estimator`` into one scheme-shaped advantage function.

Accepted: a registered scheme name; ``"MODULE:FUNCTION"`` (imported by name with
:func:`varbench._util.imports.import_object`, nothing else is evaluated); or a callable of any
estimator shape. Callables go through the same adapter as ``register_scheme``,
:func:`varbench.estimators.adapters.as_scheme`, which tells the shapes apart by signature:

- scheme: ``fn(rewards[P, G], mask[P, G, T], opts: SchemeOptions) -> advantages[P, G, T]``;
- keywords: ``fn(rewards[P, G], mask[P, G, T], **options) -> advantages[P, G, T]``;
- verl: ``fn(token_level_rewards[B, T], response_mask[B, T], index[B], **kw)
  -> (advantages[B, T], returns[B, T])`` with groups given by ``index`` (B = P * G, b = p * G + i).

Unlike :func:`~varbench.estimators.advantages`, a loaded callable's output is returned raw (not
shape-checked, not masked), so the contract checks see leaks into padding.

Errors are :class:`EstimatorInputError` (a :class:`~varbench._util.checks.UsageError`, so a
ValueError and the CLI exits 2) saying which input was bad: module not importable, no such
attribute, not callable, wrong signature, an option the estimator cannot take.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from varbench._util.checks import UsageError
from varbench._util.imports import import_object


class EstimatorInputError(UsageError):
    """The estimator could not be loaded or has a signature the checker cannot call."""


@dataclass
class Estimator:
    """A loaded estimator: ``call(rewards, mask, **token_options)`` returns ``[P, G, T]``.

    ``shape``: ``"scheme"`` (a registered name or a scheme-shaped callable), ``"keywords"`` or
    ``"verl"``.
    """

    name: str
    shape: str
    call: Callable[..., torch.Tensor]


def load(fn_or_name: Any, options: dict[str, Any] | None = None) -> Estimator:
    """Resolve a scheme name, ``MODULE:FUNCTION`` or callable into an :class:`Estimator`.

    ``options`` are fixed keyword options passed on every call (e.g. ``k`` for topk); names that
    are not :class:`~varbench.estimators.SchemeOptions` fields are extra options, passed to the
    callable as keywords. Raises :class:`EstimatorInputError` for any bad input, before running.
    """
    options = dict(options or {})
    if isinstance(fn_or_name, str):
        if ":" not in fn_or_name:
            return _scheme(fn_or_name, options)
        fn, name = import_function(fn_or_name), fn_or_name
    elif callable(fn_or_name):
        fn, name = fn_or_name, getattr(fn_or_name, "__qualname__", repr(fn_or_name))
    else:
        raise EstimatorInputError(
            f"estimator={fn_or_name!r} is not valid; pass a registered scheme name, "
            "'MODULE:FUNCTION' or a callable"
        )
    from varbench.estimators.adapters import as_scheme, scheme_shape
    from varbench.estimators.registry import OPTION_NAMES, run_scheme

    extra = tuple(k for k in options if k not in OPTION_NAMES)
    try:
        shape = scheme_shape(fn)
        scheme = as_scheme(fn, extra_options=extra, shape=shape)
        if hasattr(scheme, "check_options"):
            scheme.check_options(options)
    except UsageError as err:
        raise EstimatorInputError(f"estimator {name!r}: {err}") from None

    def call(rewards: torch.Tensor, mask: torch.Tensor, **token_options: Any) -> torch.Tensor:
        return run_scheme(scheme, rewards, mask, {**token_options, **options},
                          extra_options=extra, label=f"estimator {name!r}", mask_output=False,
                          check_output=False)

    return Estimator(name, shape, call)


def import_function(ref: str) -> Callable:
    """Import ``MODULE:FUNCTION`` by name (only the module's own import runs)."""
    try:
        obj = import_object(ref, what="estimator")
    except UsageError as err:
        cause = err.__context__  # import_object raises "from None"; the ImportError stays here
        if isinstance(cause, ModuleNotFoundError) and cause.name:
            raise EstimatorInputError(
                f"module not found: {cause.name!r} ({err}); is it on PYTHONPATH?"
            ) from None
        raise EstimatorInputError(str(err)) from None
    if not callable(obj):
        raise EstimatorInputError(
            f"estimator={ref!r} is a {type(obj).__name__}, not a function; name an advantage "
            "function (or pass a registered scheme name)"
        )
    return obj


def _scheme(name: str, options: dict) -> Estimator:
    from varbench.estimators.registry import OPTION_NAMES, advantages, scheme_info, schemes

    if name not in schemes():
        raise EstimatorInputError(
            f"estimator={name!r} is not a registered scheme; choose one of {schemes()} "
            "or pass MODULE:FUNCTION"
        )
    fn, extra, _ = scheme_info(name)
    valid = OPTION_NAMES + extra
    unknown = sorted(k for k in options if k not in valid)
    if unknown:
        raise EstimatorInputError(
            f"estimator_options={unknown} is not valid for scheme {name!r}; valid: "
            f"{sorted(valid)}"
        )
    try:
        if hasattr(fn, "check_options"):  # a registered keyword- or verl-shaped function
            fn.check_options(options)
    except UsageError as err:
        raise EstimatorInputError(f"estimator {name!r}: {err}") from None

    def call(rewards: torch.Tensor, mask: torch.Tensor, **token_options: Any) -> torch.Tensor:
        return advantages(name, rewards, mask, **{**token_options, **options})

    return Estimator(name, "scheme", call)
