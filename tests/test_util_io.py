"""varbench._util.io: atomic files and directories (the old version or the whole new one, never
a partial one) and strict JSON of everything varbench records."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from varbench._util import io


def _leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


def test_atomic_write_text_and_bytes(tmp_path):
    p = tmp_path / "a.json"
    assert io.atomic_write(p, "héllo") == p
    assert p.read_text(encoding="utf-8") == "héllo"
    io.atomic_write(str(p), b"\x00\x01", fsync=False)
    assert p.read_bytes() == b"\x00\x01"
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("where", ["fsync", "replace"])
def test_atomic_write_keeps_the_old_file_when_the_write_fails_midway(tmp_path, monkeypatch,
                                                                      where):
    p = tmp_path / "result.json"
    p.write_text("old")

    def boom(*a, **k):
        # the new data is already in the temporary file when this fails
        assert (tmp_path / f".result.json.tmp-{os.getpid()}").read_text() == "new" * 1000
        raise OSError("disk full")

    monkeypatch.setattr(io.os, where, boom)
    with pytest.raises(OSError, match="disk full"):
        io.atomic_write(p, "new" * 1000)
    assert p.read_text() == "old"
    assert _leftovers(tmp_path) == []  # the temporary file is removed


def test_tmp_names_are_recognised():
    assert io.is_tmp_name(f".summary.json.tmp-{os.getpid()}") == ("summary.json", os.getpid())
    assert io.is_tmp_name(".a.tmp-b.tmp-12") == ("a.tmp-b", 12)
    for name in ("summary.json", ".summary.json", ".x.tmp-", ".x.tmp-12a", "x.tmp-12", ".tmp-3"):
        assert io.is_tmp_name(name) is None, name


def test_atomic_dir_replaces_the_whole_directory(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "stale.bin").write_text("x")
    with io.atomic_dir(d) as tmp:
        assert tmp != d and tmp.parent == d.parent and tmp.is_dir()
        (tmp / "model.bin").write_text("new")
        assert (d / "stale.bin").exists()  # the old directory is intact until the block ends
    assert sorted(p.name for p in d.iterdir()) == ["model.bin"]
    assert _leftovers(tmp_path) == []


def test_atomic_dir_keeps_the_old_directory_when_the_block_fails(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "model.bin").write_text("old")
    with pytest.raises(KeyboardInterrupt), io.atomic_dir(d) as tmp:
        (tmp / "model.bin").write_text("half")
        raise KeyboardInterrupt
    assert (d / "model.bin").read_text() == "old"
    assert _leftovers(tmp_path) == []
    with pytest.raises(RuntimeError), io.atomic_dir(tmp_path / "fresh") as tmp:
        raise RuntimeError
    assert not (tmp_path / "fresh").exists()


def test_jsonable_non_finite_numpy_and_torch_scalars():
    data = {
        "nan": float("nan"), "inf": float("inf"), "-inf": -math.inf,
        "np_nan": np.float32("nan"), "np_f": np.float64(0.25), "np_i": np.int64(7),
        "np_b": np.bool_(True), "np_0d": np.array(1.5),
        "t_f": torch.tensor(0.5), "t_i": torch.tensor(3), "t_b": torch.tensor(False),
        "t_nan": torch.tensor(float("nan"), dtype=torch.float64),
        "tuple": (1, (2.0, float("inf"))), "path": Path("a") / "b", 3: None, "s": "x",
    }
    out = io.jsonable(data)
    assert out == {
        "nan": None, "inf": None, "-inf": None, "np_nan": None, "np_f": 0.25, "np_i": 7,
        "np_b": True, "np_0d": 1.5, "t_f": 0.5, "t_i": 3, "t_b": False, "t_nan": None,
        "tuple": [1, [2.0, None]], "path": str(Path("a") / "b"), "3": None, "s": "x",
    }
    assert type(out["np_i"]) is int and type(out["np_f"]) is float and type(out["t_i"]) is int
    assert type(out["np_b"]) is bool and type(out["t_b"]) is bool
    json.dumps(out, allow_nan=False)  # strict JSON
    assert io.jsonable(torch.ones(2)) == str(torch.ones(2))  # not a scalar: its str


class _FullDisk:
    """A file object whose write fails as a full disk does: ENOSPC and no file name."""

    def __init__(self, fh):
        self._fh = fh

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()

    def write(self, data):
        import errno

        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self._fh, name)


def full_disk(monkeypatch):
    """Make every atomic_write hit a full disk (the write raises ENOSPC, naming no file)."""
    real = io.os.fdopen
    monkeypatch.setattr(io.os, "fdopen", lambda *a, **k: _FullDisk(real(*a, **k)))


def test_a_full_disk_during_a_json_write_names_the_path(tmp_path, monkeypatch):
    """ENOSPC from write() carries no file name: the error names the file being written (issue
    32), the old file is kept and no temporary is left."""
    import errno

    p = tmp_path / "summary.json"
    p.write_text("old")
    full_disk(monkeypatch)
    with pytest.raises(OSError) as err:
        io.atomic_write(p, json.dumps({"a": 1}))
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(p)
    assert p.read_text() == "old" and _leftovers(tmp_path) == []


def test_a_full_disk_during_a_suite_run_is_exit_2_naming_the_file(tmp_path, monkeypatch, capsys):
    from varbench.app.cli import main

    suite = tmp_path / "s.toml"
    suite.write_text('[suite]\nname = "s"\n[[cases]]\nname = "c"\nkind = "check"\n'
                     'estimator = "centered"\nnum_steps = 20\nbaselines = []\n')
    full_disk(monkeypatch)
    assert main(["run", str(suite), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and str(tmp_path / "out") in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_writing_turns_a_safetensors_error_into_the_os_error_it_wraps(tmp_path):
    import errno

    from safetensors import SafetensorError

    target = tmp_path / "model.safetensors"
    with pytest.raises(OSError) as err, io.writing(target):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: '
                              'StorageFull, message: "No space left on device" })')
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(target)
    with pytest.raises(OSError) as err, io.writing(target):
        raise SafetensorError("something else")
    assert err.value.errno == errno.EIO and err.value.filename == str(target)
    with pytest.raises(KeyError), io.writing(target):  # not a write error: as it is
        raise KeyError("bug")
