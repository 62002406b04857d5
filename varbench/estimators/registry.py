"""The advantage-scheme registry and the one entry point ``advantages(scheme, rewards, mask)``.

Every registered scheme is called with one signature, ``fn(rewards, mask, opts) -> Tensor[P, G,
T]`` (the *scheme shape*):

- ``rewards``: float ``[P, G]`` outcome rewards or ``[P, G, T]`` token rewards (as given);
  use :func:`outcome_rewards` / :func:`reward_to_go` to read them in either shape;
- ``mask``: bool ``[P, G, T]``, True where the token counts;
- ``opts``: a :class:`SchemeOptions`, the keyword options of :func:`advantages`.

:func:`register_scheme` also takes a keyword-shaped ``fn(rewards, mask, **options)`` or a
verl-shaped ``fn(token_level_rewards, response_mask, index, **kw)``: it stores
:func:`varbench.estimators.adapters.as_scheme` of the function, so every consumer (advantages,
check_estimator, suites, the trainer) still calls the one signature.

Options policy: every scheme receives the full ``SchemeOptions`` and ignores fields it does not
use (so a caller never branches on the scheme name); an option name that is neither a
``SchemeOptions`` field nor declared by the scheme at registration (``extra_options``) raises
:class:`~varbench._util.checks.UsageTypeError` listing the valid names. Boundary checks (shapes,
NaN/inf rewards, empty masks) happen here once (:func:`run_scheme`), so schemes are pure
formulas. Bad input raises :class:`~varbench._util.checks.UsageError` (a ValueError) or
``UsageTypeError`` (also a TypeError).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from varbench._util.checks import (
    UsageError,
    UsageTypeError,
    check_choice,
    check_scheme_tensors,
    check_shape,
)

__all__ = [
    "CONVENTIONS",
    "SchemeOptions",
    "SchemeFn",
    "advantages",
    "run_scheme",
    "register_scheme",
    "unregister_scheme",
    "schemes",
    "scheme_info",
    "EXACT_SUFFIX",
    "exact_label",
    "split_label",
    "outcome_rewards",
    "reward_to_go",
    "returns_of",
    "togo_of",
    "valid_lengths",
]


@dataclass(frozen=True)
class SchemeOptions:
    """Keyword options shared by all schemes (each scheme reads only the fields it uses).

    Tensor options are ``[P, G, T]`` and only read where ``mask`` is True.
    """

    eps: float = 1e-6
    """normalized: added to the group std (A = (R - mu) / (sigma + eps))."""
    unbiased_std: bool = True
    """normalized: Bessel-corrected group std (False: the biased, divide-by-G std)."""
    k: int = 1
    """topk: keep the top k rewards (ties at the k-th kept); passk: the k of pass@k."""
    token_weights: torch.Tensor | None = None
    """otb/otb_loo: per-token weight w_t (exact ||g_t||^2 or the proxy)."""
    logprobs: torch.Tensor | None = None
    """otb/otb_loo: log pi_old(y_t); with ``sum_pi_sq`` gives the proxy when no token_weights."""
    sum_pi_sq: torch.Tensor | None = None
    """otb/otb_loo: sum_v pi_old(v)^2 at each position (for the proxy)."""
    cumulative_weights: torch.Tensor | None = None
    """otb/otb_loo: W_t passed directly (overrides token_weights; e.g. |o_i| gives OPO)."""
    importance_weights: torch.Tensor | None = None
    """otb/otb_loo: rollout importance ratio rho_t; w_t is scaled by rho_t^2."""
    handle_zero_tail: bool = True
    """otb: where one response alone is still running, use B_t = 0 (A = G_t) instead of 0."""
    compact: bool = True
    """otb/otb_loo: align responses by generated-token count (multi-turn), then scatter back."""
    baseline_eps: float = 1e-8
    """otb/otb_loo: added to sum_i W_t^i in the baseline's denominator."""
    whiten_eps: float = 1e-8
    """reinforce_pp_baseline: added to the batch variance before the square root."""
    conventions: str = "varbench"
    """Edge cases where the libraries disagree (:data:`CONVENTIONS`): a group of one response
    (G = 1). ``"varbench"``: normalized/rloo return A = R, centered/opo return 0; ``"verl"``
    (verl 0.9.1's loop estimators): no baseline, A = R (normalized: R / (1 + eps)),
    reinforce_pp_baseline centres a lone response at 0 baseline; ``"trl"`` (TRL 1.16.0): A = 0.
    On multi-turn masks ``"verl"`` also makes ``otb`` verl's ``optimal_token_baseline``
    (positions aligned by column, its zero tail from the second-longest token count) unless
    ``compact`` is given; ``"varbench"`` is verl's ``tir_optimal_token_baseline``."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Options a user scheme declared with ``register_scheme(name, extra_options=...)``."""
    given: frozenset[str] | None = field(default=None, repr=False, compare=False)
    """Names of the options the caller passed (:func:`advantages` fills it in). Built directly
    with ``given=None``, it holds the fields whose value differs from the default, and the
    ``extra`` keys. Adapted keyword/verl functions receive given options even where they have
    their own default (see :func:`varbench.estimators.adapters.as_scheme`)."""

    def __post_init__(self) -> None:
        if self.given is None:
            set_ = {f for f in OPTION_NAMES if not _is_default(f, getattr(self, f))}
            object.__setattr__(self, "given", frozenset(set_ | set(self.extra)))
        else:
            object.__setattr__(self, "given", frozenset(self.given))


