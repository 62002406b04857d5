"""The planner (docs/science.md, "Planner"): which scheme x G trains with the fewest sampled
tokens, predicted from measurements at the warm start, before any training run.

    varbench plan --preset tiny --task sort            # a ranked table and a figure
    res = run({"warm": policy}, [task], PlannerConfig(Gs=(4, 8, 32)))[0]
    res.records["arms"]     # arm, P, B_noise [CI], predicted relative tokens [CI], steps, rank

It runs the variance analysis (:mod:`varbench.analysis.variance`, the same cells, cache and
intervals: every path it accepts, a preset, a checkpoint, a rollouts file) on each scheme x G x
mode, reads each cell's variance, MSE, projection and its gradient noise scale (per group, with
a bootstrap-t interval: :mod:`varbench.stats.noise_scale`), and predicts per arm from one model
(McCandlish et al. 2018): with P responses per optimizer step (``prompts_per_step * G``) and a
per-response noise scale ``B = G * noise_scale``, progress per step is ``rho_inf / (1 + B / P)``,
so the steps to a reward threshold are ``S_min (1 + B / P)`` and the sampled tokens
``S_min L (P + B)`` (L: mean tokens per response). ``S_min`` (steps at an infinite batch) is the
one constant; it is shared by every arm of a task, so it cancels from the relative figures and
from any ranking.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from varbench._util.checks import UsageError
from varbench._util.config import each, knob
from varbench.analysis.kinds import AnalysisKind, one_task, register_analysis
from varbench.analysis.plan import Plan
from varbench.analysis.variance import VarianceConfig, sizes
from varbench.analysis.variance import run as variance_run
from varbench.estimators.aggregation import AGGREGATION_MODES
from varbench.models.presets import Policy
from varbench.report import figures as report_figures
from varbench.report.result import AnalysisResult, Headline
from varbench.tasks.base import Task

__all__ = ["MODEL", "PlannerConfig", "plan_figures", "predict_arms", "run"]

MODEL = ("progress per step rho(P) = rho_inf / (1 + B_noise / P) with P responses per step "
         "(McCandlish et al. 2018): steps to the threshold = S_min (1 + B_noise / P), sampled "
         "tokens = S_min L (P + B_noise); S_min, shared by a task's arms, cancels")


@dataclass(frozen=True)
class PlannerConfig(VarianceConfig):
    """The planner (:func:`run`): the variance analysis's knobs (its cells are the
    measurements) with the training grid's defaults, and the step size of the training run to
    plan for."""

    schemes: tuple[str, ...] = each(("centered", "normalized", "rloo", "otb"))
    """Scheme labels to rank (as the variance analysis takes them)."""
    Gs: tuple[int, ...] = each((4, 8, 32), key="G", minimum=2, flags=("-G",))
    """Group sizes to rank (at least 2)."""
    modes: tuple[str, ...] = each(("token-mean",), choices=AGGREGATION_MODES)
    """Loss aggregation modes (the training run's ``agg``; train's default token-mean)."""
    prompts_per_step: int = knob(8)
    """Prompts per optimizer step of the planned run: P = prompts_per_step x G responses."""

    def variance_config(self) -> VarianceConfig:
        """The variance analysis's config of these knobs."""
        return VarianceConfig(**{f.name: getattr(self, f.name) for f in fields(VarianceConfig)})


