"""Headline sentences and summary figures of the variance analysis, generated from its records."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from varbench.report.headline import fmt, ratio_sentence, with_se
from varbench.report.result import Headline


def _ratio_se(a: float, sa: float, b: float, sb: float) -> float:
    """Delta-method SE of a/b for independent a, b."""
    if a == 0 or b == 0:
        return float("nan")
    return abs(a / b) * math.sqrt((sa / a) ** 2 + (sb / b) ** 2)


def variance_headlines(
    records: dict[str, pd.DataFrame], ref_kind: str
) -> tuple[list[Headline], list[str], dict[str, Any]]:
    """(headlines, notes, summary) from the pooled ``cells`` / ``paired`` / ``reference``."""
    cells, paired, ref = records["cells"], records["paired"], records["reference"]
    heads: list[Headline] = []
    notes = [
        "Sampling is shared across schemes: every scheme is evaluated on the same M groups per "
        "prompt, so scheme-vs-centered ratios are paired and their jackknife SEs are small.",
        f"Reference gradient: {ref['reference'].iloc[0] if len(ref) else 'none'} "
        f"({ref_kind}); gradients are {ref['sketch'].iloc[0] if len(ref) else '?'} of "
        f"{int(ref['n_params'].iloc[0]) if len(ref) else '?'} parameters.",
        "Standard errors are delete-one jackknife over the M groups of a prompt, pooled over "
        "independent prompts; they condition on the reference gradient.",
    ]
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
            "the same), so cosines to g* and bias are not defined."))
    for r in paired[paired["stat"] == "variance"].itertuples() if len(paired) else []:
        if not (r.scheme.startswith("otb") or r.scheme == "rloo"):
            continue
        if not math.isfinite(r.ratio):
            continue  # 0 / 0: covered by the degenerate headlines above
        heads.append(Headline(
            f"variance_ratio:{r.scheme}:centered:G={r.G}:{r.mode}", r.ratio, r.ratio_se,
            ratio_sentence(f"{r.scheme} at G={r.G}", f"centered at G={r.G}",
                           f"variance ({r.mode})", r.ratio, r.ratio_se)))
    for r in cells.itertuples() if len(cells) else []:
        if not r.scheme.startswith("otb") or not math.isfinite(r.cosine) or ref_zero:
            continue
        heads.append(Headline(
            f"cosine:{r.scheme}:G={r.G}:{r.mode}", r.cosine, r.cosine_se,
            f"{r.scheme} at G={r.G}: mean cosine to g* {with_se(r.cosine, r.cosine_se)}, "
            f"debiased squared bias {with_se(r.bias2_debiased, r.bias2_debiased_se)}, "
            f"MSE {with_se(r.mse, r.mse_se)}."))
    if len(cells):
        gmax = int(cells["G"].max())
        for mode in dict.fromkeys(cells["mode"]):
            base = cells[(cells["scheme"] == "centered") & (cells["G"] == gmax)
                         & (cells["mode"] == mode)]
            if not len(base):
                continue
            b = base.iloc[0]
            for r in cells[(cells["mode"] == mode) & cells["scheme"].str.startswith("otb")
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
    summary = {"reference": ref_kind,
               **{h.key: {"value": h.value, "se": h.se} for h in heads}}
    return heads, notes, summary
