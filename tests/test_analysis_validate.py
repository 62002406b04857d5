"""varbench.analysis.validate: the experiment grid, its checks before any training, the run
configurations and the reuse of finished runs (the experiment end to end:
tests/test_app_cmd_train.py)."""

from __future__ import annotations

import json

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

    calls = []

    class Result:
        records = pd.DataFrame({"step": [0, 1]})
        stopped = "budget"

    monkeypatch.setattr(V, "train", lambda cfg, run_dir, progress: calls.append(cfg) or Result)
    changed = tc.replace(seed=1)
    assert list(V._run(changed, run)["step"]) == [0, 1] and calls == [changed]
    assert json.loads((run / "done.json").read_text())["config"] == changed.to_dict()
