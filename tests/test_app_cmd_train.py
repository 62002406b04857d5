"""`varbench train / validate` end to end on a grid small enough for the default test run."""

from __future__ import annotations

import json

import pandas as pd
import torch

from varbench.app.cli import main


def test_train_and_validate_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VARBENCH_CACHE", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    try:
        rc = main(["train", "--no-warm-start", "--steps", "2", "--eval-every", "1",
                   "--eval-prompts", "4", "-G", "2", "--prompts-per-step", "2",
                   "--task-option", "n=2", "--checkpoint-every", "1",
                   "--out", str(tmp_path / "run")])
        assert rc == 0
        assert "held-out accuracy" in capsys.readouterr().out
        assert json.loads((tmp_path / "run" / "config.json").read_text())["task_options"] == {
            "n": 2}
        # --resume without flags continues with the run's own settings (here: 2 more steps)
        assert main(["train", "--resume", "--steps", "4", "--out", str(tmp_path / "run")]) == 0
        assert "(4 steps" in capsys.readouterr().out
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
    mtime = (out / "runs" / "sort" / "otb_G4_s0" / "records.csv").stat().st_mtime
    main(["validate", "--tasks", "sort", "--schemes", "normalized,otb", "--gs", "4",
          "--seeds", "0", "--budget", "sort=300", "--no-prediction", "--out", str(out)])
    assert (out / "runs" / "sort" / "otb_G4_s0" / "records.csv").stat().st_mtime == mtime
