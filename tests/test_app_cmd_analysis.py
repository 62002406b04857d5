"""The analysis subcommands are one-case suites: the same executor, the same validation."""

from __future__ import annotations

import json

import pandas as pd
import pytest

import varbench.app.specs as specs
from varbench.app.cli import main
from varbench.app.runner import run_suite

PROXY = ["--preset", "micro", "--states", "random", "--task", "sort", "--knob", "n=2",
         "--prompts", "2", "-G", "2", "--boot", "10", "--seed", "1", "--no-progress"]


def test_cancellation_applies_its_knobs(tmp_path, monkeypatch):
    """Regression: `varbench cancellation --knob ...` used to be accepted and ignored."""
    seen = []
    real = specs.resolve_task

    def spy(spec, knobs=None):
        seen.append((spec, dict(knobs or {})))
        return real(spec, knobs)

    monkeypatch.setattr(specs, "resolve_task", spy)
    code = main(["cancellation", "--preset", "micro", "--states", "random", "--tasks", "arith",
                 "--knob", "digits=2", "--prompts", "1", "-G", "2", "--inner-steps", "0",
                 "--sketch-dim", "0", "--no-progress", "--out", str(tmp_path / "c")])
    assert code == 0
    # resolved twice with the knobs: validated when the case is parsed, then built to run
    assert seen == [("arith", {"digits": 2})] * 2
    summary = json.loads((tmp_path / "c" / "summary.json").read_text())
    assert summary["analyses"][0]["provenance"]["config"]["knobs"] == {"digits": 2}


def test_cancellation_rejects_an_unknown_knob_before_any_work(tmp_path, capsys):
    code = main(["cancellation", "--preset", "micro", "--states", "random", "--tasks", "arith",
                 "--knob", "nope=2", "--out", str(tmp_path / "c")])
    assert code == 2
    assert "nope" in capsys.readouterr().err
    assert not (tmp_path / "c" / "summary.json").exists()


def test_proxy_command_and_suite_case_share_one_executor(tmp_path):
    assert main(["proxy", *PROXY, "--out", str(tmp_path / "cli")]) == 0
    suite = tmp_path / "s.toml"
    suite.write_text("""
[suite]
name = "one"
[[cases]]
name = "proxy"
kind = "proxy"
preset = "micro"
states = ["random"]
task = "sort"
knobs = { n = 2 }
n_prompts = 2
G = 2
n_boot = 10
seed = 1
""")
    run_suite(suite, tmp_path / "suite", progress=False)
    for table in ("correlations", "tokens"):
        a = pd.read_csv(tmp_path / "cli" / "tables" / f"proxy__{table}.csv")
        b = pd.read_csv(tmp_path / "suite" / "tables" / f"proxy__{table}.csv")
        pd.testing.assert_frame_equal(a, b)


@pytest.mark.parametrize("args,message", [
    (["variance", "--schemes", "bogus"], r"'bogus' is not valid; choose one of"),
    (["variance", "-G", "0"], r"G"),
    (["proxy", "--task", "nope"], r"'nope' is not valid"),
    (["proxy", "--policy", "/no/such/dir"], r"checkpoint directory"),
])
def test_bad_flags_exit_2_with_one_line(tmp_path, capsys, args, message):
    import re

    code = main([*args, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(message, err), err
    assert len(err.strip().splitlines()) == 1
