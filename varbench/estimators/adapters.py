"""Estimator shapes: one adapter into the scheme signature, and verl's flat ``[B, T]`` view.

Every consumer (:func:`~varbench.estimators.registry.register_scheme` and
:func:`~varbench.estimators.registry.advantages`, ``check_estimator``, suites, the trainer)
calls one signature, the *scheme shape* ``fn(rewards, mask, opts: SchemeOptions) ->
A[P, G, T]``. :func:`as_scheme` turns the two other shapes a user may write into it; they are
told apart by the signature (:func:`scheme_shape`, rules in its docstring):

- ``"scheme"``: ``fn(rewards, mask, opts)``, passed through unchanged;
- ``"keywords"``: ``fn(rewards, mask, **options)`` or ``fn(rewards, mask, *, k=1, ...)``: the
  options it can take are passed as keywords;
- ``"verl"``: ``fn(token_level_rewards[B, T], response_mask[B, T], index[B], **kw) ->
  (advantages[B, T], returns[B, T])``: groups are flattened to rows ``b = p * G + i`` with
  ``index[b] = p`` (a numpy int array, like verl's uids), outcome rewards are placed on each
  response's last valid token, and the per-token statistics go under verl's keyword names
  (:data:`VERL_OPTION_NAMES`). verl's ``config`` argument is not supplied.

Options (keyword and verl shapes): a keyword parameter named after an option receives it when
the caller gave it (``SchemeOptions.given``) or when the parameter has no default; ``**kw``
receives every given option. The per-token statistics are data, not choices: passed whenever
given (non-None) and accepted, dropped silently otherwise (the trainer hands ``logprobs`` and
``sum_pi_sq`` to every scheme). Any other option that was set (to a non-default value), and any
extra option, that the function cannot take raises :class:`~varbench._util.checks.UsageTypeError`
naming the option, its value and the options the function accepts.

The other direction, :func:`to_flat`, exposes a registered scheme in verl's shape. Groups of
unequal size are handled by running the scheme once per distinct group size (vectorised within
each size); a batch-coupled scheme (``register_scheme(..., batch_coupled=True)``) cannot be split
that way and raises instead. :func:`from_flat` registers a verl-shaped function under a name.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from varbench._util.checks import UsageError, UsageTypeError, check_choice
from varbench.estimators.registry import (
    OPTION_DEFAULTS,
    OPTION_NAMES,
    TENSOR_OPTIONS,
    SchemeFn,
    SchemeOptions,
    _is_default,
    advantages,
    register_scheme,
    scheme_info,
)

__all__ = [
    "SHAPES",
    "VERL_OPTION_NAMES",
    "as_scheme",
    "scheme_shape",
    "from_flat",
    "to_flat",
    "outcome_to_token_rewards",
]

FlatFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]

SHAPES: Mapping[str, str] = MappingProxyType({
    "scheme": "fn(rewards[P,G] or [P,G,T], mask[P,G,T], opts: SchemeOptions) -> A[P,G,T]",
    "keywords": "fn(rewards[P,G] or [P,G,T], mask[P,G,T], **options) -> A[P,G,T]",
    "verl": "fn(token_level_rewards[B,T], response_mask[B,T], index[B], **kw) "
            "-> (advantages[B,T], returns[B,T])",
})
"""The estimator shapes :func:`as_scheme` accepts, by name."""

VERL_OPTION_NAMES: Mapping[str, str] = MappingProxyType({
    "logprobs": "old_log_probs",
    "sum_pi_sq": "sum_pi_squared",
    "importance_weights": "rollout_is_weights",
})
"""SchemeOptions field -> the keyword a verl-shaped function receives it under (others: as is)."""

_VERL_ARGS = ("token_level_rewards", "response_mask", "index")
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_SHAPE_LIST = "; ".join(f"{k}: {v}" for k, v in SHAPES.items())


def outcome_to_token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[P, G] -> [P, G, T]``: each outcome reward placed on the response's last valid token.

    A response with no valid token gets its reward on the last position (under mask 0), so a
    plain sum over T still returns it.
    """
    m = mask != 0
    T = m.shape[-1]
    last = T - 1 - m.flip(-1).to(torch.uint8).argmax(-1)  # [P, G]
    out = torch.zeros(m.shape, dtype=rewards.dtype, device=rewards.device)
    return out.scatter_(-1, last.unsqueeze(-1), rewards.unsqueeze(-1))


