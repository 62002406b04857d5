"""The measurements shared by the TRL and verl integrations, on one batch of groups.

Inputs are a batch as the peers hold it, regrouped to ``[P, G, T]``: response tokens, their
mask, outcome rewards ``[P, G]`` and (optionally) the model, the prompt and the per-token
statistics. Records (one dict per measured quantity, tidy: ``step, metric, value, n``):

- builder-test counts: groups whose rewards all agree, responses whose raw advantage (R) is
  non-zero and whose centred advantage (R - mean) is non-zero;
- ``grad_var_split``: the variance of the gradient estimate: the groups are split in two
  halves, and ``||g_1 - g_2||^2 / 4`` of the halves' token-mean surrogate gradients estimates
  tr Cov of the full-batch estimate without bias (the halves are independent given the
  policy); the two gradients are formed exactly, nothing is projected;
- ``proxy_exact_corr``: Pearson correlation of the logit proxy ``1 - 2 pi + sum pi^2`` with
  the exact per-token gradient norm ``||grad log pi(y_t)||^2`` on a subsample of responses;
- ``proxy_seq_spearman`` / ``proxy_seq_scale``: the proxy summed over each response against
  the exact per-sequence norm ``||grad log pi(y)||^2`` (ghost norms, one backward) on every
  row: rank correlation and ``mean exact / mean proxy``;
- ``cancellation_residual``: the mean relative residual ``|sum c_i A_i| / sum |c_i A_i|`` at
  steps shared by >= 2 responses of a group (token-mean weights), from the prefix trie.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from varbench.analysis.trie import shared_steps
from varbench.estimators import aggregation_weights, outcome_rewards
from varbench.grads.exact import token_grad_norms
from varbench.grads.seqnorms import sequence_grad_norms
from varbench.grads.stats import forward_stats
from varbench.models.logits import stat_dtype, token_logprobs
from varbench.report.result import AnalysisResult, Headline

__all__ = ["measure_groups", "records_result", "METRICS"]

METRICS = ("groups", "all_agree_groups", "nonzero_raw", "nonzero_centered", "responses",
           "cancellation_residual", "grad_var_split", "proxy_exact_corr", "proxy_seq_spearman",
           "proxy_seq_scale")


def _row(step: int, metric: str, value: float, n: int, **extra: Any) -> dict[str, Any]:
    return {"step": int(step), "metric": metric, "value": float(value), "n": int(n), **extra}


def builder_counts(rewards: torch.Tensor, step: int) -> list[dict[str, Any]]:
    """Builder-test counts of ``[P, G]`` rewards (groups of one count as all-agree)."""
    R = rewards.double()
    agree = (R == R[:, :1]).all(1)
    centred = R - R.mean(1, keepdim=True)
    return [
        _row(step, "groups", R.shape[0], R.shape[0]),
        _row(step, "responses", R.numel(), R.numel()),
        _row(step, "all_agree_groups", int(agree.sum()), R.shape[0]),
        _row(step, "nonzero_raw", int((R != 0).sum()), R.numel()),
        _row(step, "nonzero_centered", int((centred.abs() > 1e-12 * (1 + R.abs())).sum()),
             R.numel()),
    ]


def cancellation_record(tokens: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                        step: int) -> list[dict[str, Any]]:
    """Mean relative residual at shared steps (token-mean weights); none without shared steps."""
    m = mask != 0
    if not bool(m.any()):
        return []
    coef = aggregation_weights(m, "token-mean", dtype=torch.float64)
    df = shared_steps(tokens, adv.double(), coef, m)
    rel = df["rel_residual"].dropna()
    if rel.empty:
        return []
    return [_row(step, "cancellation_residual", rel.mean(), len(rel))]


def _half_grads(model, ids, attn, start, comp_mask, adv) -> tuple[torch.Tensor | None, ...]:
    """Gradients (trainable parameters) of ``sum_{i,t} A_{i,t} m log pi(y_t) / sum m``;
    ``adv`` ``[n, T]``."""
    logits = model(input_ids=ids, attention_mask=attn).logits
    logp = token_logprobs(logits.to(stat_dtype(logits.dtype)), ids)[:, start:]  # completion
    m = comp_mask.to(logp.dtype)
    loss = (adv.to(logp.dtype) * logp * m).sum() / m.sum().clamp(min=1)
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.autograd.grad(loss, params, allow_unused=True)


def variance_record(model, prompt_ids, prompt_mask, comp_ids, comp_mask, adv, G: int, step: int,
                    comp_attn: torch.Tensor | None = None) -> list[dict[str, Any]]:
    """``||g_1 - g_2||^2 / 4`` of the token-mean surrogate gradients of two halves of the groups
    (exact: the two gradients are in hand, summed per tensor in float64; no probes).
    ``adv`` ``[B, T]``; ``comp_attn``: the completion's attention (default ``comp_mask``; a
    multi-turn batch attends to tool tokens that its loss mask leaves out)."""
    B = comp_ids.shape[0]
    P = B // G
    if P < 2:
        return []
    ids = torch.cat([prompt_ids, comp_ids], 1)
    attn = torch.cat([prompt_mask, comp_mask if comp_attn is None else comp_attn], 1)
    start = prompt_ids.shape[1]
    half = (P // 2) * G
    with torch.enable_grad():
        g = [_half_grads(model, ids[h], attn[h], start, comp_mask[h], adv[h])
             for h in (slice(0, half), slice(half, 2 * half))]
    value = sum(float((a.double() - b.double()).pow(2).sum())
                for a, b in zip(*g, strict=True) if a is not None and b is not None)
    return [_row(step, "grad_var_split", value / 4, 2 * (P // 2))]


def proxy_record(model, prompt_ids, prompt_mask, comp_ids, comp_mask, step: int, *,
                 n_sub: int, seed: int, comp_attn: torch.Tensor | None = None
                 ) -> list[dict[str, Any]]:
    """Pearson correlation of the logit proxy with exact per-token norms on ``n_sub`` rows."""
    B = comp_ids.shape[0]
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(B, generator=gen)[: min(n_sub, B)].to(comp_ids.device)
    ids = torch.cat([prompt_ids, comp_ids], 1)[rows]
    attn = torch.cat([prompt_mask, comp_mask if comp_attn is None else comp_attn], 1)[rows]
    resp = torch.cat([torch.zeros_like(prompt_mask), comp_mask], 1)[rows]
    if int(resp.sum()) < 3:
        return []
    exact = token_grad_norms(model, ids, resp, attn).token_sq  # [n, L], column t = token t
    proxy = forward_stats(model, ids, resp, attn).proxy  # same alignment
    sel = resp != 0
    x = proxy[sel].double().cpu().numpy()
    y = exact[sel].double().cpu().numpy()
    if x.size < 3 or np.std(x) == 0 or np.std(y) == 0:
        return []
    return [_row(step, "proxy_exact_corr", np.corrcoef(x, y)[0, 1], x.size, rows=len(rows))]


def proxy_sequence_rows(model, prompt_ids, prompt_mask, comp_ids, comp_mask,
                        comp_attn: torch.Tensor | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row ``(proxy, exact)`` ``[B]`` float64 on the CPU: ``sum_t w_t`` (the proxy summed
    over the response; cross terms ignored) and ``||grad sum_t log pi(y_t)||^2`` (ghost norms:
    one backward); NaN for a row without response tokens."""
    ids = torch.cat([prompt_ids, comp_ids], 1)
    attn = torch.cat([prompt_mask, comp_mask if comp_attn is None else comp_attn], 1)
    resp = torch.cat([torch.zeros_like(prompt_mask), comp_mask], 1)
    keep = resp.sum(1) > 0
    B = ids.shape[0]
    proxy = torch.full((B,), float("nan"), dtype=torch.float64)
    exact = proxy.clone()
    if bool(keep.any()):
        ids, attn, resp = ids[keep], attn[keep], resp[keep]
        rows = keep.cpu()
        exact[rows] = sequence_grad_norms(model, ids, resp, attn).double().cpu()
        proxy[rows] = forward_stats(model, ids, resp, attn).proxy.sum(1).double().cpu()
    return proxy, exact


