"""Statistics of the validation experiment: tokens-to-threshold (Kaplan-Meier restricted means
for censored runs), bootstrap CIs, savings and their verdicts, collapse-rate intervals, the
power plan, the prediction check and the reward-hacking correlations. Pure functions of record
tables.

Tables in (one row per evaluation of one run): ``task, scheme, G, seed, step, tokens,
acc_sampled, acc_greedy, reward_sampled``. The bootstrap resamples *seeds* (whole runs): the
runs of one cell are the independent units. With 2-3 seeds per cell the percentile intervals
are crude (they cannot be wider than the spread of the seeds): read them as such.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import pandas as pd
from scipy import stats as sps

_B = 2000  # bootstrap resamples


def threshold_of(acc0: float, frac: float) -> float:
    """Accuracy threshold ``acc0 + frac * (1 - acc0)``: a fixed fraction of the remaining gap."""
    return acc0 + frac * (1.0 - acc0)


def tokens_to_threshold(curve: pd.DataFrame, threshold: float, *, interpolate: bool = False,
                        col: str = "tokens") -> tuple[float, bool]:
    """``(tokens, reached)``: sampled tokens at the first evaluation with accuracy >= threshold.

    ``curve``: one run's evaluation rows (``tokens``, ``acc_sampled``) in step order. A run that
    never reaches it returns its final token count (a lower bound: censored) and False.
    ``interpolate``: the crossing is placed on the straight line between the last evaluation
    below the threshold and the first at or above it, rather than at the latter (evaluations
    are spaced by hundreds of responses: without it the value is quantised to that spacing).
    ``col``: the column to read (``wall_s``: seconds to threshold).
    """
    acc = curve["acc_sampled"].to_numpy(float)
    x = curve[col].to_numpy(float)
    hit = np.nonzero(acc >= threshold)[0]
    if len(hit) == 0:
        return float(x[-1]), False
    k = int(hit[0])
    if not interpolate or k == 0:
        return float(x[k]), True
    frac = (threshold - acc[k - 1]) / (acc[k] - acc[k - 1])
    return float(x[k - 1] + frac * (x[k] - x[k - 1])), True


def bootstrap_mean_ci(x: np.ndarray, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap CI of the mean of ``x`` (resampling its entries)."""
    x = np.asarray(x, dtype=float)
    if len(x) == 0:
        return math.nan, math.nan
    rng = np.random.default_rng(seed)
    means = rng.choice(x, size=(_B, len(x)), replace=True).mean(1)
    a = (1 - level) / 2
    return float(np.quantile(means, a)), float(np.quantile(means, 1 - a))


def t2t_table(curves: pd.DataFrame, thresholds: dict[str, float], *,
              interpolate: bool = False) -> pd.DataFrame:
    """Per run: tokens-to-threshold, reached, final accuracy (and, where the curves carry
    ``wall_s``, wall seconds to threshold). Runs are keyed by task, scheme, G, variant (an arm
    beyond scheme x G; '' when the curves have no ``variant`` column) and seed."""
    curves = curves if "variant" in curves else curves.assign(variant="")
    rows = []
    for (task, scheme, G, variant, seed), c in curves.groupby(
            ["task", "scheme", "G", "variant", "seed"], sort=True):
        c = c.sort_values("step")
        tok, ok = tokens_to_threshold(c, thresholds[task], interpolate=interpolate)
        row = {"task": task, "scheme": scheme, "G": int(G), "variant": variant,
               "seed": int(seed), "threshold": thresholds[task], "tokens_to_threshold": tok,
               "reached": ok, "final_tokens": float(c["tokens"].iloc[-1]),
               "final_acc_sampled": float(c["acc_sampled"].iloc[-1]),
               "final_acc_greedy": float(c["acc_greedy"].iloc[-1])}
        if "wall_s" in c:
            row["wall_to_threshold"] = tokens_to_threshold(
                c, thresholds[task], interpolate=interpolate, col="wall_s")[0]
            row["final_wall_s"] = float(c["wall_s"].iloc[-1])
        rows.append(row)
    return pd.DataFrame(rows)