SchemeFn = Callable[[torch.Tensor, torch.Tensor, SchemeOptions], torch.Tensor]
TENSOR_OPTIONS = (
    "token_weights", "logprobs", "sum_pi_sq", "cumulative_weights", "importance_weights"
)
"""The per-token statistics among the options (``[P, G, T]`` tensors, default None)."""
OPTION_NAMES = tuple(f.name for f in fields(SchemeOptions) if f.name not in ("extra", "given"))
"""The option fields of :class:`SchemeOptions` (every keyword :func:`advantages` knows)."""
OPTION_DEFAULTS = {f.name: f.default for f in fields(SchemeOptions) if f.name in OPTION_NAMES}
CONVENTIONS: tuple[str, ...] = ("varbench", "verl", "trl")
"""The values of the ``conventions`` option (G = 1 and empty-response edge cases)."""


def _is_default(name: str, value: Any) -> bool:
    """Whether ``value`` is option ``name``'s default (a tensor option: whether it is None)."""
    default = OPTION_DEFAULTS[name]
    if default is None or isinstance(value, torch.Tensor):
        return value is None
    return type(value) is type(default) and value == default


@dataclass(frozen=True)
class _Entry:
    fn: SchemeFn  # the scheme-shaped callable every consumer calls
    source: Callable  # what the user registered (for re-registration and messages)
    extra_options: tuple[str, ...]
    batch_coupled: bool  # True: the result of a group depends on other groups of the batch
    output_masked: bool  # True: the scheme already returns exact zeros under mask 0
    reads: tuple[str, ...] = ()  # the options the scheme declares it reads (capabilities)


_REGISTRY: dict[str, _Entry] = {}


