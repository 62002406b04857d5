"""Planning the validation grid: its run count and wall-time estimate from measured runs
(``varbench validate --plan``) and the seeds each saving claim needs from pilot runs
(``--power-from``). Inputs are finished runs as ``(Job, records, elapsed seconds or None)``,
read from a grid's output directory by :func:`varbench.app.runner.finished_runs`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pandas as pd

from varbench._util.checks import UsageError
from varbench.analysis import validate_prereg as vp
from varbench.analysis import validate_stats as vs
from varbench.analysis.validate import (
    Job,
    ValidateConfig,
    config_dict,
    curve_rows,
    default_claims,
    figure_labels,
    jobs_of,
    registered_config,
)

FinishedRun = tuple[Job, pd.DataFrame, "float | None"]
"""One finished run: its job, its records, and the seconds its case took (None: unknown)."""


def timing_from_runs(runs: Sequence[FinishedRun]) -> pd.DataFrame:
    """Measured run times of finished runs (:func:`varbench.app.runner.finished_runs`): task
    label, G, wall seconds and sampled tokens per run (the whole case, policy build and
    warm-start load included, where recorded; else the loop's own ``time/wall_s``); the
    reward-hacking probe runs are left out."""
    rows = [{"task": job.task, "G": int(job.G),
             "wall_s": float(elapsed if elapsed is not None else df["time/wall_s"].iloc[-1]),
             "tokens": float(df["tokens/sampled"].iloc[-1])}
            for job, df, elapsed in runs if job.reward is None]
    return pd.DataFrame(rows, columns=["task", "G", "wall_s", "tokens"])


def estimate_wall(cfg: ValidateConfig, timing: pd.DataFrame, *, speedup: float = 1.0,
                  shards: int = 1) -> dict[str, Any]:
    """Wall-time estimate of the grid from measured runs: per job, seconds per sampled token
    of the measured runs of its task label and G (else of its G on any task, else of all runs)
    x its budget, divided by ``speedup``; the slowest of ``shards`` round-robin shards.
    Returns ``{"jobs", "total_s", "shard_s", "guessed"}``. Math caveat: seconds per token is
    taken as constant in the budget (evaluations are spaced by responses, so it nearly is)."""
    if len(timing) == 0:
        raise UsageError("no measured runs to estimate from; run a few first (e.g. --shard "
                         "1/50) or pass --timing-from DIR")
    if not speedup > 0:
        raise UsageError(f"speedup={speedup!r} is not valid; expected > 0")
    rate = timing.assign(spt=timing["wall_s"] / timing["tokens"].clip(lower=1))
    by_tg = rate.groupby(["task", "G"])["spt"].mean()
    by_g, overall = rate.groupby("G")["spt"].mean(), float(rate["spt"].mean())
    jobs = jobs_of(cfg)
    secs, guessed = [], set()
    for j in jobs:
        task = "sort" if j.reward is not None else j.task
        if (task, j.G) in by_tg.index:
            spt = float(by_tg[(task, j.G)])
        elif j.G in by_g.index:
            spt, _ = float(by_g[j.G]), guessed.add(f"{task} G={j.G} (from G={j.G} on other tasks)")
        else:
            spt, _ = overall, guessed.add(f"{task} G={j.G} (from all runs)")
        secs.append(spt * cfg.budgets[task] / speedup)
    shard_s = max(sum(secs[i::shards]) for i in range(shards))
    return {"jobs": len(jobs), "total_s": float(sum(secs)), "shard_s": float(shard_s),
            "guessed": sorted(guessed)}


def plan_text(cfg: ValidateConfig, timing: pd.DataFrame, *, speedups: Sequence[float] = (1.0,),
              shards: int = 1) -> str:
    """The plan as printed by ``varbench validate --plan``: jobs and estimated wall time."""
    jobs = jobs_of(cfg)
    lines = [f"grid: {len(jobs)} runs ({sum(j.reward is None for j in jobs)} claim runs, "
             f"{sum(j.reward is not None for j in jobs)} reward-hacking probe runs), "
             f"measured from {len(timing)} finished runs"]
    for sp in speedups:
        e = estimate_wall(cfg, timing, speedup=sp, shards=shards)
        lines.append(f"estimated wall time at {sp:g}x the measured loop speed: "
                     f"{e['total_s'] / 60:.1f} min in one process"
                     + (f", {e['shard_s'] / 60:.1f} min for the slowest of {shards} shards"
                        if shards > 1 else ""))
    e = estimate_wall(cfg, timing, shards=shards)
    if e["guessed"]:
        lines.append("not measured, borrowed: " + "; ".join(e["guessed"]))
    lines.append("(plus the prediction check's warm-start variance analysis, minutes per task)")
    if cfg.preregistration:  # publish the hash before the run; the report checks it again
        block = vp.report_block(cfg.preregistration, config_dict(cfg), registered_config)
        lines.append(vp.headline_text(block))
    return "\n".join(lines)


def pilot_tables(runs: Sequence[FinishedRun]
                 ) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, float]]:
    """``(t2t, mean_curves, thresholds)`` of finished runs of any grid (the reward-hacking probe
    left out): the input of :func:`validate_stats.power_plan`. The threshold rule is the
    default ``threshold_frac`` of :class:`ValidateConfig`."""
    curves = [curve_rows(df, task=j.task, scheme=j.scheme, G=int(j.G), variant=j.variant,
                         seed=int(j.seed)) for j, df, _ in runs if j.reward is None]
    if not curves:
        raise UsageError("no finished runs of a validation grid to plan from")
    c = pd.concat(curves, ignore_index=True)
    frac = ValidateConfig().threshold_frac
    thresholds = {t: vs.threshold_of(float(d[d.step == 0]["acc_sampled"].iloc[0]), frac)
                  for t, d in c.groupby("task")}
    t2t = vs.t2t_table(c, thresholds, interpolate=True)
    lab = figure_labels(c)  # scheme+variant
    lab["arm"] = (c["scheme"] + "/" + c["G"].astype(str)
                  + np.where(c["variant"] != "", "/" + c["variant"].astype(str), ""))
    mean = vs.mean_curves(lab, ["task", "arm"])
    return t2t, mean, thresholds


def power_text(cfg: ValidateConfig, pilot: Sequence[FinishedRun], *,
               half_width: float = 0.15) -> str:
    """The seeds and budgets the saving claims of ``cfg`` need, from the finished pilot runs
    ``pilot`` (``varbench validate --power-from DIR``)."""
    t2t, mean, thr = pilot_tables(pilot)
    pairs = [(c["task"], c["a"], c["b"]) for c in (cfg.claims or default_claims(cfg))
             if c["kind"] in ("tokens", "proxy", "compute")]
    rows, missing = [], []
    for p in dict.fromkeys(pairs):
        try:
            rows.append(vs.power_plan(t2t, mean, [p], half_width=half_width))
        except ValueError as err:
            missing.append(f"{p[0]}: {p[1]} vs {p[2]} ({err})")
    thr_text = ", ".join(f"{t} {v:.3f}" for t, v in thr.items())
    lines = [f"power plan for a 95% CI half-width of {half_width:g} on each saving, from "
             f"{len(t2t)} pilot runs (thresholds {thr_text}; crossings interpolated)"]
    if rows:
        lines.append(pd.concat(rows, ignore_index=True).to_string(index=False,
                                                                  float_format="%.3g"))
    lines += [f"not in the pilot: {m}" for m in missing]
    return "\n".join(lines)