def mean_curves(curves: pd.DataFrame, by: list[str]) -> pd.DataFrame:
    """Mean accuracy curve per ``by`` group on a common sampled-token grid, every seed at every
    point: ``by + [point, tokens, acc_mean, acc_std, greedy_mean, seeds]``.

    Runs of one arm evaluate at different token counts (every ``eval_every`` steps, and a step's
    tokens depend on the response lengths), and a collapsed run's short responses take many
    more steps to spend the budget. Averaging by step therefore mixes token counts and, late in
    the run, keeps only the runs that took the most steps. Here each run's curve is interpolated
    linearly (in tokens) onto ``n`` evenly spaced points from 0 to the group's smallest final
    token count, ``n`` the median number of evaluations per run; the mean and SD are over the
    group's runs (keyed by ``seed`` and, where present, ``variant``) at each point.
    Math caveat: linear interpolation between evaluations, like the tokens-to-threshold
    crossing; beyond the shortest run of the group nothing is drawn.
    """
    run_key = ["seed"] + (["variant"] if "variant" in curves and "variant" not in by else [])
    rows = []
    for key, g in curves.groupby(by, sort=True):
        runs = [c.sort_values("tokens") for _, c in g.groupby(run_key, sort=True)]
        end = min(float(c["tokens"].iloc[-1]) for c in runs)
        n = max(2, int(np.median([len(c) for c in runs])))
        grid = np.linspace(0.0, end, n)
        acc = np.stack([np.interp(grid, c["tokens"].to_numpy(float),
                                  c["acc_sampled"].to_numpy(float)) for c in runs])
        greedy = np.stack([np.interp(grid, c["tokens"].to_numpy(float),
                                     c["acc_greedy"].to_numpy(float)) for c in runs])
        std = acc.std(axis=0, ddof=1) if len(runs) > 1 else np.full(n, np.nan)
        key = key if isinstance(key, tuple) else (key,)
        for i in range(n):
            rows.append({**dict(zip(by, key, strict=True)), "point": i, "tokens": grid[i],
                         "acc_mean": float(acc[:, i].mean()), "acc_std": float(std[i]),
                         "greedy_mean": float(greedy[:, i].mean()), "seeds": len(runs)})
    return pd.DataFrame(rows)


def cell_table(t2t: pd.DataFrame, budgets: dict[str, float] | None = None) -> pd.DataFrame:
    """Per task x scheme x G (x variant): mean tokens-to-threshold (censored runs count at their
    final tokens, so the mean is a lower bound when any is censored) with a bootstrap CI over
    seeds; with ``budgets`` (task -> tokens) also the Kaplan-Meier restricted mean at the
    budget (``t2t_rmst``); final accuracy mean and std over seeds."""
    t2t = t2t if "variant" in t2t else t2t.assign(variant="")
    rows = []
    for (task, scheme, G, variant), c in t2t.groupby(["task", "scheme", "G", "variant"],
                                                      sort=True):
        x = c["tokens_to_threshold"].to_numpy()
        lo, hi = bootstrap_mean_ci(x)
        row = {"task": task, "scheme": scheme, "G": int(G), "variant": variant,
               "seeds": len(c), "reached": int(c["reached"].sum()),
               "t2t_mean": float(x.mean()), "t2t_ci_lo": lo, "t2t_ci_hi": hi,
               "t2t_is_lower_bound": bool((~c["reached"]).any()),
               "final_acc_mean": float(c["final_acc_sampled"].mean()),
               "final_acc_std": float(c["final_acc_sampled"].std(ddof=1))
               if len(c) > 1 else math.nan}
        if budgets is not None:
            row["t2t_rmst"] = km_restricted_mean(x, c["reached"].to_numpy(), budgets[task])
        rows.append(row)
    return pd.DataFrame(rows)


def rate_table(runs: pd.DataFrame, by: list[str], col: str = "collapsed") -> pd.DataFrame:
    """Per group of ``by``: runs, how many have ``col`` true, the rate and its Wilson 95% CI."""
    rows = []
    for key, d in runs.groupby(by, sort=True):
        k, n = int(d[col].sum()), len(d)
        lo, hi = wilson_ci(k, n)
        rows.append({**dict(zip(by, key if isinstance(key, tuple) else (key,), strict=True)),
                     "runs": n, col: k, "rate": k / n, "rate_ci_lo": lo, "rate_ci_hi": hi})
    return pd.DataFrame(rows)


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


# --- survival-style tokens-to-threshold (runs that never reach the threshold) -------------------