# ---- shape detection -----------------------------------------------------------------------


def _label(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _signature(fn: Any) -> inspect.Signature:
    if not callable(fn):
        raise UsageTypeError(
            f"estimator={fn!r} is not valid: a {type(fn).__name__} is not callable; "
            f"give a function of one of the shapes {_SHAPE_LIST}"
        )
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError) as err:
        raise UsageTypeError(
            f"wrong signature: cannot inspect {_label(fn)} ({err}); give a function of one of "
            f"the shapes {_SHAPE_LIST}"
        ) from None


def _is_options_annotation(annotation: Any) -> bool:
    if annotation is SchemeOptions:
        return True
    return isinstance(annotation, str) and annotation.split(".")[-1] == "SchemeOptions"


def _verl_by_name(sig: inspect.Signature) -> bool:
    """Whether ``sig`` takes verl's three arguments by keyword (as verl itself calls them)."""
    params = sig.parameters
    return set(_VERL_ARGS) <= set(params) and all(
        params[n].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        for n in _VERL_ARGS
    )


def _detect(sig: inspect.Signature) -> str | None:
    pos = [p for p in sig.parameters.values() if p.kind in _POSITIONAL]
    if _verl_by_name(sig) or (len(pos) >= 3 and pos[2].name == "index"):
        return "verl"
    if len(pos) >= 3 and (pos[2].default is inspect.Parameter.empty or pos[2].name == "opts"
                          or _is_options_annotation(pos[2].annotation)):
        return "scheme"
    if len(pos) >= 2:
        return "keywords"
    return None


def scheme_shape(fn: Callable) -> str:
    """``"scheme"``, ``"keywords"`` or ``"verl"``: the shape of ``fn``, from its signature.

    Rules, in order (``positional`` = the parameters that can be passed by position):

    1. ``"verl"`` when ``fn`` has parameters named ``token_level_rewards``, ``response_mask``
       and ``index`` (called by keyword, as verl does), or its third positional parameter is
       named ``index`` (called by position);
    2. ``"scheme"`` when it has a third positional parameter without a default (or named
       ``opts``, or annotated ``SchemeOptions``): ``fn(rewards, mask, opts)``, e.g.
       ``lambda r, m, o: ...``;
    3. ``"keywords"`` when it has at least two positional parameters (and any third one has a
       default, so it is an option): ``fn(rewards, mask, **options)``.

    Anything else (one positional parameter, ``fn(*args, **kw)``, a non-callable) raises
    :class:`~varbench._util.checks.UsageTypeError` starting "wrong signature" (or saying it is
    not callable); :func:`as_scheme`'s ``shape=`` forces a shape instead.
    """
    sig = _signature(fn)
    shape = _detect(sig)
    if shape is None:
        raise UsageTypeError(
            f"wrong signature: {_label(fn)}{sig} matches none of the estimator shapes "
            f"{_SHAPE_LIST}"
        )
    return shape


# ---- the adapter ---------------------------------------------------------------------------


