"""varbench._util.locks: one writer per directory, the holder named when busy, stale locks
taken over; and two real concurrent `varbench run`s on one output directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from varbench._util.locks import BusyError, dir_lock, holder, lock_path
from varbench.app.cache import CaseCache, load_file

_HOLD = r"""
import sys, time
from varbench._util.locks import dir_lock
with dir_lock(sys.argv[1], what="output directory"):
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _holder_process(path: Path, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path), str(seconds)],
                            stdout=subprocess.PIPE, text=True, env=_env())
    assert proc.stdout.readline().strip() == "locked"
    return proc


def _env() -> dict:
    root = str(Path(__file__).resolve().parents[1])
    tests = str(Path(__file__).resolve().parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, tests,
                                                          os.environ.get("PYTHONPATH", "")])}


def test_busy_names_the_holder_then_stale_lock_is_taken_over(tmp_path):
    proc = _holder_process(tmp_path, 60)
    try:
        with pytest.raises(BusyError, match=rf"in use by process {proc.pid}.*\.varbench\.lock"):
            with dir_lock(tmp_path, what="output directory"):
                pass
        assert holder(lock_path(tmp_path)) == proc.pid
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # killed holder: its pid is still in the file, but the lock is free
    assert holder(lock_path(tmp_path)) == proc.pid
    with dir_lock(tmp_path, what="output directory"):
        assert holder(lock_path(tmp_path)) == os.getpid()
    assert holder(lock_path(tmp_path)) is None  # released


def test_wait_gets_the_lock_when_the_holder_finishes(tmp_path):
    proc = _holder_process(tmp_path, 1.0)
    t0 = time.monotonic()
    with dir_lock(tmp_path, what="cache entry", wait=30, poll=0.05):
        assert time.monotonic() - t0 > 0.3
    proc.wait()


def test_one_process_two_holders_exclude_each_other(tmp_path):
    with dir_lock(tmp_path), pytest.raises(BusyError, match=str(os.getpid())):
        with dir_lock(tmp_path):
            pass


SUITE = """
[suite]
name = "race"

[[cases]]
name = "slow"
kind = "check"
estimator = "_fixtures_app:sleepy_centered"
num_steps = 8
baselines = []

[[cases]]
name = "train"
kind = "train"
policy = "micro"
warm_start = false
steps = 4
G = 2
prompts_per_step = 1
eval_every = 2
eval_prompts = 2
eval_samples = 1
checkpoint_every = 1
"""


def _run(suite: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "varbench", "run", str(suite), "--out",
                             str(out), "--allow-code"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=_env())


def _check_tables(out: Path) -> None:
    """Every case's tables: a `step` column holds each step once, 0..N in order."""
    cases = CaseCache(out / "cases").files()
    assert len(cases) == 2
    for f in cases:
        for res in load_file(f):
            for name, df in res.records.items():
                if "step" in df:
                    assert list(df["step"]) == list(range(len(df))), (f.name, name)
    records = list((out / "work").glob("*/run/records.csv"))
    assert len(records) == 1
    steps = pd.read_csv(records[0])["step"].tolist()
    assert steps == list(range(5))


def test_two_concurrent_runs_one_refuses_and_every_table_is_whole(tmp_path):
    suite = tmp_path / "race.toml"
    suite.write_text(SUITE)
    out = tmp_path / "out"
    runs = [_run(suite, out), _run(suite, out)]  # started together: they race for the lock
    results = [(p.pid, *p.communicate(timeout=300), p.returncode) for p in runs]
    codes = sorted(r[3] for r in results)
    assert codes == [0, 2], results
    (winner,) = [r for r in results if r[3] == 0]
    (loser,) = [r for r in results if r[3] == 2]
    assert f"in use by process {winner[0]}" in loser[2] and "Traceback" not in loser[2]
    assert "2 case(s) computed" in winner[1]
    _check_tables(out)
    manifest = json.loads((out / "suite.json").read_text())
    assert manifest["report_digest"] == manifest["digest"]


def test_analysis_work_dir_and_training_run_have_one_writer(tmp_path):
    """Cells (an analysis case's work directory) and a training run directory are locked too:
    a second writer is refused before it computes anything."""
    from varbench.app.executors import KINDS
    from varbench.train.config import TrainConfig
    from varbench.train.loop import train

    with dir_lock(tmp_path / "work"), pytest.raises(BusyError, match="work directory"):
        KINDS["variance"].execute("v", {}, tmp_path / "work", False)
    with dir_lock(tmp_path / "run"), pytest.raises(BusyError, match="training run directory"):
        train(TrainConfig(policy="micro", warm_start=False, steps=1), tmp_path / "run",
              progress=False)