def register_scheme(
    name: str,
    *,
    extra_options: Iterable[str] = (),
    batch_coupled: bool = False,
    output_masked: bool = False,
    reads: Iterable[str] = (),
) -> Callable[[SchemeFn], SchemeFn]:
    """Decorator registering an advantage function under ``name``; returns ``fn`` unchanged.

    ``fn`` may have any of the three shapes of :func:`~varbench.estimators.adapters.as_scheme`
    (told apart by its signature): the scheme shape ``fn(rewards, mask, opts) -> Tensor[P, G,
    T]``, the keyword shape ``fn(rewards, mask, **options)`` or verl's ``fn(token_level_rewards,
    response_mask, index, **kw) -> (advantages, returns)``. The registry stores
    ``as_scheme(fn)``, so :func:`advantages` and :func:`scheme_info` see the scheme shape.

    ``extra_options`` names keyword options beyond :class:`SchemeOptions` that the scheme reads
    from ``opts.extra``. ``batch_coupled=True`` marks schemes whose groups interact (e.g. batch
    whitening); adapters then refuse to split a batch by group size. ``output_masked=True``
    promises finite values and exact zeros where mask is False, so :func:`advantages` skips its
    final masking pass (a speed option; the default masks every output). ``reads`` declares
    the options the scheme reads beyond the rewards (e.g. ``("token_weights", "logprobs",
    "sum_pi_sq")`` for OTB): what the trainer and the analyses ask of it
    (:func:`scheme_reads`; e.g. only such a scheme takes ``token_weights="exact"``) instead of
    guessing from its name or calling it. Re-registering the same
    function (same module and qualified name) replaces it; a different function raises.
    A signature that fits no shape, a required keyword that is no option, or an extra option the
    function cannot take raises :class:`~varbench._util.checks.UsageTypeError` here.
    """
    if not isinstance(name, str) or not name:
        raise UsageTypeError(f"name={name!r} is not valid; a scheme name is a non-empty string")
    if isinstance(extra_options, str):
        raise UsageTypeError(f"extra_options={extra_options!r} is not valid; give a list of names")
    extra = tuple(extra_options)
    clash = [o for o in extra if o in OPTION_NAMES]
    if clash:
        raise UsageError(
            f"extra_options={clash} is not valid: clashes with the built-in options "
            f"{list(OPTION_NAMES)}"
        )

    if isinstance(reads, str):
        raise UsageTypeError(f"reads={reads!r} is not valid; give a list of option names")
    declared = tuple(reads)
    unknown = [o for o in declared if o not in OPTION_NAMES and o not in extra]
    if unknown:
        raise UsageError(f"reads={unknown} is not valid: not options of a scheme; choose from "
                         f"{sorted([*OPTION_NAMES, *extra])}")

    def deco(fn: Callable) -> Callable:
        from varbench.estimators.adapters import as_scheme  # adapters imports this module

        scheme = as_scheme(fn, extra_options=extra)
        old = _REGISTRY.get(name)
        if old is not None and not _same_function(old.source, fn):
            raise UsageError(
                f"scheme {name!r} is already registered to {_describe(old.source)}; "
                f"unregister_scheme({name!r}) first or pick another name"
            )
        _REGISTRY[name] = _Entry(scheme, fn, extra, batch_coupled, output_masked, declared)
        return fn

    return deco