def km_restricted_mean(times: np.ndarray, reached: np.ndarray, tau: float) -> float:
    """Kaplan-Meier restricted mean of tokens-to-threshold, ``integral_0^tau S(t) dt``.

    ``times``: (n,) tokens at the first evaluation at or above the threshold, or, for a run that
    never reached it (``reached`` False: right-censored), its final token count. ``tau``: the
    restriction (the budget); times beyond it are cut at ``tau``. A censored run stays in the
    risk set up to and including its censoring time (the usual tie rule). When every censored
    run is censored at ``tau`` this equals ``mean(min(T, tau))``; an earlier-censored run (one
    that stopped short of the budget) is handled by the product-limit estimate instead of being
    counted at its early stop. Math caveat: beyond the last observation ``S`` is held flat.
    """
    t = np.minimum(np.asarray(times, dtype=float), float(tau))
    e = np.asarray(reached, dtype=bool) & (np.asarray(times, dtype=float) <= tau)
    if len(t) == 0:
        return math.nan
    surv, prev, area = 1.0, 0.0, 0.0
    for tj in np.unique(t[e]):
        area += surv * (tj - prev)
        at_risk = int((t >= tj).sum())
        surv *= 1.0 - int(((t == tj) & e).sum()) / at_risk
        prev = tj
    return float(area + surv * (float(tau) - prev))


SAVING_INTERVALS = ("t", "percentile")
REPORT_INTERVAL = "t"  # the interval the report's savings use (rmst_saving's default)
LEVEL = 0.95  # every interval of the report


def rmst_saving(xa: np.ndarray, ea: np.ndarray, xb: np.ndarray, eb: np.ndarray, tau: float, *,
                paired: bool = False, seed: int = 0, level: float = LEVEL,
                interval: str = REPORT_INTERVAL) -> dict:
    """Saving ``1 - RMST_a / RMST_b`` of restricted mean tokens-to-threshold and its CI.

    Seeds (whole runs) are resampled, each arm independently, or jointly by index when
    ``paired`` (the arms share seeds, e.g. proxy vs exact weights). Each resample's RMST is
    :func:`km_restricted_mean` at ``tau``; ``saving_se`` is the resamples' SD. ``interval="t"``
    (default): ``saving -/+ t_{df} SE`` with ``df = n - 1`` (paired) or ``min(n_a, n_b) - 1``
    (Welch's lower bound): with 5 seeds a percentile interval behaves like ``z sqrt(4/5) SE``
    against ``t_4 = 2.78 SE`` and undercovers; ``"percentile"``: the resamples' quantiles.
    Positive: ``a`` needs fewer tokens. Censoring makes the estimate a bound: censored ``b``
    runs can only lower RMST_b (the saving of the true means is at least this, if ``a`` is
    uncensored); censored ``a`` runs the other way.
    """
    if interval not in SAVING_INTERVALS:
        raise ValueError(f"interval={interval!r} is not valid; choose from {SAVING_INTERVALS}")
    xa, xb = np.asarray(xa, float), np.asarray(xb, float)
    ea, eb = np.asarray(ea, bool), np.asarray(eb, bool)
    rng = np.random.default_rng(seed)
    if paired and len(xa) != len(xb):
        raise ValueError(f"paired saving needs equal seeds: {len(xa)} vs {len(xb)}")
    ia = rng.integers(0, len(xa), (_B, len(xa)))
    ib = ia if paired else rng.integers(0, len(xb), (_B, len(xb)))
    ra = np.array([km_restricted_mean(xa[i], ea[i], tau) for i in ia])
    rb = np.array([km_restricted_mean(xb[i], eb[i], tau) for i in ib])
    boots = 1.0 - ra / rb
    a = (1 - level) / 2
    ma, mb = km_restricted_mean(xa, ea, tau), km_restricted_mean(xb, eb, tau)
    saving = 1.0 - ma / mb
    se = float(np.std(boots, ddof=1))
    df = max(1, (len(xa) if paired else min(len(xa), len(xb))) - 1)
    if interval == "t":
        half = float(sps.t.ppf(1 - a, df)) * se
        lo, hi = saving - half, saving + half
    else:
        lo, hi = float(np.quantile(boots, a)), float(np.quantile(boots, 1 - a))
    return {"rmst_a": ma, "rmst_b": mb, "saving": saving, "saving_ci_lo": lo,
            "saving_ci_hi": hi, "saving_se": se, "df": df, "interval": interval,
            "censored_a": int((~ea).sum()), "censored_b": int((~eb).sum())}


