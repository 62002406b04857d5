"""varbench.analysis._common: the cell cache behind resumable analyses (keyed by the
configuration, written atomically, corrupt files named) and frame concatenation."""

from __future__ import annotations

import pandas as pd
import pytest

from varbench._util.checks import UsageError
from varbench.analysis._common import CellCache, concat


def _frame():
    return pd.DataFrame({"scheme": ["otb", "centered"], "G": [2, 4],
                         "variance": [0.1234567890123456, 3.0], "ok": [True, False]})


def test_round_trip_keyed_by_the_configuration(tmp_path):
    cache = CellCache(tmp_path / "cells", {"M": 4, "schemes": ["otb"]})
    assert cache.load("p0_G2") is None
    df = _frame().set_index("scheme")  # the index is dropped on save
    cache.save("p0_G2", df)
    back = cache.load("p0_G2")
    pd.testing.assert_frame_equal(back, df.reset_index(drop=True), rtol=1e-15)
    assert [p.name for p in (tmp_path / "cells").iterdir()] == [f"{cache.tag}__p0_G2.json"]
    same = CellCache(tmp_path / "cells", {"schemes": ["otb"], "M": 4})  # key order is irrelevant
    assert same.tag == cache.tag and same.load("p0_G2") is not None
    other = CellCache(tmp_path / "cells", {"M": 5, "schemes": ["otb"]})
    assert other.tag != cache.tag and other.load("p0_G2") is None  # never a stale cell


def test_no_directory_means_no_cache(tmp_path):
    cache = CellCache(None, {"M": 4})
    cache.save("x", _frame())
    assert cache.load("x") is None
    assert list(tmp_path.iterdir()) == []


def test_a_corrupt_cell_is_named(tmp_path):
    cache = CellCache(tmp_path, {"M": 4})
    cache.save("x", _frame())
    path = tmp_path / f"{cache.tag}__x.json"
    path.write_text(path.read_text()[:40])
    with pytest.raises(UsageError, match=r"cache file .*__x\.json is corrupt.*delete it"):
        cache.load("x")


def test_concat_skips_missing_and_empty_frames():
    a, b = _frame(), _frame().iloc[:1]
    out = concat([a, None, pd.DataFrame(), b])
    assert len(out) == 3 and list(out.index) == [0, 1, 2]
    assert concat([]).empty and concat([None, pd.DataFrame()]).empty
