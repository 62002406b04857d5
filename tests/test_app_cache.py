"""varbench.app.cache: finished cases as strict JSON files (round trip of an AnalysisResult,
keys checked, corrupt files named, torn writes of dead writers cleaned)."""

from __future__ import annotations

import json
import os

import _fixtures_app as fr
import numpy as np
import pandas as pd
import pytest

from varbench._util.checks import UsageError
from varbench._util.io import seal_json as seal
from varbench.app.cache import (
    FORMAT,
    CaseCache,
    load_file,
    read_payload,
    result_from_dict,
    result_to_dict,
)
from varbench.app.suite import load_suite
from varbench.report.result import AnalysisResult, Headline


def _result():
    records = {"cells": pd.DataFrame({"scheme": ["otb", "rloo"], "G": [2, 4],
                                      "variance": [0.25, float("nan")], "ok": [True, False]})}
    return AnalysisResult(
        kind="variance", name="v", records=records,
        summary={"ratio": np.float64(0.5), "n": np.int64(3)},
        headlines=[Headline("r", 0.5, 0.01, "text", "x"), Headline("nan", float("nan"), None, "?")],
        config={"Gs": (2, 4)}, provenance={"seeds": {"sample": 0}}, notes=["a note"])


def test_result_round_trip():
    d = result_to_dict(_result())
    json.dumps(d, allow_nan=False)  # strict JSON
    back = result_from_dict(json.loads(json.dumps(d)))
    pd.testing.assert_frame_equal(back.records["cells"], _result().records["cells"])
    assert back.summary == {"ratio": 0.5, "n": 3} and back.config == {"Gs": [2, 4]}
    assert [h.to_dict() for h in back.headlines] == [
        {"key": "r", "value": 0.5, "se": 0.01, "unit": "x", "text": "text"},
        {"key": "nan", "value": None, "se": None, "unit": "", "text": "?"}]
    assert (back.kind, back.name, back.notes) == ("variance", "v", ["a note"])


@pytest.fixture
def cases(tmp_path):
    return load_suite(fr.write_suite(tmp_path)).cases


def test_store_load_and_keys(tmp_path, cases):
    cache = CaseCache(tmp_path / "cases")
    a, b = cases[0], cases[1]
    assert not cache.has(a) and cache.files() == []
    path = cache.store(a, [_result()], wall_time_s=1.5)
    assert path == cache.path(a) and cache.has(a) and cache.files() == [path]
    assert cache.load(a)[0].records["cells"].shape == (2, 4)
    payload = read_payload(path)
    assert payload["key"] == a.key and payload["wall_time_s"] == 1.5
    assert payload["config"]["name"] == a.name
    with pytest.raises(UsageError, match=rf"holds case '{a.key}', expected '{b.key}'"):
        load_file(path, expect_key=b.key)
    assert len(load_file(path)) == 1


def test_corrupt_and_foreign_files_are_named(tmp_path, cases):
    cache = CaseCache(tmp_path)
    path = cache.store(cases[0], [_result()], 0.0)
    path.write_text(path.read_text()[:50])
    with pytest.raises(UsageError, match=r"case file .* is corrupt or unreadable"):
        cache.load(cases[0])
    path.write_text(json.dumps({"format": "something/else"}))
    with pytest.raises(UsageError, match="is not a varbench case file"):
        cache.load(cases[0])
    config = json.loads(json.dumps(cases[0].config()))
    path.write_text(json.dumps(seal({"format": FORMAT, "key": cases[0].key, "config": config,
                                     "results": [{"kind": "x"}]})))
    with pytest.raises(UsageError,
                       match=r"is corrupt \(ValueError: result key 'name' must be a str"):
        cache.load(cases[0])
    # a sealed file whose results belong to another configuration posing under this key
    other = {**config, "params": {**config["params"], "G": 99}}
    path.write_text(json.dumps(seal({"format": FORMAT, "key": cases[0].key, "config": other,
                                     "results": []})))
    with pytest.raises(UsageError, match="does not hash to its key"):
        cache.load(cases[0])


def test_clean_stale_tmp_removes_only_dead_writers_files(tmp_path, cases):
    cache = CaseCache(tmp_path)
    done = cache.store(cases[0], [_result()], 0.0)
    dead = tmp_path / f".{done.name}.tmp-999999999"
    live = tmp_path / f".{done.name}.tmp-{os.getpid()}"
    other = tmp_path / ".notes.txt"
    for p in (dead, live, other):
        p.write_text("{")
    assert cache.clean_stale_tmp() == [dead]
    assert not dead.exists() and live.exists() and other.exists() and done.exists()
    assert cache.files() == [done]  # temporary files are never read as results


