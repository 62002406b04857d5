"""Shared steps of a group (its prefix trie) and the cancellation diagnostics on tensors.

A *step* of response i at position t is the pair (context h, token a) with h = prompt + y_<t
(environment tokens included) and a = y_t. Two responses of one group share the step when their
tokens (and token kinds: policy / environment) agree at every position <= t. Shared steps are
exactly the nodes of the group's prefix trie visited by >= 2 responses; at a shared step every
member has the same ``grad log pi(a | h)``, so its net gradient is ``(sum_i c_i A_i) g``
(docs/science.md section 4).

Diagnostics per shared step S (``c`` = aggregation weight x ratio/clip factor, WITHOUT the
advantage; ``A`` = advantage):
- residual ``|sum c_i A_i|`` against the exchangeable value ``|c_bar sum A_i|``;
- weighting-induced residual ``sum (A_i - A_bar)(c_i - c_bar) / sum |A_i c_i|``
  (``sum c_i A_i = c_bar sum A_i + sum (A_i - A_bar)(c_i - c_bar)`` exactly);
- gradient cancellation ratio ``||sum c_i A_i g_i|| / sum |c_i A_i| ||g_i||`` from per-token
  gradient vectors (or sketches) when given; the scalar version uses ||g_i|| = 1.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from varbench._util.checks import check_shape

_POLICY, _ENV = 1, 2


def prefix_node_ids(
    tokens: torch.Tensor, mask: torch.Tensor, env_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Trie node id of every step: ``[P, G, T]`` long, -1 where ``mask == 0``.

    ``env_mask`` is required when environment tokens exist (without it they end the path like
    padding). Two positions (p, i, t) and (p, j, t) get the same id iff responses i and j of
    group p agree on every token and token kind up to and including t: the id is
    ``p * G + j`` with j the first response of the group sharing that prefix (unique within
    (p, t)). Vectorised over groups with a ``[P, G, G]`` agreement mask: no host sync.
    """
    check_shape("tokens", tokens, [None, None, None])
    check_shape("mask", mask, list(tokens.shape))
    P, G, T = tokens.shape
    dev = tokens.device
    mask = mask.to(dev)
    kind = (mask != 0).long() * _POLICY
    if env_mask is not None:
        check_shape("env_mask", env_mask, list(tokens.shape))
        kind = torch.where((env_mask.to(dev) != 0) & (mask == 0), torch.full_like(kind, _ENV),
                           kind)
    tok = tokens.to(dev).long()
    alive = (kind != 0).long().cumprod(-1).bool()  # padding ends a response's path
    base = (torch.arange(P, device=dev) * G)[:, None]  # [P, 1]: ids unique across groups
    same = torch.ones(P, G, G, dtype=torch.bool, device=dev)  # i and j agree up to t
    ids = torch.full((P, G, T), -1, dtype=torch.long, device=dev)
    for t in range(T):  # elementwise work only: no host sync per position (unlike unique)
        same &= (tok[:, :, None, t] == tok[:, None, :, t]) & (
            kind[:, :, None, t] == kind[:, None, :, t])
        first = same.to(torch.uint8).argmax(-1)  # the first response sharing i's prefix
        ids[:, :, t] = torch.where(alive[:, :, t], base + first, torch.full_like(first, -1))
    return torch.where(mask != 0, ids, torch.full_like(ids, -1))


