"""The validation grid runs through the suite runner: its runs are ``train`` cases with the
suites' shards, case cache, resume and merge (varbench.app.validation, varbench.app.runner)."""

from __future__ import annotations

import json
from importlib import import_module

import pandas as pd
import pytest
from _fixtures_validate import fake_train, fake_variance, tiny_grid

from varbench._util.checks import UsageError
from varbench.analysis import validate as V
from varbench.analysis.validate_plan import estimate_wall, plan_text, timing_from_runs
from varbench.app.runner import merge_outputs, shard_cases
from varbench.app.validation import case_name, finished_runs, grid_cases, run_validation


@pytest.fixture
def fake(monkeypatch):
    """Synthetic training and variance analysis; returns the configs trained, in order."""
    import varbench.analysis.variance as variance
    loop = import_module("varbench.train.loop")  # by path: varbench.train is also a function

    calls = []

    def train(tc, run_dir, resume=False, progress=False):
        calls.append(tc)
        return fake_train(tc, run_dir)

    monkeypatch.setattr(loop, "train", train)
    monkeypatch.setattr(variance, "estimator_variance", fake_variance)
    monkeypatch.setattr(V, "policy_for", lambda tc, task: None)
    return calls


def _tables(d) -> dict[str, pd.DataFrame]:
    return {n: pd.read_csv(d / "tables" / f"validation__{n}.csv")
            for n in ("claims", "tokens_to_threshold", "stability")}


def test_grid_cases_are_train_cases_one_per_run():
    cfg = tiny_grid()
    cases, jobs = grid_cases(cfg), V.jobs_of(cfg)
    assert len(cases) == len(jobs) == 14 and {c.kind for c in cases} == {"train"}
    assert [c.index for c in cases] == list(range(14))
    assert len({c.key for c in cases}) == len({c.name for c in cases}) == 14
    gspo = next(c for c, j in zip(cases, jobs, strict=True) if j.variant == "gspo_mr")
    assert gspo.name == "arith.normalized_G2_gspo_mr_s0"
    assert (gspo.params["ratio"], gspo.params["transform"]) == ("sequence", "min_replace")
    assert case_name(jobs[-1]) == "hacking.positional_s0"
    shards = [shard_cases(cases, (i, 3)) for i in (1, 2, 3)]
    assert sorted(c.key for s in shards for c in s) == sorted(c.key for c in cases)
    assert shards[1][0] == cases[1] and shards[1][1] == cases[4]
    # any change of a run's settings is a new case key: a finished run is never reused for it
    other = grid_cases(tiny_grid(base={**tiny_grid().base, "lr": 2e-3}))
    assert not {c.key for c in other} & {c.key for c in cases}


@pytest.mark.parametrize("shard", [(3, 2), (0, 2), (1, 0), ("1", 2), (1,), "1/2"])
def test_an_invalid_shard_is_refused_naming_it(tmp_path, fake, shard):
    with pytest.raises(UsageError, match=r"shard=.* is not valid") as err:
        run_validation(tiny_grid(), tmp_path / "out", shard=shard)
    assert repr(shard) in str(err.value)
    assert not (tmp_path / "out").exists() and fake == []


def test_sharded_grid_equals_unsharded_and_merges(tmp_path, fake):
    cfg = tiny_grid()
    whole = tmp_path / "whole"
    run_validation(cfg, whole, progress=False)
    assert len(fake) == 14
    one = tmp_path / "one"
    text = run_validation(cfg, one, shard=(1, 2), progress=False)
    assert "shard 1/2: 7 of 14 runs" in text and not (one / "report.md").exists()
    with pytest.raises(UsageError, match="7 of 14 runs are not finished"):
        run_validation(cfg, one, report_only=True, report_dir=tmp_path / "r")
    two = tmp_path / "two"
    run_validation(cfg, two, shard=(2, 2), progress=False)
    assert len(fake) == 28
    # the shards' case files merge like a suite's, into the same report as one process
    merged = tmp_path / "merged"
    merge_outputs([one, two], merged)
    assert len(fake) == 28  # nothing retrained
    for name in ("report.md", "report.html", "summary.json", "validation_summary.md"):
        assert (merged / name).is_file()
    for name, table in _tables(whole).items():
        pd.testing.assert_frame_equal(_tables(merged)[name], table, obj=name)
    manifest = json.loads((merged / "suite.json").read_text())
    assert manifest["shard"] is None and len(manifest["jobs"]) == 14
    # shard 2 copied into shard 1's directory: --report-only there gives the same tables
    for f in (two / "cases").glob("*.json"):
        (one / "cases" / f.name).write_bytes(f.read_bytes())
    run_validation(cfg, one, report_only=True, report_dir=tmp_path / "r", progress=False)
    for name, table in _tables(whole).items():
        pd.testing.assert_frame_equal(_tables(tmp_path / "r")[name], table, obj=name)
    assert len(fake) == 28


