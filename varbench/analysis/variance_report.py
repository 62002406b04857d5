"""Headline sentences and summary figures of the variance analysis, generated from its records.

Headlines are built from the projection ``E[g_hat] . g* / ||g*||^2`` (the scale of the mean
estimate along g*) and the MSE, not from the mean cosine: a cosine does not see scale, and a
group whose estimate is exactly 0 (an all-agree group) has no direction at all.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import torch

from varbench.estimators.registry import exact_label, reads, schemes, split_label
from varbench.report.headline import (
    DEGENERATE_CI,
    fmt,
    interval_text,
    ratio_sentence,
    with_se,
)
from varbench.report.result import Headline

PROXY_MIN_RESPONSES = 4096
"""Responses per prompt that ``min_responses="auto"`` requires when an OTB-type label reads the
proxy weights. Their per-group estimates are heavy tailed (rare wrong, high-norm responses that
the proxy does not suppress), and a sample that lacks those groups gives intervals that are too
low: measured on the enumerable coverage setup (tests/test_analysis_oracle.py, G = 4, 1,000
replicates), the 95% intervals of otb's variance, MSE and otb / otb_exact variance ratio covered
0.90 / 0.90 / 0.91 with 512 responses, 0.93 / 0.93 / 0.92 with 2048 and 0.95 / 0.94 / 0.94 with
4096."""


PROXY_MIN_GROUPS = 1024
"""Groups per prompt at every G that ``min_responses="auto"`` requires when a label reads the
proxy weights (``max(PROXY_MIN_RESPONSES, PROXY_MIN_GROUPS * max G)`` responses): the group
count at which their intervals reach nominal coverage on the heavier coverage setup
(docs/science.md, the coverage table; tests/test_coverage.py). At 4,096 responses G = 8 has only
512 groups, and OTB's variance / MSE intervals covered 0.885 / 0.900 there."""


MIN_DISTINCT_GROUPS = 3
"""Fewest distinct group estimates a Monte Carlo interval is computed from without being
flagged degenerate (the analysis's own minimum M): a bootstrap over fewer distinct values (e.g.
every group all-agree, every estimate 0) resamples almost nothing and its interval measures no
uncertainty."""


def distinct_estimates(e: torch.Tensor) -> int:
    """Distinct rows of the ``[M, K]`` group estimates (identical estimates count once)."""
    return int(torch.unique(e, dim=0).shape[0])


def reads_proxy_weights(label: str) -> bool:
    """Whether label ``label`` is fed the proxy token weights: its scheme needs token statistics
    beyond the rewards (OTB-type) and the label does not ask for exact weights (``_exact``)."""
    if split_label(label)[1] or label not in schemes():
        return False
    return reads(label, "token_weights")  # declared at register_scheme(..., reads=...)


def otb_type(label: str) -> bool:
    """Whether label ``label``'s scheme (``<scheme>_exact`` -> ``<scheme>``) declared that it
    reads token weights (``register_scheme(..., reads=("token_weights", ...))``): the OTB-type
    schemes the headlines compare with centered, whatever their name."""
    scheme = split_label(label)[0]
    return scheme in schemes() and reads(scheme, "token_weights")


def headline_vs_centered(label: str) -> bool:
    """Whether ``label`` vs centered is a headline ratio: OTB-type labels (:func:`otb_type`) and
    rloo, the leave-one-out baseline they are judged against."""
    return otb_type(label) or label == "rloo"


def _ratio_se(a: float, sa: float, b: float, sb: float) -> float:
    """Delta-method SE of a/b for independent a, b."""
    if a == 0 or b == 0:
        return float("nan")
    return abs(a / b) * math.sqrt((sa / a) ** 2 + (sb / b) ** 2)


