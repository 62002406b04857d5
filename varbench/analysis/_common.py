"""Shared plumbing of the analyses: cell cache (resume), policy states, progress, provenance."""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pandas as pd

from varbench._util.checks import UsageError
from varbench._util.io import atomic_write, check_seal, frame_from_data, frame_to_data, seal_json

# Bump when the columns a cell stores change: old cells then miss instead of loading stale.
# 4: keys name the device type and dtype (cells computed before that never load as current)
_CELL_FORMAT = 4


class CellCache:
    """Finished analysis cells stored as files under ``root`` (None: no caching).

    A cell is written atomically (temporary file + ``os.replace``), so an interrupted run
    leaves only whole cells; rerunning with the same configuration skips them. The key hashes
    the analysis configuration, so a changed configuration never reads stale cells, and
    ``placement`` (:func:`placement_of` the policies: device type and dtype; CPU and CUDA
    generators draw different tokens for one seed, so their cells must never mix).
    """

    def __init__(self, root: str | Path | None, config: dict[str, Any], *,
                 placement: dict[str, Any] | None = None) -> None:
        self.root = None if root is None else Path(root)
        key = {"format": _CELL_FORMAT, **config}
        if placement is not None:
            key["placement"] = placement
        blob = json.dumps(key, sort_keys=True, default=str).encode()
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
        path = self._path(name)
        try:
            text = path.read_text(encoding="utf-8")
        except PermissionError as err:  # another user's cell: say so, never recompute over it
            raise UsageError(f"cannot read cache file {str(path)!r}: permission denied "
                             f"({err.strerror})") from None
        try:
            return frame_from_data(check_seal(json.loads(text), f"cache file {path}")["frame"])
        except (ValueError, KeyError, TypeError) as err:
            warnings.warn(f"cache file {str(path)!r} is corrupt ({err}); recomputing the cell",
                          stacklevel=2)
            return None  # a miss: the cell is recomputed and rewritten

    def save(self, name: str, df: pd.DataFrame) -> None:
        """Store cell ``name`` atomically (no-op without a cache directory)."""
        if self.root is None:
            return
        # repr floats and a content hash: a resumed cell is the computed one bit for bit.
        atomic_write(self._path(name), json.dumps(seal_json({"frame": frame_to_data(df)}),
                                                  allow_nan=False))


def placement_of(policies: Any) -> dict[str, list[str]]:
    """``{"device": [types], "dtype": [names]}`` of a Policy, a model or a ``{name: Policy}``
    mapping (sorted, distinct): the part of a cell key that says where the cell was computed.
    The device *type* only: ``cuda:0`` and ``cuda:1`` draw alike, so torchrun ranks agree. On
    the CPU also ``"threads"``: torch's intra-op thread count changes reduction orders (results
    move at ~1e-9), so a cell computed with 2 threads is not reused under 1."""
    import torch

    items = policies.values() if isinstance(policies, dict) else [policies]
    devices, dtypes = set(), set()
    for pol in items:
        model = getattr(pol, "model", pol)
        p = next(model.parameters())
        devices.add(p.device.type)
        dtypes.add(str(p.dtype).removeprefix("torch."))
    out: dict[str, list] = {"device": sorted(devices), "dtype": sorted(dtypes)}
    if "cpu" in devices:
        out["threads"] = [torch.get_num_threads()]
    return out


def concat(frames: Iterable[pd.DataFrame]) -> pd.DataFrame:
    frames = [f for f in frames if f is not None and len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
