"""varbench.app.runner: shards, the case cache on resume and interruption, corrupt case files,
merging shard directories (in process)."""

from __future__ import annotations

import json

import _fixtures_app as fr
import pytest

from varbench.app import executors as kinds
from varbench.app.cache import CaseCache
from varbench.app.compare import compare_reports
from varbench.app.runner import merge_outputs, parse_shard, run_suite, shard_cases
from varbench.app.suite import load_suite


@pytest.fixture
def counting(monkeypatch):
    """Count case executions (to prove cached cases are not recomputed)."""
    calls: list[str] = []
    real = kinds._EXECUTORS["check"]

    def wrapped(kind, name, params, work, progress, cache):
        calls.append(name)
        return real(kind, name, params, work, progress, cache)

    monkeypatch.setitem(kinds._EXECUTORS, "check", wrapped)
    return calls


def test_shards_partition_the_cases(tmp_path):
    suite = load_suite(fr.write_suite(tmp_path, fr.SLOW_CASE), allow_code=True)
    parts = [shard_cases(suite.cases, (i, 3)) for i in (1, 2, 3)]
    names = sorted(c.name for p in parts for c in p)
    assert names == sorted(c.name for c in suite.cases)
    assert [c.name for c in parts[0]] == ["rloo", "slow"]
    assert parse_shard("2/3") == (2, 3)
    for bad in ("0/3", "4/3", "x", "1/0"):
        with pytest.raises(ValueError, match="shard"):
            parse_shard(bad)


def test_run_caches_and_resumes(tmp_path, counting):
    suite = fr.write_suite(tmp_path)
    out = tmp_path / "out"
    first = run_suite(suite, out)
    assert first.computed == ["rloo", "centered", "topk"] and counting == first.computed
    summary = json.loads((out / "summary.json").read_text())
    assert [a["name"] for a in summary["analyses"]] == ["rloo", "centered", "topk"]
    assert (out / "report.html").is_file() and (out / "report.md").is_file()
    counting.clear()
    stamp = (out / "report.html").stat().st_mtime_ns
    second = run_suite(suite, out)
    assert second.cached == ["rloo", "centered", "topk"] and counting == []
    assert (out / "report.html").stat().st_mtime_ns == stamp  # up to date: not re-rendered
    (out / "report.md").unlink()
    run_suite(suite, out)
    assert (out / "report.md").is_file() and counting == []  # re-rendered from the cache
    assert compare_reports(out, out, tolerance=0, rel_tolerance=0)["status"].eq("ok").all()


def test_interrupted_case_leaves_no_result(tmp_path, counting, monkeypatch):
    suite = fr.write_suite(tmp_path)
    out = tmp_path / "out"
    real = kinds._EXECUTORS["check"]

    def interrupt_on_topk(kind, name, params, work, progress, cache):
        if name == "topk":
            raise KeyboardInterrupt
        return real(kind, name, params, work, progress, cache)

    monkeypatch.setitem(kinds._EXECUTORS, "check", interrupt_on_topk)
    with pytest.raises(KeyboardInterrupt):
        run_suite(suite, out)
    assert sorted(p.name.split("-")[0] for p in CaseCache(out / "cases").files()) == [
        "centered", "rloo"]
    monkeypatch.setitem(kinds._EXECUTORS, "check", real)
    again = run_suite(suite, out)
    assert again.cached == ["rloo", "centered"] and again.computed == ["topk"]


def test_corrupt_case_file_is_recomputed(tmp_path):
    suite = fr.write_suite(tmp_path)
    out = tmp_path / "out"
    run_suite(suite, out)
    victim = CaseCache(out / "cases").files()[0]
    victim.write_text(victim.read_text()[:100])  # truncated by a disk failure, say
    logs: list[str] = []
    again = run_suite(suite, out, log=logs.append)
    assert len(again.computed) == 1
    assert any("[corrupt]" in m and str(victim) in m for m in logs)


