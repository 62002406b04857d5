"""`varbench train / validate` end to end on a grid small enough for the default test run."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from varbench._util.checks import UsageError
from varbench.app.cli import main


def test_train_and_validate_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VARBENCH_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    try:
        rc = main(["train", "--no-warm-start", "--steps", "2", "--eval-every", "1",
                   "--eval-prompts", "4", "-G", "2", "--prompts-per-step", "2",
                   "--knob", "n=2", "--checkpoint-every", "1",
                   "--out", str(tmp_path / "run")])
        assert rc == 0
        assert "held-out accuracy" in capsys.readouterr().out
        assert json.loads((tmp_path / "run" / "config.json").read_text())["task_options"] == {
            "n": 2}
        # --resume without flags continues with the run's own settings (here: 2 more steps)
        assert main(["train", "--resume", "--steps", "4", "--out", str(tmp_path / "run")]) == 0
        assert "(4 steps" in capsys.readouterr().out
        # issue 29: a new run over an existing one is refused; --overwrite sets it aside
        run = tmp_path / "run"
        before = (run / "records.csv").read_bytes()
        assert main(["train", "--no-warm-start", "--steps", "1", "--out", str(run)]) == 2
        assert "already holds a run" in capsys.readouterr().err
        assert (run / "records.csv").read_bytes() == before  # nothing replaced
        assert main(["train", "--resume", "--overwrite", "--out", str(run)]) == 2
        assert main(["train", "--no-warm-start", "--steps", "1", "--eval-every", "1",
                     "--eval-prompts", "2", "-G", "2", "--prompts-per-step", "2",
                     "--knob", "n=2", "--overwrite", "--out", str(run)]) == 0
        assert "moved to" in capsys.readouterr().out
        assert (tmp_path / "run.replaced-1" / "records.csv").read_bytes() == before
        assert (tmp_path / "run.replaced-1" / "checkpoints").is_dir()
        assert main(["train", "--scheme", "nope", "--out", str(tmp_path / "x")]) == 2
        assert "scheme='nope'" in capsys.readouterr().err
        out = tmp_path / "val"
        rc = main(["validate", "--tasks", "sort", "--schemes", "normalized,otb", "--gs", "4",
                   "--seeds", "0", "--budget", "sort=300", "--no-prediction",
                   "--out", str(out)])
        assert rc == 0
    finally:
        torch.set_num_threads(threads)
    text = (out / "validation_summary.md").read_text()
    assert "cannot test: no runs of normalized/32" in text  # G=32 was not run
    assert "reward hacking probe" in text
    t2t = pd.read_csv(out / "tables" / "validation__tokens_to_threshold.csv")
    assert set(t2t["scheme"]) == {"normalized", "otb"} and (t2t["final_tokens"] >= 300).all()
    assert (out / "report.md").exists() and (out / "figures").is_dir()
    # A rerun reloads finished runs instead of training again.
    case, = (out / "cases").glob("sort.otb_G4_s0-*.json")
    mtime = case.stat().st_mtime
    main(["validate", "--tasks", "sort", "--schemes", "normalized,otb", "--gs", "4",
          "--seeds", "0", "--budget", "sort=300", "--no-prediction", "--out", str(out)])
    assert case.stat().st_mtime == mtime


def test_claims_suites_give_valid_grids(tmp_path, capsys):
    """The shipped claims plans build a ValidateConfig whose every run and claim is valid."""
    from pathlib import Path

    import pytest

    from varbench._util.checks import UsageError
    from varbench.analysis import validate as V
    from varbench.app.cmd_train import suite_validate_config
    from varbench.app.validation import case_name

    root = Path(__file__).resolve().parents[1] / "suites"
    for name in ("otb-claims.toml", "otb-claims-smoke.toml"):
        cfg = suite_validate_config(str(root / name), None)
        V.check_grid(cfg)  # names, arms, claims, every run's TrainConfig
        kinds = {c["kind"] for c in cfg.claims}
        assert {"tokens", "compute", "stability"} <= kinds
        assert len(V.jobs_of(cfg)) == len({case_name(j) for j in V.jobs_of(cfg)})
    full = suite_validate_config(str(root / "otb-claims.toml"), "claims-training")
    # the prediction check needs >= 10 scheme x G cells per task
    assert len(full.schemes) * len(full.Gs) >= full.min_prediction_cells == 10
    with pytest.raises(UsageError, match="no validate case named 'nope'"):
        suite_validate_config(str(root / "otb-claims.toml"), "nope")
    assert main(["validate", "--suite", str(root / "otb-claims.toml"), "--shard", "1/2",
                 "--report-only", "--out", str(tmp_path)]) == 2
    assert "exclude each other" in capsys.readouterr().err


# --- validate: the user's task and checkpoint, bounds, code in a suite (issue 29) -------------

@pytest.mark.parametrize("frac", ["2", "nan", "0", "-0.5", "inf"])
def test_validate_refuses_a_threshold_frac_outside_0_1(tmp_path, capsys, frac):
    """Checked first: no --budget or task is asked for before it."""
    assert main(["validate", "--threshold-frac", frac, "--tasks", "nope",
                 "--out", str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err
    assert "--threshold-frac=" in err and "expected a finite number in (0, 1]" in err
    assert not (tmp_path / "v").exists()


def test_validate_says_which_tasks_it_accepts_before_asking_for_a_budget(tmp_path, capsys):
    assert main(["validate", "--tasks", "gsm.jsonl", "--out", str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err
    assert "tasks='gsm.jsonl' is not valid" in err and "--task LABEL=SPEC" in err
    assert "budget" not in err


def test_validate_takes_the_users_task_and_checkpoint(tmp_path, capsys):
    """--task LABEL=SPEC (a data file) with --knob, a checkpoint directory as --policy: the grid
    is built on them and checked (its runs would be trained; here --report-only stops at
    'missing runs', past every check)."""
    import _fixtures_user as fu

    from varbench.analysis.validate import jobs_of
    from varbench.app.cli import build_parser
    from varbench.app.cmd_train import validate_config
    from varbench.app.validation import run_validation

    data = tmp_path / "w.jsonl"
    data.write_text('{"question": "what is 2 + 2?", "answer": "4", "solution": "4"}\n'
                    '{"question": "what is 1 + 2?", "answer": "3", "solution": "3"}\n')
    ck = fu.eot_checkpoint(tmp_path / "ck")
    base = ["validate", "--reduced", "--task", f"w={data}", "--policy", str(ck),
            "--out", str(tmp_path / "v")]
    # no demonstrations: refused up front, naming the knob that gives them
    assert main(base) == 2
    assert "no demonstrations" in capsys.readouterr().err
    args = build_parser().parse_args([*base, "--knob", "solution_key=solution", "--budget",
                                      "w=500"])
    cfg = validate_config(args)
    assert cfg.tasks == ("w",) and cfg.task_specs["w"] == {"task": str(data),
                                                          "solution_key": "solution"}
    assert cfg.base["policy"] == str(ck) and cfg.base["warm_start_dir"] is True
    assert {j.task for j in jobs_of(cfg)} == {"w"}
    with pytest.raises(UsageError, match="missing"):
        run_validation(cfg, tmp_path / "v", report_only=True)


@pytest.mark.parametrize("args, message", [
    (["--task", "w"], "expected LABEL=SPEC"),
    (["--task", "../x=sort"], "--task label"),
    (["--task", "w=nosuch"], "task='nosuch' is not valid"),
    (["--knob", "n=2"], "--knob applies to the tasks given with --task"),
])
def test_validate_task_flags_are_checked(tmp_path, capsys, args, message):
    assert main(["validate", *args, "--out", str(tmp_path / "v")]) == 2
    assert message in capsys.readouterr().err


def test_validate_suite_naming_code_needs_allow_code(tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    suite = tmp_path / "s.toml"
    suite.write_text("""
