"""`varbench run / merge / compare / check`: exit codes and messages through the CLI entry point.

Most tests call ``varbench.app.cli.main`` in process (same parser, same exit codes; a subprocess
costs the full torch/transformers import). Interrupting a run needs a real process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import _fixtures_app as fr
import pytest
import torch

from varbench.app.cli import main
from varbench.app.runner import run_suite

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
       "OMP_NUM_THREADS": "1"}


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def vb(capsys, monkeypatch):
    """Run `varbench ARGS...` in process; returns exit code and captured output."""
    monkeypatch.syspath_prepend(str(TESTS))

    def run(*args: str) -> Result:
        capsys.readouterr()
        code = main(list(args))
        out = capsys.readouterr()
        return Result(code, out.out, out.err)

    return run


def test_check_exit_codes(vb):
    ok = vb("check", "rloo", "_fixtures_testing:verl_rloo", "--steps", "300",
            "--baselines", "centered", "--require-unbiased")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "PASSED" in ok.stdout and "(verl-shaped)" in ok.stdout
    bad = vb("check", "_fixtures_testing:length_bonus", "--steps", "300", "--baselines", "")
    assert bad.returncode == 1 and "FAIL    bias (rescaled)" in bad.stdout
    missing = vb("check", "no_such_module_xyz:fn")
    assert missing.returncode == 2 and "module not found: 'no_such_module_xyz'" in missing.stderr
    sig = vb("check", "_fixtures_testing:one_argument")
    assert sig.returncode == 2 and "wrong signature" in sig.stderr and "Traceback" not in sig.stderr


def test_run_bad_suite_exits_2(tmp_path, vb):
    p = tmp_path / "bad.toml"
    p.write_text('[suite]\nname = "x"\n[[cases]]\nname = "a"\nkind = "nope"\n')
    res = vb("run", str(p), "--out", str(tmp_path / "o"))
    assert res.returncode == 2 and str(p) in res.stderr and "'variance'" in res.stderr
    assert vb("run", str(tmp_path / "absent.toml")).returncode == 2
    assert vb("run", str(p), "--shard", "3/2").returncode == 2


def _wait_for(pred, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError("timed out waiting")
        time.sleep(0.05)


@pytest.mark.parametrize(
    "sig", [signal.SIGKILL, pytest.param(signal.SIGINT, marks=pytest.mark.slow)]
)
def test_kill_then_resume_without_recomputing(tmp_path, sig):
    """A real process killed in the middle of a case; the rerun (in process: the same code
    path without a second interpreter start) reuses the finished cases."""
    suite = fr.write_suite(tmp_path, fr.SLOW_CASE)
    out = tmp_path / "out"
    # the same intra-op thread count as the rerun in this process: it is part of the case keys
    env = {**ENV, "OMP_NUM_THREADS": str(torch.get_num_threads())}
    proc = subprocess.Popen([sys.executable, "-m", "varbench", "run", str(suite), "--out",
                             str(out), "--allow-code"], env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    cases = out / "cases"
    # The slow case runs last: kill while it is in progress, after the other three finished.
    _wait_for(lambda: cases.is_dir() and len(list(cases.glob("*.json"))) == 3)
    time.sleep(0.5)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == (-9 if sig == signal.SIGKILL else 130), err
    done = sorted(p.name.split("-")[0] for p in cases.glob("*.json"))
    assert done == ["centered", "rloo", "topk"]
    assert not (out / "summary.json").exists()
    (cases / ".slow-0.json.tmp-999999999").write_text('{"half": ')  # a torn write, dead writer
    logs: list[str] = []
    sys.path.insert(0, str(TESTS))  # the slow case's estimator lives in the tests folder
    try:
        again = run_suite(suite, out, log=logs.append, allow_code=True)
    finally:
        sys.path.remove(str(TESTS))
    assert again.cached == ["rloo", "centered", "topk"] and again.computed == ["slow"], logs
    assert not (cases / ".slow-0.json.tmp-999999999").exists()
    assert (out / "summary.json").is_file()


def test_shards_merge_and_compare_cli(tmp_path, vb):
    suite = fr.write_suite(tmp_path)
    for i in (1, 2):
        res = vb("run", str(suite), "--out", str(tmp_path / f"s{i}"), "--shard", f"{i}/2")
        assert res.returncode == 0 and "varbench merge" in res.stdout, res.stderr
    res = vb("merge", str(tmp_path / "s1"), str(tmp_path / "s2"), "--out", str(tmp_path / "m"))
    assert res.returncode == 0, res.stderr
    same = vb("compare", str(tmp_path / "m"), str(tmp_path / "m" / "summary.json"))
    assert same.returncode == 0 and "0 beyond tolerance" in same.stdout
    # Same suite with another seed: the bias figures move beyond a zero tolerance.
    other = tmp_path / "other.toml"
    other.write_text(suite.read_text().replace("seed = 3", "seed = 4"))
    assert vb("run", str(other), "--out", str(tmp_path / "o")).returncode == 0
    diff = vb("compare", str(tmp_path / "m"), str(tmp_path / "o"), "--tolerance", "0",
              "--rel-tolerance", "0")
    assert diff.returncode == 1 and "regression" in diff.stdout
    assert vb("compare", str(tmp_path / "m"), str(tmp_path / "nowhere")).returncode == 2


FAILING_CASE = """
[[cases]]
name = "biased"
kind = "check"
estimator = "_fixtures_testing:length_bonus"
num_steps = 100
baselines = []
"""


def test_run_exits_1_when_a_check_case_fails(vb, tmp_path):
    """Regression: `varbench run` exited 0 when a `check` case failed."""
    suite = fr.write_suite(tmp_path, FAILING_CASE)
    res = vb("run", str(suite), "--out", str(tmp_path / "out"), "--allow-code")
    assert res.returncode == 1, res.stderr
    assert "1 check case(s) FAILED: biased" in res.stderr
    again = vb("run", str(suite), "--out", str(tmp_path / "out"), "--allow-code")
    # cached: the same verdict
    assert again.returncode == 1 and "4 cached" in again.stdout
    ok = vb("run", str(fr.write_suite(tmp_path, name="ok.toml")), "--out", str(tmp_path / "ok"))
    assert ok.returncode == 0


def test_degenerate_estimators_get_a_verdict_not_a_crash(vb, tmp_path):
    """Regression: ZeroDivisionError (exit 1, the failed-check code) on an all-zero estimator
    and on `check centered -G 1`."""
    (tmp_path / "vb_zero_est.py").write_text(
        "import torch\n"
        "def zeros(rewards, mask, **kw):\n"
        "    return torch.zeros(mask.shape, dtype=rewards.dtype)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        zero = vb("check", "vb_zero_est:zeros", "--steps", "30")
    finally:
        sys.path.remove(str(tmp_path))
    g1 = vb("check", "centered", "-G", "1", "--steps", "30")
    for res in (zero, g1):
        assert res.returncode == 1 and "Traceback" not in res.stderr
        assert "FAIL    bias (rescaled)" in res.stdout and "no gradient signal" in res.stdout
    assert "at G=1 a group-mean baseline cancels every reward" in g1.stdout
    g1_rloo = vb("check", "rloo", "-G", "2", "--steps", "30", "--baselines", "centered")
    assert "Traceback" not in g1_rloo.stderr and g1_rloo.returncode in (0, 1)


EXITING = """import os, sys
def ex0(rewards, mask, **kw):
    sys.exit(0)