def test_shards_merge_into_the_full_report(tmp_path):
    suite = fr.write_suite(tmp_path)
    s1 = run_suite(suite, tmp_path / "s1", shard=(1, 2))
    s2 = run_suite(suite, tmp_path / "s2", shard=(2, 2))
    assert s1.report is None and s1.computed == ["rloo", "topk"] and s2.computed == ["centered"]
    with pytest.raises(ValueError, match="missing 1 case"):
        merge_outputs([tmp_path / "s1"], tmp_path / "m1")
    merged = merge_outputs([tmp_path / "s1", tmp_path / "s2"], tmp_path / "merged")
    assert merged.report is not None
    full = run_suite(suite, tmp_path / "full")
    table = compare_reports(full.out_dir, tmp_path / "merged", tolerance=0, rel_tolerance=0)
    assert len(table) > 5 and table["status"].eq("ok").all()
    other = tmp_path / "other.toml"
    other.write_text(fr.SUITE.format(extra="").replace("num_steps = 60", "num_steps = 50"))
    run_suite(other, tmp_path / "o", shard=(1, 2))
    with pytest.raises(ValueError, match="different suites"):
        merge_outputs([tmp_path / "s1", tmp_path / "o"], tmp_path / "m2")


EXACT_SUITE = """
[suite]
name = "exact"

[[cases]]
name = "chk"
kind = "check"
estimator = "rloo"
num_steps = 40
baselines = ["centered"]

[[cases]]
name = "trn"
kind = "train"
policy = "micro"
warm_start = false
reward = "positional"
steps = 4
G = 2
prompts_per_step = 2
eval_every = 2
eval_prompts = 4
eval_samples = 1
checkpoint_every = 2
seed = 5
"""


def _same_bits(a, b, where):
    import numpy as np
    import pandas as pd

    from varbench.train.records import TIMING_FIELDS

    a = a.drop(columns=[c for c in TIMING_FIELDS if c in a]).reset_index(drop=True)
    b = b.drop(columns=[c for c in TIMING_FIELDS if c in b]).reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b, check_exact=True, obj=where)
    for col in a.columns:
        if a[col].dtype.kind == "f":
            x, y = a[col].to_numpy(), b[col].to_numpy()
            assert np.array_equal(np.isnan(x), np.isnan(y)), (where, col)
            keep = ~np.isnan(x)
            assert x[keep].tobytes() == y[keep].tobytes(), (where, col)  # bit for bit


def test_cached_and_resumed_results_equal_the_computed_ones_bit_for_bit(tmp_path):
    """Regression: case records were cached at 10 significant digits, and a resumed training
    case wrote tokens/* as float where the uninterrupted one had ints."""
    from varbench.app.executors import KINDS
    from varbench.train.config import TrainConfig
    from varbench.train.loop import train

    path = tmp_path / "exact.toml"
    path.write_text(EXACT_SUITE)
    suite = load_suite(path)
    ref = {c.name: KINDS[c.kind].execute(c.name, c.params, tmp_path / "ref" / c.name, False,
                                         cache=False) for c in suite.cases}
    out = tmp_path / "out"
    trn = next(c for c in suite.cases if c.kind == "train")
    cut = TrainConfig.from_dict({**trn.params, "steps": 2})  # killed after step 2's checkpoint
    train(cut, out / "work" / trn.key / "run", resume=True, progress=False)
    run_suite(path, out)  # computes chk, resumes trn from its checkpoint at step 2
    cache = CaseCache(out / "cases")
    for c in suite.cases:
        for got, want in zip(cache.load(c), ref[c.name], strict=True):
            assert got.records.keys() == want.records.keys()
            for k in want.records:
                _same_bits(got.records[k], want.records[k], f"{c.name}/{k}")
            assert [h.to_dict() for h in got.headlines] == [h.to_dict() for h in want.headlines]
