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
from varbench.app.cache import CaseCache, load_file, read_payload, result_from_dict, result_to_dict
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
    path.write_text(json.dumps({"format": "varbench.case/1", "key": cases[0].key,
                                "results": [{"kind": "x"}]}))
    with pytest.raises(UsageError, match=r"is corrupt \(KeyError"):
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
