"""varbench.testing.pytest_plugin: a user's test suite checks an estimator with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

TESTS = Path(__file__).resolve().parent

USER_TESTS = '''
import pytest
import _fixtures_testing as fx

OPTS = dict(num_steps=300, baselines=())

def test_fixture_pass(varbench_check):
    res = varbench_check(fx.verl_rloo, **OPTS)
    assert res.passed and res.shape == "verl"

def test_fixture_fail(varbench_check):
    varbench_check("_fixtures_testing:length_bonus", **OPTS)

@pytest.mark.varbench_estimator("centered", num_steps=300, baselines=())
def test_marker_pass():
    pass

@pytest.mark.varbench_estimator(fx.own_token_baseline, num_steps=300, baselines=())
def test_marker_fail():
    pass
'''


def _plugin_args() -> list[str]:
    """`-p` only when the pytest11 entry point is not installed (it would register twice)."""
    eps = entry_points(group="pytest11")
    installed = any(ep.value.startswith("varbench.testing.pytest_plugin") for ep in eps)
    return [] if installed else ["-p", "varbench.testing.pytest_plugin"]


def test_fixture_and_marker_in_a_user_suite(tmp_path):
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS),
                                                        os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
         str(tmp_path), *_plugin_args(), str(tmp_path / "test_user.py")],
        cwd=tmp_path, env=env, text=True, capture_output=True, timeout=600,
    )
    out = res.stdout + res.stderr
    assert "2 failed, 2 passed" in out, out
    assert "FAILED test_user.py::test_fixture_fail" in out
    assert "FAILED test_user.py::test_marker_fail" in out
    assert "FAIL    bias (rescaled)" in out  # the table is the failure message
