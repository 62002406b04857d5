"""The validation experiment: does measured variance predict real training, and do the papers'
claims hold? (issues 6 and 17)

From one shared warm start per task, train every scheme x G x seed (and the extra ``arms``: GSPO
with and without an exchangeability transform, exact OTB weights, ...) to a fixed budget of
sampled tokens, judge on fixed held-out prompts, and report: held-out accuracy against sampled
tokens, tokens-to-threshold as a Kaplan-Meier restricted mean (runs that never reach the
threshold are right-censored at their budget, not dropped), every configured claim with a
bootstrap CI over seeds and a verdict (confirmed / refuted / undecided, rules in
``validate_stats.VERDICT_RULES``), collapse frequencies with Wilson intervals after calibrating
the collapse detector on runs that did not collapse, a prediction check (warm-start variance at
equal token budget against realised tokens-to-threshold, rank correlation) and a reward-hacking
probe on ``sort``.

    varbench validate --reduced --out work/validate-reduced          # minutes
    varbench validate --suite suites/otb-claims.toml --plan --out W   # the grid and its time
    varbench validate --suite suites/otb-claims.toml --shard 1/4 --out W   # one quarter
    varbench validate --suite suites/otb-claims.toml --out W --report-dir reports/claims

This module holds the grid (:class:`ValidateConfig`, :func:`jobs_of`, :func:`job_config`) and
the statistics on finished runs (:func:`report`); the runs themselves are ordinary ``train``
suite cases, run, cached, sharded and resumed by :func:`varbench.app.validation.run_validation`
like any suite. Plans and power: :mod:`varbench.analysis.validate_plan`.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from varbench._util.bounds import check_knob
from varbench._util.checks import UsageError, check_choice, check_positive_int
from varbench.analysis import validate_prereg as vp
from varbench.analysis import validate_stats as vs
from varbench.analysis._common import CellCache
from varbench.report import provenance, write_report
from varbench.report.result import AnalysisResult, Headline
from varbench.train.collapse import calibrate, surge_scores
from varbench.train.config import TrainConfig
from varbench.train.setup import build_task, policy_for

# Budgets in sampled (policy-generated) tokens per run, per task.
FULL_BUDGETS = {"sort": 24_000, "toolsum": 100_000}
REDUCED_BUDGETS = {"sort": 6_000, "toolsum": 24_000}
# The OTB paper's token savings of G = 4 against G = 32 group baselines (single-turn, tool use).
CLAIMED_SAVING = {"single_turn": 0.62, "multi_turn": 0.66}
# Exchangeability paper: Min-Replace / Adv-Orthogonal reach the threshold at ~0.91x GSPO's compute.
CLAIMED_COMPUTE_SAVING = 0.09
CLAIM_KINDS = ("tokens", "proxy", "compute", "stability")
# stability claims compare per-run collapse rates (validate_stats.COLLAPSE_RULE). The surge
# flag is reported, not claimed (issue 31): on the claims grid the detector caught 0 of 76
# collapses, and its factor is calibrated in-sample on the same runs the claim would compare
STABILITY_MEASURES = {"collapse": "collapsed"}
_ARM_KEYS = ("task", "scheme", "G", "variant", "seeds")


@dataclass(frozen=True)
class ValidateConfig:
    """The experiment grid; ``reduced_default()`` gives the minutes-long version."""

    tasks: tuple[str, ...] = ("sort", "toolsum")
    """Task labels of the core grid: a registered task name, or a key of ``task_specs``."""
    schemes: tuple[str, ...] = ("centered", "normalized", "topk", "rloo", "otb")
    """Advantage schemes of the core grid."""
    Gs: tuple[int, ...] = (4, 8, 32)
    """Group sizes of the core grid."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """Training seeds per cell (the warm start and held-out set are shared)."""
    budgets: dict[str, int] = field(default_factory=lambda: dict(FULL_BUDGETS))
    """Sampled-token budget per run, by task label."""
    task_seeds: dict[str, list] = field(default_factory=dict)
    """Seeds of the core grid per task label where they differ from ``seeds`` (a noisier task
    needs more for the same CI width)."""
    task_specs: dict[str, dict] = field(default_factory=dict)
    """Task labels beyond the registered names: ``label -> {"task": name, knob: value}``, e.g.
    ``{"toolsum_long": {"task": "toolsum", "k": 6}}`` (a longer horizon: more tool turns)."""
    arms: tuple[dict, ...] = ()
    """Runs beyond the core grid: each ``{"task", "scheme", "G", "variant"}`` plus TrainConfig
    overrides (``ratio``, ``transform``, ``scheme_options``, ...) and optionally its own
    ``seeds``; ``variant`` names the arm in tables and claims (``scheme/G/variant``)."""
    claims: tuple[dict, ...] = ()
    """Claims to decide (empty: the default OTB token and stability claims of the core grid).
    ``{"kind": "tokens"|"proxy"|"compute"|"stability", "task", "a", "b", ...}``; arms are
    written ``scheme/G`` or ``scheme/G/variant``; see :func:`claim_rows`."""
    threshold_frac: float = 0.3
    """Threshold = warm-start accuracy + this fraction of the remaining gap to 1."""
    interpolate: bool = True
    """Place the threshold crossing between the two evaluations around it (linear), rather
    than at the first evaluation at or above it (quantised to the evaluation spacing)."""
    eval_responses: int = 512
    """Evaluate every this many sampled training responses (equal token spacing across G)."""
    base: dict[str, Any] = field(default_factory=lambda: dict(
        policy="tiny", prompts_per_step=8, lr=1e-3, eval_prompts=128, eval_samples=4,
        agg="token-mean", steps=100_000))
    """TrainConfig fields shared by every run."""
    hacking_rewards: tuple[str, ...] = ("inclusion_adjacency", "positional")
    """Proxy rewards of the reward-hacking probe (sort)."""
    hacking_scheme: str = "normalized"
    """Scheme of the probe runs."""
    hacking_G: int = 8
    """Group size of the probe runs."""
    hacking_seeds: tuple[int, ...] = (0, 1)
    """Seeds of the probe runs."""
    variance_M: int = 16
    """Groups per prompt in the warm-start variance analysis (prediction check)."""
    variance_prompts: int = 2
    """Prompts in the warm-start variance analysis."""
    prediction: bool = True
    """Run the prediction check (warm-start variance analysis)."""
    min_prediction_cells: int = 10
    """Fewest scheme x G cells per task for a prediction verdict other than undecided."""
    surge_factor: float | None = None
    """Gradient-surge factor of the stability analysis (None: calibrated on this experiment's
    runs that did not collapse, to ``collapse_fpr``)."""
    collapse_fpr: float = 0.05
    """Target false-positive rate (per run) of the calibrated surge factor."""
    collapse_acc_frac: float = 0.5
    """A run collapsed (outcome) when its final held-out accuracy is below this fraction of
    the warm start's (or a gradient norm was non-finite)."""
    equivalence_margin: float = 0.15
    """Proxy claim: the proxy may need at most this fraction more tokens than exact weights."""
    reduced: bool = False
    """Whether this is the reduced setting (recorded in the report)."""
    preregistration: str = ""
    """Path of the grid's pre-registration file (:mod:`validate_prereg`; '' for none): the
    report hashes it and lists every deviation of the run from it."""

    def __post_init__(self) -> None:
        check_knob("threshold_frac", self.threshold_frac)

    @classmethod
    def reduced_default(cls) -> ValidateConfig:
        """Two schemes, G in {4, 32}, two seeds, small budgets: minutes on 2 cores."""
        return cls(schemes=("normalized", "otb"), Gs=(4, 32), seeds=(0, 1),
                   budgets=dict(REDUCED_BUDGETS), eval_responses=256,
                   base={**cls().base, "eval_prompts": 64}, hacking_seeds=(0,),
                   variance_M=8, reduced=True)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> ValidateConfig:
        """A config from suite-case keys (lists for tuples; ``reduced = true``: start from
        :meth:`reduced_default`)."""
        params = dict(params)
        base = cls.reduced_default() if params.pop("reduced", False) else cls()
        names = {f.name for f in fields(cls)}
        bad = sorted(set(params) - names)
        if bad:
            raise UsageError(f"validate: unknown key {bad[0]!r}; valid keys: {sorted(names)}")
        changes = {k: tuple(v) if isinstance(getattr(base, k), tuple) else v
                   for k, v in params.items()}
        return replace(base, **changes)


