"""The analysis subcommands are one-case suites: the same executor, the same validation."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from _fixtures_app import proxy_suite

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


def test_proxy_command_and_suite_case_share_one_executor(tmp_path, capsys):
    assert main(["proxy", *PROXY, "--out", str(tmp_path / "cli")]) == 0
    suite = proxy_suite(tmp_path / "s.toml")
    capsys.readouterr()
    run_suite(suite, tmp_path / "suite", progress=False)
    # the suite case prints the same cost notice as the command, before its work
    assert ("varbench: case 'proxy' cost: proxy (1 policy: random): 4 responses sampled, "
            "4 forward+backward passes") in capsys.readouterr().err
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
    (["variance", "--min-responses", "-5"], r"min_responses.*-5 is not valid.*>= 0"),
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


# --- the cost notice and --plan (issue 29 point 6) ---------------------------------------------

def _count(monkeypatch, module, name, size, tally):
    """Wrap ``module.name`` so each call adds ``size(*args)`` to ``tally[name]``."""
    real = getattr(module, name)

    def spy(*args, **kwargs):
        tally[name] = tally.get(name, 0) + size(*args, **kwargs)
        return real(*args, **kwargs)
    monkeypatch.setattr(module, name, spy)


def _sampled(policy, task, prompts, G, **kw):
    return len(prompts) * G


def _batch_rows(model, batch, **kw):
    return int(batch.rewards.numel())


VARIANCE = ["variance", "--preset", "micro", "--states", "random", "--task", "sort",
            "--knob", "n=2", "--schemes", "centered", "rloo", "-G", "2", "-M", "3",
            "--min-responses", "24", "--reference", "sampled", "--n-ref", "8",
            "--sketch-dim", "16", "--n-boot", "10", "--no-progress"]


def test_variance_notice_is_what_it_samples(tmp_path, monkeypatch, capsys):
    """The floor (24 responses: M 3 -> 12 groups of 2) and the sampled reference (8) are in
    the notice, and the spied sampler and gradient harnesses spend exactly that (on the
    per-token vectors path, whose passes the notice counts)."""
    import varbench.analysis.variance as va

    tally: dict[str, int] = {}
    _count(monkeypatch, va, "sample", _sampled, tally)
    _count(monkeypatch, va, "token_vectors", _batch_rows, tally)
    _count(monkeypatch, va, "sequence_grad_norms", lambda m, ids, *a, **k: ids.shape[0], tally)
    assert main([*VARIANCE, "--gradients", "vectors", "--out", str(tmp_path / "v")]) == 0
    err = capsys.readouterr().err
    assert ("32 responses sampled (24 for the estimates + 8 for the sampled reference), "
            "38 forward+backward passes") in err
    assert "M raised from 3 to 12" in err
    assert tally["sample"] == 32
    assert tally["token_vectors"] + tally["sequence_grad_norms"] == 38


def test_variance_auto_floor_is_announced():
    """`variance -M 4` with an OTB-type scheme: PROXY_MIN_GROUPS (1024) groups at G = 8, i.e.
    8192 responses per prompt (above the 4096-response floor), + 1024 reference."""
    from varbench.analysis.variance import variance_plan
    from varbench.tasks import get_task

    sizes = variance_plan(get_task("arith"), vocab_size=30, schemes=["centered", "otb"],
                          Gs=[2, 4, 8], M=4, n_prompts=1, n_ref=1024)
    assert (sizes.M_floor, sizes.min_responses, sizes.reference) == (1024, 8192, "sampled")
    assert sizes.groups == {2: 4096, 4: 2048, 8: 1024}
    assert (sizes.plan.sampled, sizes.plan.reference) == (8192, 1024)
    assert "min_responses auto = 8192" in sizes.plan.text()
    assert "at least 1024 groups at every G" in sizes.plan.text()


def test_proxy_and_cancellation_notices_are_what_they_spend(tmp_path, monkeypatch, capsys):
    import importlib

    ca = importlib.import_module("varbench.analysis.cancellation")  # the package exports a
    pa = importlib.import_module("varbench.analysis.proxy")  # function of the same name

    tally: dict[str, int] = {}
    _count(monkeypatch, pa, "sample", _sampled, tally)
    _count(monkeypatch, pa, "token_grad_norms", lambda m, ids, *a, **k: ids.shape[0], tally)
    assert main(["proxy", *PROXY, "--out", str(tmp_path / "p")]) == 0
    assert "4 responses sampled, 4 forward+backward passes" in capsys.readouterr().err
    assert tally == {"sample": 4, "token_grad_norms": 4}

    tally.clear()
    _count(monkeypatch, ca, "sample", _sampled, tally)
    _count(monkeypatch, ca, "token_vectors", _batch_rows, tally)
    _count(monkeypatch, ca, "policy_loss", lambda logp, *a, **k: logp.shape[0] * logp.shape[1],
           tally)
    assert main(["cancellation", "--preset", "micro", "--states", "random", "--tasks", "arith",
                 "--prompts", "2", "-G", "2", "--inner-steps", "0", "2", "--sketch-dim", "8",
                 "--no-progress", "--out", str(tmp_path / "c")]) == 0
    # 4 responses; 2 PPO steps over them and one sketch pass each: 12 passes
    assert "4 responses sampled, 12 forward+backward passes" in capsys.readouterr().err
    assert tally == {"sample": 4, "token_vectors": 4, "policy_loss": 8}


@pytest.mark.parametrize("cmd", [VARIANCE, ["proxy", *PROXY],
                                 ["cancellation", "--preset", "micro", "--tasks", "arith"]])
def test_plan_samples_nothing_and_builds_no_policy(tmp_path, monkeypatch, capsys, cmd):
    import importlib

    def boom(*a, **k):
        raise AssertionError("--plan must not do this")
    for mod in ("varbench.rollout.sampler", "varbench.analysis.variance",
                "varbench.analysis.proxy", "varbench.analysis.cancellation"):
        monkeypatch.setattr(importlib.import_module(mod), "sample", boom)
    monkeypatch.setattr(importlib.import_module("varbench.train.policies"), "build_policy", boom)
    out = tmp_path / "out"
    assert main([*cmd, "--plan", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "--plan:" in text and "responses sampled" in text and "forward+backward" in text
    assert not out.exists()


def test_plan_checks_like_the_run(capsys):
    """--plan validates the sizes the run would check (here M < 3)."""
    assert main(["variance", "-M", "2", "--plan"]) == 2
    assert "M=2" in capsys.readouterr().err


def test_run_suite_plan_prints_each_case(tmp_path, capsys):
    suite = tmp_path / "s.toml"
    suite.write_text("""