def bare_exit(rewards, mask, **kw):
    exit()
def osx(rewards, mask, **kw):
    os._exit(0)
def kbi(rewards, mask, **kw):
    raise KeyboardInterrupt
"""


@pytest.mark.parametrize("fn", ["ex0", "bare_exit", "osx"])
def test_an_estimator_that_exits_is_a_fail_row_and_exit_1(vb, tmp_path, monkeypatch, fn):
    """Regression: sys.exit(0) / exit() / os._exit(0) inside an estimator made `check` and
    `run` exit 0 with no verdict. Now: FAIL rows, exit 1, and the process goes on."""
    (tmp_path / "vb_exiting.py").write_text(EXITING)
    monkeypatch.syspath_prepend(str(tmp_path))
    res = vb("check", f"vb_exiting:{fn}", "--steps", "30", "--baselines", "")
    assert res.returncode == 1, res.stderr
    assert "FAIL    shape/mask contract" in res.stdout and "FAILED" in res.stdout
    assert ("os._exit(0)" if fn == "osx" else "SystemExit") in res.stdout
    suite = fr.write_suite(tmp_path, FAILING_CASE.replace("_fixtures_testing:length_bonus",
                                                          f"vb_exiting:{fn}"))
    run = vb("run", str(suite), "--out", str(tmp_path / "out"), "--allow-code")
    assert run.returncode == 1 and "1 check case(s) FAILED: biased" in run.stderr
    assert (tmp_path / "out" / "report.md").is_file()  # every case finished, one failed


def test_an_estimator_interrupt_is_a_fail_row_and_nonzero(vb, tmp_path, monkeypatch):
    (tmp_path / "vb_exiting.py").write_text(EXITING)
    monkeypatch.syspath_prepend(str(tmp_path))
    res = vb("check", "vb_exiting:kbi", "--steps", "30", "--baselines", "")
    assert res.returncode == 130 and "FAIL    finished: interrupted" in res.stdout
    suite = fr.write_suite(tmp_path, FAILING_CASE.replace("_fixtures_testing:length_bonus",
                                                          "vb_exiting:kbi"))
    run = vb("run", str(suite), "--out", str(tmp_path / "out"), "--allow-code")
    assert run.returncode == 130  # nothing cached for the interrupted case, no report
    assert not (tmp_path / "out" / "report.md").exists()


def test_module_exiting_at_import_is_bad_input_not_a_pass(vb, tmp_path, monkeypatch):
    (tmp_path / "vb_exit_on_import.py").write_text("raise SystemExit(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    res = vb("check", "vb_exit_on_import:fn")
    assert res.returncode == 2 and "SystemExit(0)" in res.stderr


def test_a_case_whose_user_code_exits_fails_the_run(vb, tmp_path, monkeypatch):
    """A scheme of a variance case calling exit(0) (outside a check's guarded rows): the run
    stops with exit 2 naming the case, nothing cached for it."""
    import varbench.app.executors as ex

    def exits(*a, **k):
        raise SystemExit(0)

    monkeypatch.setitem(ex._EXECUTORS, "check", exits)
    res = vb("run", str(fr.write_suite(tmp_path)), "--out", str(tmp_path / "out"))
    assert res.returncode == 2 and "ended without a result" in res.stderr
    assert "SystemExit(0)" in res.stderr
    assert not list((tmp_path / "out" / "cases").glob("*.json"))


def test_python_m_does_not_import_from_the_current_directory(tmp_path):
    """`python -m varbench` drops the current directory python put on sys.path (the
    `varbench` script never adds it): a module beside a suite is not importable by accident;
    PYTHONPATH=. puts it back on purpose."""
    (tmp_path / "vb_cwd_est.py").write_text(
        "def fn(rewards, mask, **kw):\n    return rewards[..., None] * mask\n")
    env = {**ENV, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "varbench", "check", "vb_cwd_est:fn", "--steps", "30",
            "--baselines", ""]
    res = subprocess.run(args, cwd=tmp_path, env=env, text=True, capture_output=True)
    assert res.returncode == 2 and "the current directory is not on the import path" in res.stderr
    res = subprocess.run(args, cwd=tmp_path, env={**env, "PYTHONPATH": f"{ROOT}{os.pathsep}."},
                         text=True, capture_output=True)
    assert res.returncode in (0, 1) and "check_estimator: vb_cwd_est:fn" in res.stdout


# --- check on the user's policy and task (issue 29 point 6) -----------------------------------

NEGATED = """def negated(rewards, mask, **kw):
    m = mask.to(rewards.dtype)
    return -(rewards - rewards.mean(1, keepdim=True)).unsqueeze(-1) * m
"""


def test_check_on_your_policy_and_task(vb, tmp_path, monkeypatch):
    """The bias test against a reference sampled from the user's policy on the user's task,
    through the app's resolvers: an unbiased estimator passes, a sign-flipped one fails."""
    import varbench.app.specs as specs

    seen = []
    real = specs.resolve_task
    monkeypatch.setattr(specs, "resolve_task",
                        lambda spec, knobs=None: seen.append(spec) or real(spec, knobs))
    (tmp_path / "vb_negated.py").write_text(NEGATED)
    monkeypatch.syspath_prepend(str(tmp_path))
    res = vb("check", "rloo", "vb_negated:negated", "--policy", "micro", "--task", "arith",
             "--steps", "96", "--prompts", "2", "--n-ref", "512", "--sketch-dim", "64",
             "--baselines", "centered")
    assert res.returncode == 1, res.stdout + res.stderr
    rloo, neg = res.stdout.split("check_estimator: ")[1:]
    assert "g* sampled (512 responses per prompt)" in rloo and "PASSED" in rloo
    assert "FAIL    scale along g*" in neg and "FAILED" in neg
    assert seen == ["arith"]


def test_check_on_a_user_checkpoint_and_data_file(vb, tmp_path):
    """A checkpoint and a JSONL the project has never seen: every reward is 0 there, which the
    verdict says (no gradient signal), with no traceback."""
    import _fixtures_user as fu

    ck = fu.eot_checkpoint(tmp_path / "ck")
    data = fu.word_jsonl(tmp_path / "w.jsonl")
    res = vb("check", "rloo", "--policy", str(ck), "--task", str(data), "--knob",
             "max_new_tokens=8", "--knob", "chat=false", "--steps", "4", "--prompts", "1",
             "--n-ref", "8", "--sketch-dim", "16", "--baselines", "")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert "sampled reference gradient is exactly 0 on task" in res.stdout


@pytest.mark.parametrize("args, message", [
    (["--prompts", "3"], "--prompts applies to your policy and task"),
    (["--knob", "n=2", "--n-ref", "9"], "--knob, --n-ref apply to your policy and task"),
    (["--task", "nosuch"], "task='nosuch' is not valid"),
    (["--policy", "/no/such/dir"], "policy='/no/such/dir' is not valid"),
    (["--task", "sort", "--knob", "nope=1"], "nope"),
])
def test_check_policy_task_flags_are_checked_first(vb, args, message):
    res = vb("check", "rloo", *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr
