"""Finished cases on disk: one JSON file per case, written atomically.

``OUT/cases/<case name>-<hash>.json`` holds the case's config (name, kind, parameters, varbench
version: the hash), its AnalysisResults (records column by column with their dtypes, floats by
``repr`` so a cached number is the computed one bit for bit) and ``sha256``, the hash of all
that, checked on load: a changed digit makes the file a miss (recomputed), never a result.
A file is written to a temporary name and moved into place with ``os.replace``: a run killed
mid-write leaves a temporary file that is never read as a result (and is removed by the next
run once its writer is gone). JSON, not pickle: merging shard directories from
other machines must not execute anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from varbench._util.checks import UsageError
from varbench._util.io import (
    IntegrityError,
    atomic_write,
    check_seal,
    frame_from_data,
    frame_to_data,
    inside,
    is_tmp_name,
    jsonable,
    safe_name,
    seal_json,
)
from varbench._util.locks import pid_alive
from varbench.app.suite import Case, case_key
from varbench.report.result import AnalysisResult, Headline

FORMAT = "varbench.case/2"  # 2: exact frames, content hash


def result_to_dict(r: AnalysisResult) -> dict[str, Any]:
    """An AnalysisResult as strict JSON-ready data."""
    return {
        "kind": r.kind, "name": r.name,
        "records": {k: frame_to_data(df) for k, df in r.records.items()},
        "summary": jsonable(r.summary), "headlines": [jsonable(h.to_dict()) for h in r.headlines],
        "config": jsonable(r.config), "provenance": jsonable(r.provenance),
        "notes": list(r.notes),
    }


_RESULT_TYPES = {"kind": str, "name": str, "records": dict, "summary": dict, "headlines": list,
                 "config": dict, "provenance": dict, "notes": list}


def check_result_dict(d: Any) -> None:
    """Refuse data :func:`result_to_dict` never writes (ValueError naming the key): a sealed
    file from elsewhere is checked against the schema before it is copied or rendered."""
    if not isinstance(d, dict):
        raise ValueError(f"a result must be an object, got {type(d).__name__}")
    for key, typ in _RESULT_TYPES.items():
        if not isinstance(d.get(key), typ):
            raise ValueError(f"result key {key!r} must be a {typ.__name__}, got {d.get(key)!r:.80}")
    for k, v in d["records"].items():
        if not isinstance(v, dict):
            raise ValueError(f"records[{k!r}] must be an object (a frame), got {v!r:.80}")
    for h in d["headlines"]:
        if not isinstance(h, dict) or not isinstance(h.get("key"), str) or not isinstance(
                h.get("text"), str):
            raise ValueError(f"a headline must have a string key and text, got {h!r:.80}")
        for f in ("value", "se", "ci_lo", "ci_hi", "level"):
            v = h.get(f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float, str))):
                raise ValueError(f"headline {h['key']!r}: {f}={v!r:.80} is not a number")
    if not all(isinstance(n, str) for n in d["notes"]):
        raise ValueError("notes must be strings")


def result_from_dict(d: dict[str, Any]) -> AnalysisResult:
    """Inverse of :func:`result_to_dict` (checked by :func:`check_result_dict` first)."""
    check_result_dict(d)
    records = {k: frame_from_data(v) for k, v in d["records"].items()}
    heads = [Headline.from_dict(h) for h in d["headlines"]]
    return AnalysisResult(d["kind"], d["name"], records, d["summary"], heads, d["config"],
                          d["provenance"], d["notes"])


class CaseCache:
    """The ``cases/`` directory of one output directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, case: Case | str) -> Path:
        """The file of ``case`` (or of a case key), checked to stay inside :attr:`root`."""
        key = case if isinstance(case, str) else case.key
        return inside(self.root, safe_name("case key", key) + ".json", what="case file")

    def has(self, case: Case) -> bool:
        return self.path(case).is_file()

    def load(self, case: Case) -> list[AnalysisResult]:
        """The stored results of ``case``; ValueError naming the file if it is corrupt."""
        return load_file(self.path(case), expect_key=case.key)

    def store(self, case: Case, results: list[AnalysisResult], wall_time_s: float) -> Path:
        """Write ``case``'s results atomically (tmp file + fsync + os.replace)."""
        payload = seal_json({"format": FORMAT, "key": case.key, "config": jsonable(case.config()),
                        "wall_time_s": wall_time_s,
                        "results": [result_to_dict(r) for r in results]})
        return atomic_write(self.path(case), json.dumps(payload, allow_nan=False))

    def clean_stale_tmp(self) -> list[Path]:
        """Remove temporary files whose writer process is gone; returns what was removed."""
        gone = []
        for p in self.root.iterdir():
            tmp = is_tmp_name(p.name)
            if tmp is not None and not pid_alive(tmp[1]):
                p.unlink(missing_ok=True)
                gone.append(p)
        return gone

    def files(self) -> list[Path]:
        """Case files of this directory; a symlink that leads outside it is an error."""
        found = sorted(p for p in self.root.glob("*.json") if not p.name.startswith("."))
        return [inside(self.root, p.name, what="case file") for p in found]


def load_file(path: Path, expect_key: str | None = None) -> list[AnalysisResult]:
    """Read one case file; IntegrityError (a UsageError) naming it when it is corrupt, changed
    or not the expected case; UsageError when it cannot be read (permission)."""
    payload = read_payload(path)
    if expect_key is not None and payload.get("key") != expect_key:
        raise IntegrityError(f"case file {path} holds case {payload.get('key')!r}, "
                             f"expected {expect_key!r}")
    config = payload.get("config")
    if not isinstance(config, dict) or case_key(config) != payload.get("key"):
        raise IntegrityError(f"case file {path}: its config does not hash to its key "
                             f"{payload.get('key')!r} (results of another case or version)")
    try:
        if not isinstance(payload.get("results"), list):
            raise ValueError("'results' must be a list")
        return [result_from_dict(d) for d in payload["results"]]
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise IntegrityError(f"case file {path} is corrupt ({type(err).__name__}: {err})"
                             ) from None


def read_payload(path: Path) -> dict[str, Any]:
    """The raw JSON of a case file, checked for the format tag and its content hash.

    A file that cannot be read for lack of permission raises a UsageError saying so (the
    caller must not treat it as corrupt and overwrite it); a changed or torn file raises
    :class:`~varbench._util.io.IntegrityError` naming it.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except PermissionError as err:
        raise UsageError(f"cannot read case file {str(path)!r}: permission denied "
                         f"({err.strerror})") from None
    except OSError as err:
        raise IntegrityError(f"case file {path} is unreadable ({err})") from None
    try:
        payload = json.loads(text)
    except ValueError as err:
        raise IntegrityError(f"case file {path} is corrupt or unreadable ({err})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise IntegrityError(f"case file {path} is not a varbench case file (format {FORMAT})")
    return check_seal(payload, f"case file {path}")