def sequence_records(proxy: torch.Tensor, exact: torch.Tensor, step: int
                     ) -> list[dict[str, Any]]:
    """``proxy_seq_spearman`` (rank correlation) and ``proxy_seq_scale`` (``mean exact / mean
    proxy``) of per-row values (NaN rows left out); none below 3 rows."""
    from scipy.stats import spearmanr

    ok = ~(torch.isnan(proxy) | torch.isnan(exact))
    p, e = proxy[ok].numpy(), exact[ok].numpy()
    n = int(ok.sum())
    if n < 3:
        return []
    out = []
    if np.std(e) > 0 and np.std(p) > 0:
        out.append(_row(step, "proxy_seq_spearman", spearmanr(p, e).statistic, n))
    if p.mean() > 0:
        out.append(_row(step, "proxy_seq_scale", e.mean() / p.mean(), n))
    return out


def proxy_sequence_record(model, prompt_ids, prompt_mask, comp_ids, comp_mask, step: int,
                          comp_attn: torch.Tensor | None = None) -> list[dict[str, Any]]:
    """The per-sequence proxy against exact per-sequence norms on every row
    (:func:`proxy_sequence_rows`) as :func:`sequence_records`."""
    proxy, exact = proxy_sequence_rows(model, prompt_ids, prompt_mask, comp_ids, comp_mask,
                                       comp_attn)
    return sequence_records(proxy, exact, step)