[suite]
name = "mine"
[[cases]]
name = "grid"
kind = "validate"
tasks = ["echo"]
budgets = { echo = 300 }
task_specs = { echo = { task = "_plugin_tasks:EchoTask" } }
""")
    out = tmp_path / "v"
    assert main(["validate", "--suite", str(suite), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "names code" in err and "_plugin_tasks:EchoTask" in err and "--allow-code" in err
    (tmp_path / "empty").mkdir()
    # with --allow-code the grid is read and checked: --plan then asks for measured runs
    assert main(["validate", "--suite", str(suite), "--allow-code", "--plan", "--timing-from",
                 str(tmp_path / "empty"), "--out", str(out)]) == 2
    assert "no measured runs" in capsys.readouterr().err


def test_train_config_file_naming_code_needs_allow_code(tmp_path, monkeypatch, capsys):
    """A --config file is data, like a suite: a MODULE:ATTR it names (task, scheme, verifier)
    or trust_remote_code = true is refused with the list of entries unless --allow-code is
    given, before anything is imported; the same flag given on the command line needs no
    opt-in (issue 32)."""
    mod = tmp_path / "cfg_hostile_mod.py"
    marker = tmp_path / "imported"
    mod.write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n"
                   "def adv(rewards, mask):\n    return rewards\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = tmp_path / "run.toml"
    cfg.write_text('scheme = "cfg_hostile_mod:adv"\ntrust_remote_code = true\n'
                   '[task_options]\nverifier = "cfg_hostile_mod:adv"\n')
    out = tmp_path / "run"
    assert main(["train", "--config", str(cfg), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "this config names code" in err and "--allow-code" in err, err
    for entry in ("'scheme' = 'cfg_hostile_mod:adv'", "'trust_remote_code' = True",
                  "'task_options.verifier' = 'cfg_hostile_mod:adv'"):
        assert entry in err, err
    assert not marker.exists() and not out.exists()  # nothing imported, nothing written
    # with --allow-code the file's code is reached (here: imported, then the next check)
    cfg.write_text('scheme = "cfg_hostile_mod:adv"\nagg = "bogus"\n')
    assert main(["train", "--config", str(cfg), "--allow-code", "--out", str(out)]) == 2
    assert marker.exists() and "this config names code" not in capsys.readouterr().err