def _degenerate(r, stat: str) -> bool:
    """Whether row ``r``'s Monte Carlo interval of ``stat`` is degenerate: flagged by the
    analysis (``degenerate_ci``: too few distinct groups, or zero width in a prompt) or of zero
    width as pooled."""
    if getattr(r, "method", "mc") == "exact":
        return False
    lo, hi = _get(r, f"{stat}_ci_low"), _get(r, f"{stat}_ci_high")
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return False  # no interval printed
    return _get(r, "degenerate_ci", 0.0) > 0 or lo == hi


def _get(r, name: str, default: float = float("nan")) -> float:
    v = getattr(r, name, default)
    return float(v) if v is not None and pd.notna(v) else default


def shrinkage_share(variance_ratio: float, projection_ratio: float) -> float:
    """Share (0..1) of a variance reduction that a pure rescaling explains, on the log scale.

    Multiplying an estimator by q multiplies its variance by q^2, so a scheme with variance
    ratio v < 1 and projection ratio q <= 1 against a baseline owes ``2 log q / log v`` of its
    reduction to shrinkage and the rest to noise suppression. NaN unless 0 < v < 1; 0 when
    q >= 1 (no shrinkage), capped at 1.
    """
    if not (math.isfinite(variance_ratio) and 0 < variance_ratio < 1
            and math.isfinite(projection_ratio) and projection_ratio > 0):
        return float("nan")
    if projection_ratio >= 1:
        return 0.0
    return min(1.0, 2 * math.log(projection_ratio) / math.log(variance_ratio))


_TARGETED = ("projection:", "variance_ratio:", "mse_ratio:", "proxy_cost:")


def targeted_rel_se(heads: list[Headline]) -> dict[str, float]:
    """Relative SE ``se / |value|`` of each headline figure adaptive M targets (finite, with
    an SE > 0: deterministic ratios such as rloo / centered variance are left out)."""
    out = {}
    for h in heads:
        if (h.key.startswith(_TARGETED) and h.se is not None and math.isfinite(h.se)
                and h.se > 0 and h.value):
            out[h.key] = abs(h.se / h.value)
    return out


