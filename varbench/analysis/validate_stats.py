"""Statistics of the validation experiment: tokens-to-threshold, bootstrap CIs, the OTB claim,
the prediction check and the reward-hacking correlations. Pure functions of record tables.

Tables in (one row per evaluation of one run): ``task, scheme, G, seed, step, tokens,
acc_sampled, acc_greedy, reward_sampled``. The bootstrap resamples *seeds* (whole runs): the
runs of one cell are the independent units. With 2-3 seeds per cell the percentile intervals
are crude (they cannot be wider than the spread of the seeds): read them as such.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from scipy import stats as sps

_B = 2000  # bootstrap resamples


def threshold_of(acc0: float, frac: float) -> float:
    """Accuracy threshold ``acc0 + frac * (1 - acc0)``: a fixed fraction of the remaining gap."""
    return acc0 + frac * (1.0 - acc0)


def tokens_to_threshold(curve: pd.DataFrame, threshold: float) -> tuple[float, bool]:
    """``(tokens, reached)``: sampled tokens at the first evaluation with accuracy >= threshold.

    ``curve``: one run's evaluation rows (``tokens``, ``acc_sampled``) in step order. A run that
    never reaches it returns its final token count (a lower bound: censored) and False.
    """
    hit = curve[curve["acc_sampled"] >= threshold]
    if len(hit):
        return float(hit["tokens"].iloc[0]), True
    return float(curve["tokens"].iloc[-1]), False


def bootstrap_mean_ci(x: np.ndarray, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of ``x`` (resampling its entries)."""
    x = np.asarray(x, dtype=float)
    if len(x) == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = rng.choice(x, size=(_B, len(x)), replace=True).mean(1)
    a = (1 - level) / 2
    return float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def t2t_table(curves: pd.DataFrame, thresholds: dict[str, float]) -> pd.DataFrame:
    """Per run: tokens-to-threshold, reached, final accuracy. Columns as in the module doc."""
    rows = []
    for (task, scheme, G, seed), c in curves.groupby(["task", "scheme", "G", "seed"], sort=True):
        c = c.sort_values("step")
        tok, ok = tokens_to_threshold(c, thresholds[task])
        rows.append({"task": task, "scheme": scheme, "G": int(G), "seed": int(seed),
                     "threshold": thresholds[task], "tokens_to_threshold": tok, "reached": ok,
                     "final_tokens": float(c["tokens"].iloc[-1]),
                     "final_acc_sampled": float(c["acc_sampled"].iloc[-1]),
                     "final_acc_greedy": float(c["acc_greedy"].iloc[-1])})
    return pd.DataFrame(rows)


def cell_table(t2t: pd.DataFrame) -> pd.DataFrame:
    """Per task x scheme x G: mean tokens-to-threshold (censored runs count at their final
    tokens, so the mean is a lower bound when any is censored) with a bootstrap CI over seeds,
    and final accuracy mean and std over seeds."""
    rows = []
    for (task, scheme, G), c in t2t.groupby(["task", "scheme", "G"], sort=True):
        x = c["tokens_to_threshold"].to_numpy()
        lo, hi = bootstrap_mean_ci(x)
        rows.append({"task": task, "scheme": scheme, "G": int(G), "seeds": len(c),
                     "reached": int(c["reached"].sum()),
                     "t2t_mean": float(x.mean()), "t2t_ci_lo": lo, "t2t_ci_hi": hi,
                     "t2t_is_lower_bound": bool((~c["reached"]).any()),
                     "final_acc_mean": float(c["final_acc_sampled"].mean()),
                     "final_acc_std": float(c["final_acc_sampled"].std(ddof=1))
                     if len(c) > 1 else math.nan})
    return pd.DataFrame(rows)