@dataclass(frozen=True)
class Job:
    """One training run of the grid."""

    task: str
    scheme: str
    G: int
    seed: int
    variant: str = ""
    overrides: tuple[tuple[str, Any], ...] = ()
    reward: str | None = None

    @property
    def arm(self) -> str:
        """``scheme/G`` or ``scheme/G/variant``: how claims name the arm."""
        return f"{self.scheme}/{self.G}" + (f"/{self.variant}" if self.variant else "")


def jobs_of(cfg: ValidateConfig) -> list[Job]:
    """Every run of the grid in a fixed order: core grid, arms, then the hacking probe."""
    jobs = [Job(t, s, G, int(seed)) for t in cfg.tasks for s in cfg.schemes for G in cfg.Gs
            for seed in cfg.task_seeds.get(t, cfg.seeds)]
    for arm in cfg.arms:
        over = tuple(sorted((k, _freeze(v)) for k, v in arm.items() if k not in _ARM_KEYS))
        for seed in arm.get("seeds", cfg.seeds):
            jobs.append(Job(arm["task"], arm["scheme"], int(arm["G"]), int(seed),
                            arm.get("variant", ""), over))
    if "sort" in cfg.tasks:
        jobs += [Job("sort", cfg.hacking_scheme, cfg.hacking_G, seed, reward=r)
                 for r in cfg.hacking_rewards for seed in cfg.hacking_seeds]
    return jobs


def _freeze(v: Any) -> Any:
    return tuple(sorted(v.items())) if isinstance(v, dict) else v


def _task_of(cfg: ValidateConfig, label: str) -> tuple[str, dict]:
    spec = dict(cfg.task_specs.get(label, {}))
    return spec.pop("task", label), spec