class _Adapted:
    """A keyword- or verl-shaped function behind the scheme signature ``(rewards, mask, opts)``."""

    def __init__(
        self, fn: Callable, sig: inspect.Signature, shape: str, names: Mapping[str, str],
        extra_options: tuple[str, ...],
    ) -> None:
        self.source, self.shape, self.signature = fn, shape, sig
        self.names = dict(names)  # SchemeOptions field -> keyword name in fn
        params = list(sig.parameters.values())
        pos = [p for p in params if p.kind in _POSITIONAL]
        self.by_keyword = shape == "verl" and _verl_by_name(sig)
        n_args = 3 if shape == "verl" else 2
        skip = set(_VERL_ARGS) if self.by_keyword else {p.name for p in pos[:n_args]}
        var_positional = any(p.kind is p.VAR_POSITIONAL for p in params)
        if len(pos) < n_args and not var_positional and not self.by_keyword:
            raise UsageTypeError(
                f"wrong signature: {_label(fn)}{sig} cannot be called as the {shape} shape "
                f"{SHAPES[shape]}"
            )
        late = [p.name for p in pos[n_args:] if p.kind is inspect.Parameter.POSITIONAL_ONLY
                and p.default is p.empty and p.name not in skip]
        if late:
            raise UsageTypeError(
                f"wrong signature: {_label(fn)}{sig} requires positional argument(s) {late} "
                f"beyond the {shape} shape {SHAPES[shape]}"
            )
        # keyword-capable parameters other than the shape's own arguments -> required?
        self.keywords: dict[str, bool] = {
            p.name: p.default is p.empty
            for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in skip
        }
        self.any_keyword = any(p.kind is p.VAR_KEYWORD for p in params)
        self.fields = {self.names.get(f, f): f for f in OPTION_NAMES}  # keyword -> field
        known = set(self.fields) | set(extra_options)
        unknown = [k for k, required in self.keywords.items() if required and k not in known]
        if unknown:
            raise UsageTypeError(
                f"{_label(fn)}{sig} requires keyword argument(s) {unknown}, which are no "
                f"option: the options are {sorted(self.fields)}; declare any other as an extra "
                "option (register_scheme(..., extra_options=[...]) or check_estimator(..., "
                "estimator_options={...}))"
            )
        for k in extra_options:
            if not self.accepts(k):
                raise self._refusal(k, None, declared=True)
        self.__name__ = f"as_scheme<{getattr(fn, '__name__', _label(fn))}>"
        self.__qualname__ = f"as_scheme<{_label(fn)}>"
        self.__module__ = getattr(fn, "__module__", None) or __name__
        self.__doc__ = getattr(fn, "__doc__", None)

    def __repr__(self) -> str:
        return f"as_scheme({_label(self.source)}, shape={self.shape!r})"

    def accepts(self, keyword: str) -> bool:
        """Whether the function can take the keyword argument ``keyword``."""
        return self.any_keyword or keyword in self.keywords

    def accepted(self) -> list[str]:
        return ["**kwargs"] if self.any_keyword else sorted(self.keywords)

    def _refusal(self, option: str, value: Any, *, declared: bool = False) -> UsageTypeError:
        key = self.names.get(option, option)
        what = "declared extra option" if declared else f"option {option}={value!r}"
        return UsageTypeError(
            f"{what} cannot be passed to {_label(self.source)}{self.signature}: it takes no "
            f"keyword {key!r}; the keywords it accepts: {self.accepted()}"
        )

    def check_options(self, options: Mapping[str, Any]) -> None:
        """Raise, as a call would, for an option in ``options`` that the function cannot take."""
        for option, value in options.items():
            key = self.names.get(option, option)
            if self.accepts(key) or option in TENSOR_OPTIONS:
                continue
            if option not in OPTION_DEFAULTS or not _is_default(option, value):
                raise self._refusal(option, value)

    def keywords_for(self, opts: SchemeOptions, rows: tuple[int, int] | None) -> dict[str, Any]:
        """The keyword arguments for one call (tensor options reshaped to ``rows`` if given)."""
        kw: dict[str, Any] = {}
        given = opts.given or frozenset()
        for option in OPTION_NAMES:
            key = self.names.get(option, option)
            value = getattr(opts, option)
            named = key in self.keywords
            if option in TENSOR_OPTIONS:
                if value is not None and (named or self.any_keyword):
                    kw[key] = value.reshape(rows) if rows is not None else value
                continue
            if named:
                if option in given or self.keywords[key]:
                    kw[key] = value
            elif option in given:
                if self.any_keyword:
                    kw[key] = value
                elif not _is_default(option, value):
                    raise self._refusal(option, value)
        for key, value in opts.extra.items():
            if not self.accepts(key):
                raise self._refusal(key, value)
            kw[key] = value
        missing = [k for k, required in self.keywords.items() if required and k not in kw]
        if missing:
            options = [self.fields.get(k, k) for k in missing]
            raise UsageError(
                f"{_label(self.source)} requires option(s) {options} (keyword {missing}), which "
                f"the caller did not give; pass {options[0]}=... (given: {sorted(given)})"
            )
        return kw

    def __call__(self, rewards: torch.Tensor, mask: torch.Tensor, opts: SchemeOptions):
        if self.shape == "keywords":
            return self.source(rewards, mask, **self.keywords_for(opts, None))
        P, G, T = mask.shape
        B = P * G
        tok = rewards if rewards.dim() == 3 else outcome_to_token_rewards(rewards, mask)
        args = (tok.reshape(B, T), mask.to(tok.dtype).reshape(B, T), np.repeat(np.arange(P), G))
        kw = self.keywords_for(opts, (B, T))
        if self.by_keyword:
            out = self.source(**dict(zip(_VERL_ARGS, args, strict=True)), **kw)
        else:
            out = self.source(*args, **kw)
        adv = out[0] if isinstance(out, (tuple, list)) and out else out
        if not isinstance(adv, torch.Tensor):
            raise UsageTypeError(
                f"verl-shaped {_label(self.source)} returned {type(adv).__name__}; expected "
                "(advantages[B, T], returns[B, T]) or a tensor"
            )
        if tuple(adv.shape) != (B, T):
            raise UsageError(
                f"verl-shaped {_label(self.source)} returned advantages of shape "
                f"{list(adv.shape)}, expected [B, T] = {[B, T]} (B = P * G)"
            )
        return adv.reshape(P, G, T).to(tok.dtype)