# --- proportions -------------------------------------------------------------------------------

def wilson_ci(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``k / n`` (sane at k = 0 and k = n)."""
    if n <= 0:
        return math.nan, math.nan
    z = float(sps.norm.ppf(0.5 + level / 2))
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def newcombe_diff_ci(k1: int, n1: int, k2: int, n2: int,
                     level: float = 0.95) -> tuple[float, float, float]:
    """``(p1 - p2, lo, hi)``: Newcombe's hybrid score interval (method 10) from Wilson limits."""
    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson_ci(k1, n1, level)
    l2, u2 = wilson_ci(k2, n2, level)
    d = p1 - p2
    lo = d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2)
    hi = d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)
    return d, max(-1.0, lo), min(1.0, hi)


# --- verdicts ----------------------------------------------------------------------------------

VERDICT_RULES = {
    "saving": "'a saves at least the claimed share': confirmed when the 95% CI's lower limit "
              "is at least the claimed saving (and above 0); refuted when its upper limit is "
              "below the claimed saving unless censored runs of the reference arm make the "
              "estimate a lower bound; undecided otherwise. Censored runs of the claimed-better "
              "arm make the estimate an upper bound: then it cannot be confirmed. With Holm "
              "over the claims family the limits are those of the Holm-adjusted level.",
    "equivalence": "confirmed when the 95% CI's lower limit is above -margin (the tested arm "
                   "needs at most margin more) and none of its runs is censored; refuted when the "
                   "upper limit is below -margin and no reference run is censored; undecided "
                   "otherwise, read 'not detectably worse' when the interval also covers 0.",
    "rate_diff": "confirmed when the 95% CI of (reference rate - tested rate) lies above 0; "
                 "refuted when it lies below 0; undecided otherwise (including no collapses).",
    "correlation": "confirmed when the 95% CI of Spearman's rho lies above 0 over at least "
                   "min_cells cells; refuted when it lies below 0; undecided otherwise or with "
                   "fewer cells.",
}


# What a saving or equivalence claim is about. "mean": the mean tokens-to-threshold, which the
# restricted mean only bounds when runs are censored (VERDICT_RULES' caveats); "restricted": the
# Kaplan-Meier restricted mean up to the budget itself (a run that never reaches the threshold
# counts at the budget by construction), so censoring bounds nothing and the interval decides.
ESTIMANDS = ("mean", "restricted")
RESTRICTED_RULES = {
    "saving_restricted": "(estimand = 'restricted') 'the restricted mean tokens-to-threshold of a, "
                         "up to the budget, is at least the claimed share below b's': confirmed "
                         "when the 95% CI's lower limit is at least the claimed saving (and above "
                         "0); refuted when its upper limit is below the claimed saving; undecided "
                         "otherwise. Censored runs are part of this estimand (each counts up to "
                         "the budget), so they bound nothing. With Holm over the claims family "
                         "the limits are those of the Holm-adjusted level.",
    "equivalence_restricted": "(estimand = 'restricted') the restricted mean up to the budget: "
                              "confirmed when the 95% CI's lower limit is above -margin, refuted "
                              "when the upper limit is below -margin, undecided otherwise (read "
                              "'not detectably worse' when the interval also covers 0); "
                              "censored runs bound nothing.",
}
RESTRICTED_KINDS = ("tokens", "proxy")  # budget-restricted; compute's wall time has no budget


def verdict_rules(estimands: Iterable[str] = ()) -> dict[str, str]:
    """The verdict rules a report states: VERDICT_RULES, plus RESTRICTED_RULES when a claim's
    estimand is 'restricted' (so a grid without one states and registers what it always did)."""
    out = dict(VERDICT_RULES)
    if "restricted" in set(estimands):
        out.update(RESTRICTED_RULES)
    return out


def estimand_of(claim: dict) -> str:
    """A claim's (or claim row's) estimand: 'mean' unless it says ``estimand = "restricted"``."""
    return claim.get("estimand", "mean")


def _bounds_apply(estimand: str) -> bool:
    if estimand not in ESTIMANDS:
        raise ValueError(f"estimand={estimand!r} is not valid; choose from {ESTIMANDS}")
    return estimand == "mean"