def test_resume_skips_finished_runs_and_reruns_an_interrupted_one(tmp_path, fake,
                                                                  monkeypatch):
    loop = import_module("varbench.train.loop")  # by path: varbench.train is also a function

    cfg, out = tiny_grid(), tmp_path / "out"
    ok = loop.train

    def dies_on_third(tc, run_dir, resume=False, progress=False):
        if len(fake) == 2:
            fake.append(tc)
            raise KeyboardInterrupt  # killed mid-run: nothing cached for it
        return ok(tc, run_dir, resume, progress)

    monkeypatch.setattr(loop, "train", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        run_validation(cfg, out, progress=False)
    assert len(list((out / "cases").glob("*.json"))) == 2
    interrupted = fake[2]
    monkeypatch.setattr(loop, "train", ok)
    del fake[:]
    run_validation(cfg, out, progress=False)
    assert len(fake) == 12 and fake[0] == interrupted  # the two finished runs were not redone
    del fake[:]
    summary = run_validation(cfg, out, progress=False)
    assert fake == [] and "Kaplan-Meier" in summary


def test_grid_report_and_plan(tmp_path, fake):
    """The report's content and the plan, from the cached runs (real loop: the slow test)."""
    _check_grid_end_to_end(tmp_path, tiny_grid(), fake)
    claims = pd.read_csv(tmp_path / "report" / "tables" / "validation__claims.csv")
    tok = claims[claims.kind == "tokens"].iloc[0]  # otb reaches the threshold 2x faster
    assert tok["estimate"] > 0.2 and tok["verdict"] in ("confirmed", "refuted", "undecided")
    # synthetic runs reach the threshold: the saving claims have p-values, Holm-adjusted
    assert claims["p_confirm_holm"].notna().any()


@pytest.mark.slow
def test_tiny_grid_sharded_resumed_and_reported(tmp_path, monkeypatch):
    """The same on the real training loop (micro policy at random init, tiny budgets)."""
    monkeypatch.setenv("VARBENCH_CACHE", str(tmp_path / "cache"))
    _check_grid_end_to_end(tmp_path, tiny_grid(), None)


def _check_grid_end_to_end(tmp_path, cfg, calls):
    out, rep = tmp_path / "work", tmp_path / "report"
    text = run_validation(cfg, out, shard=(1, 2), progress=False)
    assert "shard 1/2: 7 of 14 runs" in text and not (out / "report.md").exists()
    run_validation(cfg, out, shard=(2, 2), progress=False)
    timing = timing_from_runs(finished_runs(out))
    assert len(timing) == 13 and (timing["wall_s"] > 0).all()  # the probe run is left out
    est, fast = estimate_wall(cfg, timing), estimate_wall(cfg, timing, speedup=3.0)
    assert est["jobs"] == 14 and fast["total_s"] == pytest.approx(est["total_s"] / 3)
    assert "estimated wall time at 3x" in plan_text(cfg, timing, speedups=(1.0, 3.0))
    trained = None if calls is None else len(calls)
    summary = run_validation(cfg, out, report_only=True, report_dir=rep, progress=False)
    assert calls is None or len(calls) == trained  # --report-only trains nothing
    for name in ("report.md", "report.html", "summary.json", "validation_summary.md"):
        assert (rep / name).is_file()
    assert list((rep / "figures").glob("*.png"))
    assert not (rep / "cases").exists() and not list(rep.rglob("*.pt"))  # no caches, no ckpts
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
    assert "Verdict rule (saving)" in md and "Kaplan-Meier" in summary and "95% t CI" in md
    # The Holm sentence is written for the claims that have a p-value. A saving has none when
    # no run of either arm reached the threshold (all censored at the budget: saving 0, SE
    # 0), as on the real loop's random-init micro policy at these budgets.
    tested = "p_confirm_holm" in claims and bool(claims["p_confirm_holm"].notna().any())
    assert ("Holm-adjusted one-sided p" in md) == tested
    stab = pd.read_csv(rep / "tables" / "validation__stability.csv")
    assert {"collapsed_outcome", "surge_score", "flag_surge", "collapsed"} <= set(stab.columns)
    assert (out / "prediction").is_dir()  # the variance cells are cached with the runs
    # the toy caveats and the multiplicity statement (issue 31): every task's warm-start greedy
    # accuracy at step 0, from the curves; Holm's family named in the report
    cav = pd.read_csv(rep / "tables" / "validation__caveats.csv")
    curves = pd.read_csv(rep / "tables" / "validation__curves.csv")
    g0 = curves[curves.step == 0].groupby("task")["acc_greedy"].mean()
    assert cav.set_index("task")["greedy0"].to_dict() == pytest.approx(g0.to_dict())
    n_fam = int(claims["p_confirm"].notna().sum()) if "p_confirm" in claims else 0
    assert f"Multiplicity: Holm's step-down procedure over the family of {n_fam} " in md


def test_two_shards_may_run_at_once_into_one_directory(tmp_path, fake):
    """Each shard holds its own lock (README: two cores, one shard each into one --out); the
    same shard twice at once is refused, naming the directory."""
    from varbench._util.locks import BusyError, dir_lock

    cfg, out = tiny_grid(), tmp_path / "out"
    out.mkdir()
    with dir_lock(out, lock_file=out / ".varbench-shard-1-of-2.lock"):  # shard 1 is running
        run_validation(cfg, out, shard=(2, 2), progress=False)
        assert len(fake) == 7
        with pytest.raises(BusyError, match="output directory"):
            run_validation(cfg, out, shard=(1, 2), progress=False)
    run_validation(cfg, out, shard=(1, 2), progress=False)
    assert len(fake) == 14 and len(finished_runs(out)) == 14


def test_a_validate_case_in_a_suite_runs_its_grid_through_the_runner(tmp_path, fake):
    """A suite's ``validate`` case (suites/otb-claims-smoke.toml's kind) runs its grid as train
    cases inside its work directory and is itself one cached case."""
    from varbench.app.runner import run_suite

    suite = tmp_path / "s.toml"
    suite.write_text("""
[suite]
name = "grid"
[[cases]]
name = "claims"
kind = "validate"
tasks = ["sort"]
schemes = ["normalized", "otb"]
Gs = [2, 4]
seeds = [0, 1]
eval_responses = 4
budgets = { sort = 60 }
base = { policy = "micro", warm_start = false, prompts_per_step = 2, eval_prompts = 4, \
eval_samples = 1, agg = "token-mean", steps = 100000 }
claims = [{ kind = "tokens", task = "sort", a = "otb/4", b = "normalized/4" }]
hacking_rewards = ["positional"]
hacking_G = 2
hacking_seeds = [0]
prediction = false
""")
    out = tmp_path / "out"
    first = run_suite(suite, out, progress=False)
    assert first.computed == ["claims"] and len(fake) == 9  # 2 x 2 x 2 + the probe
    assert "sort: otb/4 vs normalized/4 (tokens-to-threshold)" in (out / "report.md").read_text()
    grid = next((out / "work").glob("claims-*/validation"))
    assert len(list((grid / "cases").glob("*.json"))) == 9
    again = run_suite(suite, out, progress=False)
    assert again.cached == ["claims"] and len(fake) == 9