def variance_headlines(
    records: dict[str, pd.DataFrame], ref_kind: str, level: float = 0.95
) -> tuple[list[Headline], list[str], dict[str, Any]]:
    """(headlines, notes, summary) from the pooled ``cells`` / ``paired`` / ``reference``;
    ``level``: the intervals' coverage (the analysis's ``level``)."""
    cells, paired, ref = records["cells"], records["paired"], records["reference"]
    heads: list[Headline] = []
    notes = [
        "Sampling is shared across schemes: every scheme is evaluated on the same M groups per "
        "prompt, so scheme-vs-centered ratios are paired and their SEs are small.",
        f"Reference gradient: {ref['reference'].iloc[0] if len(ref) else 'none'} "
        f"({ref_kind}); gradients are {ref['sketch'].iloc[0] if len(ref) else '?'} of "
        f"{int(ref['n_params'].iloc[0]) if len(ref) else '?'} parameters.",
        "Cells with method = exact are expectations over groups of G i.i.d. draws from the "
        "enumerated response distribution (no sampling error); exact-sketched cells are the "
        "same expectations of count-sketched vectors, whose one sketch draw's error is their "
        "SE and interval; method = mc cells are Monte "
        f"Carlo over M groups with {100 * level:.4g}% studentized bootstrap intervals over groups "
        "(log scale "
        "for variance, MSE and ratios) that condition on the reference gradient; a sketch's "
        "own error is added to their SEs and intervals (none for flat vectors).",
        "projection = E[g_hat] . g* / ||g*||^2: 1 for an unbiased scheme, (G-1)/G for centered. "
        "cosine_nonzero is the mean cosine over the groups whose estimate is not exactly 0 "
        "(frac_zero: share of groups with a zero estimate, all-agree groups for the baseline "
        "schemes); the cosine is not a headline because it does not measure scale.",
    ]
    if len(ref) and "M_used" in ref:
        used = "; ".join(f"p{int(r.prompt)}: M = {int(r.M_used)}"
                         + (f" ({r.groups_per_G})" if isinstance(
                             getattr(r, "groups_per_G", None), str) else "")
                         + ("" if pd.isna(r.target_met) else
                            f", largest relative SE {fmt(r.max_rel_se, 2)}"
                            + (f" ({r.max_rel_se_of})" if getattr(r, "max_rel_se_of", "")
                               else "")
                            + f", target {'met' if bool(r.target_met) else 'NOT met: cap'}")
                         for r in ref.itertuples())
        notes.append(f"Groups per prompt (every response is used at every G): {used}.")
    proxy = [s for s in sorted(set(cells["scheme"]) if len(cells) else ()) if
             reads_proxy_weights(s)]
    if proxy and len(ref) and "responses" in ref and len(cells):
        # every response is used at every G: a prompt's groups at G are its responses // G
        Gs = sorted({int(g) for g in cells["G"]})
        few = []
        for r in ref.itertuples():
            low = [f"G={G}: {int(r.responses) // G}" for G in Gs
                   if int(r.responses) // G < PROXY_MIN_GROUPS]
            if low:
                few.append(f"p{int(r.prompt)}: {', '.join(low)}")
        if few:
            notes.append(
                f"The intervals of {', '.join(proxy)} (proxy weights) rest on fewer than "
                f"{PROXY_MIN_GROUPS} groups at some G ({'; '.join(few)} groups): their variance, "
                "MSE and proxy-cost intervals are too narrow there (measured coverage of a "
                "nominal 95%: 0.885 / 0.900 with 512 groups at G = 8 on the heavier setup; "
                "docs/science.md). min_responses='auto' samples max("
                f"{PROXY_MIN_RESPONSES}, {PROXY_MIN_GROUPS} * max G) responses per prompt: at "
                f"least {PROXY_MIN_GROUPS} groups at every G.")
    if len(cells) and "method" in cells and bool(((cells["G"] == 2)
                                                  & (cells["method"] == "mc")).any()):
        notes.append(
            "G = 2 Monte Carlo intervals cover at the low end of nominal: on the heavier "
            "coverage setup their 95% intervals covered 0.932-0.956 at 2,048 groups (840 "
            "replicates at K = 4096, 940 at K = 1024) and 0.931-0.956 at 4,096 groups with "
            "K = 1024 (620 replicates), within 2 points of nominal, the lowest otb_exact's "
            "variance; their first blocks of replicates read 1-3 points short "
            "(docs/science.md, the G = 2 coverage table).")
    if (len(paired) and "n_prompts" in paired and "method" in paired
            and bool(((paired["n_prompts"] > 1) & paired["method"].isin(["mc", "mixed"])).any())):
        notes.append(
            "Paired ratios pooled over prompts are coverage-tested at G = 8, 4 and 2 (two "
            "prompts of 1,024 groups, 2,048 at G = 2, K = 1024): their 95% intervals covered "
            "0.940-0.947 over 1,400 replicates on micro at G = 8 (otb / centered 0.946 / 0.940, "
            "variance / MSE) and 0.938-0.963 over 600 new ones, 0.946-0.959 over 900 on tiny "
            "at G = 8, 0.943-0.958 / 0.932-0.955 over 600 at G = 4 (micro / tiny) and "
            "0.950-0.965 over 460 on tiny at G = 2, within 2 points of nominal, and "
            "0.958-0.973 over 400 on micro at G = 2 (otb_exact / centered MSE 0.973: a wide "
            "interval, no figure departs from [0.93, 0.97] by rule S; docs/science.md, pooled "
            "intervals).")
    if ref_kind == "sampled" and len(ref):
        notes.append(
            "The sampled reference has its own error: ||g*|| = "
            f"{with_se(float(ref['ref_norm'].mean()), float(ref['ref_se_norm'].mean()))} "
            "(mean over prompts)."
        )
    # Degenerate inputs first: with every reward equal every estimate is 0, and with g* = 0 no
    # cosine or bias is defined; say exactly that instead of printing n/a ratios.
    all_equal = ("frac_all_agree" in cells and bool(len(cells))
                 and bool((cells["frac_all_agree"] >= 1).all()))
    ref_zero = bool(len(ref)) and bool((ref["ref_norm"] == 0).all())
    if all_equal:
        mean_r = (float(ref["mean_reward_sampled"].mean()) if "mean_reward_sampled" in ref
                  else float("nan"))
        heads.append(Headline(
            "all_rewards_equal", 1.0, None,
            f"Every sampled group had all rewards equal (mean reward {fmt(mean_r)}): every "
            "group's estimate is 0 for every scheme, so no variance ratio is defined. Use a "
            "policy that sometimes succeeds (e.g. warm-started) or a shaped reward."))
    if ref_zero:
        heads.append(Headline(
            "reference_gradient_zero", 0.0, None,
            "The reference gradient g* is exactly 0 (every response in the reference scored "
            "the same), so projections and cosines on g* and bias are not defined."))
    by_cell = ({(r.scheme, r.G, r.mode): r for r in cells.itertuples()} if len(cells) else {})
    for r in cells.itertuples() if len(cells) else []:
        proj = _get(r, "projection")
        if r.scheme == "raw" or not math.isfinite(proj):
            continue
        method = getattr(r, "method", "mc")
        iv = {k: interval_text(_get(r, k), _get(r, f"{k}_ci_low"), _get(r, f"{k}_ci_high"),
                               exact=method == "exact", degenerate=_degenerate(r, k),
                               level=level)
              for k in ("projection", "mse", "variance")}
        ci = ({} if method == "exact" else
              {"ci_lo": _get(r, "projection_ci_low"), "ci_hi": _get(r, "projection_ci_high"),
               "level": level})
        heads.append(Headline(
            f"projection:{r.scheme}:G={r.G}:{r.mode}", proj, _get(r, "projection_se"),
            f"{r.scheme} at G={r.G} ({method}): projection on g* {iv['projection']}, MSE "
            f"{iv['mse']}, variance {iv['variance']}; "
            f"{fmt(100 * _get(r, 'frac_all_agree'), 3)}% of groups all-agree.", **ci))
    for r in paired.itertuples() if len(paired) else []:
        if not math.isfinite(r.ratio):
            continue  # 0 / 0: covered by the degenerate headlines above
        lo, hi = _get(r, "ratio_ci_low"), _get(r, "ratio_ci_high")
        exact = getattr(r, "method", "mc") == "exact"
        ci = {} if exact else {"ci_lo": lo, "ci_hi": hi, "level": level}
        if r.baseline == "centered" and headline_vs_centered(r.scheme):
            heads.append(Headline(
                f"{r.stat}_ratio:{r.scheme}:centered:G={r.G}:{r.mode}", r.ratio, r.ratio_se,
                ratio_sentence(f"{r.scheme} at G={r.G}", f"centered at G={r.G}",
                               f"{r.stat} ({r.mode})", r.ratio, r.ratio_se, lo, hi,
                               exact=exact, degenerate=_degenerate(r, "ratio"), level=level),
                **ci))
        elif r.baseline == exact_label(r.scheme):
            text = interval_text(r.ratio, lo, hi, exact=exact,
                                 degenerate=_degenerate(r, "ratio"), level=level)
            heads.append(Headline(
                f"proxy_cost:{r.scheme}:{r.stat}:G={r.G}:{r.mode}", r.ratio, r.ratio_se,
                f"What the proxy costs at G={r.G}: {r.scheme} (proxy weights) has {text}x the "
                f"{r.stat} of {r.baseline} (exact ||g_t||^2 weights) on the same groups.", **ci))
    for (scheme, G, mode), r in by_cell.items():
        base = by_cell.get(("centered", G, mode))
        if not otb_type(scheme) or base is None:
            continue
        v = paired[(paired["scheme"] == scheme) & (paired["baseline"] == "centered")
                   & (paired["G"] == G) & (paired["mode"] == mode)
                   & (paired["stat"] == "variance")] if len(paired) else paired
        if not len(v):
            continue
        vr = float(v["ratio"].iloc[0])
        if not math.isfinite(vr):
            continue  # 0 / 0: covered by the degenerate headlines above
        pb = _get(base, "projection")
        q = _get(r, "projection") / pb if pb != 0 else float("nan")
        if not math.isfinite(q):
            continue  # no projection (g* = 0 or undefined): nothing to split the reduction by
        share = shrinkage_share(vr, q)
        reading = (f"a pure rescaling would explain {fmt(100 * share, 2)}% of the reduction "
                   "(log scale), the rest is noise suppression" if math.isfinite(share)
                   else "no variance reduction to explain")
        heads.append(Headline(
            f"shrinkage_share:{scheme}:G={G}:{mode}", share, None,
            f"{scheme} at G={G}: projection {fmt(q)}x centered's with {fmt(vr)}x its variance; "
            f"{reading}."))
    if len(cells):
        gmax = int(cells["G"].max())
        for mode in dict.fromkeys(cells["mode"]):
            base = cells[(cells["scheme"] == "centered") & (cells["G"] == gmax)
                         & (cells["mode"] == mode)]
            if not len(base):
                continue
            b = base.iloc[0]
            for r in cells[(cells["mode"] == mode) & cells["scheme"].map(otb_type)
                           & (cells["G"] < gmax)].itertuples():
                if not b["variance"]:
                    continue  # 0 / 0: covered by the degenerate headlines above
                ratio = r.variance / b["variance"]
                se = _ratio_se(r.variance, r.variance_se, b["variance"], b["variance_se"])
                heads.append(Headline(
                    f"budget:{r.scheme}:G={r.G}:vs_centered:G={gmax}:{mode}", ratio, se,
                    f"{r.scheme} at G={r.G} has {fmt(ratio)}x the variance of centered at "
                    f"G={gmax} (SE {fmt(se, 2)}, groups not paired) using "
                    f"{fmt(r.tokens_per_group / b['tokens_per_group'])}x the sampled tokens."))
    target = (float(ref["target_rel_se"].iloc[0]) if len(ref) and "target_rel_se" in ref
              else float("nan"))
    reached = targeted_rel_se(heads)
    if reached:
        top = max(reached, key=reached.get)
        over = sorted(k for k, v in reached.items() if math.isfinite(target) and v > target)
        notes.append(
            "Adaptive M targets the headline figures (projections, paired variance and MSE "
            "ratios; budget rows are unpaired and not targeted)"
            + (f" at relative SE {fmt(target, 2)} pooled over prompts" if math.isfinite(target)
               else " (no target set)")
            + f": reached relative SE, largest {fmt(reached[top], 2)} ({top}), median "
            f"{fmt(float(pd.Series(list(reached.values())).median()), 2)} over "
            f"{len(reached)} figures"
            + (f"; above the target: {', '.join(over)}" if over else
               "; all within the target" if math.isfinite(target) else "") + ".")
    flagged = [h.key for h in heads if h.degenerate_ci]
    if flagged:
        notes.append(
            f"{len(flagged)} headline(s) have a degenerate interval (zero width, or computed "
            f"from fewer than {MIN_DISTINCT_GROUPS} distinct group estimates; marked "
            f"'{DEGENERATE_CI}'): it measures no uncertainty. Raise M (or the responses per "
            "prompt) or use a policy whose groups disagree: "
            f"{', '.join(flagged[:6])}{' ...' if len(flagged) > 6 else ''}.")
    summary = {"reference": ref_kind,
               **{h.key: {"value": h.value, "se": h.se,
                          **({"degenerate_ci": True} if h.degenerate_ci else {})}
                  for h in heads}}
    return heads, notes, summary