HOLM_FAMILY = ("every saving and equivalence claim (tokens, proxy, compute; each metric of a "
               "compute claim its own member) whose p-value is finite, each direction (for, "
               "against) its own family; stability and prediction claims are outside it "
               "(descriptive)")
COLLAPSE_RULE = ("a run collapsed when its final held-out sampled accuracy is below "
                 "collapse_acc_frac x the warm start's, or a gradient norm was non-finite; "
                 "surge and entropy flags are reported, never counted")


def verdict_saving(lo: float, hi: float, claimed: float, *, censored_a: int = 0,
                   censored_b: int = 0, estimand: str = "mean") -> str:
    """Verdict on 'a saves at least ``claimed`` over b' from the saving's CI (VERDICT_RULES;
    RESTRICTED_RULES when ``estimand`` is 'restricted': the censored counts are then ignored)."""
    if not _bounds_apply(estimand):
        censored_a = censored_b = 0
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "undecided"
    if lo >= claimed and lo > 0 and censored_a == 0:
        return "confirmed"
    if hi < claimed and censored_b == 0:
        return "refuted"
    return "undecided"


def verdict_equivalence(lo: float, hi: float, margin: float, *, censored_a: int = 0,
                        censored_b: int = 0, estimand: str = "mean") -> str:
    """Verdict on 'a is no worse than b by more than ``margin``' (VERDICT_RULES); censored
    runs bound the saving as in :func:`verdict_saving` (of ``a``: no confirmation; of ``b``: no
    refutation), unless ``estimand`` is 'restricted'."""
    if not _bounds_apply(estimand):
        censored_a = censored_b = 0
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "undecided"
    if lo > -margin and censored_a == 0:
        return "confirmed"
    return "refuted" if hi < -margin and censored_b == 0 else "undecided"


def equivalence_reading(verdict: str, lo: float, hi: float) -> str:
    """How an equivalence verdict reads: ``confirmed`` only when the interval clears the margin;
    an undecided one whose interval covers 0 is 'not detectably worse', not equivalent."""
    if verdict == "undecided" and lo <= 0 <= hi:
        return "not detectably worse (the interval does not clear the margin)"
    return verdict


def saving_pvalues(estimate: float, se: float, df: int, claimed: float) -> tuple[float, float]:
    """One-sided t p-values ``(p_confirm, p_refute)`` of 'saving >= claimed' against 'saving <
    claimed' and back: ``p_confirm <= (1 - level) / 2`` exactly when the t interval's lower
    limit is >= claimed (the 'confirmed' side of :func:`verdict_saving`)."""
    if not (math.isfinite(estimate) and math.isfinite(se)) or se <= 0:
        return math.nan, math.nan
    tstat = (estimate - claimed) / se
    return float(sps.t.sf(tstat, df)), float(sps.t.cdf(tstat, df))


def holm(pvalues: list[float] | np.ndarray) -> np.ndarray:
    """Holm's step-down adjusted p-values (NaN entries stay NaN and are not counted):
    ``p_(i) -> max_{j <= i} min(1, (m - j + 1) p_(j))`` over the m finite ones."""
    p = np.asarray(pvalues, dtype=float)
    out = np.full(p.shape, np.nan)
    idx = np.nonzero(np.isfinite(p))[0]
    m = len(idx)
    order = idx[np.argsort(p[idx], kind="stable")]
    run = 0.0
    for j, i in enumerate(order):
        run = max(run, min(1.0, (m - j) * p[i]))
        out[i] = run
    return out


def holm_verdicts(rows: list[dict], *, level: float = 0.95) -> None:
    """Holm over the family of rows with a ``p_confirm`` (savings, tested against
    ``max(claimed, 0)``, and equivalences, against ``-margin``), each
    direction its own family: a row is confirmed when its Holm-adjusted ``p_confirm`` is at
    most ``(1 - level) / 2`` and no run of its claimed-better arm is censored, refuted when its
    adjusted ``p_refute`` is and no reference run is censored, else undecided; a row whose
    ``estimand`` is 'restricted' ignores censoring. In place: adds ``p_confirm_holm``,
    ``p_refute_holm``, ``verdict_unadjusted``."""
    fam = [r for r in rows if math.isfinite(r.get("p_confirm", math.nan))]
    alpha = (1 - level) / 2
    pc = holm([r["p_confirm"] for r in fam])
    pr = holm([r["p_refute"] for r in fam])
    for r, c, f in zip(fam, pc, pr, strict=True):
        r["p_confirm_holm"], r["p_refute_holm"] = float(c), float(f)
        r["verdict_unadjusted"] = r["verdict"]
        bounds = _bounds_apply(estimand_of(r))
        if c <= alpha and (r.get("censored_a", 0) == 0 or not bounds):
            r["verdict"] = "confirmed"
        elif f <= alpha and (r.get("censored_b", 0) == 0 or not bounds):
            r["verdict"] = "refuted"
        else:
            r["verdict"] = "undecided"


