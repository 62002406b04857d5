"""varbench.analysis.validate: the experiment grid, its checks before any training, the run
configurations and the stability statistics (the grid run, sharded, resumed and reported:
tests/test_app_runner_validate.py; through the CLI: tests/test_app_cmd_train.py)."""

from __future__ import annotations

from dataclasses import replace
from importlib import import_module

import pandas as pd
import pytest
from _fixtures_validate import tiny_grid

from varbench._util.checks import UsageError
from varbench.analysis import validate as V
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
    not a collapse, nor is a run the surge detector flags while it learns (a surge is its own
    measure); a run whose accuracy collapsed is, with or without a flag. The headlines give the
    entropy flag's rate on both kinds of run; stability claims count either measure."""
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
    surge = V._stability_claim(cfg, {**both, "measure": "surge"}, out)
    assert (surge["collapsed_a"], surge["collapsed_b"]) == (0, 1)
    assert surge["claim"].startswith("surge-flag rate of") and "1/2 vs 0/3 runs flagged" in (
        surge["note"])
    bad = replace(cfg, claims=({**both, "measure": "entropy"},))
    with pytest.raises(ValueError, match="measure.*'entropy'.*'collapse'"):
        V.check_grid(bad)
