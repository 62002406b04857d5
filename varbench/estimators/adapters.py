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
  (:data:`VERL_OPTION_NAMES`). verl's ``config`` argument is not supplied (verl's estimators
  take ``config=None``).

Options (keyword and verl shapes): a keyword parameter named after an option receives it when
the caller gave it (``SchemeOptions.given``) or when the parameter has no default; ``**kw``
receives every given option. The per-token statistics are data, not choices: passed whenever
given (non-None) and accepted, dropped silently otherwise (the trainer hands ``logprobs`` and
``sum_pi_sq`` to every scheme). Any other option that was set (to a non-default value), and any
extra option, that the function cannot take raises :class:`~varbench._util.checks.UsageTypeError`
naming the option, its value and the options the function accepts.

The other direction, :func:`to_flat`, exposes a registered scheme as a verl estimator that
verl's ``compute_advantage`` calls unchanged (``config``, verl's keyword names, verl's tuple).
Groups of unequal size are handled by running the scheme once per distinct group size
(vectorised within each size); the built-in batch-coupled schemes are centred per group and
coupled over the batch; a user's batch-coupled scheme (``register_scheme(...,
batch_coupled=True)``) cannot be split that way and raises instead. :func:`from_flat`
registers a verl-shaped function under a name.
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
    "VERL_KEYWORDS",
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

VERL_KEYWORDS: Mapping[str, Mapping[str, str | None]] = MappingProxyType({
    "epsilon": MappingProxyType({"normalized": "eps", "normalized_batch": "eps",
                                 "otb": "baseline_eps", "otb_loo": "baseline_eps"}),
    "norm_adv_by_std_in_grpo": MappingProxyType({"normalized": None}),
})
"""verl keyword -> {scheme: the varbench option it sets}; ``None``: read by the adapter
(``norm_adv_by_std_in_grpo=False`` turns normalized into centered, as verl's GRPO does).
For another scheme the keyword has no meaning: its verl default is accepted (verl's own
estimators take and ignore it), any other value raises unless named in ``ignore``."""
_VERL_DEFAULTS = {"epsilon": (1e-6, 1e-8), "norm_adv_by_std_in_grpo": (True,)}
_RETURNS_TO_GO = ("otb", "otb_loo")  # verl's OTB returns (advantages, reward-to-go)
_RAGGED = ("reinforce_pp_baseline", "normalized_batch")  # batch-coupled, built from centered


def _config_get(config: Any, key: str) -> Any:
    """``config[key]`` of verl's AlgoConfig, a DictConfig, a dict or None (None if absent)."""
    if config is None:
        return None
    get = getattr(config, "get", None)
    if callable(get):
        return get(key, None)
    return getattr(config, key, None)


