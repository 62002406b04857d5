"""The validation experiment: does measured variance predict real training? (issue 6)

From one shared warm start per task, train every scheme x G x seed to a fixed budget of sampled
tokens, judge on fixed held-out prompts, and report: held-out accuracy against sampled tokens,
tokens-to-threshold with bootstrap CIs, the claim "otb at G=4 reaches the threshold with fewer
sampled tokens than normalized at G=32" as measured, collapse flags and gradient-norm traces,
a prediction check (warm-start variance at equal token budget against realised
tokens-to-threshold, rank correlation) and a reward-hacking probe on ``sort``.

    varbench validate --reduced --out reports/validate-reduced     # minutes
    varbench validate --out reports/validate                       # the full grid (hours)

Every finished run is kept under ``OUT/runs/...`` (records.csv + done.json); rerunning the
command skips finished runs, so an interrupted experiment continues where it stopped.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from tqdm.auto import tqdm

from varbench._util.checks import UsageError, check_choice, check_positive_int
from varbench._util.progress import show_progress
from varbench.analysis import validate_stats as vs
from varbench.report import provenance, write_report
from varbench.report.result import AnalysisResult, Headline
from varbench.train.config import TrainConfig
from varbench.train.loop import train
from varbench.train.records import read_records
from varbench.train.setup import build_policy, build_task

# Budgets in sampled (policy-generated) tokens per run, per task.
FULL_BUDGETS = {"sort": 24_000, "toolsum": 100_000}
REDUCED_BUDGETS = {"sort": 6_000, "toolsum": 24_000}


@dataclass(frozen=True)
class ValidateConfig:
    """The experiment grid; ``reduced()`` gives the minutes-long version."""

    tasks: tuple[str, ...] = ("sort", "toolsum")
    """Tasks: sort (single-turn, exact match) and toolsum (multi-turn tool use)."""
    schemes: tuple[str, ...] = ("centered", "normalized", "topk", "rloo", "otb")
    """Advantage schemes compared."""
    Gs: tuple[int, ...] = (4, 8, 32)
    """Group sizes."""
    seeds: tuple[int, ...] = (0, 1, 2)
    """Training seeds per cell (the warm start and held-out set are shared)."""
    budgets: dict[str, int] = field(default_factory=lambda: dict(FULL_BUDGETS))
    """Sampled-token budget per run, by task."""
    threshold_frac: float = 0.3
    """Threshold = warm-start accuracy + this fraction of the remaining gap to 1."""
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
    reduced: bool = False
    """Whether this is the reduced setting (recorded in the report)."""

    @classmethod
    def reduced_default(cls) -> ValidateConfig:
        """Two schemes, G in {4, 32}, two seeds, small budgets: minutes on 2 cores."""
        return cls(schemes=("normalized", "otb"), Gs=(4, 32), seeds=(0, 1),
                   budgets=dict(REDUCED_BUDGETS), eval_responses=256,
                   base={**cls().base, "eval_prompts": 64}, hacking_seeds=(0,),
                   variance_M=8, reduced=True)


def _run_config(cfg: ValidateConfig, task: str, scheme: str, G: int, seed: int,
                reward: str | None = None) -> TrainConfig:
    per_step = cfg.base["prompts_per_step"] * G
    return TrainConfig(**cfg.base, task=task, scheme=scheme, G=G, seed=seed, reward=reward,
                       token_budget=cfg.budgets[task],
                       eval_every=max(1, cfg.eval_responses // per_step))


def _run(tc: TrainConfig, run_dir: Path) -> pd.DataFrame:
    """Train (or load a finished run) and return its records."""
    done = run_dir / "done.json"
    if done.exists() and json.loads(done.read_text()).get("config") == tc.to_dict():
        return read_records(run_dir / "records.csv")
    res = train(tc, run_dir, progress=False)
    done.write_text(json.dumps({"config": tc.to_dict(), "stopped": res.stopped}))
    return res.records


def _curve_rows(df: pd.DataFrame, **keys: Any) -> pd.DataFrame:
    ev = df.dropna(subset=["eval/acc_sampled"])
    out = pd.DataFrame({"step": ev["step"], "tokens": ev["tokens/sampled"],
                        "env_tokens": ev["tokens/env"], "acc_sampled": ev["eval/acc_sampled"],
                        "acc_greedy": ev["eval/acc_greedy"],
                        "reward_sampled": ev["eval/reward_sampled"]})
    for k, v in reversed(keys.items()):
        out.insert(0, k, v)
    return out


def run_validation(cfg: ValidateConfig, out: Path, *, progress: bool | None = None) -> str:
    """Run the experiment into ``out``; returns the markdown summary (also written there)."""
    _check(cfg)
    t_start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    show = show_progress(progress)
    jobs = [(t, s, G, seed) for t in cfg.tasks for s in cfg.schemes for G in cfg.Gs
            for seed in cfg.seeds]
    hack_jobs = [(r, seed) for r in cfg.hacking_rewards for seed in cfg.hacking_seeds
                 if "sort" in cfg.tasks]
    bar = tqdm(total=len(jobs) + len(hack_jobs), desc="validate runs", disable=not show)
    phases = {"runs": 0.0, "prediction": 0.0}
    t_phase = time.perf_counter()
    curves, traces, stab, timing = [], [], [], []
    for task, scheme, G, seed in jobs:
        tc = _run_config(cfg, task, scheme, G, seed)
        df = _run(tc, out / "runs" / task / f"{scheme}_G{G}_s{seed}")
        keys = dict(task=task, scheme=scheme, G=G, seed=seed)
        curves.append(_curve_rows(df, **keys))
        body = df[df["step"] > 0]
        traces.append(pd.DataFrame({**keys, "step": body["step"], "tokens": body["tokens/sampled"],
                                    "grad_norm": body["grad/norm"],
                                    "entropy": body["policy/entropy"]}))
        stab.append({**keys, "steps": int(body["step"].max()),
                     "grad_surge_steps": int(body["collapse/grad_surge"].fillna(0).sum()),
                     "entropy_collapse_steps": int(body["collapse/entropy"].fillna(0).sum()),
                     "grad_norm_median": float(body["grad/norm"].median()),
                     "grad_norm_max": float(body["grad/norm"].max()),
                     "final_entropy": float(body["policy/entropy"].iloc[-1])})
        timing.append({**keys, "wall_s": float(df["time/wall_s"].iloc[-1]),
                       "tokens": float(df["tokens/sampled"].iloc[-1])})
        bar.update(1)
    hack = []
    for reward, seed in hack_jobs:
        tc = _run_config(cfg, "sort", cfg.hacking_scheme, cfg.hacking_G, seed, reward=reward)
        df = _run(tc, out / "runs" / "hacking" / f"{reward}_s{seed}")
        hack.append(_curve_rows(df, reward=reward, seed=seed))
        bar.update(1)
    bar.close()
    phases["runs"] = time.perf_counter() - t_phase

    curves_df = pd.concat(curves, ignore_index=True)
    acc0 = {t: float(c[c["step"] == 0]["acc_sampled"].iloc[0])
            for t, c in curves_df.groupby("task")}
    thresholds = {t: vs.threshold_of(a, cfg.threshold_frac) for t, a in acc0.items()}
    t2t = vs.t2t_table(curves_df, thresholds)
    cells = vs.cell_table(t2t)
    claims = [vs.claim(t2t, t, ("otb", 4), ("normalized", 32)) for t in cfg.tasks]
    mean_curves = (curves_df.groupby(["task", "scheme", "G", "step"], as_index=False)
                   .agg(tokens=("tokens", "mean"), acc_mean=("acc_sampled", "mean"),
                        acc_std=("acc_sampled", "std"), greedy_mean=("acc_greedy", "mean"),
                        seeds=("seed", "count")))
    stab_df, timing_df = pd.DataFrame(stab), pd.DataFrame(timing)
    t_phase = time.perf_counter()
    pred_df, pred_notes = (_prediction(cfg, cells) if cfg.prediction
                           else (pd.DataFrame(), ["prediction check skipped (--no-prediction)"]))
    phases["prediction"] = time.perf_counter() - t_phase
    hack_df = vs.hacking_table(pd.concat(hack, ignore_index=True)) if hack else pd.DataFrame()
    wall = time.perf_counter() - t_start

    heads, notes = _headlines(cfg, claims, acc0, thresholds, stab_df, pred_df, hack_df)
    notes += pred_notes + _runtime_notes(cfg, timing_df, wall, phases)
    records = {"cells": cells, "tokens_to_threshold": t2t, "curves_mean": mean_curves,
               "curves": curves_df, "claims": pd.DataFrame(claims), "stability": stab_df,
               "grad_traces": pd.concat(traces, ignore_index=True), "timing": timing_df}
    if len(pred_df):
        records["prediction"] = pred_df
    if len(hack_df):
        records["hacking"] = hack_df
    summary = {"acc0": acc0, "thresholds": thresholds, "claims": claims, "wall_s": wall,
               "reduced": cfg.reduced}
    result = AnalysisResult(
        kind="training", name="validation", records=records, summary=summary, headlines=heads,
        config=_jsonable_cfg(cfg), notes=notes,
        provenance=provenance(config=_jsonable_cfg(cfg), seeds={"train": list(cfg.seeds)},
                              device="cpu", wall_time_s=wall))
    write_report([result], out, title="varbench validation: does variance predict training?")
    text = "\n".join(["# Validation summary", ""] + [f"- {h.text}" for h in heads] + [""]
                     + ["## Notes", ""] + [f"- {n}" for n in notes]) + "\n"
    (out / "validation_summary.md").write_text(text)
    return text


def _check(cfg: ValidateConfig) -> None:
    """Names and sizes checked before any training starts."""
    from varbench.estimators import schemes
    from varbench.tasks import task_names

    for t in cfg.tasks:
        check_choice("tasks", t, task_names())
        if t not in cfg.budgets:
            raise UsageError(f"budgets: no token budget for task {t!r}; add {t}=N")
    for s in (*cfg.schemes, cfg.hacking_scheme):
        check_choice("schemes", s, schemes())
    for G in cfg.Gs:
        check_positive_int("Gs", G)
    if not cfg.seeds:
        raise UsageError("seeds is empty; give at least one seed")


def _jsonable_cfg(cfg: ValidateConfig) -> dict:
    return json.loads(json.dumps(asdict(cfg)))


def _prediction(cfg: ValidateConfig, cells: pd.DataFrame) -> tuple[pd.DataFrame, list[str]]:
    """Warm-start variance x tokens per scheme x G against realised tokens-to-threshold."""
    try:
        from varbench.analysis.variance import estimator_variance
    except ImportError as err:  # the analysis module is another issue's
        return pd.DataFrame(), [f"prediction check not run: {err}"]
    rows, notes = [], []
    for task_name in cfg.tasks:
        tc = _run_config(cfg, task_name, cfg.schemes[0], cfg.Gs[0], cfg.seeds[0])
        task, _ = build_task(tc)
        policy = build_policy(tc, task)
        Gs = [G for G in cfg.Gs if G >= 2]
        res = estimator_variance(policy, task, schemes=cfg.schemes, Gs=Gs, modes=(tc.agg,),
                                 M=cfg.variance_M, n_prompts=cfg.variance_prompts,
                                 reference="sampled", n_ref=64, sketch_dim=256, progress=False)
        v = res.records["cells"][["scheme", "G", "variance", "variance_x_tokens"]]
        m = cells[cells.task == task_name].merge(v, on=["scheme", "G"])
        m.insert(0, "task", m.pop("task"))
        rho, lo, hi = vs.rank_correlation_ci(m["variance_x_tokens"], m["t2t_mean"])
        m["spearman_rho"], m["rho_ci_lo"], m["rho_ci_hi"] = rho, lo, hi
        rows.append(m)
        if len(m) < 8:
            notes.append(f"{task_name}: the rank correlation rests on {len(m)} scheme x G cells; "
                         "with so few its CI is nearly [-1, 1] and it is weak evidence either way.")
        if m["t2t_is_lower_bound"].any():
            notes.append(f"{task_name}: some cells' tokens-to-threshold are lower bounds (runs "
                         "that never reached the threshold), which ties their ranks at the budget.")
        notes.append(
            f"{task_name}: the variance analysis used a sampled reference (64 responses) and "
            f"M={cfg.variance_M} groups x {cfg.variance_prompts} prompts; only variance x "
            "tokens enters the prediction, which needs no reference.")
    return pd.concat(rows, ignore_index=True), notes


def _headlines(cfg, claims, acc0, thresholds, stab, pred, hack) -> tuple[list[Headline], list[str]]:
    heads, notes = [], []
    for t in acc0:
        notes.append(f"{t}: warm-start held-out sampled accuracy {acc0[t]:.3f}; threshold "
                     f"{thresholds[t]:.3f} (= acc0 + {cfg.threshold_frac} x (1 - acc0)).")
    for c in claims:
        heads.append(Headline(key=f"{c['task']}/otb4_vs_normalized32_saving",
                              value=c.get("saving", float("nan")), se=None,
                              text=vs.claim_sentence(c), unit="fraction of tokens"))
    for col, what in (("grad_surge_steps", "a gradient-norm surge (> surge_factor x running "
                       "median)"), ("entropy_collapse_steps", "entropy collapse (< entropy_floor "
                       "x first-step entropy)")):
        flagged = stab[stab[col] > 0]
        which = ", ".join(f"{r.task}/{r.scheme}/G={r.G}/s{r.seed} ({getattr(r, col)} steps)"
                          for r in flagged.itertuples())
        heads.append(Headline(key=f"collapse/{col}", value=len(flagged), se=None, unit="runs",
                              text=f"{len(flagged)} of {len(stab)} runs flagged for {what}"
                                   + (f": {which}." if which else ".")))
    if len(pred):
        for t, p in pred.groupby("task"):
            rho, lo, hi = p["spearman_rho"].iloc[0], p["rho_ci_lo"].iloc[0], p["rho_ci_hi"].iloc[0]
            heads.append(Headline(
                key=f"{t}/prediction_spearman", value=rho, se=None, unit="rho",
                text=f"{t}: Spearman rank correlation between warm-start variance x tokens and "
                     f"realised tokens-to-threshold over {len(p)} scheme x G cells = {rho:.2f} "
                     f"[95% bootstrap CI {lo:.2f}, {hi:.2f}] (positive: the variance "
                     "analysis predicts which settings need more tokens)."))
    for r in hack.itertuples() if len(hack) else []:
        heads.append(Headline(
            key=f"hacking/{r.reward}/s{r.seed}", value=r.pearson, se=None, unit="r",
            text=f"reward hacking probe, sort trained on {r.reward} (seed {r.seed}): held-out "
                 f"{r.reward} went {r.reward_start:.2f} -> {r.reward_end:.2f} while exact-match "
                 f"accuracy went {r.exact_start:.2f} -> {r.exact_end:.2f}; correlation over "
                 f"{r.evals} evaluations: Pearson {r.pearson:.2f}, Spearman {r.spearman:.2f}."))
    return heads, notes


def _runtime_notes(cfg: ValidateConfig, timing: pd.DataFrame, wall: float,
                   phases: dict[str, float]) -> list[str]:
    """Measured wall time, and the full grid's runtime extrapolated from these runs."""
    notes = [f"This experiment took {wall / 60:.1f} min of wall time (training runs "
             f"{phases['runs'] / 60:.1f} min, prediction check {phases['prediction'] / 60:.1f} "
             "min; finished runs reloaded from disk count as zero)."]
    full = ValidateConfig()
    per_token = {t: (d["wall_s"] / d["tokens"].clip(lower=1)).groupby(d["G"]).mean()
                 for t, d in timing.groupby("task")}
    est, guessed = 0.0, []
    for task in full.tasks:
        if task not in per_token:
            guessed.append(f"{task} (no runs here)")
            continue
        for G in full.Gs:
            by_g = per_token[task]
            if G in by_g.index:
                s_per_tok = float(by_g[G])
            else:  # an unmeasured G: the mean over the measured ones
                s_per_tok = float(by_g.mean())
                guessed.append(f"{task} G={G}")
            est += s_per_tok * full.budgets[task] * len(full.schemes) * len(full.seeds)
    if "sort" in per_token:
        est += (float(per_token["sort"].mean()) * full.budgets["sort"]
                * len(full.hacking_rewards) * len(full.hacking_seeds))
    if phases["prediction"] > 0:  # scales with cells x M
        cells = len(cfg.schemes) * len(cfg.Gs) * cfg.variance_M
        est += phases["prediction"] * (len(full.schemes) * len(full.Gs) * full.variance_M) / cells
    if est > 0:
        notes.append(
            f"Extrapolated runtime of the full grid (this run's measured seconds per sampled "
            f"token x full budgets x {len(full.schemes)} schemes x {len(full.Gs)} G x "
            f"{len(full.seeds)} seeds, plus the probe and the prediction check scaled by cells): "
            f"{est / 3600:.1f} h on this machine under its load during this run"
            + (f"; per-token cost not measured for {guessed}, taken as the task's mean over "
               "the measured G" if guessed else "") + ".")
    return notes