def as_scheme(
    fn: Callable,
    *,
    extra_options: Iterable[str] = (),
    shape: str | None = None,
    option_names: Mapping[str, str] | None = None,
) -> SchemeFn:
    """``fn`` as a scheme-shaped function ``scheme(rewards, mask, opts) -> A[P, G, T]``.

    The shape of ``fn`` is read from its signature (:func:`scheme_shape`) unless ``shape``
    (``"scheme"``, ``"keywords"`` or ``"verl"``) forces it. A scheme-shaped ``fn`` is returned
    unchanged; the others are wrapped (module docstring: how options are passed).
    ``extra_options`` are the options beyond :class:`SchemeOptions` the caller may give: each
    must be a keyword ``fn`` accepts. ``option_names`` maps a SchemeOptions field to the keyword
    ``fn`` takes it under (default: the field's own name; verl shape: :data:`VERL_OPTION_NAMES`
    first). The wrapper has ``.source`` (``fn``), ``.shape`` and ``.accepts(keyword)``.

    Raises :class:`~varbench._util.checks.UsageTypeError` for a signature that fits no shape, a
    required keyword that is no option (nor in ``extra_options``), or an extra option ``fn``
    cannot take; at call time, for a set option ``fn`` cannot take (naming it).
    """
    sig = _signature(fn)
    if shape is None:
        shape = scheme_shape(fn)
    else:
        check_choice("shape", shape, SHAPES)
    if isinstance(extra_options, str):
        raise UsageTypeError(f"extra_options={extra_options!r} is not valid; give a list of names")
    extra = tuple(extra_options)
    if shape == "scheme":  # reads every option, extras included, from opts
        return fn
    names = dict(VERL_OPTION_NAMES) if shape == "verl" else {}
    for option, key in (option_names or {}).items():
        check_choice("option_names key", option, OPTION_NAMES)
        if not isinstance(key, str) or not key.isidentifier():
            raise UsageTypeError(
                f"option_names[{option!r}]={key!r} is not valid; expected a keyword name"
            )
        names[option] = key
    return _Adapted(fn, sig, shape, names, extra)


# ---- verl's flat layout --------------------------------------------------------------------