def test_frames_round_trip_bit_for_bit():
    rng = np.random.default_rng(0)
    x = rng.standard_normal(50) * 10.0 ** rng.integers(-300, 300, 50)
    df = pd.DataFrame({"x": x, "f32": (x[::-1] / 10.0 ** 280).clip(-1e30, 1e30).astype(np.float32),
                       "odd": [float("nan"), float("inf"), float("-inf"), -0.0, 5e-324] * 10,
                       "i": np.arange(50, dtype=np.int64), "b": [True, False] * 25,
                       "s": ["a", None] * 25, "mixed": [1, "x", 2.5, None, float("nan")] * 10})
    res = AnalysisResult("k", "n", {"t": df}, {}, [], {}, {})
    back = result_from_dict(json.loads(json.dumps(result_to_dict(res), allow_nan=False)))
    got = back.records["t"]
    pd.testing.assert_frame_equal(got, df)
    for col in ("x", "f32", "odd"):  # the same bits, not merely close
        assert got[col].to_numpy().tobytes() == df[col].to_numpy().tobytes()


def test_one_changed_digit_is_a_miss_and_recomputed(tmp_path):
    """Regression: a changed digit in a case file was rendered in a table while the headline
    kept the old value. Now the file fails its hash, and `run` recomputes the case."""
    from varbench.app.runner import run_suite

    suite = fr.write_suite(tmp_path)
    out = tmp_path / "out"
    run_suite(suite, out)
    path = CaseCache(out / "cases").files()[0]
    text = path.read_text()
    i = next(i for i, c in enumerate(text) if c.isdigit() and i > text.index('"results"'))
    path.write_text(text[:i] + str((int(text[i]) + 1) % 10) + text[i + 1:])
    with pytest.raises(UsageError, match="does not match its content hash"):
        load_file(path)
    logs = []
    summary = run_suite(suite, out, log=logs.append)
    assert len(summary.computed) == 1 and any("[corrupt]" in m for m in logs)
    assert read_payload(path)["sha256"] == seal(read_payload(path))["sha256"]


def test_unreadable_case_file_is_a_permission_error_not_corruption(tmp_path, monkeypatch):
    """Regression: a case file another user cannot read was called corrupt and replaced."""
    from varbench.app.runner import run_suite

    suite, out = fr.write_suite(tmp_path), tmp_path / "out"
    run_suite(suite, out)
    path = CaseCache(out / "cases").files()[0]
    real = type(path).read_text

    def denied(self, *a, **k):
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(type(path), "read_text", denied)
    with pytest.raises(UsageError, match="permission denied") as err:
        load_file(path)
    assert "corrupt" not in str(err.value)
    before = path.stat().st_mtime_ns
    with pytest.raises(UsageError, match="permission denied"):  # not recomputed, not replaced
        run_suite(suite, out)
    assert path.stat().st_mtime_ns == before


def test_case_keys_name_device_and_dtype(tmp_path, monkeypatch):
    """The same case on another device or dtype has another key (and another file): a CPU
    result never answers for a CUDA run, nor float32 for bfloat16; a case file of the previous
    key (no placement) is not found."""
    from varbench.app.suite import Case, case_key

    def key(**params):
        return Case(0, "v", "variance", {"preset": "micro", **params}).key

    import torch

    cpu = key(device="cpu")
    assert Case(0, "v", "variance", {"preset": "micro", "device": "cpu"}).config()[
        "placement"] == {"device": "cpu", "dtype": "auto", "threads": torch.get_num_threads()}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # resolved, never used
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert key(device="cuda") != cpu

    def where(**params):
        return Case(0, "v", "variance", {"preset": "micro", **params}).config()["placement"]

    assert where() == where(device="cuda:1") == {"device": "cuda", "dtype": "auto",
                                                 "threads": torch.get_num_threads()}
    assert key(device="cpu", dtype="bfloat16") != cpu
    assert key(device="cpu", dtype="float64") != key(device="cpu", dtype="float32")
    case = Case(0, "v", "variance", {"preset": "micro", "device": "cpu"})
    old = {k: v for k, v in case.config().items() if k != "placement"}
    assert case_key(old) != case.key
    cache = CaseCache(tmp_path)
    assert not cache.has(case)


def test_case_keys_name_the_thread_count(monkeypatch):
    """torch's intra-op thread count changes the order of CPU reductions (results differ at
    ~1e-9 between 1 and 2 threads), so it is part of every case's key: a result computed with
    2 threads never answers for a run with 1 (issue 32)."""
    import torch

    from varbench.app.suite import Case

    cases = [Case(0, "v", "variance", {"preset": "micro", "device": "cpu"}),
             Case(0, "c", "check", {"estimator": "centered", "device": "cpu"})]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    one = [c.key for c in cases]
    assert [c.config()["placement"]["threads"] for c in cases] == [1, 1]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert all(a != c.key for a, c in zip(one, cases, strict=True))