def predict_arms(cells: pd.DataFrame, prompts_per_step: int) -> pd.DataFrame:
    """The ranked table of the arms of pooled variance ``cells`` (one row per scheme x G x
    mode): P, the per-response noise scale ``B = G * noise_scale`` with its interval, and the
    model's predicted sampled tokens ``L (P + B)`` and steps ``1 + B / P`` to the threshold,
    in units of ``S_min``, with relative tokens against the best arm (interval: the arm's B
    interval, the best arm's point). An arm whose signal is not resolved (B NaN) is unranked."""
    if prompts_per_step < 1:
        raise UsageError(f"prompts_per_step={prompts_per_step!r} is not valid; expected >= 1")
    need = ["scheme", "G", "mode", "noise_scale", "tokens_per_group"]
    missing = [c for c in need if c not in cells]
    if missing:
        raise UsageError(f"cells lack the columns {missing} (the variance analysis's records)")
    d = cells.copy()
    G = d["G"].astype(float)
    nan = pd.Series(np.nan, index=d.index)
    out = pd.DataFrame({
        "arm": d["scheme"] + "/G=" + d["G"].astype(str) + "/" + d["mode"],
        "scheme": d["scheme"], "G": d["G"], "mode": d["mode"],
        "P": prompts_per_step * d["G"],
        "B_noise": G * d["noise_scale"],
        "B_noise_ci_low": G * d.get("noise_scale_ci_low", nan),
        "B_noise_ci_high": G * d.get("noise_scale_ci_high", nan),
        "tokens_per_response": d["tokens_per_group"] / G,
    })
    for col in ("variance", "variance_x_tokens", "mse", "projection"):
        out[col] = d.get(col, nan)
    # the MSE at an equal token budget, as variance_x_tokens is the variance's
    out["mse_x_tokens"] = out["mse"] * d["tokens_per_group"]
    P, L = out["P"].astype(float), out["tokens_per_response"]
    for suffix, b in (("", out["B_noise"]), ("_ci_low", out["B_noise_ci_low"]),
                      ("_ci_high", out["B_noise_ci_high"])):
        out[f"pred_tokens{suffix}"] = L * (P + b)
        out[f"pred_steps{suffix}"] = 1 + b / P
    best = out["pred_tokens"].min()
    for suffix in ("", "_ci_low", "_ci_high"):
        out[f"pred_tokens_rel{suffix}"] = out[f"pred_tokens{suffix}"] / best
    out["rank"] = out["pred_tokens"].rank(method="min")
    return out.sort_values(["rank", "arm"], na_position="last").reset_index(drop=True)


def _headlines(arms: pd.DataFrame, level: float) -> list[Headline]:
    """One headline per ranked arm: predicted tokens relative to the best, with its interval."""
    out = []
    for r in arms.itertuples():
        if not math.isfinite(r.pred_tokens_rel):
            out.append(Headline(f"plan:{r.arm}", float("nan"), None,
                                f"{r.arm}: signal not resolved at the warm start (noise scale "
                                "undefined); not ranked"))
            continue
        ci = ""
        lo, hi = r.pred_tokens_rel_ci_low, r.pred_tokens_rel_ci_high
        if math.isfinite(lo) and math.isfinite(hi):
            ci = f" [{lo:.2f}, {hi:.2f}]"
        out.append(Headline(
            f"plan:{r.arm}", float(r.pred_tokens_rel), None,
            f"#{int(r.rank)} {r.arm}: predicted sampled tokens to the threshold "
            f"{r.pred_tokens_rel:.2f}x the best arm's{ci}, steps {r.pred_steps:.2f} x S_min "
            f"(P = {int(r.P)}, B_noise = {r.B_noise:.3g} responses)",
            unit="x best", ci_lo=lo if ci else None, ci_hi=hi if ci else None,
            level=level if ci else None))
    return out


def run(policies: Mapping[str, Policy], tasks: Sequence[Task], config: PlannerConfig, *,
        cache_dir: str | None = None, progress: bool | None = None,
        settings: dict[str, Any] | None = None) -> list[AnalysisResult]:
    """The planner on each policy state of the one task: the variance analysis's cells, then
    :func:`predict_arms`; one result per state (records ``arms`` and the variance records)."""
    if not isinstance(config, PlannerConfig):
        raise UsageError(f"config={config!r} is not valid; expected a PlannerConfig")
    one_task(tasks, "plan")
    out = []
    for res in variance_run(policies, tasks, config.variance_config(), cache_dir=cache_dir,
                            progress=progress, settings=settings):
        arms = predict_arms(res.records["cells"], config.prompts_per_step)
        cfg = {**res.config, "analysis": "plan", "prompts_per_step": config.prompts_per_step}
        notes = [
            f"Model: {MODEL}. B_noise = G x the group noise scale V / ||E g_hat||^2 "
            "(varbench.stats.noise_scale), measured at this policy; its interval is the "
            "bootstrap-t over groups (the sketch's own error is not in it).",
            "Assumptions: every arm's mean estimate points along the true gradient (the same "
            "rho_inf; the projection column shows each scale, which Adam's normalisation "
            "absorbs), B stays at its warm-start value along the run, and the noise is the "
            "within-prompt sampling noise (prompt-to-prompt variation is not measured).",
            *res.notes]
        unresolved = arms.loc[~np.isfinite(arms["B_noise"]), "arm"].tolist()
        if unresolved:
            notes.append(f"not ranked (signal not resolved: ||g_bar||^2 <= V/M): "
                         f"{', '.join(unresolved)}; more groups (-M) resolve it")
        records = {"arms": arms, **res.records}
        out.append(AnalysisResult(
            kind="plan", name="plan", records=records,
            summary={**res.summary, "best_arm": next(
                (r.arm for r in arms.itertuples() if math.isfinite(r.rank)), None)},
            headlines=_headlines(arms, config.level), config=cfg, notes=notes,
            provenance={**res.provenance, "config": cfg}))
    return out


