"""varbench measurements of a verl batch: builder-test counts, the cancellation residual, the
split-group variance and proxy fidelity, and verl's own variance proxy against exact norms.

``batch_records(batch, step=...)`` takes what verl's trainer holds after ``compute_advantage``:
a ``DataProto`` (its ``batch`` tensors and ``non_tensor_batch["uid"]``) or a plain mapping of
the same keys. Groups are the ``uid`` values in order of first appearance, so relabelling the
uids changes nothing; the batch's own ``advantages`` are measured when present; the model
attends to what ``attention_mask`` says (tool tokens of a multi-turn batch included) while
only ``response_mask`` tokens are trained.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from varbench._util.checks import UsageError
from varbench.integrations.measure import (
    measure_groups,
    records_result,
)

__all__ = ["batch_records", "records_result", "batch_fields", "verl_proxy_records",
           "verl_proxy_rows"]

_WEIGHTED = ("cancellation_residual", "grad_var_split", "proxy_exact_corr",
             "proxy_seq_spearman", "proxy_seq_scale")


def batch_fields(batch: Any) -> dict[str, Any]:
    """The tensors and the ``uid`` of a verl ``DataProto`` (or of a mapping) as one dict."""
    if hasattr(batch, "batch") and hasattr(batch, "non_tensor_batch"):
        td = batch.batch
        out: dict[str, Any] = {k: td[k] for k in td.keys()} if td is not None else {}
        out.update(dict(batch.non_tensor_batch))
        return out
    if isinstance(batch, Mapping):
        return dict(batch)
    raise UsageError(f"batch={type(batch).__name__} is not valid; give a verl DataProto or a "
                     "mapping of its keys")


def _groups(uid: Any) -> tuple[np.ndarray, np.ndarray]:
    """``(inverse, counts)`` with groups numbered in order of first appearance."""
    ids = uid.cpu().numpy() if isinstance(uid, torch.Tensor) else np.asarray(uid)
    _, first, inverse, counts = np.unique(ids, return_index=True, return_inverse=True,
                                          return_counts=True)
    order = np.argsort(first, kind="stable")  # group k of the sorted uids -> appearance rank
    rank = np.empty_like(order)
    rank[order] = np.arange(len(order))
    return rank[inverse.reshape(-1)], counts[order]


def batch_records(
    batch: Any, *, step: int, model: torch.nn.Module | None = None,
    proxy_rows: int = 4, seed: int = 0,
) -> list[dict[str, Any]]:
    """Builder-test counts and (with ``responses``) the cancellation residual of a verl batch;
    with ``model`` (the actor) also ``grad_var_split``, ``proxy_seq_*`` and
    ``proxy_exact_corr``.

    ``batch``: a ``DataProto`` or a mapping with ``token_level_rewards``, ``response_mask``
    ``[B, T]`` and ``uid`` ``[B]``; ``advantages`` ``[B, T]`` when present (otherwise rewards
    centred per group); ``prompts``, ``responses`` and ``attention_mask`` ``[B, Lp + T]`` for
    ``model``. Counts are summed over the group sizes present; the other metrics are averaged
    over the sizes, weighted by their ``n``.
    """
    f = batch_fields(batch)
    for key in ("token_level_rewards", "response_mask", "uid"):
        if key not in f:
            raise UsageError(f"verl batch has no {key!r}; keys: {sorted(f)}")
    tok, mask = f["token_level_rewards"], f["response_mask"]
    B, T = mask.shape
    R = tok.sum(-1)  # verl's outcome: the sum over every position
    adv = f.get("advantages")
    if adv is not None and tuple(adv.shape) != (B, T):
        raise UsageError(f"advantages has shape {list(adv.shape)}, expected {[B, T]}")
    responses = f.get("responses")
    inverse, counts = _groups(f["uid"])
    if inverse.shape != (B,):
        raise UsageError(f"uid has {inverse.shape[0]} entries, expected {B}")
    if model is not None:
        missing = [k for k in ("prompts", "responses", "attention_mask") if k not in f]
        if missing:
            raise UsageError(f"model= needs the batch's {missing}; keys: {sorted(f)}")
        Lp = f["prompts"].shape[1]
        if f["attention_mask"].shape[1] != Lp + T:
            raise UsageError(f"attention_mask has {f['attention_mask'].shape[1]} columns, "
                             f"expected prompts + responses = {Lp + T}")
    order = np.argsort(inverse, kind="stable")
    starts = np.cumsum(counts) - counts
    total: dict[str, list[float]] = {}
    for size in np.unique(counts):
        groups = np.nonzero(counts == size)[0]
        rows = torch.as_tensor(order[starts[groups][:, None] + np.arange(size)[None, :]])
        rows = rows.reshape(-1).to(mask.device)
        toks = responses[rows] if responses is not None else torch.zeros_like(mask[rows]).long()
        measures = ("counts", "cancellation") if responses is not None else ("counts",)
        extra: dict[str, Any] = {}
        if model is not None:
            attn = f["attention_mask"][rows]
            extra = {"model": model, "prompt_ids": f["prompts"][rows],
                     "prompt_mask": attn[:, :Lp], "completion_attention": attn[:, Lp:],
                     "proxy_rows": proxy_rows, "seed": seed}
            measures = (*measures, "variance", "proxy_seq", "proxy")
        for r in measure_groups(step=step, rewards=R[rows], completion_ids=toks,
                                completion_mask=mask[rows], G=int(size), measures=measures,
                                advantages=None if adv is None else adv[rows], **extra):
            total.setdefault(r["metric"], []).extend([r["value"], r["n"]])
    out = []
    for metric, vals in total.items():
        v, n = np.array(vals[0::2]), np.array(vals[1::2])
        value = float((v * n).sum() / n.sum()) if metric in _WEIGHTED else float(v.sum())
        out.append({"step": int(step), "metric": metric, "value": value, "n": int(n.sum())})
    return out


def verl_proxy_rows(batch: Any, model: torch.nn.Module, *,
                    gradient_norm: float | None = None) -> dict[str, Any]:
    """verl's ``variance_proxy/*`` metrics of ``batch`` and, per row, verl's proxy and the
    exact norm it stands for: ``{"verl": {...}, "proxy": [B], "exact": [B]}`` (float64, CPU).

    verl's ``proxy2_total_power`` is ``mean_b Abar_b^2 W_b`` (``Abar`` the row's masked mean
    advantage, ``W_b = sum_t (1 - 2 pi_t + sum pi^2)``, clamped at 0); ``exact_b`` is
    ``||sum_t A_{b,t} grad log pi(y_t)||^2`` (ghost norms, one backward). Needs the batch's
    ``old_log_probs``, ``sum_pi_squared``, ``advantages``, ``prompts``, ``responses``,
    ``attention_mask``, ``response_mask`` (the DataProto verl logs the proxy from).
    """
    from verl.trainer.ppo.metric_utils import compute_variance_proxy_metrics

    from varbench.grads.seqnorms import sequence_grad_norms

    f = batch_fields(batch)
    missing = [k for k in ("old_log_probs", "sum_pi_squared", "advantages", "prompts",
                           "responses", "attention_mask", "response_mask") if k not in f]
    if missing:
        raise UsageError(f"verl batch has no {missing}; keys: {sorted(f)}")
    if not hasattr(batch, "batch"):
        raise UsageError("verl_proxy_rows needs the DataProto itself (verl's metric reads it)")
    if "rollout_is_weights" in f:
        raise UsageError("verl_proxy_rows does not handle rollout_is_weights yet (verl's "
                         "off-policy proxy); drop them from the batch to compare on-policy")
    theirs = compute_variance_proxy_metrics(batch, gradient_norm=gradient_norm)
    m = f["response_mask"].double()
    A = f["advantages"].double()
    w = 1 - 2 * f["old_log_probs"].double().exp() + f["sum_pi_squared"].double()
    abar = (A * m).sum(-1) / m.sum(-1).clamp(min=1)
    proxy = (abar ** 2 * (w * m).sum(-1).clamp(min=0)).cpu()
    verl_power = float(theirs["variance_proxy/proxy2_total_power"])
    # the per-row proxy (verl reports only its mean) must reproduce verl's number
    if abs(float(proxy.mean()) - verl_power) > 1e-5 * max(1.0, abs(verl_power)):
        raise RuntimeError(f"per-row proxy mean {float(proxy.mean())!r} differs from verl's "
                           f"proxy2_total_power {verl_power!r}")
    ids = torch.cat([f["prompts"], f["responses"]], 1)
    resp = torch.cat([torch.zeros_like(f["prompts"]), f["response_mask"].long()], 1)
    coef = torch.cat([torch.zeros_like(f["prompts"], dtype=A.dtype), A], 1)
    exact = sequence_grad_norms(model, ids, resp, f["attention_mask"], coefficients=coef)
    return {"verl": theirs, "proxy": proxy.numpy(), "exact": exact.double().cpu().numpy()}


def verl_proxy_records(batch: Any, model: torch.nn.Module, *, step: int,
                       gradient_norm: float | None = None) -> list[dict[str, Any]]:
    """verl's variance proxy beside its exact counterpart (:func:`verl_proxy_rows`) as records:
    ``verl_total_power`` (verl's ``proxy2_total_power``), ``exact_total_power`` (the mean exact
    norm), ``verl_proxy_scale`` (exact / verl) and ``verl_proxy_spearman`` (per-row rank
    correlation of verl's proxy with the exact norm)."""
    from scipy.stats import spearmanr

    r = verl_proxy_rows(batch, model, gradient_norm=gradient_norm)
    p, e = r["proxy"], r["exact"]
    B = len(p)
    verl_power = float(r["verl"]["variance_proxy/proxy2_total_power"])
    out = [
        {"step": step, "metric": "verl_total_power", "value": verl_power, "n": B},
        {"step": step, "metric": "exact_total_power", "value": float(e.mean()), "n": B},
    ]
    if verl_power > 0:
        out.append({"step": step, "metric": "verl_proxy_scale",
                    "value": float(e.mean()) / verl_power, "n": B})
    if np.std(p) > 0 and np.std(e) > 0:
        out.append({"step": step, "metric": "verl_proxy_spearman",
                    "value": float(spearmanr(p, e).statistic), "n": B})
    return out