def shared_steps(
    tokens: torch.Tensor,
    adv: torch.Tensor,
    coef: torch.Tensor,
    mask: torch.Tensor,
    *,
    env_mask: torch.Tensor | None = None,
    token_grads: torch.Tensor | None = None,
    min_size: int = 2,
) -> pd.DataFrame:
    """One row per shared step (trie node with >= ``min_size`` members) of every group.

    Inputs ``[P, G, T]``: ``tokens``, ``adv`` (A), ``coef`` (c without the advantage), ``mask``.
    ``token_grads`` ``[P, G, T, K]``: per-token gradients or sketches (optional). Columns:
    ``p, t, token, size, full_group`` (all G responses share the step), ``sum_A``,
    ``residual`` = |sum c A|, ``exchangeable`` = |c_bar sum A|, ``abs_sum`` = sum |c A|,
    ``rel_residual`` = residual / abs_sum, ``weighting_residual`` (normalised, signed),
    ``scalar_ratio`` = rel_residual, ``grad_ratio`` (NaN without token_grads). Rows with
    abs_sum == 0 (nothing to cancel) have NaN relative columns.
    """
    for name, x in (("adv", adv), ("coef", coef), ("mask", mask)):
        check_shape(name, x, list(tokens.shape))
    P, G, T = tokens.shape
    dev = tokens.device
    ids = prefix_node_ids(tokens, mask, env_mask)
    valid = ids >= 0
    pp, ii, tt = valid.nonzero(as_tuple=True)
    # ids are all -1 when no step is valid (width 1 then)
    width = max(int(ids.max().item()) + 1, 1) if ids.numel() else 1
    key = (pp * T + tt) * width + ids[pp, ii, tt]
    nodes, inv, size = torch.unique(key, return_inverse=True, return_counts=True)
    n = nodes.numel()
    a = adv.to(dev)[pp, ii, tt].double()
    c = coef.to(dev)[pp, ii, tt].double()

    def seg(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float64, device=dev).index_add_(0, inv, x)

    sum_ca, sum_a, sum_c, abs_ca = seg(c * a), seg(a), seg(c), seg((c * a).abs())
    cnt = size.double()
    a_bar, c_bar = sum_a / cnt, sum_c / cnt
    wres = seg((a - a_bar[inv]) * (c - c_bar[inv]))
    ok = abs_ca > 0
    nan = torch.full_like(abs_ca, float("nan"))
    rel = torch.where(ok, sum_ca.abs() / abs_ca.clamp(min=1e-300), nan)
    grad_ratio = nan.clone()
    if token_grads is not None:
        check_shape("token_grads", token_grads, [P, G, T, None])
        g = token_grads.to(dev)[pp, ii, tt].double()  # [N, K]
        net = torch.zeros(n, g.shape[1], dtype=torch.float64, device=dev)
        net.index_add_(0, inv, (c * a)[:, None] * g)
        denom = seg((c * a).abs() * g.norm(dim=1))
        grad_ratio = torch.where(denom > 0, net.norm(dim=1) / denom.clamp(min=1e-300), nan)
    node_t = (nodes // width) % T
    node_p = nodes // (width * T)
    first = torch.full((n,), -1, dtype=torch.long, device=dev).scatter_reduce(
        0, inv, torch.arange(inv.numel(), device=dev), reduce="amax", include_self=True
    )
    cols = {
        "p": node_p,
        "t": node_t,
        "token": tokens[pp, ii, tt][first].long(),
        "size": size,
        "full_group": size == G,
        "sum_A": sum_a,
        "residual": sum_ca.abs(),
        "exchangeable": (c_bar * sum_a).abs(),
        "abs_sum": abs_ca,
        "rel_residual": rel,
        "weighting_residual": torch.where(ok, wres / abs_ca.clamp(min=1e-300), nan),
        "scalar_ratio": rel,
        "grad_ratio": grad_ratio,
    }
    df = _frame(cols, ints=("p", "t", "token", "size"), bools=("full_group",))
    return df[df["size"] >= min_size].reset_index(drop=True)


def _frame(cols: dict[str, torch.Tensor], *, ints: tuple[str, ...] = (),
           bools: tuple[str, ...] = ()) -> pd.DataFrame:
    """A DataFrame of equal-length device columns, moved to the host in ONE transfer
    (float64 holds the integer columns exactly: ids and counts are far below 2**53)."""
    host = torch.stack([x.double() for x in cols.values()], 1).cpu().numpy()
    data = {}
    for j, k in enumerate(cols):
        x = host[:, j]
        data[k] = x.astype(np.int64) if k in ints else x.astype(bool) if k in bools else x
    return pd.DataFrame(data)


def token_net_weight(
    tokens: torch.Tensor,
    adv: torch.Tensor,
    coef: torch.Tensor,
    mask: torch.Tensor,
    *,
    top: int | None = 20,
) -> pd.DataFrame:
    """Signed net coefficient ``sum c A`` per vocabulary id over the batch, most frequent first.

    Columns ``token, count, net_weight, abs_weight, rel_net`` (= |net| / abs). Approximate as a
    cancellation measure: occurrences of one id sit in different contexts.
    """
    for name, x in (("adv", adv), ("coef", coef), ("mask", mask)):
        check_shape(name, x, list(tokens.shape))
    dev = tokens.device
    m = mask.to(dev) != 0
    tok = tokens[m].long()
    ca = (coef.to(dev)[m] * adv.to(dev)[m]).double()
    V = int(tok.max().item()) + 1 if tok.numel() else 1
    count = torch.bincount(tok, minlength=V)
    net = torch.zeros(V, dtype=torch.float64, device=dev).index_add_(0, tok, ca)
    absw = torch.zeros(V, dtype=torch.float64, device=dev).index_add_(0, tok, ca.abs())
    df = _frame({"token": torch.arange(V, device=dev), "count": count, "net_weight": net,
                 "abs_weight": absw}, ints=("token", "count"))
    df = df[df["count"] > 0]
    df["rel_net"] = (df["net_weight"].abs() / df["abs_weight"]).where(df["abs_weight"] > 0)
    df = df.sort_values(["count", "token"], ascending=[False, True]).reset_index(drop=True)
    return df.head(top) if top is not None else df
