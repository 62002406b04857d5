"""Variance cells (docs/science.md sections 5 and 9): group estimates of every (scheme, mode)
at one G, their statistics, intervals and paired ratios, for :mod:`varbench.analysis.variance`.

A group estimate is ``g_hat_m = sum_{i,t} c_{m,i,t} grad log pi(y_{m,i,t} | ...)`` with ``c``
the exact loss coefficients at ratio 1 (:func:`group_coefficients`). Two contractions compute
it, both in a random sketch space whose own error goes into the intervals:

- :class:`ProjectedContraction` (the default, ``gradients="projected"``): coefficient-first,
  one forward per chunk of responses and one weighted backward per coefficient set, Kronecker
  projections per weight (:func:`varbench.grads.projected.response_sketches`), group sums
  accumulated on the host as chunks stream; error :func:`~varbench.grads.projected.projection_sd`.
- :class:`VectorContraction` (``gradients="vectors"``, enumerated tables, the tests'
  reference): per-token vectors (count-sketched or flat) contracted with ``combine``; error
  :func:`~varbench.stats.intervals.sketch_sd`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pandas as pd
import torch

from varbench._util.bounds import check_knob
from varbench._util.checks import UsageError
from varbench.analysis.oracle import ResponseTable, exact_moments
from varbench.analysis.variance_report import MIN_DISTINCT_GROUPS, distinct_estimates
from varbench.estimators.aggregation import aggregation_weights
from varbench.estimators.coefficients import token_coefficients
from varbench.estimators.registry import advantages, exact_label, split_label
from varbench.grads.projected import projection_sd, response_sketches
from varbench.grads.vectors import combine
from varbench.stats.estimates import (
    VARIANCE_STATS,
    moment_statistics,
    paired_compare,
    variance_stats,
)
from varbench.stats.intervals import (
    INTERVAL_STATS,
    exact_pair_sd,
    exact_sketch_sd,
    gram_matrix,
    group_intervals,
    paired_ratio_interval,
    sketch_pair_sd,
    sketch_sd,
    widen,
)
from varbench.stats.noise_scale import noise_scale_interval

GRADIENTS = ("projected", "vectors")


class VectorContraction:
    """Group estimates from the per-token vectors ``data["vec"] [1, n, T, K]`` (``sketch_k``:
    the CountSketch's buckets, None for flat vectors: no sketch error)."""

    def __init__(self, sketch_k: int | None) -> None:
        self.sketch_k = sketch_k

    def estimates(self, data: dict[str, torch.Tensor],
                  sets: list[tuple[Any, torch.Tensor]]) -> list[torch.Tensor]:
        """``[M, K]`` float64 host estimates per ``(key, coef [M, G, T])``."""
        vec = data["vec"]
        out = []
        for _, coef in sets:
            M, G = coef.shape[:2]
            v = vec[0, : M * G].reshape(M, G, *vec.shape[2:])
            out.append(combine(v, coef).to(torch.float64).cpu())
        return out

    def error_sd(self, e: torch.Tensor, r: torch.Tensor, gram=None,
                 mean=None) -> dict[str, float]:
        """The CountSketch's SD of variance, MSE and projection (0 for flat vectors;
        ``mean``: an exact cell's E g_hat)."""
        if not self.sketch_k:
            return dict.fromkeys(INTERVAL_STATS, 0.0)
        return sketch_sd(e, r, self.sketch_k, gram=gram, mean=mean)

    def pair_error_sd(self, e, eb, r, gram=None, gram_b=None) -> dict[str, dict[str, float]]:
        """``{stat: {log_ratio, diff}}``: the CountSketch's SD of two schemes' log ratio and
        difference of variance and MSE on one sketch draw
        (:func:`~varbench.stats.intervals.sketch_pair_sd`; 0 for flat vectors)."""
        if not self.sketch_k:
            return dict.fromkeys(("variance", "mse"), {"log_ratio": 0.0, "diff": 0.0})
        return sketch_pair_sd(e, eb, r, self.sketch_k, gram_a=gram, gram_b=gram_b)


class ProjectedContraction:
    """Coefficient-first group estimates of one prompt's responses through
    :func:`response_sketches`: ``k1 x k2`` Gaussian projections per weight and a ``k_dense``
    CountSketch of the small parameters (``k1 = None``: every block exact, the flat
    gradients). The arrays (``data`` of :meth:`estimates`: ``input_ids`` / ``attention_mask
    [1, n, Lp + T]``, ``mask [1, n, T]``) stay on the host; chunks go to the device. Estimates
    are cached per key and extended when M grows (adaptive M re-reads the first groups: they
    are not recomputed). ``rows``: responses per chunk (None: the memory plan's,
    :func:`varbench.grads.seqnorms.sequence_rows`)."""

    def __init__(self, model: torch.nn.Module, *, k1: int | None, k2: int | None,
                 k_dense: int | None, seed: int, rows: int | None = None) -> None:
        self.model, self.rows = model, rows
        self.kw = ({"projection": "identity", "k_dense": None} if k1 is None else
                   {"k1": k1, "k2": k2, "k_dense": k_dense, "projection": "gaussian"})
        self.kw["seed"] = seed
        self.acc = torch.float64 if next(model.parameters()).dtype == torch.float64 else (
            torch.float32)
        self.cache: dict[Any, torch.Tensor] = {}
        self.blocks: list | None = None
        self.description = ""

    def sketch(self, ids: torch.Tensor, attn: torch.Tensor, mask: torch.Tensor,
               coef: torch.Tensor, *, groups: int | None) -> torch.Tensor:
        """``[S, n / groups, K]`` float64 host sketches of responses ``ids``/``attn
        [n, Lp + T]`` (``mask [n, T]`` their response tokens) with coefficients ``coef
        [S, n, T]`` (summed over runs of ``groups`` responses)."""
        n, T = mask.shape
        resp = torch.zeros(n, ids.shape[1], dtype=self.acc, device="cpu")
        resp[:, ids.shape[1] - T:] = mask.to(self.acc)
        try:
            # coefficients right-aligned [S, n, T]: each chunk is padded on the device
            r = response_sketches(self.model, ids, resp, attn, coefficients=coef.to(self.acc),
                                  rows=self.rows,
                                  out_device="cpu", groups=groups, **self.kw)
        except UsageError as err:
            raise UsageError(f"{err} (in the variance analysis: gradients='vectors' takes the "
                             "per-token vectors path instead)") from err
        self.blocks, self.description = r.blocks, r.description
        return r.vec.to(torch.float64)

    def estimates(self, data: dict[str, torch.Tensor],
                  sets: list[tuple[Any, torch.Tensor]]) -> list[torch.Tensor]:
        """``[M, K]`` float64 host estimates per ``(key, coef [M, G, T])``: the groups not yet
        cached, every set sharing a start in one call (one forward per chunk). The first
        groups of ``data`` must be those of the earlier calls (rounds only append)."""
        todo: dict[tuple[int, int, int], list[int]] = {}
        for i, (key, coef) in enumerate(sets):
            M, G = coef.shape[:2]
            m0 = 0 if key not in self.cache else self.cache[key].shape[0]
            if m0 < M:
                todo.setdefault((m0, M, G), []).append(i)
        for (m0, M, G), idx in todo.items():
            lo, hi = m0 * G, M * G
            ids = data["input_ids"][0, lo:hi]
            attn = data["attention_mask"][0, lo:hi]
            mask = data["mask"][0, lo:hi]
            coef = torch.stack([sets[i][1][m0:M].reshape(hi - lo, -1).cpu() for i in idx])
            new = self.sketch(ids, attn, mask, coef, groups=G)
            for j, i in enumerate(idx):
                key = sets[i][0]
                old = self.cache.get(key)
                self.cache[key] = new[j] if old is None else torch.cat([old[:m0], new[j]])
        return [self.cache[key][: coef.shape[0]] for key, coef in sets]

    def error_sd(self, e: torch.Tensor, r: torch.Tensor, gram=None,
                 mean=None) -> dict[str, float]:
        """The projection's SD estimate of variance, MSE and projection (:func:`projection_sd`;
        ``mean`` unused: no exact cells on this path)."""
        return projection_sd(e, r, self.blocks or [])

    def pair_error_sd(self, e, eb, r, gram=None, gram_b=None) -> dict[str, dict[str, float]]:
        """``{stat: {log_ratio, diff}}``: SD bounds of two schemes' log ratio and difference of
        variance and MSE, ``sd_a/a + sd_b/b`` and ``sd_a + sd_b``, true whatever the two
        errors' correlation (the projection's covariance of two schemes is not modelled)."""
        sa, sb = self.error_sd(e, r, gram), self.error_sd(eb, r, gram_b)
        va, vb = variance_stats(e, r), variance_stats(eb, r)
        out = {}
        for k in ("variance", "mse"):
            a, b = va[k][0], vb[k][0]
            rel = sa[k] / a + sb[k] / b if a > 0 and b > 0 else float("nan")
            out[k] = {"log_ratio": rel, "diff": sa[k] + sb[k]}
        return out


def group_advantages(label, rewards, mask, logprobs, sum_pi_sq, token_sq, *, k=1):
    """``[M, G, T]`` advantages of scheme ``label`` for M groups (one group per row)."""
    scheme, exact = split_label(label)
    opts: dict[str, Any] = {"logprobs": logprobs, "sum_pi_sq": sum_pi_sq, "k": k}
    if exact:
        opts = {"token_weights": token_sq, "k": k}
    return advantages(scheme, rewards, mask, **opts)


def group_coefficients(adv: torch.Tensor, mask: torch.Tensor, logp: torch.Tensor, mode: str, *,
                       max_len: int) -> torch.Tensor:
    """``[M, G, T]`` float64 ascent-direction coefficients ``c_{i,t}`` of each group's estimate.

    ``adv``, ``mask``, ``logp`` ``[M, G, T]``. The coefficient is the exact per-token gradient
    weight of the clipped loss at ratio 1 (``token_coefficients``, sign flipped), computed per
    group so that each group is its own batch (B = G in the aggregation weights).
    """
    # One coefficient pass over all M groups (a batch of B = M*G), then each token's weight
    # rescaled from the batch's omega to its own group's (omega is linear in c; at ratio 1
    # no clip is active): no Python loop over groups in the loss terms.
    coef = -token_coefficients(logp, logp, adv, mask, mode, max_len=max_len)
    wb = aggregation_weights(mask, mode, max_len=max_len, dtype=torch.float64)
    wg = aggregation_weights(mask, mode, max_len=max_len, dtype=torch.float64, per_group=True)
    return coef.double() * torch.where(wb > 0, wg / torch.where(wb > 0, wb, 1), 0)


def group_estimates(vec: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, logp: torch.Tensor,
                    mode: str, *, max_len: int) -> torch.Tensor:
    """``[M, K]`` ascent-direction estimates ``sum_{i,t} c_{i,t} v_{i,t}`` for each group from
    per-token vectors ``vec [M, G, T, K]`` (:func:`group_coefficients` for ``c``)."""
    # The one contraction (varbench.grads.vectors.combine): in the vectors' dtype, no
    # per-scheme copy of the large [M, G, T, K] tensor.
    coef = group_coefficients(adv, mask, logp, mode, max_len=max_len)
    return combine(vec, coef).to(torch.float64)


def _mode_scale(mode: str, mean_len: float, max_len: int) -> float:
    if mode == "seq-mean-token-sum":
        return 1.0
    if mode == "seq-mean-token-sum-norm":
        return 1.0 / max_len
    return 1.0 / mean_len



# The per-response arrays a cell reads ([1, n, ...]): the vectors path's per-token vectors
# ``vec [1, n, T, K]``, the projected path's model inputs ``input_ids`` / ``attention_mask``
# ``[1, n, Lp + T]`` (host memory: they go to the device one chunk at a time).
_ARRAYS = ("token_sq", "mask", "logprobs", "sum_pi_sq", "rewards")
_VECTORS_ARRAYS = ("vec",)
_PROJECTED_ARRAYS = ("input_ids", "attention_mask")


def _from_sample(batch, tv) -> dict[str, torch.Tensor]:
    """The vectors path's arrays of a sampled batch and its token vectors."""
    return {"vec": tv.vec, "token_sq": tv.token_sq, "mask": batch.mask,
            "logprobs": batch.logprobs, "sum_pi_sq": batch.sum_pi_sq, "rewards": batch.rewards}


def _from_batch(batch, token_sq: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The projected path's arrays of a sampled batch, on the host (``token_sq``: exact
    ``||g_t||^2 [1, n, T]`` when a label reads it, else NaN: never read)."""
    flat = batch.flat()
    P, G, T = batch.tokens.shape
    tsq = (torch.full((P, G, T), float("nan"), dtype=torch.float32, device="cpu")
           if token_sq is None
           else token_sq)
    out = {"token_sq": tsq, "mask": batch.mask, "logprobs": batch.logprobs,
           "sum_pi_sq": batch.sum_pi_sq, "rewards": batch.rewards,
           "input_ids": flat.input_ids.reshape(P, G, -1),
           "attention_mask": flat.attention_mask.reshape(P, G, -1)}
    return {k: v.detach().cpu() for k, v in out.items()}


def _concat_arrays(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Responses of several sampling rounds side by side (dim 1), each array zero-padded on
    dim 2 to its longest round (one prompt: the prompt part is the same in every round)."""
    out = {}
    for k in parts[0]:
        n = max(p[k].shape[2] for p in parts) if k != "rewards" else 0
        xs = []
        for p in parts:
            x = p[k]
            if k != "rewards" and x.shape[2] < n:
                pad = [0, 0] * (x.dim() - 3) + [0, n - x.shape[2]]
                x = torch.nn.functional.pad(x, pad)
            xs.append(x)
        out[k] = torch.cat(xs, 1)
    return out


def _coef_fn(label: str, mode: str, *, topk_k: int, max_len: int):
    """``coef_fn(rewards [C, G], mask [C, G, T])`` for :func:`exact_moments` (None: the
    scheme needs more than rewards, e.g. OTB's token weights)."""
    scheme, exact = split_label(label)

    def fn(R, mask):
        adv = advantages(scheme, R, mask != 0, k=topk_k)
        lp = torch.zeros_like(adv)
        # every configuration its own batch of G, in one pass (no loop over configurations)
        return -token_coefficients(lp, lp, adv, mask, mode, max_len=max_len, per_group=True)
    return None if exact else fn


def _exact_cell(table, label, mode, G, ref, *, topk_k, max_len):
    fn = _coef_fn(label, mode, topk_k=topk_k, max_len=max_len)
    if fn is None or ref is None:
        return None
    try:
        return exact_moments(table, fn, G, ref)
    except UsageError:
        return None  # the scheme needs token statistics: Monte Carlo


def _cell(data, G, M, labels, modes, ref, *, topk_k, max_len, mean_len, table=None,
          sketch_k=None, interval="studentized", n_boot=1000, level=0.95, seed=0,
          intervals=True, contraction=None):
    """Statistics of every (scheme, mode) at group size G for one prompt; paired ratios.

    ``data``: the arrays of >= M*G responses. ``contraction`` turns each (scheme, mode)'s
    coefficients into the M group estimates (default: :class:`VectorContraction` of
    ``data["vec"]`` with ``sketch_k`` CountSketch buckets, None: flat). With ``table`` (an
    enumerable prompt), a scheme that reads only rewards gets exact values (``method = exact``,
    ``exact-sketched`` through a sketch); otherwise the Monte Carlo values over the M groups
    (``method = mc``) with bootstrap-t intervals, widened by the sketch's or projection's own
    error (``contraction.error_sd``).
    """
    n = M * G
    if contraction is None:
        # a sketched table's vectors carry the table's sketch: its error goes into every cell
        contraction = VectorContraction(sketch_k if sketch_k is not None else (
            None if table is None else table.sketch_k))

    def grp(x):
        return x[0, :n].reshape(M, G, *x.shape[2:])

    mask = grp(data["mask"]) != 0
    T = mask.shape[-1]
    logp, spsq, tsq = grp(data["logprobs"]), grp(data["sum_pi_sq"]), grp(data["token_sq"])
    rewards = data["rewards"][0, :n].reshape(M, G).to(logp.dtype)
    tokens = mask.sum((1, 2)).double().cpu()
    agree = (rewards == rewards[:, :1]).all(1).double().mean()
    z = float(torch.distributions.Normal(*torch.tensor([0.0, 1.0], device="cpu")).icdf(
        torch.tensor((1 + level) / 2, device="cpu")))
    table_k = None if table is None else table.sketch_k
    exact_label = "exact" if table_k is None else "exact-sketched"
    rows, paired, est = [], [], {}
    nonzero, sets = {}, []
    exact_rows_of: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # per mode: rows, Gram
    forms: dict[tuple[str, str], dict] = {}
    for label in labels:
        adv = group_advantages(label, rewards, mask, logp, spsq, tsq, k=topk_k)
        nonzero[label] = ((adv != 0) & mask).any(-1).double().mean()
        for mode in modes:
            sets.append(((label, mode, G), group_coefficients(
                adv, mask.to(logp.dtype), logp, mode, max_len=max_len)))
    # every set's [M, K] estimates at once (the projected path: one forward per chunk of
    # responses, one weighted backward per set), on the host: the statistics are host code
    ests = dict(zip((k for k, _ in sets), contraction.estimates(data, sets), strict=True))
    for label in labels:
        for mode in modes:
            r = None if ref is None else ref.cpu() * _mode_scale(mode, mean_len, max_len)
            e = ests[label, mode, G]
            st = variance_stats(e, r, tokens=tokens)
            row = {"scheme": label, "G": G, "mode": mode, "M": M, "T": T}
            for k in VARIANCE_STATS:
                row[k], row[f"{k}_se"] = st[k]
            row["frac_nonzero_delta"] = float(nonzero[label])
            row["frac_all_agree"] = float(agree)
            row["tokens_per_group"] = float(tokens.mean())
            ex = None if table is None else _exact_cell(table, label, mode, G, r,
                                                        topk_k=topk_k, max_len=max_len)
            row["method"] = "mc" if ex is None else exact_label
            row["distinct_groups"] = distinct_estimates(e)
            row["degenerate_ci"] = 0.0
            # X X^T once per estimate set: the intervals, the sketch SD and the paired ratios
            # all read it
            gram = gram_matrix(e) if r is not None and (intervals or ex is not None) else None
            if ex is not None:
                # an exact contraction of sketched vectors is exact for the sketch, not for the
                # gradients: its one draw's error is its SE, read from the cell's exact forms
                # (the projection's about E g_hat); not from the sampled groups, whose
                # sum ||a_m||^4 / M excess made the ratios' intervals too wide
                sd = None
                if table_k:
                    if mode not in exact_rows_of:
                        xr = ex["rows"]
                        exact_rows_of[mode] = (xr, xr @ xr.T)
                    sd = {**contraction.error_sd(e, r, gram, mean=ex["mean"]),
                          **exact_sketch_sd(ex["forms"], exact_rows_of[mode][0], table_k,
                                            gram=exact_rows_of[mode][1])}
                    forms[label, mode] = ex["forms"]
                _set_exact(row, ex, sd, z)
            elif r is not None and intervals:
                iv = group_intervals(e, r, level=level, n_boot=n_boot, seed=seed,
                                     method=interval, gram=gram)
                sd = contraction.error_sd(e, r, gram)
                for k in INTERVAL_STATS:
                    w = widen(iv[k], sd[k], z)
                    row[f"{k}_se"], row[f"{k}_ci_low"], row[f"{k}_ci_high"] = (
                        w["se"], w["ci_low"], w["ci_high"])
                    row[f"{k}_sketch_sd"] = sd[k]
                # the per-group noise scale's bootstrap-t interval (varbench.stats.noise_scale;
                # the sketch's error is not in it), read by the planner
                ns = noise_scale_interval(e, level=level, n_boot=n_boot, seed=seed + 7,
                                          method=interval, gram=gram)
                row["noise_scale_ci_low"], row["noise_scale_ci_high"] = ns["ci_low"], ns["ci_high"]
                # 1.0 / 0.0 (a float: pooled over prompts, > 0 when any prompt's is)
                row["degenerate_ci"] = float(row["distinct_groups"] < MIN_DISTINCT_GROUPS or any(
                    row[f"{k}_ci_high"] == row[f"{k}_ci_low"] for k in INTERVAL_STATS))
            est[label, mode] = (e, r, None if ex is None else row, gram,
                                row["distinct_groups"])
            rows.append(row)
    for label, base in headline_pairs(labels):
        for mode in modes:
            (e, r, ex, gram, nd), (eb, _, exb, gram_b, nd_b) = est[label, mode], est[base, mode]
            # one sketch draw under both schemes: the SDs of their ratios and differences
            if (label, mode) in forms and (base, mode) in forms:  # two exact-sketched cells
                xr, H = exact_rows_of[mode]
                psds = exact_pair_sd(forms[label, mode], forms[base, mode], xr, table_k,
                                     gram=H)
            else:
                psds = (contraction.pair_error_sd(e, eb, r, gram, gram_b)
                        if r is not None and (intervals or ex is not None) else None)
            for stat in ("variance", "mse"):
                if stat == "mse" and r is None:
                    continue
                row = {"scheme": label, "baseline": base, "G": G, "mode": mode, "stat": stat}
                psd = None if psds is None else psds[stat]
                if ex is not None and exb is not None:
                    row.update(_exact_ratio(ex, exb, stat, z, psd if table_k else None),
                               method=exact_label)
                else:
                    c = paired_compare(e, eb, r, stat=stat)
                    row.update(ratio=c["ratio"], ratio_se=c["ratio_se"], diff=c["diff"],
                               diff_se=c["diff_se"], method="mc")
                    if (intervals and r is not None and math.isfinite(c["ratio"])
                            and c["ratio"] > 0):
                        pi = paired_ratio_interval(e, eb, r, stat=stat, level=level,
                                                   n_boot=n_boot, seed=seed, method=interval,
                                                   gram_a=gram, gram_b=gram_b)
                        pi = widen(pi, psd["log_ratio"], z, log=True)
                        row.update(ratio_ci_low=pi["ci_low"], ratio_ci_high=pi["ci_high"],
                                   ratio_se=math.hypot(c["ratio_se"], c["ratio"]
                                                       * psd["log_ratio"]),
                                   diff_se=math.hypot(c["diff_se"], psd["diff"]),
                                   ratio_sketch_sd=psd["log_ratio"])
                        # the cells' distinct counts (torch.unique of [M, K]: once per set)
                        few = min(nd, nd_b)
                        row["degenerate_ci"] = float(few < MIN_DISTINCT_GROUPS
                                                     or pi["ci_low"] == pi["ci_high"])
                paired.append(row)
    return pd.DataFrame(rows), pd.DataFrame(paired)


def _exact_ratio(row: dict, base: dict, stat: str, z: float,
                 sd: dict[str, float] | None) -> dict[str, float]:
    """Ratio and difference of two exact cells' ``stat``; with sketched vectors (both cells
    share one sketch draw) ``sd``: the SDs of the log ratio and the difference over the sketch
    (``pair_error_sd`` of the cells' sampled groups), as SEs and ``-/+ z sd`` intervals."""
    a, b = row[stat], base[stat]
    ratio = a / b if b else float("nan")
    rel, dsd = (0.0, 0.0) if sd is None else (sd["log_ratio"], sd["diff"])
    return {"ratio": ratio, "ratio_se": abs(ratio) * rel, "diff": a - b, "diff_se": dsd,
            "ratio_ci_low": ratio * math.exp(-z * rel), "ratio_ci_high": ratio * math.exp(z * rel),
            "ratio_sketch_sd": rel}


def _set_exact(row: dict, ex: dict[str, float], sketch: dict[str, float] | None = None,
               z: float = 1.96) -> None:
    """Overwrite a cell's moment statistics with their exact values: SE 0, or with
    ``sketch`` (the sketch's SD of variance, MSE and projection, ``exact-sketched``) those as
    SEs and ``value -/+ z sd`` as intervals, and NaN SEs for the statistics derived from them
    (their sketch error is not modelled)."""
    # the derived statistics' one definition, at exact moments (n = inf: g_bar = E g_hat)
    derived = moment_statistics(ex["variance"], ex["signal_norm2"], ex["bias2"],
                                row["tokens_per_group"])
    vals = {**{k: float(v) for k, v in derived.items()},
            "mse": ex["mse"], "projection": ex["projection"],
            "frac_all_agree": ex["frac_all_agree"], "frac_zero": ex["frac_zero"]}
    for k, v in vals.items():
        row[k] = v
        if f"{k}_se" in row:
            row[f"{k}_se"] = 0.0 if sketch is None else float("nan")
    # the noise scale's interval: the exact value itself (flat vectors), unknown (sketched)
    row["noise_scale_ci_low"] = row["noise_scale_ci_high"] = (
        vals["noise_scale"] if sketch is None else float("nan"))
    for k in INTERVAL_STATS:
        sd = 0.0 if sketch is None else sketch[k]
        row[f"{k}_se"] = sd
        lo = vals[k] - z * sd
        row[f"{k}_ci_low"] = max(lo, 0.0) if k in ("variance", "mse") else lo
        row[f"{k}_ci_high"] = vals[k] + z * sd
        row[f"{k}_sketch_sd"] = sd


def headline_pairs(labels: Sequence[str]) -> list[tuple[str, str]]:
    """The (scheme, baseline) pairs whose paired ratios are headlines: every label against
    centered, and an OTB-type label against its ``_exact`` twin (what the proxy costs)."""
    pairs = [(lab, "centered") for lab in labels if lab != "centered" and "centered" in labels]
    return pairs + [(lab, exact_label(lab)) for lab in labels if exact_label(lab) in labels]


def table_cells(
    table: ResponseTable,
    G: int,
    M: int,
    *,
    schemes: Sequence[str] = ("centered", "otb"),
    modes: Sequence[str] = ("seq-mean-token-sum",),
    exact: bool = False,
    interval: str = "studentized",
    n_boot: int = 1000,
    level: float = 0.95,
    topk_k: int = 1,
    seed: int = 0,
    sketch_k: int | None = None,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """``(cells, paired)`` of M groups of G drawn from an enumerated ``table`` (one prompt).

    The Monte Carlo cells of :func:`~varbench.analysis.variance.estimator_variance`
    (``exact=False``) or, for the schemes that read only rewards, the exact ones
    (``exact=True``), against the table's own g*. The groups are drawn with
    ``torch.Generator().manual_seed(seed)``: a replicate study (interval coverage, exact
    against Monte Carlo) is a loop over seeds. ``sketch_k``: the table's sketch bucket count,
    to widen the Monte Carlo intervals by the sketch's SD as the analysis does (None: not
    widened, the truth in the sketch's space).
    """
    check_knob("G", G, minimum=2)
    check_knob("M", M, minimum=3)
    T = table.mask.shape[1]
    data = table.sample(M * G, torch.Generator().manual_seed(seed))
    return _cell(data, G, M, list(schemes), list(modes), table.reference(), topk_k=topk_k,
                 max_len=T, mean_len=float(T), table=table if exact else None,
                 sketch_k=sketch_k, interval=interval, n_boot=n_boot, level=level, seed=seed)