def verdict_interval(lo: float, hi: float) -> str:
    """Verdict on 'the quantity is positive' from its CI (rate differences, correlations)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return "undecided"
    return "confirmed" if lo > 0 else "refuted" if hi < 0 else "undecided"


# --- power -------------------------------------------------------------------------------------

def seeds_for_saving(cv_a: float, cv_b: float, saving: float, *, half_width: float = 0.15,
                     level: float = 0.95, min_seeds: int = 3, interval: str = "t") -> int:
    """Seeds per arm so that the CI of ``s = 1 - m_a / m_b`` has half-width <= ``half_width``.

    Delta method for a ratio of two independent means over ``n`` seeds each:
    ``SE(s) ~= (1 - s) sqrt((cv_a^2 + cv_b^2) / n)`` (``cv``: coefficient of variation of one
    run's tokens-to-threshold). ``interval="t"`` (default, the interval the report uses,
    :func:`rmst_saving`): the smallest ``n >= min_seeds`` with ``t_{n-1} SE <= half_width``;
    ``"z"``: ``n = ceil(z^2 (1 - s)^2 (cv_a^2 + cv_b^2) / half_width^2)``, which undershoots a
    t interval at few seeds (n = 5: t_4 = 2.78 against z = 1.96).
    Math caveat: the delta method is first-order; hence a floor of ``min_seeds``.
    """
    if interval not in ("t", "z"):
        raise ValueError(f"interval={interval!r} is not valid; choose from ('t', 'z')")
    z = float(sps.norm.ppf(0.5 + level / 2))
    n = z * z * (1 - saving) ** 2 * (cv_a ** 2 + cv_b ** 2) / half_width ** 2
    n = max(int(min_seeds), int(math.ceil(n - 1e-9)))
    if interval == "t":  # the z count is a lower bound: step up until the t interval fits
        while saving_half_width(cv_a, cv_b, saving, n, level, interval="t") > half_width:
            n += 1
    return n


def saving_half_width(cv_a: float, cv_b: float, saving: float, n: int,
                      level: float = 0.95, interval: str = "t") -> float:
    """The delta-method CI half-width of the saving with ``n`` seeds per arm, ``t_{n-1}`` or
    ``z`` times its SE (inverse of :func:`seeds_for_saving`)."""
    q = (float(sps.t.ppf(0.5 + level / 2, max(1, n - 1))) if interval == "t"
         else float(sps.norm.ppf(0.5 + level / 2)))
    return q * (1 - saving) * math.sqrt((cv_a ** 2 + cv_b ** 2) / n)


def extrapolate_t2t(tokens: np.ndarray, acc: np.ndarray, threshold: float) -> float:
    """Tokens at which a least-squares line through the second half of a mean accuracy curve
    crosses ``threshold`` (inf when it does not rise). For budgeting arms that never reached the
    threshold in a short run; the first crossing is returned when the curve already reached it.
    Math caveat: a linear trend; learning curves flatten, so this is optimistic."""
    tokens, acc = np.asarray(tokens, float), np.asarray(acc, float)
    hit = np.nonzero(acc >= threshold)[0]
    if len(hit):
        return float(tokens[hit[0]])
    half = tokens >= tokens[len(tokens) // 2]
    if half.sum() < 2:
        return math.inf
    slope, icpt = np.polyfit(tokens[half], acc[half], 1)
    return float((threshold - icpt) / slope) if slope > 0 else math.inf


def power_plan(t2t: pd.DataFrame, mean_curves: pd.DataFrame, pairs: list[tuple[str, str, str]],
               *, half_width: float = 0.15, level: float = 0.95) -> pd.DataFrame:
    """Seeds and budget each comparison needs, from pilot runs.

    ``t2t``: :func:`t2t_table` of the pilot (arms named ``scheme/G[/variant]`` via the
    ``scheme``, ``G``, ``variant`` columns); ``mean_curves``: per task x arm mean accuracy
    (``task, arm, tokens, acc_mean``) for arms that never reached the threshold;
    ``pairs``: ``(task, a, b)``, saving of ``a`` over ``b``. Per arm the planning mean is the
    mean tokens-to-threshold when every pilot run reached it; the Kaplan-Meier restricted mean
    up to the longest run when at least half did (the mean curve of such an arm is dragged
    down by its collapsed runs and crosses late or never: issue 31's toolsum otb/4, 12 of 14
    reached at a mean 39k, extrapolated to 81k); else the linear extrapolation of
    the mean curve (:func:`extrapolate_t2t`). The coefficient of variation of a KM-planned arm
    is that of every run's tokens, censored runs at their final count (with censoring at the
    budget the restricted mean is the mean of these, so this is the spread the saving's
    interval sees; the reached runs alone understate it: issue 31's second toolsum follow-up,
    planned on reached-run CVs for a half-width of 0.15, measured 0.25, which its all-run CVs
    predict); otherwise it comes from the reached runs (>= 2 of them), else the median CV of the
    task's fully reached arms ('borrowed'). Seeds: :func:`seeds_for_saving` for a t CI
    half-width ``half_width``; budget: the larger arm's planning mean x (1 + 2 CV) (about its
    97.5% quantile, so nearly every run is observed reaching the threshold), rounded up to 1000
    tokens.
    """
    d = t2t if "variant" in t2t else t2t.assign(variant="")
    d = d.assign(arm=d["scheme"] + "/" + d["G"].astype(str)
                 + np.where(d["variant"] != "", "/" + d["variant"].astype(str), ""))

    def arm_stats(task: str, arm: str) -> dict:
        r = d[(d.task == task) & (d.arm == arm)]
        if len(r) == 0:
            raise ValueError(f"power_plan: no pilot runs of {arm} on {task}")
        x, ok = r["tokens_to_threshold"].to_numpy(float), r["reached"].to_numpy(bool)
        out = {"n": len(r), "reached": int(ok.sum())}
        if ok.all():
            out["mean"] = float(x.mean())
        elif 2 * ok.sum() >= len(ok):  # most reached: the mean curve mixes in collapsed runs
            out["mean"] = km_restricted_mean(x, ok, float(x.max()))  # (a lower bound)
            out["km"] = True
        else:
            c = mean_curves[(mean_curves.task == task) & (mean_curves.arm == arm)]
            c = c.sort_values("tokens")
            out["mean"] = extrapolate_t2t(c["tokens"].to_numpy(), c["acc_mean"].to_numpy(),
                                          float(r["threshold"].iloc[0]))
        if out.get("km"):  # the restricted mean's unit: every run, censored at its count
            out["cv"] = float(x.std(ddof=1) / x.mean())
        else:
            out["cv"] = (float(x[ok].std(ddof=1) / x[ok].mean()) if ok.sum() >= 2 else math.nan)
        return out

    full_cv: dict[str, list[float]] = {}
    for (task, _arm), r in d.groupby(["task", "arm"]):
        if r["reached"].all() and len(r) >= 2:
            x = r["tokens_to_threshold"].to_numpy(float)
            full_cv.setdefault(task, []).append(float(x.std(ddof=1) / x.mean()))
    rows = []
    for task, a, b in pairs:
        sa, sb = arm_stats(task, a), arm_stats(task, b)
        src = []
        for side, st in (("a", sa), ("b", sb)):
            if not math.isfinite(st["cv"]):
                st["cv"] = float(np.median(full_cv.get(task, [math.nan])))
                src.append(f"{side} borrowed")
            if st["reached"] < st["n"]:
                src.append(f"{side} KM mean" if st.get("km") else f"{side} extrapolated")
        s = 1 - sa["mean"] / sb["mean"] if math.isfinite(sb["mean"]) else 1.0
        ok = all(math.isfinite(v) for v in (sa["cv"], sb["cv"], sa["mean"], sb["mean"]))
        n = seeds_for_saving(sa["cv"], sb["cv"], s, half_width=half_width,
                             level=level) if ok else -1
        top = max(sa["mean"] * (1 + 2 * sa["cv"]), sb["mean"] * (1 + 2 * sb["cv"]))
        rows.append({"task": task, "a": a, "b": b, "n_a": sa["n"], "reached_a": sa["reached"],
                     "n_b": sb["n"], "reached_b": sb["reached"], "plan_mean_a": sa["mean"],
                     "plan_mean_b": sb["mean"], "cv_a": sa["cv"], "cv_b": sb["cv"],
                     "plan_saving": s, "seeds_needed": n,
                     "budget_needed": int(math.ceil(top / 1000) * 1000) if ok else -1,
                     "source": ", ".join(src) or "measured"})
    return pd.DataFrame(rows)


# --- caveats of a toy grid (issue 31) ----------------------------------------------------------

GREEDY_SOLVED = 0.95
"""A warm start at or above this held-out greedy accuracy already solves the greedy problem."""


def toy_caveats(curves: pd.DataFrame, t2t: pd.DataFrame, stab: pd.DataFrame, *,
                solved: float = GREEDY_SOLVED) -> pd.DataFrame:
    """Per task: the warm start's held-out greedy accuracy at step 0 (``greedy0``, the mean
    over runs, which share the warm start and the held-out prompts; ``greedy0_spread`` the
    max - min), whether it is ``solved`` (>= ``solved``), the runs, how many collapsed or never
    reached the threshold (censored), and ``uninformative``: every run of every scheme
    collapsed or is censored, so the task's verdicts say nothing scheme-specific.

    ``curves``: evaluation rows (``task, step, acc_greedy``); ``t2t``, ``stab``: one row per run
    keyed by ``task, scheme, G, variant, seed`` with ``reached`` and ``collapsed``."""
    keys = ["task", "scheme", "G", "variant", "seed"]
    runs = t2t[keys + ["reached"]].merge(stab[keys + ["collapsed"]], on=keys, how="left")
    if runs["collapsed"].isna().any():
        raise ValueError("toy_caveats: a run of t2t has no stability row")
    rows = []
    for task, c in curves[curves["step"] == 0].groupby("task", sort=True):
        g = c["acc_greedy"].to_numpy(float)
        r = runs[runs["task"] == task]
        bad = int((r["collapsed"].astype(bool) | ~r["reached"].astype(bool)).sum())
        rows.append({"task": task, "greedy0": float(g.mean()),
                     "greedy0_spread": float(g.max() - g.min()),
                     "solved": bool(g.mean() >= solved), "runs": len(r),
                     "collapsed_or_censored": bad, "uninformative": bool(len(r) and bad == len(r))})
    return pd.DataFrame(rows)


def caveat_texts(caveats: pd.DataFrame, tasks: list[str] | None = None) -> list[str]:
    """The caveat sentences of ``tasks`` (None: every task of ``caveats``)."""
    out = []
    for r in caveats.to_dict("records"):
        if tasks is not None and r["task"] not in tasks:
            continue
        if r["solved"]:
            out.append(f"{r['task']}: the warm start's held-out greedy accuracy is "
                       f"{r['greedy0']:.3f} (>= {GREEDY_SOLVED:g}): warm start already solves the "
                       "greedy problem; training only sharpens sampling")
        if r["uninformative"]:
            out.append(f"{r['task']}: every one of its {r['runs']} runs, of every scheme, "
                       "collapsed or never reached the threshold (censored): its verdicts say "
                       "nothing scheme-specific")
    return out


def multiplicity_statement(claims: list[dict]) -> str:
    """Which claims Holm's procedure adjusts over (:func:`holm_verdicts`), and which not."""
    fam = [r for r in claims if math.isfinite(r.get("p_confirm", math.nan))]
    untested = [r for r in claims if r.get("kind") in ("tokens", "proxy", "compute")
                and not math.isfinite(r.get("p_confirm", math.nan))]
    other = [r for r in claims if r.get("kind") in ("stability", "prediction")]
    return (f"Multiplicity: Holm's step-down procedure over the family of {len(fam)} saving and "
            "equivalence verdicts with a p-value (each direction, for and against, its own "
            "family, at one-sided 0.025 after adjustment)"
            + (f"; {len(untested)} saving verdict(s) have none (no spread: every run of both "
               "arms censored) and stay undecided outside it" if untested else "")
            + f"; the {len(other)} stability and prediction verdicts are not adjusted: read them "
              "as descriptive.")