[suite]
name = "planned"
[[cases]]
name = "v"
kind = "variance"
preset = "micro"
task = "sort"
schemes = ["centered", "otb"]
Gs = [2, 4]
M = 4
reference = "sampled"
n_ref = 100
[[cases]]
name = "t"
kind = "train"
steps = 1
""")
    assert main(["run", str(suite), "--plan", "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "(8,192 for the estimates + 200 for the sampled reference)" in out
    assert "t: train case, no cost plan" in out
    assert not (tmp_path / "o").exists()


def test_variance_notice_is_redone_when_the_built_vocabulary_differs(tmp_path, monkeypatch,
                                                                    capsys):
    """--add-task-tokens grows a checkpoint's vocabulary only once it is built: the notice
    (exact enumeration of V**T responses, V from the config) is printed again with the built V."""
    import importlib

    import _fixtures_user as fu

    va = importlib.import_module("varbench.analysis.variance")

    class Stop(Exception):
        pass

    def stop(*a, **k):  # the run's first model call (the notices came before it)
        raise Stop
    monkeypatch.setattr(va, "enumerate_distribution", stop)
    monkeypatch.setattr(va, "sample", stop)
    ck = fu.eot_checkpoint(tmp_path / "ck")
    with pytest.raises(Stop):
        main(["variance", "--policy", str(ck), "--add-task-tokens", "--task", "sort",
              "--knob", "n=2", "--schemes", "centered", "-G", "2", "-M", "3",
              "--min-responses", "0", "--no-progress", "--out", str(tmp_path / "v")])
    err = capsys.readouterr().err
    first, again = err.split("varbench: case 'variance' cost")[1:3]
    assert again.startswith(", with the policy built")
    V0, V1 = (int(t.split("V**T = ")[1].split(" ")[0]) for t in (first, again))
    assert V1 > V0
