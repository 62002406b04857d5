"""Files written whole or not at all, and strict JSON for anything varbench records."""

from __future__ import annotations

import contextlib
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def atomic_write(path: str | Path, data: str | bytes, *, fsync: bool = True) -> Path:
    """Write ``data`` to ``path`` so that a reader sees the old file or the whole new one.

    The data goes to a temporary file beside ``path`` (named after this process, so a writer
    killed mid-write leaves a file that is never read as a result), is flushed and fsynced, and
    is moved into place with ``os.replace``. Returns ``path``.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    mode = "wb" if isinstance(data, bytes) else "w"
    kwargs = {} if isinstance(data, bytes) else {"encoding": "utf-8"}
    try:
        with open(tmp, mode, **kwargs) as fh:
            fh.write(data)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink(missing_ok=True)
    return path


def is_tmp_name(name: str) -> tuple[str, int] | None:
    """``(target name, writer pid)`` when ``name`` is a temporary file of :func:`atomic_write`."""
    if not name.startswith(".") or ".tmp-" not in name:
        return None
    target, _, pid = name[1:].rpartition(".tmp-")
    return (target, int(pid)) if pid.isdigit() and target else None


def jsonable(obj: Any) -> Any:
    """``obj`` as strict JSON data: NaN/inf become None, numpy and torch scalars plain numbers,
    tuples lists, paths and other objects their ``str``."""
    import numpy as np

    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        return float(obj) if math.isfinite(float(obj)) else None
    if obj is None or isinstance(obj, str):
        return obj
    if hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:
        return jsonable(obj.item())
    return str(obj)


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Build a directory in a temporary sibling and move it to ``path`` only when the block
    completes, so ``path`` is the old directory or the whole new one, never a partial one.

    Yields the temporary directory to fill. Files written into it should be fsynced by their
    writers where it matters (checkpoints); the final rename is atomic on one file system.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
