"""Shared plumbing of the analyses: cell cache (resume), policy states, progress, provenance."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from io import StringIO
from pathlib import Path
from typing import Any

import pandas as pd

from varbench._util.checks import UsageError
from varbench._util.io import atomic_write

# Bump when the columns a cell stores change: old cells then miss instead of loading stale.
_CELL_FORMAT = 2


class CellCache:
    """Finished analysis cells stored as files under ``root`` (None: no caching).

    A cell is written atomically (temporary file + ``os.replace``), so an interrupted run
    leaves only whole cells; rerunning with the same configuration skips them. The key hashes
    the analysis configuration, so a changed configuration never reads stale cells.
    """

    def __init__(self, root: str | Path | None, config: dict[str, Any]) -> None:
        self.root = None if root is None else Path(root)
        blob = json.dumps({"format": _CELL_FORMAT, **config}, sort_keys=True, default=str).encode()
        self.tag = hashlib.sha256(blob).hexdigest()[:12]
        if self.root is not None:
            self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, name: str) -> Path:
        assert self.root is not None
        return self.root / f"{self.tag}__{name}.json"

    def load(self, name: str) -> pd.DataFrame | None:
        """The cached frame of cell ``name``, or None (also when no cache directory is set)."""
        if self.root is None or not self._path(name).is_file():
            return None
        try:
            return pd.read_json(StringIO(self._path(name).read_text()), orient="table")
        except ValueError as err:
            raise UsageError(
                f"cache file {self._path(name)} is corrupt ({err}); delete it to recompute"
            ) from None

    def save(self, name: str, df: pd.DataFrame) -> None:
        """Store cell ``name`` atomically (no-op without a cache directory)."""
        if self.root is None:
            return
        # 15 significant digits (pandas' maximum): a resumed cell equals the original to ~1e-15.
        atomic_write(self._path(name), df.reset_index(drop=True).to_json(
            orient="table", index=False, double_precision=15))


def concat(frames: Iterable[pd.DataFrame]) -> pd.DataFrame:
    frames = [f for f in frames if f is not None and len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