def to_flat(
    scheme: str,
    *,
    ignore: Iterable[str] = (),
    conventions: str = "verl",
    ignore_unknown: bool = False,
    **defaults: Any,
) -> FlatFn:
    """The registered ``scheme`` as a verl advantage estimator, to register unchanged with
    verl's ``register_adv_est`` and call from its ``compute_advantage``.

    ``fn(token_level_rewards[B, T], response_mask[B, T], index[B], config=None, **kw) ->
    (advantages[B, T], returns[B, T])``; ``returns`` is the reward-to-go for otb/otb_loo (as
    verl's OTB) and the advantages otherwise (as verl's critic-free estimators). ``index``: any
    array-like of hashable group ids (numpy, list, tensor); groups may have any sizes (one call
    per distinct size; the batch-coupled reinforce_pp_baseline and normalized_batch are
    centred per group, then coupled over the whole batch).

    Options, from ``defaults`` updated by ``kw``: varbench's names (:class:`SchemeOptions`, the
    scheme's extra options), verl's names for the token statistics (:data:`VERL_OPTION_NAMES`:
    ``old_log_probs``, ``sum_pi_squared``, ``rollout_is_weights``) and verl's estimator keywords
    (:data:`VERL_KEYWORDS`: ``epsilon``, ``norm_adv_by_std_in_grpo``; ``handle_zero_tail`` is
    the same name). ``config`` (verl's AlgoConfig, a dict or None) is read for what verl reads
    from it for this estimator: ``norm_adv_by_std_in_grpo`` (normalized). Any other option
    raises :class:`~varbench._util.checks.UsageTypeError` naming it (``defaults`` already at
    construction, before any rollout), unless listed in ``ignore`` (then dropped);
    ``ignore_unknown=True`` drops every unknown one (not advised).

    ``conventions`` (default ``"verl"``): the G = 1 convention passed to schemes that take it
    (:class:`SchemeOptions`); with ``"verl"`` the outcome of a non-OTB scheme is
    ``token_level_rewards.sum(-1)`` over every position, as verl sums it (an empty response
    keeps the reward placed under its mask), otherwise the sum over valid tokens.
    """
    fn_scheme, extra, batch_coupled = scheme_info(scheme)
    known = set(OPTION_NAMES) | set(extra)
    ignored = {ignore} if isinstance(ignore, str) else set(ignore)
    check_choice("conventions", conventions, ("varbench", "verl", "trl"))
    # scheme-shaped functions read opts.conventions; an adapted one only by its own keyword
    takes_conventions = not isinstance(fn_scheme, _Adapted) or "conventions" in fn_scheme.keywords
    ragged_ok = scheme in _RAGGED
    _options(scheme, known, ignored, ignore_unknown, defaults, None)  # refuse unknown ones now

    def fn(
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: Any = None,
        config: Any = None,
        **kw: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = response_mask.shape
        if token_level_rewards.shape != (B, T):
            raise UsageError(
                f"token_level_rewards has shape {list(token_level_rewards.shape)}, "
                f"expected response_mask's {[B, T]}"
            )
        if index is None:
            raise UsageError("index=None is not valid: give the group id of each row (verl's uid)")
        ids = index.cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
        if ids.shape != (B,):
            raise UsageError(f"index has shape {list(ids.shape)}, expected [{B}]")
        options, center_only = _options(scheme, known, ignored, ignore_unknown,
                                        {**defaults, **kw}, config)
        if takes_conventions and "conventions" not in options:
            options["conventions"] = conventions
        name = "centered" if center_only else scheme
        tok = _float(token_level_rewards)
        mask_f = response_mask.to(tok.dtype)
        verl_sum = options.get("conventions", conventions) == "verl"
        if name in _RETURNS_TO_GO or not verl_sum:
            rewards = tok
        else:  # verl: scores = token_level_rewards.sum(-1), every position
            rewards = tok.sum(-1)
        _, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
        inverse = inverse.reshape(-1)
        sizes = np.unique(counts)
        if batch_coupled and len(sizes) > 1 and not center_only:
            if not ragged_ok:
                raise UsageError(
                    f"scheme {scheme!r} couples groups across the batch and needs equal group "
                    f"sizes; index has groups of sizes {sizes.tolist()}"
                )
            adv = _ragged(scheme, rewards, tok, mask_f, inverse, options)
        else:
            adv = _by_size(name, rewards, mask_f, inverse, counts, sizes, options, B, T)
        if name in _RETURNS_TO_GO:  # verl's OTB: reward-to-go as the second value
            return adv, (tok * mask_f).flip(-1).cumsum(-1).flip(-1)
        return adv, adv

    fn.__name__ = f"to_flat_{scheme}"
    fn.__doc__ = f"verl-shaped view of the varbench scheme {scheme!r} (see varbench.to_flat)."
    return fn


def _options(
    scheme: str, known: set[str], ignored: set[str], ignore_unknown: bool,
    given: Mapping[str, Any], config: Any,
) -> tuple[dict[str, Any], bool]:
    """varbench options from verl's keywords and config; ``True``: normalized without std."""
    options: dict[str, Any] = {}
    center_only = False
    norm = _config_get(config, "norm_adv_by_std_in_grpo") if scheme == "normalized" else None
    for key, value in given.items():
        if key in ignored:
            continue
        if key in VERL_KEYWORDS:
            target = VERL_KEYWORDS[key].get(scheme, "-")
            if target is None:  # norm_adv_by_std_in_grpo for normalized
                if norm is not None and bool(norm) != bool(value):
                    raise UsageError(
                        f"norm_adv_by_std_in_grpo={value!r} contradicts config's "
                        f"norm_adv_by_std_in_grpo={norm!r}"
                    )
                norm = value
                continue
            if target == "-":
                if any(value == d for d in _VERL_DEFAULTS[key]):
                    continue  # verl's own default: verl's estimators take and ignore it too
                raise UsageTypeError(
                    f"option {key}={value!r} has no meaning for scheme {scheme!r} (verl reads it "
                    f"for {sorted(VERL_KEYWORDS[key])}); pass to_flat(..., ignore=({key!r},)) "
                    "to drop it"
                )
            key = target
        ours = _FROM_VERL.get(key, key) if key not in known else key
        if ours not in known:
            if ignore_unknown:
                continue
            raise UsageTypeError(
                f"scheme {scheme!r} got unknown option {key!r}; valid: varbench's "
                f"{sorted(known)}, verl's {sorted(VERL_OPTION_NAMES.values())} and "
                f"{sorted(VERL_KEYWORDS)}; pass to_flat(..., ignore=({key!r},)) to drop it"
            )
        if ours in options:
            raise UsageError(f"option {ours!r} given twice (as {ours!r} and as {key!r})")
        options[ours] = value
    if norm is not None and not bool(norm):
        center_only = True
        options.pop("eps", None)  # verl's epsilon only divides the std
    return options, center_only


def _regroup(x: Any, rows: torch.Tensor, B: int, T: int) -> Any:
    if isinstance(x, torch.Tensor) and x.shape in ((B, T), (B,)):
        return x[rows]
    return x


def _by_size(
    scheme: str, rewards: torch.Tensor, mask: torch.Tensor, inverse: np.ndarray,
    counts: np.ndarray, sizes: np.ndarray, options: Mapping[str, Any], B: int, T: int,
) -> torch.Tensor:
    """One vectorised :func:`advantages` call per distinct group size, scattered back."""
    order = np.argsort(inverse, kind="stable")  # rows grouped, original order inside
    starts = np.cumsum(counts) - counts
    out = torch.zeros(B, T, dtype=mask.dtype, device=mask.device)
    for size in sizes:  # one vectorised call per distinct group size, not per group
        groups = np.nonzero(counts == size)[0]
        rows = torch.as_tensor(order[starts[groups][:, None] + np.arange(size)[None, :]])
        rows = rows.to(mask.device)
        m = mask[rows]  # [P_s, size, T]
        if not bool(m.any()):
            continue  # every response of these groups is empty: advantages 0
        opts = {k: _regroup(v, rows, B, T) for k, v in options.items()}
        if size == 1 and scheme in _RETURNS_TO_GO and opts.get("conventions") == "verl":
            opts["handle_zero_tail"] = True  # verl: a lone response has no baseline, A = G_t
        adv = advantages(scheme, rewards[rows], m, **opts)
        out[rows.reshape(-1)] = adv.reshape(-1, T).to(out.dtype)
    return out


def _ragged(
    scheme: str, rewards: torch.Tensor, tok: torch.Tensor, mask: torch.Tensor,
    inverse: np.ndarray, options: Mapping[str, Any],
) -> torch.Tensor:
    """reinforce_pp_baseline / normalized_batch over groups of unequal sizes: centre each
    group (a lone response under ``conventions="verl"`` keeps R), then couple over the batch
    with the schemes' own helpers."""
    from varbench.estimators.schemes import batch_std, batch_whiten

    unknown = sorted(set(options) - {"conventions", "whiten_eps", "eps"} - set(TENSOR_OPTIONS))
    if unknown:
        raise UsageTypeError(f"scheme {scheme!r} over unequal groups takes no option {unknown}")
    m = mask != 0
    R = rewards if rewards.dim() == 1 else torch.where(m, tok, 0).sum(-1)
    g = torch.as_tensor(inverse, device=R.device)
    n = torch.bincount(g).to(R.dtype)
    mean = torch.zeros_like(n).index_add_(0, g, R) / n
    c = R - mean[g]
    if options.get("conventions", "varbench") == "verl":
        c = torch.where(n[g] == 1, R, c)
    if scheme == "reinforce_pp_baseline":
        lengths = m.sum(-1).to(R.dtype)
        a = batch_whiten(c, lengths, options.get("whiten_eps", OPTION_DEFAULTS["whiten_eps"]),
                         verl=options.get("conventions") == "verl")
    else:
        a = c / (batch_std(R) + options.get("eps", OPTION_DEFAULTS["eps"]))
    return torch.where(m, a.unsqueeze(-1), 0)


def _float(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_floating_point() else x.to(torch.get_default_dtype())