def claim(t2t: pd.DataFrame, task: str, a: tuple[str, int], b: tuple[str, int],
          seed: int = 0) -> dict:
    """Token saving of cell ``a`` against cell ``b``: ``1 - mean_a / mean_b`` with a bootstrap
    CI (seeds of each cell resampled independently). Positive: ``a`` needs fewer tokens."""
    ca = t2t[(t2t.task == task) & (t2t.scheme == a[0]) & (t2t.G == a[1])]
    cb = t2t[(t2t.task == task) & (t2t.scheme == b[0]) & (t2t.G == b[1])]
    out = {"task": task, "a": f"{a[0]} G={a[1]}", "b": f"{b[0]} G={b[1]}"}
    if len(ca) == 0 or len(cb) == 0:
        missing = a if len(ca) == 0 else b
        return {**out, "available": False, "missing": f"{missing[0]} at G={missing[1]}"}
    xa, xb = ca["tokens_to_threshold"].to_numpy(), cb["tokens_to_threshold"].to_numpy()
    rng = np.random.default_rng(seed)
    ma = rng.choice(xa, size=(_B, len(xa))).mean(1)
    mb = rng.choice(xb, size=(_B, len(xb))).mean(1)
    saving = 1 - ma / mb
    return {**out, "available": True, "t2t_a": float(xa.mean()), "t2t_b": float(xb.mean()),
            "reached_a": int(ca["reached"].sum()), "reached_b": int(cb["reached"].sum()),
            "seeds_a": len(xa), "seeds_b": len(xb),
            "saving": float(1 - xa.mean() / xb.mean()),
            "saving_ci_lo": float(np.quantile(saving, 0.025)),
            "saving_ci_hi": float(np.quantile(saving, 0.975))}


def claim_sentence(c: dict) -> str:
    """The claim as measured, whichever way it falls."""
    if not c["available"]:
        return (f"{c['task']}: cannot test '{c['a']} reaches the threshold with fewer sampled "
                f"tokens than {c['b']}': no runs of {c['missing']} in this experiment.")
    censored = ""
    if c["reached_a"] < c["seeds_a"] or c["reached_b"] < c["seeds_b"]:
        censored = (f" Not every run reached the threshold ({c['a']}: {c['reached_a']}/"
                    f"{c['seeds_a']}, {c['b']}: {c['reached_b']}/{c['seeds_b']}); unreached runs "
                    "count at their full budget, so those means are lower bounds.")
    verdict = "fewer" if c["saving"] > 0 else "more"
    holds = ("holds" if c["saving_ci_lo"] > 0 else
             "is contradicted" if c["saving_ci_hi"] < 0 else "is not resolved (CI spans 0)")
    return (f"{c['task']}: {c['a']} reached the threshold after {c['t2t_a']:,.0f} sampled tokens "
            f"(mean of {c['seeds_a']} seeds) vs {c['t2t_b']:,.0f} for {c['b']}: "
            f"{abs(c['saving']) * 100:.0f}% {verdict} tokens (saving {c['saving'] * 100:.0f}%, "
            f"95% bootstrap CI [{c['saving_ci_lo'] * 100:.0f}%, {c['saving_ci_hi'] * 100:.0f}%]); "
            f"the claim {holds} as measured.{censored}")


def rank_correlation_ci(x: np.ndarray, y: np.ndarray, seed: int = 0) -> tuple[float, float, float]:
    """Spearman rho of paired cells with a percentile bootstrap CI over cells."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    if len(x) < 3:
        return math.nan, math.nan, math.nan
    rho = float(sps.spearmanr(x, y).statistic)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), (_B, len(x)))
    rx, ry = sps.rankdata(x[idx], axis=1), sps.rankdata(y[idx], axis=1)  # Spearman = Pearson
    rx, ry = rx - rx.mean(1, keepdims=True), ry - ry.mean(1, keepdims=True)  # of the ranks
    den = np.sqrt((rx * rx).sum(1) * (ry * ry).sum(1))
    ok = den > 0  # a resample with all-equal values has no correlation: dropped
    if not ok.any():
        return rho, math.nan, math.nan
    boots = (rx * ry).sum(1)[ok] / den[ok]
    return rho, float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))


def hacking_table(curves: pd.DataFrame) -> pd.DataFrame:
    """Per proxy-reward run: Pearson and Spearman correlation, over the evaluations of training,
    between the held-out proxy reward and held-out exact-match accuracy; start and end values."""
    rows = []
    for (reward, seed), c in curves.groupby(["reward", "seed"], sort=True):
        c = c.sort_values("step")
        x, y = c["reward_sampled"].to_numpy(), c["acc_sampled"].to_numpy()
        ok = len(c) >= 3 and np.ptp(x) > 0 and np.ptp(y) > 0
        rows.append({"reward": reward, "seed": int(seed), "evals": len(c),
                     "pearson": float(np.corrcoef(x, y)[0, 1]) if ok else math.nan,
                     "spearman": float(sps.spearmanr(x, y).statistic) if ok else math.nan,
                     "reward_start": float(x[0]), "reward_end": float(x[-1]),
                     "exact_start": float(y[0]), "exact_end": float(y[-1])})
    return pd.DataFrame(rows)
