"""varbench.analysis.validate: the experiment grid, its checks before any training, the run
configurations and the stability statistics (the grid run, sharded, resumed and reported:
tests/test_app_runner_validate.py; through the CLI: tests/test_app_cmd_train.py)."""

from __future__ import annotations

from dataclasses import replace
from importlib import import_module
from pathlib import Path

import pandas as pd
import pytest
from _fixtures_validate import tiny_grid

from varbench._util.checks import UsageError
from varbench.analysis import validate as V
from varbench.analysis import validate_stats as vs
from varbench.app.validation import run_validation


@pytest.fixture
def no_training(monkeypatch):
    loop = import_module("varbench.train.loop")  # by path: varbench.train is also a function

    monkeypatch.setattr(loop, "train", lambda *a, **k: pytest.fail("trained before checking"))


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
        run_validation(cfg, tmp_path / "out")
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


def test_an_arms_own_prompts_per_step_spaces_its_evaluations():
    cfg = V.ValidateConfig()  # eval_responses 512, base prompts_per_step 8
    arm = V._run_config(cfg, "sort", "otb", 4, 1, overrides=(("prompts_per_step", 2),))
    assert arm.prompts_per_step == 2
    assert arm.eval_every == 512 // (2 * 4)  # its own 8 responses a step, not the base's 32
    assert V._run_config(cfg, "sort", "otb", 4, 1).eval_every == 512 // (8 * 4)


def test_jobs_and_arms():
    cfg = tiny_grid()
    jobs = V.jobs_of(cfg)
    # core 2 x 2 x 2 seeds, arms 2 + 2 + 1 (own seeds), hacking 1
    assert len(jobs) == 8 + 5 + 1
    assert {j.arm for j in jobs if j.variant} == {"normalized/2/gspo", "normalized/2/gspo_mr"}
    gspo = next(j for j in jobs if j.variant == "gspo_mr")
    tc = V.job_config(cfg, gspo)
    assert (tc.task, tc.ratio, tc.transform, tc.G) == ("arith", "sequence", "min_replace", 2)
    long = V.job_config(cfg, next(j for j in jobs if j.task == "toolsum_long"))
    assert long.task == "toolsum" and dict(long.task_options) == {"k": 4}
    assert long.token_budget == 150
    more = V.jobs_of(tiny_grid(task_seeds={"sort": [0, 1, 2]}))
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
        run_validation(tiny_grid(**changes), tmp_path / "out")


def test_the_entropy_flag_is_reported_not_counted_as_a_collapse():
    """A run that learns (final accuracy high) but whose entropy fell below the live floor is
    not a collapse, nor is a run the surge detector flags while it learns (the surge flag is
    descriptive); a run whose accuracy collapsed is, with or without a flag. The headlines give
    the entropy flag's rate on both kinds of run; stability claims count collapses."""
    cfg = tiny_grid(surge_factor=5.0)
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
    bad = replace(cfg, claims=({**both, "measure": "entropy"},))
    with pytest.raises(ValueError, match="measure.*'entropy'.*'collapse'"):
        V.check_grid(bad)


def test_surge_flags_are_descriptive_never_a_claim():
    """Issue 31 point 4: the surge detector caught none of the grid's collapses and is
    calibrated on the runs a claim would compare: a surge claim is refused, naming why."""
    both = {"kind": "stability", "a": ["otb/4"], "b": ["normalized/4"], "measure": "surge"}
    with pytest.raises(UsageError, match="measure = 'surge'.*descriptively.*in-sample"):
        V.check_grid(tiny_grid(claims=(both,)))
    assert set(V.STABILITY_MEASURES) == {"collapse"}


def _proxy_row(tokens_a, tokens_b):
    seeds = range(len(tokens_a))
    a = pd.DataFrame({"seed": seeds, "tokens_to_threshold": tokens_a, "reached": True})
    b = pd.DataFrame({"seed": seeds, "tokens_to_threshold": tokens_b, "reached": True})
    c = {"kind": "proxy", "task": "sort", "a": "otb/2", "b": "otb/4"}
    return V._saving_claim(tiny_grid(budgets={"sort": 1000}), c, a, b, "tokens")


def test_equivalence_reads_not_detectably_worse_unless_it_clears_the_margin():
    """An undecided equivalence whose interval covers 0 is 'not detectably worse', never
    'equivalent'; one whose lower limit clears -margin is confirmed, without that reading."""
    loose = _proxy_row([300, 420, 250, 500, 330], [400, 310, 450, 280, 390])
    assert loose["verdict"] == "undecided" and loose["ci_lo"] < -0.15 < 0 < loose["ci_hi"]
    text = V.claim_sentence(loose)
    assert text.startswith("UNDECIDED") and "not detectably worse" in text
    assert "equivalen" not in text.lower()
    tight = _proxy_row([400, 402, 398, 401, 399], [400, 401, 399, 402, 398])
    assert tight["verdict"] == "confirmed" and tight["ci_lo"] > -0.15
    assert "not detectably worse" not in V.claim_sentence(tight)


# --- the shipped claims suites (issue 31, point 1: controls, GSPO updates, seeds) ---------------

ROOT = Path(__file__).resolve().parents[1]
# The power plan (validate_stats.power_plan, t interval, half-width 0.15) of otb/4 against the
# group baselines at G = 4, with the published grid (reports/claims/, 2026-12-01) as the pilot:
# the seeds the registered grid must give each arm.
PLANNED_SEEDS = {("sort", "otb/4"): 11, ("sort", "centered/4"): 11, ("sort", "normalized/4"): 8,
                 ("sort", "rloo/4"): 6, ("toolsum", "otb/4"): 28, ("toolsum", "centered/4"): 9,
                 ("toolsum", "normalized/4"): 28, ("toolsum", "rloo/4"): 27}


