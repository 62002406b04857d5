"""Adapters between varbench schemes ``[P, G, T]`` and verl-shaped estimators.

verl shape: ``fn(token_level_rewards[B, T], response_mask[B, T], index[B], **kw) ->
(advantages[B, T], returns[B, T])`` with groups given by equal ``index`` values.

- :func:`from_flat` registers such a function unchanged as a varbench scheme;
- :func:`to_flat` exposes a varbench scheme in that shape. Groups of unequal size are handled by
  running the scheme once per distinct group size (vectorised within each size); a
  batch-coupled scheme (``register_scheme(..., batch_coupled=True)``) cannot be split that way
  and raises ValueError instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from varbench.estimators.registry import (
    SchemeOptions,
    advantages,
    register_scheme,
    scheme_info,
)

__all__ = ["from_flat", "to_flat", "outcome_to_token_rewards"]

FlatFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


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


def from_flat(
    fn: FlatFn,
    name: str,
    *,
    extra_options: Iterable[str] = (),
    pass_options: Mapping[str, str] | None = None,
) -> str:
    """Register a verl-shaped estimator ``fn`` as the varbench scheme ``name``; return ``name``.

    Rows are ``b = p * G + i``; ``index[b] = p`` (numpy int array); ``[P, G]`` rewards are placed
    on each response's last valid token. ``extra_options`` are keyword options forwarded to
    ``fn`` unchanged (e.g. ``("epsilon",)``); ``pass_options`` maps varbench options to ``fn``'s
    keyword names, with ``[P, G, T]`` tensors flattened to ``[B, T]`` (e.g.
    ``{"logprobs": "old_log_probs", "sum_pi_sq": "sum_pi_squared"}``). The returned ``returns``
    are discarded.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    mapping = dict(pass_options or {})

    def scheme(rewards: torch.Tensor, mask: torch.Tensor, opts: SchemeOptions) -> torch.Tensor:
        P, G, T = mask.shape
        tok = rewards if rewards.dim() == 3 else outcome_to_token_rewards(rewards, mask)
        kw: dict[str, Any] = dict(opts.extra)
        for ours, theirs in mapping.items():
            value = getattr(opts, ours)
            if isinstance(value, torch.Tensor):
                value = value.reshape(P * G, T)
            if value is not None:
                kw[theirs] = value
        index = np.repeat(np.arange(P), G)
        adv, _ = fn(tok.reshape(P * G, T), mask.to(tok.dtype).reshape(P * G, T), index, **kw)
        return adv.reshape(P, G, T).to(tok.dtype)

    scheme.__qualname__ = f"from_flat<{getattr(fn, '__qualname__', repr(fn))}>"
    scheme.__module__ = getattr(fn, "__module__", __name__)
    scheme.__doc__ = f"verl-shaped estimator {scheme.__qualname__} adapted by from_flat."
    register_scheme(name, extra_options=extra_options)(scheme)
    return name


def to_flat(scheme: str, *, ignore_unknown: bool = False, **defaults: Any) -> FlatFn:
    """Expose the registered ``scheme`` as ``fn(token_level_rewards, response_mask, index, **kw)``.

    Returns ``(advantages, advantages)`` as verl's critic-free estimators do. ``index``: any
    array-like of hashable group ids (numpy, list, tensor). Keyword options are ``defaults``
    updated by ``kw``; ``[B, T]`` tensors among them are regrouped like the rewards.
    ``ignore_unknown=True`` drops options the scheme does not know (verl passes e.g. ``config``).
    """
    _, extra, batch_coupled = scheme_info(scheme)
    known = {f for f in SchemeOptions.__dataclass_fields__ if f != "extra"} | set(extra)

    def fn(
        token_level_rewards: torch.Tensor,
        response_mask: torch.Tensor,
        index: Any,
        **kw: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = response_mask.shape
        if token_level_rewards.shape != (B, T):
            raise ValueError(
                f"token_level_rewards has shape {list(token_level_rewards.shape)}, "
                f"expected response_mask's {[B, T]}"
            )
        ids = index.cpu().numpy() if isinstance(index, torch.Tensor) else np.asarray(index)
        if ids.shape != (B,):
            raise ValueError(f"index has shape {list(ids.shape)}, expected [{B}]")
        options = {**defaults, **kw}
        if ignore_unknown:
            options = {k: v for k, v in options.items() if k in known}
        _, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
        inverse = inverse.reshape(-1)
        sizes = np.unique(counts)
        if batch_coupled and len(sizes) > 1:
            raise ValueError(
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
