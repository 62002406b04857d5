"""Rule S (issue 30, pre-registered at stop 56): a coverage verdict that tells chance from a
real shortfall.

Rule W (every figure's point estimate in [lo, hi]) flags about 2.4% of figures whose true
coverage is exactly 0.95 at 600 replicates, so a row of 15 figures fails it by chance about a
third of the time. Rule S tests each figure's true coverage instead: with ``h`` hits in ``n``
replicates, ``p_short = P(Bin(n, lo) <= h)`` and ``p_over = P(Bin(n, hi) >= h)`` (exact
binomial, one-sided); every p-value of the family (both sides of every figure) goes through
Holm's step-down procedure at family-wise ``alpha``. A figure is *short* / *over* when its
p-value is rejected; a row is *within* when none of its figures is, *undecided* when it has
fewer than ``min_reps`` replicates, else *not within*.

Usage (the harness's CSVs; a pooled run gives three rows: pooled, ``p0:``, ``p1:``)::

    python tests/_coverage_verdict.py RUN.csv [RUN.csv ...]
"""

from __future__ import annotations

import argparse

import pandas as pd
from scipy.stats import binom


def holm(pvalues: list[float], alpha: float = 0.05) -> list[bool]:
    """Holm's step-down rejections: sort ascending, reject while ``p_(i) <= alpha / (m - i)``
    (i = 0 .. m - 1), stop at the first that is not; family-wise error <= alpha."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha={alpha!r} is not valid; expected 0 < alpha < 1")
    m = len(pvalues)
    reject = [False] * m
    for i, j in enumerate(sorted(range(m), key=lambda k: pvalues[k])):
        if not pvalues[j] <= alpha / (m - i):
            break
        reject[j] = True
    return reject


def figure_pvalues(hits: int, reps: int, *, lo: float = 0.93,
                   hi: float = 0.97) -> tuple[float, float]:
    """(p_short, p_over): exact one-sided binomial p-values of ``hits`` in ``reps`` against a
    true coverage of ``lo`` (shortfall) and ``hi`` (over-coverage)."""
    if not 0 <= hits <= reps or reps < 1:
        raise ValueError(f"hits={hits!r}, reps={reps!r}: expected 0 <= hits <= reps, reps >= 1")
    return float(binom.cdf(hits, reps, lo)), float(binom.sf(hits - 1, reps, hi))


def rule_s(figures: pd.DataFrame, *, alpha: float = 0.05, lo: float = 0.93, hi: float = 0.97,
           min_reps: int = 400) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Rule S over one family: ``figures`` has ``row``, ``quantity``, ``stat``, ``hits``,
    ``reps``; returns (figures with ``p_short``, ``p_over``, ``short``, ``over``; rows with
    their verdict, replicates, range and the figures flagged)."""
    missing = {"row", "quantity", "stat", "hits", "reps"} - set(figures.columns)
    if missing:
        raise ValueError(f"figures lacks columns {sorted(missing)}")
    f = figures.reset_index(drop=True).copy()
    ps = [figure_pvalues(int(h), int(n), lo=lo, hi=hi) for h, n in zip(f.hits, f.reps, strict=True)]
    f["p_short"] = [p for p, _ in ps]
    f["p_over"] = [p for _, p in ps]
    rej = holm(list(f.p_short) + list(f.p_over), alpha)
    f["short"] = rej[:len(f)]
    f["over"] = rej[len(f):]
    f["coverage"] = f.hits / f.reps
    rows = []
    for name, g in f.groupby("row", sort=False):
        flagged = g[g.short | g.over]
        n = int(g.reps.min())
        verdict = ("not within" if len(flagged) else
                   "undecided" if n < min_reps else "within")
        rows.append({"row": name, "figures": len(g), "reps": n,
                     "range": f"{g.coverage.min():.3f}-{g.coverage.max():.3f}",
                     "rule_w": bool(g.coverage.between(lo, hi).all()),
                     "rule_s": verdict,
                     "flagged": ", ".join(f"{q} {s}" for q, s in zip(flagged.quantity,
                                                                       flagged.stat,
                                                                       strict=True))})
    return f, pd.DataFrame(rows)


def power(reps: int, family: int, true_coverage: float, *, alpha: float = 0.05,
          lo: float = 0.93, hi: float = 0.97) -> float:
    """Probability that one figure of true coverage ``true_coverage`` is flagged on the side it
    lies when every other of the ``family`` p-values is a true null far from rejection (Holm's
    first step: p <= alpha / family)."""
    cut = alpha / family
    if true_coverage < lo:
        h = int(binom.ppf(cut, reps, lo))  # largest h with cdf(h) <= cut
        while h >= 0 and binom.cdf(h, reps, lo) > cut:
            h -= 1
        return float(binom.cdf(h, reps, true_coverage)) if h >= 0 else 0.0
    if true_coverage > hi:
        h = int(binom.isf(cut, reps, hi))
        while h <= reps and binom.sf(h - 1, reps, hi) > cut:
            h += 1
        return float(binom.sf(h - 1, reps, true_coverage)) if h <= reps else 0.0
    raise ValueError(f"true_coverage={true_coverage!r} lies in [{lo}, {hi}]: nothing to detect")


def run_figures(csv: str, label: str | None = None) -> pd.DataFrame:
    """One harness CSV as rule-S figures: a row per run (pooled) and per ``p{p}:`` prompt."""
    d = pd.read_csv(csv)
    label = label or csv.rsplit("/", 1)[-1].removesuffix(".csv")
    pre = d.quantity.str.extract(r"^(p\d+):")[0]
    return pd.DataFrame({
        "row": [label + (f" {p} alone" if isinstance(p, str) else "") for p in pre],
        "quantity": d.quantity.str.replace(r"^p\d+:", "", regex=True),
        "stat": d.stat, "hits": [round(c * n) for c, n in zip(d.coverage, d.reps, strict=True)],
        "reps": d.reps})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="+", help="harness CSVs, one family")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--min-reps", type=int, default=400)
    a = ap.parse_args(argv)
    figs = pd.concat([run_figures(c) for c in a.csv], ignore_index=True)
    f, rows = rule_s(figs, alpha=a.alpha, min_reps=a.min_reps)
    print(rows.to_string(index=False))
    m = 2 * len(f)
    for n in sorted(set(rows.reps)):
        print(f"power at n = {n}, family {m}: true .90 -> {power(n, m, 0.90, alpha=a.alpha):.2f},"
              f" .91 -> {power(n, m, 0.91, alpha=a.alpha):.2f},"
              f" .99 -> {power(n, m, 0.99, alpha=a.alpha):.2f}")
    print(f"smallest p: short {f.p_short.min():.2g}, over {f.p_over.min():.2g}")


if __name__ == "__main__":
    main()