def _run_config(cfg: ValidateConfig, task: str, scheme: str, G: int, seed: int,
                reward: str | None = None, overrides: Sequence[tuple[str, Any]] = ()
                ) -> TrainConfig:
    name, knobs = _task_of(cfg, task)
    extra = {k: dict(v) if isinstance(v, tuple) and k.endswith("_options") else v
             for k, v in overrides}
    if knobs:
        extra["task_options"] = knobs
    # evaluations every ~eval_responses sampled responses of this run: an arm's own
    # prompts_per_step (an override) sets its step's response count, not the grid's base
    per_step = {**cfg.base, **extra}["prompts_per_step"] * G
    return TrainConfig(**{**cfg.base, **extra}, task=name, scheme=scheme, G=G, seed=seed,
                       reward=reward, token_budget=cfg.budgets[task],
                       eval_every=max(1, cfg.eval_responses // per_step))


def job_config(cfg: ValidateConfig, job: Job) -> TrainConfig:
    """The TrainConfig of one run of the grid."""
    return _run_config(cfg, job.task, job.scheme, job.G, job.seed, job.reward, job.overrides)


def curve_rows(df: pd.DataFrame, **keys: Any) -> pd.DataFrame:
    """A run's held-out evaluations (one row each), prefixed by ``keys`` as columns."""
    ev = df.dropna(subset=["eval/acc_sampled"])
    out = pd.DataFrame({"step": ev["step"], "tokens": ev["tokens/sampled"],
                        "env_tokens": ev["tokens/env"], "acc_sampled": ev["eval/acc_sampled"],
                        "acc_greedy": ev["eval/acc_greedy"],
                        "reward_sampled": ev["eval/reward_sampled"],
                        "wall_s": ev["time/wall_s"]})
    for k, v in reversed(keys.items()):
        out.insert(0, k, v)
    return out


def report(cfg: ValidateConfig, out: Path, frames: dict[Job, pd.DataFrame],
           phases: dict[str, float], t_start: float, *, report_dir: Path | None) -> str:
    """The statistics of the finished runs ``frames`` (each run's records) and their report
    (written to ``report_dir``, default ``out``; the prediction check caches its variance cells
    under ``out/prediction``); returns the markdown summary."""
    curves, traces, stab, timing, hack = [], [], [], [], []
    for job, df in frames.items():
        if job.reward is not None:
            hack.append(curve_rows(df, reward=job.reward, seed=job.seed))
            continue
        keys = dict(task=job.task, scheme=job.scheme, G=job.G, variant=job.variant,
                    seed=job.seed)
        curves.append(curve_rows(df, **keys))
        body = df[df["step"] > 0]
        traces.append(pd.DataFrame({**keys, "step": body["step"], "tokens": body["tokens/sampled"],
                                    "grad_norm": body["grad/norm"],
                                    "entropy": body["policy/entropy"]}))
        stab.append({**keys, "steps": int(body["step"].max()),
                     "grad_surge_steps_live": int(body["collapse/grad_surge"].fillna(0).sum()),
                     "entropy_collapse_steps": int(body["collapse/entropy"].fillna(0).sum()),
                     "grad_norm_median": float(body["grad/norm"].median()),
                     "grad_norm_max": float(body["grad/norm"].max()),
                     "final_entropy": float(body["policy/entropy"].iloc[-1])})
        timing.append({**keys, "wall_s": float(df["time/wall_s"].iloc[-1]),
                       "tokens": float(df["tokens/sampled"].iloc[-1])})

    curves_df = pd.concat(curves, ignore_index=True)
    acc0 = {t: float(c[c["step"] == 0]["acc_sampled"].iloc[0])
            for t, c in curves_df.groupby("task")}
    thresholds = {t: vs.threshold_of(a, cfg.threshold_frac) for t, a in acc0.items()}
    t2t = vs.t2t_table(curves_df, thresholds, interpolate=cfg.interpolate)
    cells = vs.cell_table(t2t, {t: float(cfg.budgets[t]) for t in thresholds})
    traces_df = pd.concat(traces, ignore_index=True)
    stab_df, calib = _stability(cfg, pd.DataFrame(stab), traces_df, t2t, acc0)
    timing_df = pd.DataFrame(timing)
    t_phase = time.perf_counter()
    pred_df, pred_notes = (_prediction(cfg, cells, out) if cfg.prediction
                           else (pd.DataFrame(), ["prediction check skipped (--no-prediction)"]))
    phases["prediction"] = time.perf_counter() - t_phase
    claims_df = pd.DataFrame(claim_rows(cfg, t2t, stab_df, pred_df))
    caveats = vs.toy_caveats(curves_df, t2t, stab_df)  # per task: greedy solved, all censored
    claims_df["caveat"] = ["; ".join(vs.caveat_texts(caveats, None if t == "all" else
                                                     t.split(","))) for t in claims_df["task"]]
    hack_df = vs.hacking_table(pd.concat(hack, ignore_index=True)) if hack else pd.DataFrame()
    wall = time.perf_counter() - t_start

    heads, notes = _headlines(cfg, claims_df, acc0, thresholds, stab_df, calib, hack_df)
    pre = (vp.report_block(cfg.preregistration, config_dict(cfg), registered_config)
           if cfg.preregistration else None)
    heads.insert(0, Headline(key="preregistration", value=len(pre["deviations"]) if pre else
                             math.nan, se=None, unit="deviations", text=vp.headline_text(pre)))
    heads.append(Headline(key="multiplicity", value=math.nan, se=None, unit="",
                          text=vs.multiplicity_statement(claims_df.to_dict("records"))))
    notes = vp.notes_of(pre) + vs.caveat_texts(caveats) + notes
    notes += pred_notes + _runtime_notes(timing_df, wall, phases)
    fig_label = figure_labels  # figures group by scheme and G: fold the variant into the label
    mean_curves = vs.mean_curves(fig_label(curves_df), ["task", "scheme", "G"])
    records = {"claims": claims_df, "cells": cells, "tokens_to_threshold": t2t,
               "curves_mean": mean_curves, "curves": curves_df, "stability": stab_df,
               "collapse_rates": vs.rate_table(stab_df, ["task", "scheme", "G", "variant"]),
               "collapse_rates_pooled": vs.rate_table(stab_df, ["scheme", "G", "variant"]),
               "surge_rates": vs.rate_table(stab_df, ["task", "scheme", "G", "variant"],
                                            col="flag_surge"),  # descriptive: no claim
               "grad_traces": fig_label(traces_df), "timing": timing_df, "caveats": caveats}
    if len(pred_df):
        records["prediction"] = pred_df
    if len(hack_df):
        records["hacking"] = hack_df
    summary = {"acc0": acc0, "thresholds": thresholds, "wall_s": wall, "reduced": cfg.reduced,
               "collapse_calibration": {k: v for k, v in calib.items() if k != "scores"},
               "verdicts": [{k: r[k] for k in ("claim", "estimate", "ci_lo", "ci_hi", "verdict")}
                            for r in claims_df.to_dict("records")],
               "verdict_rules": vs.verdict_rules(claim_estimands(cfg)), "preregistration": pre,
               "caveats": caveats.to_dict("records")}
    result = AnalysisResult(
        kind="training", name="validation", records=records, summary=summary, headlines=heads,
        config=config_dict(cfg), notes=notes,
        provenance=provenance(config=config_dict(cfg), seeds={"train": list(cfg.seeds)},
                              device=str(cfg.base.get("device", "cpu")), wall_time_s=wall))
    dest = Path(report_dir) if report_dir is not None else out
    write_report([result], dest, title="varbench validation: the papers' claims, decided")
    text = "\n".join(["# Validation summary", ""] + [f"- {h.text}" for h in heads] + [""]
                     + ["## Notes", ""] + [f"- {n}" for n in notes]) + "\n"
    (dest / "validation_summary.md").write_text(text)
    return text


def figure_labels(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with the variant folded into the scheme (``gspo+mr``): figures group by it."""
    df = df.copy()
    v = df.pop("variant").astype(str)
    df["scheme"] = np.where(v != "", df["scheme"].astype(str) + "+" + v, df["scheme"])
    return df


def check_grid(cfg: ValidateConfig) -> None:
    """Names and sizes checked before any training starts."""
    from varbench.estimators import schemes

    for label, spec in cfg.task_specs.items():
        if not isinstance(spec, dict) or "task" not in spec:
            raise UsageError(f"task_specs[{label!r}]={spec!r} is not valid; expected a table "
                             "with task = NAME and the task's knobs")
    labels = set(cfg.tasks) | {a.get("task") for a in cfg.arms}
    for t in sorted(labels, key=str):
        check_task_label(cfg, t)
        if t not in cfg.budgets:
            raise UsageError(f"budgets: no token budget for task {t!r}; add {t}=N")
    for s in (*cfg.schemes, cfg.hacking_scheme, *(a.get("scheme") for a in cfg.arms)):
        check_choice("schemes", s, schemes())
    for G in (*cfg.Gs, *(a.get("G") for a in cfg.arms)):
        check_positive_int("Gs", G)
    if not cfg.seeds or any(not v for v in cfg.task_seeds.values()):
        raise UsageError("seeds is empty; give at least one seed")
    for t in cfg.task_seeds:
        if t not in cfg.tasks:
            raise UsageError(f"task_seeds: {t!r} is not one of tasks {list(cfg.tasks)}")
    for a in cfg.arms:
        for k in a:
            if k not in _ARM_KEYS and k not in {f.name for f in fields(TrainConfig)}:
                raise UsageError(f"arms: key {k!r} of {a!r} is not valid; use {_ARM_KEYS} or "
                                 "TrainConfig fields")
    if cfg.preregistration:  # the file, its sections and its design's keys, before training
        vp.report_block(cfg.preregistration, config_dict(cfg), registered_config)
    arms = {j.arm for j in jobs_of(cfg) if j.reward is None}
    for c in cfg.claims:
        check_choice("claims kind", c.get("kind"), CLAIM_KINDS)
        if c.get("kind") == "stability":
            if c.get("measure") == "surge":
                raise UsageError(f"claims: measure = 'surge' of {c!r} is no longer a claim: "
                                 "the surge flag is reported descriptively (surge_rates table)"
                                 "; its calibration is in-sample on the runs it would compare"
                                 "; use the collapse measure (drop the key)")
            check_choice("claims measure", c.get("measure", "collapse"), STABILITY_MEASURES)
            for t in _as_list(c.get("tasks")):
                check_choice("claims tasks", t, list(cfg.tasks))
        if "estimand" in c:
            check_choice("claims estimand", c["estimand"], vs.ESTIMANDS)
            if c["estimand"] == "restricted" and c.get("kind") not in vs.RESTRICTED_KINDS:
                raise UsageError(f"claims: estimand = 'restricted' of {c!r} is not valid for "
                                 f"kind {c.get('kind')!r}; it is for kinds "
                                 f"{list(vs.RESTRICTED_KINDS)} (restricted to the token budget)")
        for side in ("a", "b"):
            for ref in _as_list(c.get(side)):
                if ref not in arms:
                    raise UsageError(f"claims: arm {ref!r} of {c!r} is not in the grid; arms: "
                                     f"{sorted(arms)}")
    for j in jobs_of(cfg):  # every run's configuration is valid before any of them trains
        job_config(cfg, j)


def check_task_label(cfg: ValidateConfig, label: Any) -> None:
    """A task label of the grid: a registered name, or a ``task_specs`` label (a safe name:
    it names the runs' directories) whose ``task`` is any task spec (a data file, a user's
    ``MODULE:ATTR``) with its knobs, checked without calling user code; a warm-started grid
    needs the task's demonstrations."""
    from varbench._util.io import safe_name
    from varbench.tasks import check_task, task_names

    if label not in cfg.task_specs:
        if label not in task_names():
            raise UsageError(f"tasks={label!r} is not valid; choose one of "
                             f"{sorted(task_names()) + sorted(cfg.task_specs)} (registered tasks "
                             "and task_specs labels) or give your own task a label: "
                             "task_specs = {LABEL = {task = SPEC, ...}} in a suite, --task "
                             "LABEL=SPEC on the command line")
        return
    safe_name("task label", label)
    spec, knobs = _task_of(cfg, label)
    task = check_task(spec, **knobs)
    from varbench.models import presets

    policy = cfg.base.get("policy", "tiny")
    warm = (cfg.base.get("warm_start", True) if policy in presets()
            else cfg.base.get("warm_start_dir", False))
    if task is not None and warm and not task.has_demonstrations:
        raise UsageError(f"task {label!r} ({spec!r}) has no demonstrations, and every run of "
                         "the grid starts from a warm start on them: a dataset task needs "
                         "solution_key=COLUMN among its knobs")


def _as_list(x: Any) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


def config_dict(cfg: ValidateConfig) -> dict:
    """``cfg`` as plain JSON data (:meth:`ValidateConfig.from_params` reads it back)."""
    return json.loads(json.dumps(asdict(cfg)))


def registered_config(design: dict) -> dict:
    """A pre-registration's ``[design]`` table as plain config data, defaults filled in."""
    return config_dict(ValidateConfig.from_params(design))


# --- stability ---------------------------------------------------------------------------------

def _stability(cfg: ValidateConfig, stab: pd.DataFrame, traces: pd.DataFrame, t2t: pd.DataFrame,
               acc0: dict[str, float]) -> tuple[pd.DataFrame, dict]:
    """Per run: outcome collapse, the calibrated detector's flag, and whether it collapsed.

    A run *collapsed by outcome* when its final held-out accuracy fell below
    ``collapse_acc_frac`` x the warm start's or a gradient norm was non-finite. The surge factor
    is calibrated on the runs that did not (their false-positive rate is reported) and its flag
    is reported descriptively (``flag_surge``, the ``surge_rates`` table), never claimed: on
    the claims grid it flagged none of the runs whose accuracy collapsed and mostly runs that
    learned, so ``collapsed`` is the outcome alone. The live entropy flag (entropy below
    ``entropy_floor`` x its first value) is reported with its own false-positive rate and not
    counted: a policy that learns a task with one right answer has a low entropy, so the flag
    fires on runs that succeed.
    """
    keys = ["task", "scheme", "G", "variant", "seed"]
    final = t2t.set_index(keys)["final_acc_sampled"]
    score, nonfinite, norms = {}, {}, {}
    for k, d in traces.groupby(keys, sort=False):
        g = d.sort_values("step")["grad_norm"].to_numpy(dtype=float)
        sc = surge_scores(g, window=int(cfg.base.get("surge_window", 20)))
        score[k], nonfinite[k] = max(sc, default=0.0), bool((~np.isfinite(g)).any())
        norms[k] = g.tolist()
    stab = stab.copy()
    idx = [tuple(r) for r in stab[keys].itertuples(index=False)]
    stab["final_acc"] = [float(final[k]) for k in idx]
    stab["surge_score"] = [score[k] for k in idx]
    stab["collapsed_outcome"] = [bool(nonfinite[k] or final[k] < cfg.collapse_acc_frac
                                      * acc0[k[0]]) for k in idx]
    healthy = [norms[k] for k, bad in zip(idx, stab["collapsed_outcome"], strict=True)
               if not bad]
    default = TrainConfig().surge_factor
    if cfg.surge_factor is None and healthy:
        calib = calibrate(healthy, target_fpr=cfg.collapse_fpr, default=default,
                          window=int(cfg.base.get("surge_window", 20)))
        calib["source"] = "calibrated on this experiment's non-collapsing runs (in-sample)"
    else:
        factor = float(cfg.surge_factor if cfg.surge_factor is not None else default)
        sc = [s for s, bad in zip(stab["surge_score"], stab["collapsed_outcome"], strict=True)
              if not bad]
        n = max(len(sc), 1)
        calib = {"surge_factor": factor, "fpr": sum(s > factor for s in sc) / n,
                 "fpr_default": sum(s > default for s in sc) / n, "runs": len(sc),
                 "source": "fixed in the configuration (out-of-sample check)"}
    calib["default"] = default
    healthy_n = int((~stab["collapsed_outcome"]).sum())
    calib["fpr_ci"] = vs.wilson_ci(round(calib["fpr"] * healthy_n), healthy_n)
    stab["flag_surge"] = stab["surge_score"] > calib["surge_factor"]
    stab["flag_surge_default"] = stab["surge_score"] > default
    stab["flag_entropy"] = stab["entropy_collapse_steps"] > 0
    stab["collapsed"] = stab["collapsed_outcome"]
    bad = stab[stab["collapsed_outcome"]]
    good = stab[~stab["collapsed_outcome"]]
    calib["detected_outcome_collapses"] = int(bad["flag_surge"].sum())
    calib["outcome_collapses"] = len(bad)
    calib["entropy_flagged_healthy"] = int(good["flag_entropy"].sum())
    calib["entropy_flagged_collapsed"] = int(bad["flag_entropy"].sum())
    return stab, calib


# --- claims ------------------------------------------------------------------------------------

def default_claims(cfg: ValidateConfig) -> list[dict]:
    """The OTB claims the core grid can test: otb G=4 against normalized and centered at G=32
    and G=8 per task (tokens), and the stability of otb G=4 against those group baselines."""
    arms = {j.arm for j in jobs_of(cfg) if j.reward is None}
    out = []
    for t in cfg.tasks:
        for b in ("normalized/32", "centered/32", "normalized/8", "centered/8"):
            # the headline claim is always listed: without its arms it reads 'undecided'
            if b == "normalized/32" or ("otb/4" in arms and b in arms):
                out.append({"kind": "tokens", "task": t, "a": "otb/4", "b": b})
    group = [b for b in ("normalized/32", "centered/32", "normalized/8", "centered/8")
             if b in arms]
    if "otb/4" in arms and group:
        out.append({"kind": "stability", "a": ["otb/4"], "b": group})
    return out


def claim_estimands(cfg: ValidateConfig) -> list[str]:
    """Each claim's estimand ('mean' unless the claim says ``estimand = "restricted"``)."""
    return [vs.estimand_of(c) for c in (cfg.claims or default_claims(cfg))]


def _claimed_saving(cfg: ValidateConfig, task: str) -> float:
    from varbench.tasks import get_task

    name, knobs = _task_of(cfg, task)
    multi = bool(getattr(get_task(name, **knobs), "multi_turn", False))
    return CLAIMED_SAVING["multi_turn" if multi else "single_turn"]


def _arm_rows(t2t: pd.DataFrame, task: str, arm: str) -> pd.DataFrame:
    parts = arm.split("/")
    scheme, G, variant = parts[0], int(parts[1]), parts[2] if len(parts) > 2 else ""
    d = t2t[(t2t.task == task) & (t2t.scheme == scheme) & (t2t.G == G)
            & (t2t.variant == variant)]
    return d.sort_values("seed")


def claim_rows(cfg: ValidateConfig, t2t: pd.DataFrame, stab: pd.DataFrame,
               pred: pd.DataFrame) -> list[dict]:
    """One row per claim (and metric): the estimate, its 95% CI and the verdict.

    ``tokens``: saving ``1 - RMST_a / RMST_b`` of Kaplan-Meier restricted mean tokens-to-
    threshold at the task's budget (seed bootstrap), against the paper's claimed saving;
    ``proxy``: the same saving with seeds paired, judged as equivalence (the proxy needs at
    most ``equivalence_margin`` more); ``compute``: the saving in sampled tokens and in wall
    seconds to threshold, against ~9%; ``stability``: collapse rate of ``b`` minus that of
    ``a`` (Newcombe CI); ``prediction``: Spearman rho per task over the scheme x G cells.
    """
    rows = []
    for c in (cfg.claims or default_claims(cfg)):
        kind = c["kind"]
        if kind == "stability":
            rows.append(_stability_claim(cfg, c, stab))
            continue
        task = c["task"]
        a, b = _arm_rows(t2t, task, c["a"]), _arm_rows(t2t, task, c["b"])
        if kind == "proxy":
            common = sorted(set(a.seed) & set(b.seed))
            a, b = a[a.seed.isin(common)], b[b.seed.isin(common)]
        metrics = ("tokens", "wall_s") if kind == "compute" else ("tokens",)
        for metric in metrics:
            rows.append(_saving_claim(cfg, c, a, b, metric))
    for t, p in (pred.groupby("task") if len(pred) else []):
        rho, lo, hi = (float(p[k].iloc[0]) for k in ("spearman_rho", "rho_ci_lo", "rho_ci_hi"))
        enough = len(p) >= cfg.min_prediction_cells
        rows.append({"claim": f"{t}: warm-start variance x tokens predicts tokens-to-threshold",
                     "kind": "prediction", "task": t, "a": "", "b": "", "metric": "spearman_rho",
                     "estimate": rho, "ci_lo": lo, "ci_hi": hi, "claimed": math.nan,
                     "n_a": len(p), "n_b": len(p),
                     "verdict": vs.verdict_interval(lo, hi) if enough else "undecided",
                     "rule": vs.VERDICT_RULES["correlation"].replace(
                         "min_cells", str(cfg.min_prediction_cells)),
                     "note": "" if enough else f"only {len(p)} cells"})
    vs.holm_verdicts(rows)
    return rows


def _saving_claim(cfg: ValidateConfig, c: dict, a: pd.DataFrame, b: pd.DataFrame,
                  metric: str) -> dict:
    kind, task = c["kind"], c["task"]
    estimand = vs.estimand_of(c)
    what = {"tokens": "tokens-to-threshold", "wall_s": "wall seconds to threshold"}[metric]
    if estimand == "restricted":
        what = f"restricted mean {what} up to the budget"
    row = {"claim": f"{task}: {c['a']} vs {c['b']} ({what})", "kind": kind, "task": task,
           "a": c["a"], "b": c["b"], "metric": metric, "n_a": len(a), "n_b": len(b),
           "estimand": estimand}
    rules = vs.verdict_rules([estimand])
    suffix = "_restricted" if estimand == "restricted" else ""
    if kind == "proxy":
        row["claimed"] = -float(c.get("margin", cfg.equivalence_margin))
    elif kind == "compute":
        row["claimed"] = float(c.get("claimed", CLAIMED_COMPUTE_SAVING))
    else:
        row["claimed"] = float(c.get("claimed", _claimed_saving(cfg, task)))
    if len(a) == 0 or len(b) == 0:
        return {**row, "estimate": math.nan, "ci_lo": math.nan, "ci_hi": math.nan,
                "verdict": "undecided", "rule": rules["saving" + suffix],
                "note": "cannot test: no runs of " + (c["a"] if len(a) == 0 else c["b"])}
    col = "tokens_to_threshold" if metric == "tokens" else "wall_to_threshold"
    xa, xb = a[col].to_numpy(float), b[col].to_numpy(float)
    ea, eb = a["reached"].to_numpy(bool), b["reached"].to_numpy(bool)
    if metric == "tokens":
        tau = float(cfg.budgets[task])
    else:  # restricted to the shortest censored run's wall time (all runs are observed there)
        both = pd.concat([a, b])
        cens = both.loc[~both["reached"], "final_wall_s"]
        tau = float(cens.min()) if len(cens) else float(both[col].max())
    s = vs.rmst_saving(xa, ea, xb, eb, tau, paired=kind == "proxy")
    row.update(estimate=s["saving"], ci_lo=s["saving_ci_lo"], ci_hi=s["saving_ci_hi"],
               reached_a=int(ea.sum()), reached_b=int(eb.sum()), tau=tau,
               rmst_a=s["rmst_a"], rmst_b=s["rmst_b"], saving_se=s["saving_se"], df=s["df"],
               censored_a=s["censored_a"], censored_b=s["censored_b"])
    # 'at least X' (a saving is also above 0) or 'at most the margin worse' (equivalence)
    target = row["claimed"] if kind == "proxy" else max(row["claimed"], 0.0)
    row["p_confirm"], row["p_refute"] = vs.saving_pvalues(s["saving"], s["saving_se"],
                                                          s["df"], target)
    if kind == "proxy":
        row["verdict"] = vs.verdict_equivalence(s["saving_ci_lo"], s["saving_ci_hi"],
                                                -row["claimed"], censored_a=s["censored_a"],
                                                censored_b=s["censored_b"], estimand=estimand)
        row["rule"] = rules["equivalence" + suffix].replace("margin", f"{-row['claimed']:g}")
        row["reading"] = vs.equivalence_reading(row["verdict"], s["saving_ci_lo"],
                                                s["saving_ci_hi"])
    else:
        row["verdict"] = vs.verdict_saving(s["saving_ci_lo"], s["saving_ci_hi"], row["claimed"],
                                           censored_a=s["censored_a"], censored_b=s["censored_b"],
                                           estimand=estimand)
        row["rule"] = rules["saving" + suffix]
    own = "counted up to the budget: the restricted mean's own estimand, no bound"
    cens = [f"{n}/{len(d)} of {arm} censored ("
            + (own if estimand == "restricted" else f"saving is {bound} bound") + ")"
            for n, d, arm, bound in ((s["censored_a"], a, c["a"], "an upper"),
                                     (s["censored_b"], b, c["b"], "a lower")) if n]
    row["note"] = "; ".join(cens)
    return row


def _stability_claim(cfg: ValidateConfig, c: dict, stab: pd.DataFrame) -> dict:
    def pick(arms):
        m = np.zeros(len(stab), bool)
        for arm in arms:
            parts = arm.split("/")
            m |= ((stab.scheme == parts[0]) & (stab.G == int(parts[1]))
                  & (stab.variant == (parts[2] if len(parts) > 2 else ""))).to_numpy()
        if c.get("tasks"):
            m &= stab.task.isin(c["tasks"]).to_numpy()
        return stab[m]

    a_arms, b_arms = _as_list(c["a"]), _as_list(c["b"])
    a, b = pick(a_arms), pick(b_arms)
    measure = c.get("measure", "collapse")
    col = STABILITY_MEASURES[measure]
    where = f" on {', '.join(c['tasks'])}" if c.get("tasks") else ""
    row = {"claim": f"collapse rate of {'+'.join(b_arms)} minus {'+'.join(a_arms)}{where}",
           "kind": "stability", "task": ",".join(c.get("tasks", [])) or "all",
           "a": "+".join(a_arms), "b": "+".join(b_arms), "metric": "collapse_rate_diff",
           "claimed": math.nan, "n_a": len(a), "n_b": len(b),
           "rule": vs.VERDICT_RULES["rate_diff"]}
    if len(a) == 0 or len(b) == 0:
        return {**row, "estimate": math.nan, "ci_lo": math.nan, "ci_hi": math.nan,
                "verdict": "undecided", "note": "no runs of one side"}
    ka, kb = int(a[col].sum()), int(b[col].sum())
    d, lo, hi = vs.newcombe_diff_ci(kb, len(b), ka, len(a))
    return {**row, "estimate": d, "ci_lo": lo, "ci_hi": hi, "collapsed_a": ka, "collapsed_b": kb,
            "verdict": vs.verdict_interval(lo, hi),
            "measure": measure,
            "note": f"{kb}/{len(b)} vs {ka}/{len(a)} runs collapsed"
                    + ("; no run collapsed on either side" if ka + kb == 0 else "")}


# --- prediction --------------------------------------------------------------------------------

def _prediction(cfg: ValidateConfig, cells: pd.DataFrame, out: Path
                ) -> tuple[pd.DataFrame, list[str]]:
    """Warm-start variance x tokens per scheme x G against realised tokens-to-threshold (the
    Kaplan-Meier restricted mean at the budget). The variance cells are cached under
    ``out/prediction`` (keyed by their configuration), so a rerun reuses them."""
    from varbench.analysis.variance import estimator_variance

    rows, notes = [], []
    core = cells[cells["variant"] == ""]
    for task_name in cfg.tasks:
        tc = _run_config(cfg, task_name, cfg.schemes[0], cfg.Gs[0], cfg.seeds[0])
        Gs = [G for G in cfg.Gs if G >= 2]
        key = {"task": tc.task, "task_options": dict(tc.task_options), "schemes": cfg.schemes,
               "Gs": Gs, "agg": tc.agg, "M": cfg.variance_M, "prompts": cfg.variance_prompts,
               "policy": tc.policy, "warm_start_seed": tc.warm_start_seed}
        cache = CellCache(out / "prediction", key)
        v = cache.load(task_name)
        if v is None:
            task, _ = build_task(tc)
            policy = policy_for(tc, task)
            res = estimator_variance(policy, task, schemes=cfg.schemes, Gs=Gs, modes=(tc.agg,),
                                     M=cfg.variance_M, n_prompts=cfg.variance_prompts,
                                     reference="sampled", n_ref=64, sketch_dim=256,
                                     # point estimates only (no interval is read): no floor
                                     min_responses=0, progress=False)
            v = res.records["cells"][["scheme", "G", "variance", "variance_x_tokens"]]
            cache.save(task_name, v)
        m = core[core.task == task_name].merge(v, on=["scheme", "G"])
        m.insert(0, "task", m.pop("task"))
        rho, lo, hi = vs.rank_correlation_ci(m["variance_x_tokens"], m["t2t_rmst"])
        m["spearman_rho"], m["rho_ci_lo"], m["rho_ci_hi"] = rho, lo, hi
        rows.append(m)
        if len(m) < cfg.min_prediction_cells:
            notes.append(f"{task_name}: the rank correlation rests on {len(m)} scheme x G cells "
                         f"(< {cfg.min_prediction_cells}); its verdict is undecided whatever "
                         "its value.")
        if m["t2t_is_lower_bound"].any():
            notes.append(f"{task_name}: some cells' runs never reached the threshold; their "
                         "restricted means are capped by the budget, which ties such cells.")
        notes.append(
            f"{task_name}: the variance analysis used a sampled reference (64 responses) and "
            f"M={cfg.variance_M} groups x {cfg.variance_prompts} prompts; only variance x "
            "tokens enters the prediction, which needs no reference.")
    return pd.concat(rows, ignore_index=True), notes


# --- headlines and notes -----------------------------------------------------------------------

def claim_sentence(r: dict) -> str:
    """A claim row as one sentence: estimate, CI, verdict, caveats."""
    if r["kind"] in ("prediction",):
        est = f"rho = {r['estimate']:.2f} over {r['n_a']} cells"
        ci = f"[{r['ci_lo']:.2f}, {r['ci_hi']:.2f}]"
    elif r["kind"] == "stability":
        est = f"difference {r['estimate'] * 100:+.0f} points"
        ci = f"[{r['ci_lo'] * 100:+.0f}, {r['ci_hi'] * 100:+.0f}]"
    else:
        claimed = ("" if r["kind"] == "proxy"
                   else f"; claimed {r['claimed'] * 100:.0f}%")
        est = (f"saving {r['estimate'] * 100:.0f}% (seeds {r['n_a']} / {r['n_b']}, reached "
               f"{int(r.get('reached_a', 0))} / {int(r.get('reached_b', 0))}{claimed})")
        ci = f"[{r['ci_lo'] * 100:.0f}%, {r['ci_hi'] * 100:.0f}%]"
    if not math.isfinite(r["estimate"]):
        est, ci = "not measurable", "n/a"
    notes = [r[k] for k in ("note", "caveat") if isinstance(r.get(k), str) and r[k]]
    if math.isfinite(r.get("p_confirm_holm", math.nan)):
        notes.append(f"Holm-adjusted one-sided p {r['p_confirm_holm']:.3g} for, "
                     f"{r['p_refute_holm']:.3g} against")
        if isinstance(r.get("verdict_unadjusted"), str) and r["verdict_unadjusted"] != r[
                "verdict"]:
            notes.append(f"{r['verdict_unadjusted']} before the adjustment")
    verdict = r["verdict"].upper()
    if isinstance(r.get("reading"), str) and r["reading"] != r["verdict"]:
        notes.insert(0, r["reading"])
    note = f" ({'; '.join(notes)})" if notes else ""
    return f"{verdict}: {r['claim']}: {est}, 95% t CI {ci}{note}." if r["kind"] in (
        "tokens", "proxy", "compute") else f"{verdict}: {r['claim']}: {est}, 95% CI {ci}{note}."


def _headlines(cfg, claims: pd.DataFrame, acc0, thresholds, stab: pd.DataFrame, calib: dict,
               hack: pd.DataFrame) -> tuple[list[Headline], list[str]]:
    heads, notes = [], []
    for r in claims.to_dict("records"):
        heads.append(Headline(key=f"claim/{r['claim']}", value=r["estimate"], se=None,
                              text=claim_sentence(r), unit=r["metric"], ci_lo=r.get("ci_lo"),
                              ci_hi=r.get("ci_hi"), level=0.95))
    fpr_lo, fpr_hi = calib["fpr_ci"]
    heads.append(Headline(
        key="collapse/detector_fpr", value=calib["fpr"], se=None, unit="fraction of runs",
        text=f"Surge detector (descriptive, no claim rests on it; per-arm flag rates in the "
             f"surge_rates table): surge factor {calib['surge_factor']:.2f} "
             f"({calib['source']}); false-positive rate on the {calib['runs']} runs that did not "
             f"collapse {calib['fpr'] * 100:.0f}% (Wilson 95% CI {fpr_lo * 100:.0f}-"
             f"{fpr_hi * 100:.0f}%), against {calib['fpr_default'] * 100:.0f}% at the live "
             f"default {calib['default']:g}; it flags {calib['detected_outcome_collapses']} of "
             f"the {calib['outcome_collapses']} runs whose held-out accuracy collapsed."))
    ent_lo, ent_hi = vs.wilson_ci(calib["entropy_flagged_healthy"], calib["runs"])
    floor = cfg.base.get("entropy_floor", TrainConfig().entropy_floor)
    heads.append(Headline(
        key="collapse/entropy_flag_fpr", value=calib["entropy_flagged_healthy"] / max(
            calib["runs"], 1), se=None, unit="fraction of runs",
        text=f"Entropy flag (entropy below {floor:g} x its first "
             f"value; not counted as a collapse): it fired on {calib['entropy_flagged_healthy']} "
             f"of the {calib['runs']} runs that did not collapse (Wilson 95% CI "
             f"{ent_lo * 100:.0f}-{ent_hi * 100:.0f}%) and on "
             f"{calib['entropy_flagged_collapsed']} of the {calib['outcome_collapses']} that "
             "did: a policy that learns a task with one right answer has a low entropy."))
    n_c = int(stab["collapsed"].sum())
    which = ", ".join(f"{r.task}/{r.scheme}/G={r.G}{'/' + r.variant if r.variant else ''}"
                      f"/s{r.seed}" for r in stab[stab["collapsed"]].itertuples())
    heads.append(Headline(key="collapse/runs", value=n_c, se=None, unit="runs",
                          text=f"{n_c} of {len(stab)} runs collapsed (final held-out accuracy "
                               f"below {cfg.collapse_acc_frac:g} x the warm start's, or a "
                               "non-finite gradient norm)" + (f": {which}." if which else ".")))
    for r in hack.itertuples() if len(hack) else []:
        heads.append(Headline(
            key=f"hacking/{r.reward}/s{r.seed}", value=r.pearson, se=None, unit="r",
            text=f"reward hacking probe, sort trained on {r.reward} (seed {r.seed}): held-out "
                 f"{r.reward} went {r.reward_start:.2f} -> {r.reward_end:.2f} while exact-match "
                 f"accuracy went {r.exact_start:.2f} -> {r.exact_end:.2f}; correlation over "
                 f"{r.evals} evaluations: Pearson {r.pearson:.2f}, Spearman {r.spearman:.2f}."))
    for t in acc0:
        notes.append(f"{t}: warm-start held-out sampled accuracy {acc0[t]:.3f}; threshold "
                     f"{thresholds[t]:.3f} (= acc0 + {cfg.threshold_frac} x (1 - acc0)).")
    notes.append("Tokens-to-threshold is the sampled-token count at which held-out accuracy "
                 "first reaches the threshold (" + ("interpolated linearly between the two "
                 "evaluations around the crossing" if cfg.interpolate else "at the first "
                 "evaluation at or above it") + "). A run that never reaches it is right-"
                 "censored at its final count; arms are compared by the Kaplan-Meier restricted "
                 "mean up to the budget (RMST), with a t interval on the SE of a bootstrap over "
                 "seeds (each arm resampled separately; paired for the proxy claim).")
    notes += [f"Verdict rule ({k}): {v}"
              for k, v in vs.verdict_rules(claim_estimands(cfg)).items()]
    return heads, notes


def _runtime_notes(timing: pd.DataFrame, wall: float, phases: dict[str, float]) -> list[str]:
    notes = [f"This report took {wall / 60:.1f} min of wall time (training runs "
             f"{phases['runs'] / 60:.1f} min, prediction check {phases['prediction'] / 60:.1f} "
             "min; finished runs reloaded from disk count as zero)."]
    if len(timing):
        notes.append(f"Training runs: {len(timing)}, summed run wall time "
                     f"{timing['wall_s'].sum() / 60:.1f} min, "
                     f"{timing['tokens'].sum() / timing['wall_s'].sum():,.0f} sampled tokens/s "
                     "overall (time/wall_s of each run, evaluations included).")
    return notes