def plan_figures(result: AnalysisResult, fig_dir: Path, prefix: str) -> list[tuple[str, str]]:
    """Predicted relative tokens per arm (ranked, with intervals) and B_noise against G."""
    arms = result.records.get("arms")
    if arms is None or not len(arms):
        return []
    ok = arms[np.isfinite(arms["pred_tokens_rel"])]
    fig, (a1, a2) = report_figures.subplots(1, 2, figsize=(11, 0.3 * len(ok) + 2.5))
    y = np.arange(len(ok))[::-1]
    lo = (ok["pred_tokens_rel"] - ok["pred_tokens_rel_ci_low"]).clip(lower=0).fillna(0)
    hi = (ok["pred_tokens_rel_ci_high"] - ok["pred_tokens_rel"]).clip(lower=0).fillna(0)
    a1.errorbar(ok["pred_tokens_rel"], y, xerr=[lo, hi], fmt="o", capsize=2)
    a1.set_yticks(y, ok["arm"], fontsize=7)
    a1.set_xscale("log")  # relative tokens and their intervals span decades at small M
    a1.set_xlabel("predicted sampled tokens to threshold (x best arm)")
    a1.set_title("planner ranking")
    for (scheme, mode), e in arms.groupby(["scheme", "mode"], sort=False):
        e = e.sort_values("G")
        err = [(e["B_noise"] - e["B_noise_ci_low"]).clip(lower=0).fillna(0),
               (e["B_noise_ci_high"] - e["B_noise"]).clip(lower=0).fillna(0)]
        a2.errorbar(e["G"], e["B_noise"], yerr=err, marker="o", capsize=2,
                    label=f"{scheme} ({mode})")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("group size G")
    a2.set_ylabel("B_noise (responses)")
    a2.set_title("gradient noise scale at the warm start")
    a2.legend(fontsize=7)
    name = f"{prefix}plan.png"
    fig.tight_layout()
    fig.savefig(fig_dir / name, dpi=110)
    return [(name, "Predicted sampled tokens to the threshold per arm relative to the best "
                   "(interval from B_noise's), and B_noise against G per scheme.")]


def plan(tasks: Sequence[Task], config: PlannerConfig, vocab_size: Callable[[], int]) -> Plan:
    """What :func:`run` spends per policy state: the variance analysis's sizes."""
    p = sizes(one_task(tasks, "plan"), config.variance_config(), vocab_size()).plan
    return dataclasses.replace(p, analysis="plan")


KIND = register_analysis(AnalysisKind(
    "plan", PlannerConfig, run, plan_figures, plan,
    "predict tokens-to-threshold per scheme x G from warm-start noise scales",
    policies="states", tasks=("sort",), states=("warm",),
    cli_defaults={"M": 16, "n_prompts": 1, "n_ref": 256},
    description="Rank scheme x G arms by predicted sampled tokens to a reward threshold from "
                "the gradient noise scale measured at the policy (McCandlish et al. 2018; "
                "docs/science.md, Planner). Runs the variance analysis's cells; CLI defaults "
                "are smaller than the library's to run in minutes on 2 cores."))