def from_flat(
    fn: FlatFn,
    name: str,
    *,
    extra_options: Iterable[str] = (),
    pass_options: Mapping[str, str] | None = None,
) -> str:
    """Register a verl-shaped estimator ``fn`` as the varbench scheme ``name``; return ``name``.

    The same as ``register_scheme(name, extra_options=...)(as_scheme(fn, shape="verl",
    option_names=pass_options))``: rows are ``b = p * G + i``, ``index[b] = p`` (numpy int
    array), ``[P, G]`` rewards are placed on each response's last valid token, ``extra_options``
    are keyword options forwarded to ``fn`` unchanged (e.g. ``("epsilon",)``) and
    ``pass_options`` maps varbench options to ``fn``'s keyword names beyond
    :data:`VERL_OPTION_NAMES` (``[P, G, T]`` tensors flattened to ``[B, T]``). The returned
    ``returns`` are discarded. ``register_scheme(name)(fn)`` does the same when ``fn``'s
    signature already reads as verl's.
    """
    if not callable(fn):
        raise UsageTypeError(f"fn={fn!r} is not valid; expected a verl-shaped callable")
    extra = tuple(extra_options)
    scheme = as_scheme(fn, extra_options=extra, shape="verl", option_names=pass_options)
    register_scheme(name, extra_options=extra)(scheme)
    return name


_FROM_VERL = {v: k for k, v in VERL_OPTION_NAMES.items()}


def to_flat(scheme: str, *, ignore_unknown: bool = False, **defaults: Any) -> FlatFn:
    """Expose the registered ``scheme`` as ``fn(token_level_rewards, response_mask, index, **kw)``.

    Returns ``(advantages, advantages)`` as verl's critic-free estimators do. ``index``: any
    array-like of hashable group ids (numpy, list, tensor). Keyword options are ``defaults``
    updated by ``kw``, under varbench's names or verl's (:data:`VERL_OPTION_NAMES`, e.g.
    ``old_log_probs``); ``[B, T]`` tensors among them are regrouped like the rewards.
    ``ignore_unknown=True`` drops options the scheme does not know (verl passes e.g. ``config``).
    """
    _, extra, batch_coupled = scheme_info(scheme)
    known = set(OPTION_NAMES) | set(extra)

    def fn(
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: Any,
        **kw: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = response_mask.shape
        if token_level_rewards.shape != (B, T):
            raise UsageError(
                f"token_level_rewards has shape {list(token_level_rewards.shape)}, "
                f"expected response_mask's {[B, T]}"
            )
        ids = index.cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
        if ids.shape != (B,):
            raise UsageError(f"index has shape {list(ids.shape)}, expected [{B}]")
        options: dict[str, Any] = {}
        for key, value in {**defaults, **kw}.items():
            ours = _FROM_VERL.get(key, key) if key not in known else key
            if ours in options:
                raise UsageError(f"option {ours!r} given twice (as {ours!r} and as {key!r})")
            options[ours] = value
        if ignore_unknown:
            options = {k: v for k, v in options.items() if k in known}
        _, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
        inverse = inverse.reshape(-1)
        sizes = np.unique(counts)
        if batch_coupled and len(sizes) > 1:
            raise UsageError(
                f"scheme {scheme!r} couples groups across the batch and needs equal group sizes; "
                f"index has groups of sizes {sizes.tolist()}"
            )
        order = np.argsort(inverse, kind="stable")  # rows grouped, original order inside
        starts = np.cumsum(counts) - counts
        out = torch.zeros_like(token_level_rewards, dtype=_float(token_level_rewards).dtype)
        for size in sizes:  # one vectorised call per distinct group size, not per group
            groups = np.nonzero(counts == size)[0]
            rows = torch.as_tensor(order[starts[groups][:, None] + np.arange(size)[None, :]])
            rows = rows.to(response_mask.device)

            def take(x: torch.Tensor, rows: torch.Tensor = rows) -> torch.Tensor:
                return x[rows]  # [P_s, size, T]

            opts = {
                k: take(v) if isinstance(v, torch.Tensor) and v.shape == (B, T) else v
                for k, v in options.items()
            }
            adv = advantages(
                scheme, take(_float(token_level_rewards)), take(response_mask), **opts
            )
            out[rows.reshape(-1)] = adv.reshape(-1, T).to(out.dtype)
        return out, out

    fn.__name__ = f"to_flat_{scheme}"
    fn.__doc__ = f"verl-shaped view of the varbench scheme {scheme!r} (see varbench.to_flat)."
    return fn


def _float(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())
