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


def test_a_corrupt_or_changed_cell_is_named_and_recomputed(tmp_path):
    """A truncated file or one changed digit fails the content hash: a warning names the file
    and the cell is a miss (recomputed and rewritten), never a stale or half-read frame."""
    cache = CellCache(tmp_path, {"M": 4})
    cache.save("x", _frame())
    path = tmp_path / f"{cache.tag}__x.json"
    good = path.read_text()
    path.write_text(good[:40])
    with pytest.warns(UserWarning, match=r"__x\.json.*recomputing the cell"):
        assert cache.load("x") is None
    assert "1234567890123456" in good
    path.write_text(good.replace("1234567890123456", "1234567890123457"))
    with pytest.warns(UserWarning, match=r"__x\.json.*recomputing the cell"):
        assert cache.load("x") is None
    cache.save("x", _frame())  # the recomputed cell replaces it
    pd.testing.assert_frame_equal(cache.load("x"), _frame(), rtol=0, atol=0)


def test_cells_round_trip_bit_for_bit_with_non_finite_values(tmp_path):
    cache = CellCache(tmp_path, {"M": 4})
    df = pd.DataFrame({"v": [0.1 + 0.2, 1 / 3, float("nan"), float("inf"), -0.0],
                       "n": [1, 2, 3, 4, 5]})
    cache.save("y", df)
    back = cache.load("y")
    assert [float(x).hex() for x in back["v"]] == [float(x).hex() for x in df["v"]]
    assert back["n"].dtype == df["n"].dtype


def test_an_unreadable_cell_is_a_permission_error_not_corruption(tmp_path, monkeypatch):
    from pathlib import Path

    cache = CellCache(tmp_path, {"M": 4})
    cache.save("x", _frame())
    path = tmp_path / f"{cache.tag}__x.json"

    def denied(self, *a, **k):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "read_text", denied)
    with pytest.raises(UsageError, match="permission denied"):
        cache.load("x")
    monkeypatch.undo()
    assert path.is_file()  # never deleted or overwritten


def test_concat_skips_missing_and_empty_frames():
    a, b = _frame(), _frame().iloc[:1]
    out = concat([a, None, pd.DataFrame(), b])
    assert len(out) == 3 and list(out.index) == [0, 1, 2]
    assert concat([]).empty and concat([None, pd.DataFrame()]).empty


def test_cell_keys_name_device_and_dtype(tmp_path):
    """Regression: cell keys left out device and dtype, while CPU and CUDA generators draw
    different tokens for one seed: cells of the two silently mixed."""
    import torch

    from varbench.analysis._common import placement_of

    cfg = {"M": 4}
    model = torch.nn.Linear(2, 2)
    cpu32 = placement_of({"a": model})
    threads = torch.get_num_threads()
    assert cpu32 == {"device": ["cpu"], "dtype": ["float32"], "threads": [threads]}
    cpu64 = placement_of(model.double())
    before = torch.get_num_threads()
    torch.set_num_threads(1 if threads != 1 else 2)
    try:  # the thread count moves reductions at ~1e-9 (issue 32): another key
        other_threads = placement_of(model.float())
    finally:
        torch.set_num_threads(before)
    assert other_threads["threads"] != cpu32["threads"]
    base = CellCache(tmp_path, cfg, placement=cpu32)
    base.save("c", _frame())
    for other in (cpu64, other_threads, {"device": ["cuda"], "dtype": ["float32"]}, None):
        moved = CellCache(tmp_path, cfg, placement=other)
        assert moved.tag != base.tag and moved.load("c") is None
    assert CellCache(tmp_path, cfg, placement=dict(cpu32)).load("c") is not None


def test_cells_of_the_previous_format_are_not_reused(tmp_path):
    """A cell written under format 3 (no device in its key) is a miss, never a result."""
    import hashlib
    import json

    from varbench.analysis import _common

    cfg = {"M": 4}
    old = hashlib.sha256(json.dumps({"format": 3, **cfg}, sort_keys=True).encode()).hexdigest()
    new = CellCache(tmp_path, cfg)
    assert _common._CELL_FORMAT == 4 and new.tag != old[:12]
