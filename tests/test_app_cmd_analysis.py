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

    def spying(name):
        real = getattr(specs, name)

        def spy(spec, knobs=None):
            seen.append((name, spec, dict(knobs or {})))
            return real(spec, knobs)
        monkeypatch.setattr(specs, name, spy)

    spying("check_task_spec")
    spying("resolve_task")
    code = main(["cancellation", "--preset", "micro", "--states", "random", "--tasks", "arith",
                 "--knob", "digits=2", "--prompts", "1", "-G", "2", "--inner-steps", "0",
                 "--sketch-dim", "0", "--no-progress", "--out", str(tmp_path / "c")])
    assert code == 0
    # with the knobs twice: validated when the case is parsed, then built to run
    assert seen == [("check_task_spec", "arith", {"digits": 2}),
                    ("resolve_task", "arith", {"digits": 2})]
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
    (["variance", "--sketch-dim", "flat"], r"--sketch-dim='flat' is not valid.*'auto'"),
    (["variance", "--interval", "bca"], r"interval.*'bca' is not valid.*'studentized'"),
    (["variance", "--exact", "always"], r"exact.*'always' is not valid.*'never'"),
    (["variance", "--level", "1.5"], r"level.*1.5 is not valid.*\(0, 1\)"),
    (["variance", "--target-rel-se", "0"], r"target_rel_se.*0.0 is not valid"),
    (["variance", "-M", "8", "--M-cap", "4"], r"M_cap=4 is not valid; expected an integer >= 8"),
    (["variance", "--table-limit", "0"], r"table_limit.*>= 1"),
    (["variance", "--n-boot", "0"], r"n_boot.*>= 1"),
    (["variance", "--sketch-seed", "-1"], r"sketch_seed.*>= 0"),
    (["variance", "--min-responses", "lots"], r"--min-responses='lots' is not valid.*'auto'"),
    (["variance", "--min-responses", "-5"], r"--min-responses='-5' is not valid"),
])
def test_bad_flags_exit_2_with_one_line(tmp_path, capsys, args, message):
    import re

    code = main([*args, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(message, err), err
    assert len(err.strip().splitlines()) == 1


def test_variance_flags_reach_the_analysis(tmp_path):
    """Every statistics knob of `varbench variance` is passed to the analysis (its config)."""
    out = tmp_path / "v"
    code = main(["variance", "--preset", "micro", "--states", "random", "--task", "sort",
                 "--knob", "n=1", "--schemes", "centered", "rloo", "-G", "2", "-M", "4",
                 "--M-cap", "8", "--target-rel-se", "0.5", "--sketch-dim", "auto",
                 "--sketch-seed", "3", "--interval", "normal", "--n-boot", "20", "--level",
                 "0.9", "--exact", "never", "--table-limit", "10", "--min-responses", "0",
                 "--no-progress",
                 "--no-cache", "--out", str(out)])
    assert code == 0
    cfg = json.loads((out / "summary.json").read_text())["analyses"][0]["provenance"]["config"]
    assert cfg["sketch_dim"] is None  # auto: micro has < 200k parameters, so flat vectors
    assert {k: cfg[k] for k in ("sketch_seed", "M_cap", "target_rel_se", "interval", "n_boot",
                                "level", "exact", "table", "min_responses")} == {
        "sketch_seed": 3, "M_cap": 8, "target_rel_se": 0.5, "interval": "normal",
        "n_boot": 20, "level": 0.9, "exact": "never", "table": False, "min_responses": 0}