@pytest.mark.parametrize("name", ["otb-claims", "otb-claims-smoke"])
def test_shipped_claims_suites_have_their_controls_and_follow_their_preregistration(
        name, monkeypatch):
    """Every task with token claims has otb/4 against each group scheme at G = 4; sort (and
    toolsum in the real grid) has an equal-updates arm (as many responses per step as G = 4)
    that otb/4 and the family's G = 4 arm are compared with; every GSPO arm takes several
    updates per batch; no claim rests on the surge flag; the pre-registration lists no
    deviation of the suite from it."""
    from varbench.analysis import validate_prereg as P
    from varbench.app.cmd_train import suite_validate_config

    monkeypatch.chdir(ROOT)  # the preregistration path is relative to the repository root
    cfg = suite_validate_config(f"suites/{name}.toml", None)
    V.check_grid(cfg)
    block = P.report_block(cfg.preregistration, V.config_dict(cfg), V.registered_config)
    assert block["deviations"] == [] and len(block["sha256"]) == 64
    claims = [(c["task"], c["a"], c["b"], c.get("claimed")) for c in cfg.claims
              if c["kind"] == "tokens"]
    group = [s for s in cfg.schemes if s != "otb"]
    for task in {t for t, *_ in claims}:
        for s in group:
            assert (task, "otb/4", f"{s}/4", 0.0) in claims, (task, s)
    jobs = [j for j in V.jobs_of(cfg) if j.reward is None]
    pps = cfg.base["prompts_per_step"]
    eq_tasks = ["sort", "toolsum"] if name == "otb-claims" else ["sort"]
    for task in eq_tasks:
        eq = [j for j in jobs if j.task == task and j.variant == "eq_updates"]
        assert eq, task
        tc = V.job_config(cfg, eq[0])
        assert tc.G > 4 and tc.prompts_per_step * tc.G == pps * 4
        assert (task, "otb/4", eq[0].arm, None) in claims
        assert (task, f"{eq[0].scheme}/4", eq[0].arm, 0.0) in claims
    gspo = [j for j in jobs if V.job_config(cfg, j).ratio == "sequence"]
    assert {j.variant for j in gspo} == {"gspo4", "gspo4_mr", "gspo4_ao"}
    for j in gspo:
        tc = V.job_config(cfg, j)
        assert tc.epochs * tc.minibatches > 1 and (tc.clip_low, tc.clip_high) == (3e-4, 4e-4)
    assert not any(c.get("measure") == "surge" for c in cfg.claims)
    if name == "otb-claims":
        seeds: dict[tuple[str, str], set[int]] = {}
        for j in jobs:
            seeds.setdefault((j.task, j.arm), set()).add(j.seed)
        for arm, n in PLANNED_SEEDS.items():
            assert len(seeds[arm]) >= n, (arm, len(seeds[arm]), n)


def test_a_claims_caveat_is_part_of_its_sentence():
    row = _proxy_row([400, 402, 398, 401, 399], [400, 401, 399, 402, 398])
    row["caveat"] = "sort: warm start already solves the greedy problem"
    assert V.claim_sentence(row).endswith(
        "(sort: warm start already solves the greedy problem).")


def test_a_restricted_claim_counts_censored_runs_in_its_estimand():
    """The same censored runs: a mean claim is undecided (the saving is an upper bound), a
    restricted-mean claim is confirmed by its interval, says so in its claim and note, and
    carries its own rule; a restricted compute claim or an unknown estimand is refused."""
    seeds = range(8)
    a = pd.DataFrame({"seed": seeds, "tokens_to_threshold": [300, 320, 280, 310, 290, 305, 1000,
                                                            295],
                      "reached": [True] * 6 + [False, True]})
    b = pd.DataFrame({"seed": seeds, "tokens_to_threshold": [1000] * 6 + [900, 950],
                      "reached": [False] * 6 + [True, True]})
    cfg = tiny_grid(budgets={"sort": 1000})
    c = {"kind": "tokens", "task": "sort", "a": "otb/4", "b": "otb/2", "claimed": 0.0}
    mean = V._saving_claim(cfg, c, a, b, "tokens")
    rest = V._saving_claim(cfg, {**c, "estimand": "restricted"}, a, b, "tokens")
    assert mean["estimate"] == rest["estimate"] and mean["ci_lo"] > 0
    assert mean["verdict"] == "undecided" and "upper bound" in mean["note"]
    assert rest["verdict"] == "confirmed" and "bound" not in rest["note"].replace("no bound", "")
    assert "restricted mean tokens-to-threshold up to the budget" in rest["claim"]
    assert rest["rule"] == vs.RESTRICTED_RULES["saving_restricted"]
    assert "1/8 of otb/4 censored (counted up to the budget" in rest["note"]
    for bad, msg in (({**c, "estimand": "median"}, r"claims estimand='median' is not valid"),
                     ({**c, "kind": "compute", "estimand": "restricted"},
                      r"estimand = 'restricted' .* not valid for kind 'compute'")):
        with pytest.raises(UsageError, match=msg):
            V.check_grid(tiny_grid(claims=({**bad, "a": "otb/4", "b": "otb/2"},)))
