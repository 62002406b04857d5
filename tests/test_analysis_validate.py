"""varbench.analysis.validate: the experiment grid, its checks before any training, the run
configurations and the reuse of finished runs (the experiment end to end:
tests/test_app_cmd_train.py)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pandas as pd
import pytest

from varbench._util.checks import UsageError
from varbench.analysis import validate as V


@pytest.fixture
def no_training(monkeypatch):
    monkeypatch.setattr(V, "train", lambda *a, **k: pytest.fail("trained before checking"))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tasks": ("sort", "nope")}, r"tasks='nope' is not valid.*'toolsum'"),
        ({"budgets": {"sort": 100}}, r"no token budget for task 'toolsum'; add toolsum=N"),
        ({"schemes": ("otb", "bogus")}, r"schemes='bogus' is not valid.*'centered'"),
        ({"hacking_scheme": "bogus"}, r"schemes='bogus' is not valid"),
        ({"Gs": (4, 0)}, r"Gs=0 is not valid"),
        ({"seeds": ()}, r"seeds is empty"),
    ],
)
def test_bad_grids_are_refused_before_any_training(tmp_path, no_training, changes, message):
    cfg = V.ValidateConfig(**changes)
    with pytest.raises(UsageError, match=message):
        V.run_validation(cfg, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_reduced_grid():
    full, red = V.ValidateConfig(), V.ValidateConfig.reduced_default()
    assert red.reduced and not full.reduced
    assert red.schemes == ("normalized", "otb") and red.Gs == (4, 32) and red.seeds == (0, 1)
    assert red.budgets == V.REDUCED_BUDGETS and full.budgets == V.FULL_BUDGETS
    assert red.base["eval_prompts"] == 64 and full.base["eval_prompts"] == 128
    assert {k: v for k, v in red.base.items() if k != "eval_prompts"} == {
        k: v for k, v in full.base.items() if k != "eval_prompts"}
    assert red.budgets is not V.REDUCED_BUDGETS  # a copy: the module constants stay


def test_run_configs_space_evaluations_by_responses():
    cfg = V.ValidateConfig()  # eval_responses 512, prompts_per_step 8
    a = V._run_config(cfg, "sort", "otb", 4, 1)
    b = V._run_config(cfg, "toolsum", "normalized", 32, 2, reward="positional")
    assert (a.task, a.scheme, a.G, a.seed, a.reward) == ("sort", "otb", 4, 1, None)
    assert a.token_budget == 24_000 and a.eval_every == 512 // (8 * 4)
    assert b.token_budget == 100_000 and b.eval_every == 512 // (8 * 32)
    assert b.reward == "positional"
    tiny = V.ValidateConfig(eval_responses=8)
    assert V._run_config(tiny, "sort", "otb", 32, 0).eval_every == 1


def test_a_finished_run_is_reused_and_a_changed_one_retrained(tmp_path, monkeypatch):
    from varbench.train.records import RecordWriter

    tc = V._run_config(V.ValidateConfig(), "sort", "otb", 4, 0)
    run = tmp_path / "run"
    run.mkdir()
    RecordWriter(run / "records.csv").write({"step": 0, "eval/acc_sampled": 0.25})
    (run / "done.json").write_text(json.dumps({"config": tc.to_dict(), "stopped": "budget"}))
    monkeypatch.setattr(V, "train", lambda *a, **k: pytest.fail("retrained a finished run"))
    df = V._run(tc, run)
    assert list(df["step"]) == [0] and df["eval/acc_sampled"].iloc[0] == 0.25
    # a run finished before a config field existed ran with its default: still finished
    older = {k: v for k, v in tc.to_dict().items() if k != "update_forward"}
    (run / "done.json").write_text(json.dumps({"config": older, "stopped": "budget"}))
    assert list(V._run(tc, run)["step"]) == [0]
    assert not V._is_done(tc.replace(update_forward="sampler"), run)

    calls = []

    class Result:
        records = pd.DataFrame({"step": [0, 1]})
        stopped = "budget"

    monkeypatch.setattr(V, "train", lambda cfg, run_dir, progress: calls.append(cfg) or Result)
    changed = tc.replace(seed=1)
    assert list(V._run(changed, run)["step"]) == [0, 1] and calls == [changed]
    assert json.loads((run / "done.json").read_text())["config"] == changed.to_dict()


def _tiny_grid(**changes) -> V.ValidateConfig:
    """Random-init micro policy, a few hundred tokens per run: seconds for the whole grid."""
    base = dict(policy="micro", warm_start=False, prompts_per_step=2, lr=1e-3, eval_prompts=4,
                eval_samples=1, agg="token-mean", steps=100_000)
    cfg = V.ValidateConfig(
        tasks=("sort",), schemes=("normalized", "otb"), Gs=(2, 4), seeds=(0, 1),
        budgets={"sort": 60, "arith": 40, "toolsum_long": 150},
        task_specs={"toolsum_long": {"task": "toolsum", "k": 4}}, eval_responses=4, base=base,
        arms=({"task": "arith", "scheme": "normalized", "G": 2, "variant": "gspo",
               "ratio": "sequence"},
              {"task": "arith", "scheme": "normalized", "G": 2, "variant": "gspo_mr",
               "ratio": "sequence", "transform": "min_replace"},
              {"task": "toolsum_long", "scheme": "otb", "G": 4, "seeds": [0]}),
        claims=({"kind": "tokens", "task": "sort", "a": "otb/4", "b": "normalized/4"},
                {"kind": "compute", "task": "arith", "a": "normalized/2/gspo_mr",
                 "b": "normalized/2/gspo"},
                {"kind": "proxy", "task": "sort", "a": "otb/2", "b": "otb/4"},
                {"kind": "stability", "a": ["otb/4"], "b": ["normalized/2", "normalized/4"]}),
        hacking_rewards=("positional",), hacking_G=2, hacking_seeds=(0,),
        variance_M=3, variance_prompts=1, prediction=True)
    return V.ValidateConfig(**{**cfg.__dict__, **changes})


def test_jobs_arms_and_shards():
    cfg = _tiny_grid()
    jobs = V.jobs_of(cfg)
    # core 2 x 2 x 2 seeds, arms 2 + 2 + 1 (own seeds), hacking 1
    assert len(jobs) == 8 + 5 + 1
    assert {j.arm for j in jobs if j.variant} == {"normalized/2/gspo", "normalized/2/gspo_mr"}
    gspo = next(j for j in jobs if j.variant == "gspo_mr")
    tc = V._job_config(cfg, gspo)
    assert (tc.task, tc.ratio, tc.transform, tc.G) == ("arith", "sequence", "min_replace", 2)
    long = V._job_config(cfg, next(j for j in jobs if j.task == "toolsum_long"))
    assert long.task == "toolsum" and dict(long.task_options) == {"k": 4}
    assert long.token_budget == 150
    shards = [V.shard_jobs(jobs, (i, 3)) for i in (1, 2, 3)]
    assert sorted(map(repr, sum(shards, []))) == sorted(map(repr, jobs))  # a partition
    assert shards[1][0] == jobs[1] and shards[1][1] == jobs[4]
    assert len({j.rel_dir for j in jobs}) == len(jobs)  # one directory per run
    with pytest.raises(UsageError, match="shard"):
        V.shard_jobs(jobs, (4, 3))
    more = V.jobs_of(_tiny_grid(task_seeds={"sort": [0, 1, 2]}))
    assert len(more) == len(jobs) + 4 and {j.seed for j in more if j.task == "sort"} == {0, 1, 2}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"claims": ({"kind": "tokens", "task": "sort", "a": "otb/8", "b": "otb/4"},)},
         r"arm 'otb/8' .* is not in the grid"),
        ({"claims": ({"kind": "nope", "task": "sort", "a": "otb/4", "b": "otb/2"},)},
         r"claims kind='nope' is not valid"),
        ({"task_specs": {"toolsum_long": {"k": 4}}}, r"task_specs\['toolsum_long'\]"),
        ({"task_seeds": {"arith": [0]}}, r"task_seeds: 'arith' is not one of tasks"),
        ({"arms": ({"task": "arith", "scheme": "otb", "G": 2, "bogus": 1},)},
         r"arms: key 'bogus'"),
        ({"arms": ({"task": "arith", "scheme": "otb", "G": 2, "ratio": "nope"},), "claims": ()},
         r"ratio='nope' is not valid"),
    ],
)
def test_bad_arms_and_claims_are_refused_before_training(tmp_path, no_training, changes,
                                                         message):
    with pytest.raises(UsageError, match=message):
        V.run_validation(_tiny_grid(**changes), tmp_path / "out")


def _fake_train(tc, run_dir, progress=False):
    """Deterministic records of a run: accuracy rises at a speed set by the arm and seed, so
    arms differ and some runs never reach the threshold (censored)."""
    from varbench.train.records import RecordWriter

    Path(run_dir).mkdir(parents=True, exist_ok=True)
    speed = {"otb": 2.0, "normalized": 1.0}.get(tc.scheme, 1.0) * (1 + 0.3 * tc.seed)
    speed *= 1.2 if tc.transform != "none" else 1.0
    per_step = tc.prompts_per_step * tc.G * 3
    w = RecordWriter(Path(run_dir) / "records.csv")
    rows, step, tok = [], 0, 0
    while True:
        acc = min(1.0, 0.2 + speed * tok / (4.0 * tc.token_budget))
        row = {"step": step, "tokens/sampled": tok, "tokens/env": 0, "eval/acc_sampled": acc,
               "eval/acc_greedy": acc, "eval/reward_sampled": acc, "time/wall_s": 0.01 * step
               + 0.001 * tc.G}
        if step:
            row.update({"grad/norm": 1.0 + 0.1 * ((step * 7 + tc.seed) % 5),
                        "policy/entropy": 1.0, "collapse/grad_surge": 0,
                        "collapse/entropy": 0})
        w.write(row)
        rows.append(row)
        if tok >= tc.token_budget:
            break
        step, tok = step + 1, tok + per_step

    class Result:
        records = pd.DataFrame(rows)
        stopped = "budget"
    return Result


def _fake_variance(policy, task, *, schemes, Gs, **kw):
    from varbench.report.result import AnalysisResult

    cells = pd.DataFrame([{"scheme": s, "G": G, "variance": 1.0 / G,
                           "variance_x_tokens": (2.0 if s == "normalized" else 1.0) / G}
                          for s in schemes for G in Gs])
    return AnalysisResult("variance", "v", {"cells": cells}, {}, [], {}, {}, [])


def test_grid_sharded_resumed_and_reported(tmp_path, monkeypatch):
    """The grid machinery end to end on synthetic runs (the real loop: the slow test below)."""
    import varbench.analysis.variance as variance

    monkeypatch.setattr(V, "train", _fake_train)
    monkeypatch.setattr(variance, "estimator_variance", _fake_variance)
    monkeypatch.setattr(V, "build_policy", lambda tc, task: None)
    _check_grid_end_to_end(tmp_path, monkeypatch, _tiny_grid())
    claims = pd.read_csv(tmp_path / "report" / "tables" / "validation__claims.csv")
    tok = claims[claims.kind == "tokens"].iloc[0]  # otb reaches the threshold 2x faster
    assert tok["estimate"] > 0.2 and tok["verdict"] in ("confirmed", "refuted", "undecided")


@pytest.mark.slow
def test_tiny_grid_sharded_resumed_and_reported(tmp_path, monkeypatch):
    """The same on the real training loop (micro policy at random init, tiny budgets)."""
    monkeypatch.setenv("VARBENCH_CACHE", str(tmp_path / "cache"))
    _check_grid_end_to_end(tmp_path, monkeypatch, _tiny_grid())


def _check_grid_end_to_end(tmp_path, monkeypatch, cfg):
    out, rep = tmp_path / "work", tmp_path / "report"
    text = V.run_validation(cfg, out, shard=(1, 2), progress=False)
    assert "shard 1/2: 7 of 14 runs" in text and not (out / "report.md").exists()
    with pytest.raises(UsageError, match="7 of 14 runs are not finished"):
        V.run_validation(cfg, out, report_only=True, report_dir=rep)
    V.run_validation(cfg, out, shard=(2, 2), progress=False)
    timing = V.timing_from_runs(out)
    assert len(timing) == 13 and (timing["wall_s"] > 0).all()  # the probe run is left out
    est, fast = V.estimate_wall(cfg, timing), V.estimate_wall(cfg, timing, speedup=3.0)
    assert est["jobs"] == 14 and fast["total_s"] == pytest.approx(est["total_s"] / 3)
    assert "estimated wall time at 3x" in V.plan_text(cfg, timing, speedups=(1.0, 3.0))

    monkeypatch.setattr(V, "train", lambda *a, **k: pytest.fail("retrained a finished run"))
    summary = V.run_validation(cfg, out, report_only=True, report_dir=rep, progress=False)
    for name in ("report.md", "report.html", "summary.json", "validation_summary.md"):
        assert (rep / name).is_file()
    assert list((rep / "figures").glob("*.png"))
    assert not (rep / "runs").exists() and not list(rep.rglob("*.pt"))  # no caches, no ckpts
    claims = pd.read_csv(rep / "tables" / "validation__claims.csv")
    assert set(claims["kind"]) == {"tokens", "compute", "proxy", "stability", "prediction"}
    assert set(claims["verdict"]) <= {"confirmed", "refuted", "undecided"}
    assert list(claims.loc[claims.kind == "compute", "metric"]) == ["tokens", "wall_s"]
    pred = claims[claims.kind == "prediction"].iloc[0]
    assert pred["verdict"] == "undecided" and pred["n_a"] == 4  # 4 cells < 10
    verdicts = json.loads((rep / "summary.json").read_text())["analyses"][0]["summary"][
        "verdicts"]
    assert len(verdicts) == len(claims)
    md = (rep / "report.md").read_text()
    assert all(v.upper() + ":" in md for v in claims["verdict"])
    assert "Verdict rule (saving)" in md and "Kaplan-Meier" in summary
    assert "Holm-adjusted one-sided p" in md and "95% t CI" in md
    stab = pd.read_csv(rep / "tables" / "validation__stability.csv")
    assert {"collapsed_outcome", "surge_score", "flag_surge", "collapsed"} <= set(stab.columns)
    assert (out / "prediction").is_dir()  # the variance cells are cached with the runs


def test_the_entropy_flag_is_reported_not_counted_as_a_collapse():
    """A run that learns (final accuracy high) but whose entropy fell below the live floor is
    not a collapse, nor is a run the surge detector flags while it learns (a surge is its own
    measure); a run whose accuracy collapsed is, with or without a flag. The headlines give the
    entropy flag's rate on both kinds of run; stability claims count either measure."""
    cfg = _tiny_grid(surge_factor=5.0)
    keys = dict(task="sort", scheme="otb", G=4, variant="")
    runs = [(0, 0.9, 3), (1, 0.9, 0), (2, 0.9, 0), (3, 0.05, 0), (4, 0.05, 2)]
    stab = pd.DataFrame([{**keys, "seed": s, "entropy_collapse_steps": e} for s, _, e in runs])
    stab.loc[[1, 2], "scheme"] = "normalized"
    # seed 2 learns, with one gradient-norm spike 50x its trailing median
    traces = pd.DataFrame([{**keys, "seed": s, "step": k,
                            "grad_norm": 50.0 if (s, k) == (2, 25) else 1.0 + 0.01 * k}
                           for s, _, _ in runs for k in range(1, 30)])
    traces.loc[traces.seed.isin([1, 2]), "scheme"] = "normalized"
    t2t = stab[["task", "scheme", "G", "variant", "seed"]].assign(
        final_acc_sampled=[a for _, a, _ in runs])
    out, calib = V._stability(cfg, stab, traces, t2t, {"sort": 0.4})
    assert out["collapsed"].tolist() == [False, False, False, True, True]
    assert out["flag_entropy"].tolist() == [True, False, False, False, True]
    assert out["flag_surge"].tolist() == [False, False, True, False, False]
    assert (calib["entropy_flagged_healthy"], calib["entropy_flagged_collapsed"]) == (1, 1)
    heads, _ = V._headlines(cfg, pd.DataFrame(columns=["claim"]), {"sort": 0.4},
                            {"sort": 0.58}, out, calib, pd.DataFrame())
    text = {h.key: h.text for h in heads}
    assert "fired on 1 of the 3 runs that did not collapse" in text["collapse/entropy_flag_fpr"]
    assert text["collapse/runs"].startswith("2 of 5 runs collapsed")
    both = {"kind": "stability", "a": ["otb/4"], "b": ["normalized/4"], "tasks": ["sort"]}
    col = V._stability_claim(cfg, both, out)
    assert (col["collapsed_a"], col["collapsed_b"], col["measure"]) == (2, 0, "collapse")
    assert col["claim"] == "collapse rate of normalized/4 minus otb/4 on sort"
    surge = V._stability_claim(cfg, {**both, "measure": "surge"}, out)
    assert (surge["collapsed_a"], surge["collapsed_b"]) == (0, 1)
    assert surge["claim"].startswith("surge-flag rate of") and "1/2 vs 0/3 runs flagged" in (
        surge["note"])
    bad = replace(cfg, claims=({**both, "measure": "entropy"},))
    with pytest.raises(ValueError, match="measure.*'entropy'.*'collapse'"):
        V._check(bad)