def _describe(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _same_function(a: Callable, b: Callable) -> bool:
    if a is b:
        return True
    key = (getattr(a, "__module__", None), getattr(a, "__qualname__", None))
    return key[1] is not None and "<locals>" not in key[1] and key == (
        getattr(b, "__module__", None), getattr(b, "__qualname__", None)
    )


def unregister_scheme(name: str) -> None:
    """Remove a registered scheme (KeyError-free: UsageError listing the known names)."""
    _lookup(name)
    del _REGISTRY[name]


def schemes() -> list[str]:
    """Names of the registered schemes, in registration order (built-ins first)."""
    return list(_REGISTRY)


def scheme_reads(name: str) -> tuple[str, ...]:
    """The options scheme ``name`` declared it reads (``register_scheme(..., reads=...)``)."""
    return _lookup(name).reads


def reads(name: str, option: str) -> bool:
    """Whether scheme ``name`` declared that it reads ``option`` (e.g. ``"token_weights"``)."""
    return option in _lookup(name).reads


def weighted_schemes() -> list[str]:
    """The registered schemes that read token weights (those ``token_weights="exact"`` and an
    analysis label ``<scheme>_exact`` apply to)."""
    return [n for n, e in _REGISTRY.items() if "token_weights" in e.reads]


EXACT_SUFFIX = "_exact"
"""How an analysis label asks a weighted scheme for exact token weights (``otb_exact``)."""


def exact_label(name: str) -> str:
    """The analysis label of scheme ``name`` fed exact token weights (``otb`` -> ``otb_exact``)."""
    return name + EXACT_SUFFIX


def split_label(label: str) -> tuple[str, bool]:
    """``(scheme, exact_weights)`` of an analysis label, the one parser of the ``_exact``
    suffix: ``otb_exact`` -> ``("otb", True)``, ``otb`` -> ``("otb", False)``."""
    if label.endswith(EXACT_SUFFIX):
        return label[: -len(EXACT_SUFFIX)], True
    return label, False


def scheme_info(name: str) -> tuple[SchemeFn, tuple[str, ...], bool]:
    """``(fn, extra_options, batch_coupled)`` of a registered scheme; ``fn`` has the scheme
    shape ``fn(rewards, mask, opts)`` whatever shape was registered."""
    e = _lookup(name)
    return e.fn, e.extra_options, e.batch_coupled


def _lookup(name: str) -> _Entry:
    if name not in _REGISTRY:
        raise UsageError(f"scheme={name!r} is not registered; choose one of {schemes()}")
    return _REGISTRY[name]


def outcome_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[P, G]`` return R_i: the outcome reward itself, or ``sum_t r_t m_t`` for token rewards.

    ``rewards`` ``[P, G]`` or ``[P, G, T]``, ``mask`` ``[P, G, T]`` of 0/1 (bool, int or float);
    checked as :func:`advantages` checks them (shapes, a 0/1 mask, finite rewards)."""
    return returns_of(*_check_rewards_mask(rewards, mask))


def reward_to_go(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``[P, G, T]`` G_t = sum_{k >= t} r_k m_k, 0 where mask is 0 (= R_i for outcomes); the
    arguments checked as :func:`outcome_rewards` checks them."""
    return togo_of(*_check_rewards_mask(rewards, mask))


def returns_of(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`outcome_rewards` of arguments already checked (``mask`` bool): the schemes'."""
    if rewards.dim() == 2:
        return rewards
    return torch.where(mask, rewards, 0).sum(-1)


def togo_of(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """:func:`reward_to_go` of arguments already checked (``mask`` bool): the schemes'."""
    if rewards.dim() == 2:
        return torch.where(mask, rewards.unsqueeze(-1), 0)
    r = torch.where(mask, rewards, 0)
    togo = r.flip(-1).cumsum(-1).flip(-1)
    return torch.where(mask, togo, 0)


def advantages(
    scheme: str, rewards: torch.Tensor, mask: torch.Tensor, **options: Any
) -> torch.Tensor:
    """Per-token advantages ``A[P, G, T]`` of a registered scheme; exactly 0 where mask is 0.

    ``rewards``: ``[P, G]`` outcome rewards or ``[P, G, T]`` token rewards (values under mask 0
    are ignored); ``mask``: ``[P, G, T]`` of 0/1 (bool, int or float). Options: the fields of
    :class:`SchemeOptions` (documented there) plus any the scheme declared. Output dtype is the
    rewards' floating dtype (float32 for integer rewards); float64 in, float64 out.

    Raises :class:`~varbench._util.checks.UsageError` (a ValueError; ``UsageTypeError`` for an
    unknown option or a non-tensor input) naming the argument for: unknown scheme/option, shape
    mismatches, non-binary or all-zero masks, and NaN/inf rewards (naming the first bad group p).
    """
    entry = _lookup(scheme)
    return run_scheme(
        entry.fn, rewards, mask, options, extra_options=entry.extra_options,
        label=f"scheme {scheme!r}", mask_output=not entry.output_masked,
    )


def run_scheme(
    fn: SchemeFn,
    rewards: torch.Tensor,
    mask: torch.Tensor,
    options: Mapping[str, Any] | None = None,
    *,
    extra_options: Iterable[str] = (),
    label: str = "scheme",
    mask_output: bool = True,
    check_output: bool = True,
) -> torch.Tensor:
    """Call the scheme-shaped ``fn`` behind :func:`advantages`'s boundary checks.

    Checks ``rewards``/``mask`` and the keyword ``options`` (fields of :class:`SchemeOptions`
    plus ``extra_options``) exactly as :func:`advantages` does, calls ``fn(rewards, bool mask,
    opts)``, then (``check_output``) checks the ``[P, G, T]`` shape and (``mask_output``) zeroes
    the positions where mask is 0. ``check_estimator`` turns both off to see the raw output.
    """
    rewards, m = _check_rewards_mask(rewards, mask)
    opts = _build_options(label, tuple(extra_options), dict(options or {}), rewards.dtype, m.shape)
    check_scheme_tensors(rewards, m, {k: getattr(opts, k) for k in TENSOR_OPTIONS})
    out = fn(rewards, m, opts)
    if check_output:
        check_shape(f"advantages returned by {label}", out, list(m.shape))
    return torch.where(m, out, 0) if mask_output else out


def _check_rewards_mask(rewards: Any, mask: Any) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(mask, torch.Tensor):
        raise UsageTypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
    if not isinstance(rewards, torch.Tensor):
        raise UsageTypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    check_shape("mask", mask, [None, None, None])
    P, G, T = mask.shape
    if rewards.dim() == 2:
        check_shape("rewards", rewards, [P, G])
    else:
        check_shape("rewards", rewards, [P, G, T])
    m = _binary_mask(mask)
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    # Fast path: a finite total implies every entry is finite (inf and NaN propagate through a
    # sum); only a non-finite total (or an overflow) pays for the exact, mask-aware check.
    if not bool(torch.isfinite(rewards.sum())):
        r = rewards if rewards.dim() == 2 else torch.where(m, rewards, 0)
        finite = torch.isfinite(r)
        if not bool(finite.all()):
            bad = (~finite).reshape(P, -1).any(-1).nonzero()[:, 0].tolist()
            raise UsageError(
                f"rewards contain NaN or inf in group(s) p={bad[:10]} (first group {bad[0]}); "
                "score every response with a finite reward"
            )
    return rewards, m


# dtypes whose 0/1 check runs as one aminmax reduction plus (floats) a truncating int8 cast.
_FAST_FLOAT = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FAST_INT = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)
_NOT_BINARY = "mask must contain only 0 and 1 (or be bool); got other values"


def _binary_mask(mask: torch.Tensor) -> torch.Tensor:
    """Bool ``[P, G, T]`` of a 0/1 ``mask``; UsageError for any other value or no valid token.

    Float masks: ``aminmax`` proves every value lies in [0, 1] (NaN propagates and fails it;
    -0.0 counts as 0). Inside [0, 1] the int8 cast truncates, so it equals the bool cast exactly
    when no value lies strictly between 0 and 1, i.e. when the two nonzero counts agree. This is
    four fast passes instead of the elementwise compare, cast, ``torch.equal`` and max.
    """
    P, G, T = mask.shape
    if mask.dtype == torch.bool:
        m = mask
        empty = mask.numel() == 0 or not bool(m.view(torch.uint8).max())
    elif mask.numel() == 0:
        m, empty = mask != 0, True
    elif mask.dtype in _FAST_FLOAT or mask.dtype in _FAST_INT:
        lo, hi = torch.aminmax(mask)
        if not (bool(lo >= 0) and bool(hi <= 1)):
            raise UsageError(_NOT_BINARY)
        if mask.dtype in _FAST_FLOAT:
            trunc = mask.to(torch.int8)
            if int(torch.count_nonzero(trunc)) != int(torch.count_nonzero(mask)):
                raise UsageError(_NOT_BINARY)
            m = trunc.view(torch.bool)  # holds only 0/1 bytes, a valid bool tensor
        else:
            m = mask.to(torch.bool)  # an integer in [0, 1] is 0 or 1
        empty = not bool(hi)  # hi is 0 or 1 here
    else:  # other dtypes (complex, float8, wide unsigned): the generic elementwise check
        m = mask != 0
        mf = m.to(mask.dtype)
        # mask == (mask != 0) elementwise holds iff every value is 0 or 1 (NaN fails it too).
        if not torch.equal(mask, mf):
            raise UsageError(_NOT_BINARY)
        empty = not bool(m.view(torch.uint8).max())
    if empty:
        raise UsageError(f"mask of shape {[P, G, T]} has no valid token (all zeros)")
    return m


def valid_lengths(mask: torch.Tensor) -> torch.Tensor:
    """``[P, G]`` int32 number of valid tokens ``|o_i|`` of a bool ``[P, G, T]`` mask.

    Sums the uint8 view: a bool ``sum(-1)`` takes a slow widening path on CPU (~20x slower).
    """
    return mask.view(torch.uint8).sum(-1, dtype=torch.int32)


def _build_options(
    label: str, extra_options: tuple[str, ...], options: dict[str, Any], dtype: torch.dtype,
    shape: torch.Size,
) -> SchemeOptions:
    known, extra = {}, {}
    for key, value in options.items():
        if key in OPTION_NAMES:
            known[key] = value
        elif key in extra_options:
            extra[key] = value
        else:
            valid = sorted(OPTION_NAMES + extra_options)
            raise UsageTypeError(f"{label} got unknown option {key!r}; valid: {valid}")
    for key in TENSOR_OPTIONS:
        if known.get(key) is not None:
            check_shape(key, known[key], list(shape))
            known[key] = known[key].to(dtype)
    for key in ("eps", "baseline_eps", "whiten_eps"):
        if key in known and not (isinstance(known[key], (int, float)) and known[key] >= 0):
            raise UsageError(f"{key}={known[key]!r} is not valid; expected a float >= 0")
    if "conventions" in known:
        check_choice("conventions", known["conventions"], CONVENTIONS)
    if "k" in known and (isinstance(known["k"], bool) or not isinstance(known["k"], int)
                         or known["k"] < 1):
        raise UsageError(f"k={known['k']!r} is not valid; expected an integer >= 1")
    return SchemeOptions(**known, extra=extra, given=frozenset(options))