def measure_groups(
    *,
    step: int,
    rewards: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor | None = None,
    model: torch.nn.Module | None = None,
    prompt_ids: torch.Tensor | None = None,
    prompt_mask: torch.Tensor | None = None,
    completion_attention: torch.Tensor | None = None,
    G: int,
    proxy_rows: int = 4,
    seed: int = 0,
    measures: Sequence[str] = ("counts", "cancellation", "variance", "proxy"),
) -> list[dict[str, Any]]:
    """varbench records for one batch of ``B = P * G`` rows, groups contiguous (row p * G + i).

    ``rewards`` ``[B]``; ``completion_ids``/``completion_mask`` ``[B, T]``; ``advantages``
    ``[B]`` or ``[B, T]`` (default: centred rewards); ``model`` with ``prompt_ids``/
    ``prompt_mask`` ``[B, Lp]`` enables the variance and proxy measures (skipped otherwise);
    ``completion_attention`` ``[B, T]``: what the model attends to in the completion (default
    ``completion_mask``; in multi-turn batches the tool tokens are attended, not trained).
    Caveat: ``grad_var_split`` is one two-half split (an unbiased but noisy estimate); average
    it over steps.
    """
    B, T = completion_mask.shape
    if B % G:
        raise ValueError(f"batch of {B} rows is not a whole number of groups of G={G}")
    P = B // G
    R = rewards.reshape(P, G).double()
    mask3 = completion_mask.reshape(P, G, T) != 0
    if advantages is None:
        adv = (R - R.mean(1, keepdim=True)).reshape(B)
    else:
        adv = advantages.double()
    adv3 = (adv.reshape(B, 1).expand(B, T) if adv.dim() == 1 else adv).reshape(P, G, T)
    out: list[dict[str, Any]] = []
    if "counts" in measures:
        out += builder_counts(outcome_rewards(R, mask3), step)
    if "cancellation" in measures:
        out += cancellation_record(completion_ids.reshape(P, G, T), adv3, mask3, step)
    if model is not None and prompt_ids is not None and prompt_mask is not None:
        ca = completion_attention
        if "variance" in measures:
            out += variance_record(model, prompt_ids, prompt_mask, completion_ids,
                                   completion_mask, adv3.reshape(B, T), G, step, comp_attn=ca)
        if "proxy_seq" in measures:
            out += proxy_sequence_record(model, prompt_ids, prompt_mask, completion_ids,
                                         completion_mask, step, comp_attn=ca)
        if "proxy" in measures:
            out += proxy_record(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                step, n_sub=proxy_rows, seed=seed, comp_attn=ca)
    return out


def records_result(records: Sequence[dict[str, Any]], *, name: str, source: str,
                   config: dict[str, Any] | None = None) -> AnalysisResult:
    """The records as an :class:`~varbench.report.AnalysisResult` (kind ``"training"``) with
    one headline per metric (its mean over the recorded steps and the SE across steps)."""
    df = pd.DataFrame(list(records), columns=None)
    heads: list[Headline] = []
    for metric, g in df.groupby("metric", sort=False) if not df.empty else []:
        v = g["value"].astype(float)
        se = float(v.std(ddof=1) / np.sqrt(len(v))) if len(v) > 1 else None
        heads.append(Headline(metric, float(v.mean()), se,
                              f"{metric}: {v.mean():.4g} (mean over {len(v)} recorded steps)"))
    return AnalysisResult(kind="training", name=name, records={"steps": df}, headlines=heads,
                          config=dict(config or {}), summary={"source": source,
                                                              "steps": sorted(set(df["step"]))
                                                              if not df.empty else []})
