"""Files written whole or not at all, and strict JSON for anything varbench records."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from varbench._util.checks import UsageError, UsageTypeError


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
    tmp.unlink(missing_ok=True)  # a stale temporary of a dead writer with our pid
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        with writing(path), os.fdopen(os.open(tmp, flags, 0o666), mode, **kwargs) as fh:
            fh.write(data)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink(missing_ok=True)
    return path


@contextlib.contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Errors of a write to ``path`` as an OSError naming it: an OSError without a file name
    (a full disk: ``write`` raises ENOSPC with none) gets ``path``; a safetensors writer's
    ``SafetensorError`` becomes the OSError it wraps (its errno, else EIO). The command line
    prints those as the path and the reason, exit 2."""
    try:
        yield
    except OSError as err:
        if err.filename is None:
            raise OSError(err.errno, err.strerror or str(err), str(path)) from err
        raise
    except Exception as err:
        if type(err).__name__ != "SafetensorError":
            raise
        code = re.search(r"code: (\d+)", str(err))
        num = int(code.group(1)) if code else errno.EIO
        raise OSError(num, os.strerror(num) if code else f"cannot write ({err})",
                      str(path)) from err


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


# ----------------------------------------------------------------------------- safe paths
# Names that come from data (suite names, case keys, shard files) become at most one path
# component: letters, digits, '_', '-', '.', not starting with '.', bounded length (a file
# system allows 255 bytes; a key adds a hash and ".json").
MAX_NAME = 128
_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


def safe_name(what: str, value: Any) -> str:
    """Return ``value`` if it is a safe single path component, else UsageError naming it.

    Refused: non-strings, empty, absolute paths, separators, ``..``, NUL and other control
    characters, a leading ``.``, non-ASCII and names longer than :data:`MAX_NAME`.
    """
    if (not isinstance(value, str) or len(value) > MAX_NAME or not _SAFE_NAME.fullmatch(value)
            or ".." in value):
        shown = value if not isinstance(value, str) or len(value) <= 80 else value[:80] + "..."
        raise UsageError(f"{what}={shown!r} is not a safe name; expected 1-{MAX_NAME} letters, "
                         "digits, '_', '-', '.' (no '/', '..', leading '.', NUL)")
    return value


def inside(root: str | Path, *parts: str, what: str = "path") -> Path:
    """``root/parts...`` after checking it resolves (symlinks followed) inside ``root``."""
    root = Path(root)
    path = root.joinpath(*parts)
    try:
        real_root, real = root.resolve(), path.resolve()
    except (OSError, RuntimeError, ValueError) as err:
        raise UsageError(f"{what} {str(path)!r} cannot be resolved ({err})") from None
    if real != real_root and real_root not in real.parents:
        raise UsageError(f"{what} {str(path)!r} resolves to {str(real)!r}, outside "
                         f"{str(root)!r}; refusing to write or read there")
    return path


def check_path(what: str, value: Any) -> Path:
    """A user-given path as a Path; UsageError for non-paths, NUL bytes and over-long names."""
    if not isinstance(value, (str, os.PathLike)):
        raise UsageTypeError(f"{what}={value!r} is not a path")
    text = os.fspath(value)
    if isinstance(text, bytes) or "\x00" in text:
        raise UsageError(f"{what}={text!r} is not a valid path (contains a NUL byte)")
    if any(len(part.encode()) > 255 for part in Path(text).parts):
        raise UsageError(f"{what}={text[:80]!r}... is not a valid path (a component is longer "
                         "than 255 bytes)")
    return Path(text)


# ----------------------------------------------------------------------------- content hashes
DIGEST_FILE = "varbench_sha256.json"


class IntegrityError(UsageError):
    """A file's content does not match the hash written with it (the message names it)."""


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_digest(directory: str | Path) -> Path:
    """Write ``DIGEST_FILE`` into ``directory``: the SHA-256 of every other file in it.

    Call it last, inside the :func:`atomic_dir` block, so the hashes move into place with the
    files they cover."""
    directory = Path(directory)
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != DIGEST_FILE)
    table = {p.relative_to(directory).as_posix(): file_sha256(p) for p in files}
    return atomic_write(directory / DIGEST_FILE,
                        json.dumps({"sha256": table}, indent=1, sort_keys=True) + "\n")


def verify_digest(directory: str | Path, what: str) -> None:
    """Check every file of ``directory`` against its ``DIGEST_FILE``.

    Raises :class:`IntegrityError` naming the first file that is missing, extra or changed
    (or the digest file itself when it is absent or unreadable as JSON). A permission error is
    raised as such (``PermissionError``), never reported as corruption.
    """
    directory = Path(directory)
    path = directory / DIGEST_FILE
    try:
        table = json.loads(path.read_text(encoding="utf-8"))["sha256"]
    except FileNotFoundError:
        raise IntegrityError(f"{what} {str(directory)!r} has no {DIGEST_FILE} (incomplete, or "
                             "written by an older varbench)") from None
    except (ValueError, KeyError, TypeError) as err:
        raise IntegrityError(f"{what}: {str(path)!r} is corrupt ({err})") from None
    if not isinstance(table, dict):
        raise IntegrityError(f"{what}: {str(path)!r} is corrupt (no hash table)")
    present = {p.relative_to(directory).as_posix() for p in directory.rglob("*")
               if p.is_file() and p.name != DIGEST_FILE}
    for rel in sorted(present | set(table)):
        if rel not in table:
            raise IntegrityError(f"{what}: {str(directory / rel)!r} is not covered by its "
                                 f"{DIGEST_FILE} (added after it was written)")
        if rel not in present:
            raise IntegrityError(f"{what}: {str(directory / rel)!r} is missing")
        if file_sha256(directory / rel) != table[rel]:
            raise IntegrityError(f"{what}: {str(directory / rel)!r} does not match its content "
                                 "hash (changed or corrupt)")


def text_sha256(text: str) -> str:
    """Hex SHA-256 of ``text`` encoded as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ----------------------------------------------------------------------------- exact frames
# JSON numbers are written with repr (shortest round-trip), so a float64 read back is the same
# float bit for bit; non-finite floats, which strict JSON lacks, are the strings below.
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _float_out(v: float) -> float | str:
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def _float_in(v: Any) -> float:
    if isinstance(v, str):
        if v not in _NONFINITE:
            raise ValueError(f"{v!r} is not a float")
        return _NONFINITE[v]
    if v is None:
        return math.nan
    return float(v)


def _object_out(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return {"float": _float_out(v)}
    if hasattr(v, "item") and getattr(v, "ndim", 1) == 0:
        return _object_out(v.item())
    return v if v is None or isinstance(v, (str, bool, int, float)) else str(v)


def _object_in(v: Any) -> Any:
    return _float_in(v["float"]) if isinstance(v, dict) else v


_NUMPY_DTYPES = {"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
                 "uint16", "uint32", "uint64", "bool"}


def frame_to_data(df: Any) -> dict[str, Any]:
    """A DataFrame as strict JSON data that :func:`frame_from_data` restores exactly: values
    bit for bit (floats by repr, NaN/inf by name), dtypes and column order kept; the index is
    dropped. Columns of another dtype (strings, mixed) are stored as objects."""
    df = df.reset_index(drop=True)
    cols = []
    for name in df.columns:
        s = df[name]
        kind = s.dtype.kind if str(s.dtype) in _NUMPY_DTYPES else "O"
        if kind == "f":
            values = [_float_out(float(v)) for v in s.tolist()]
        elif kind in "iub":
            values = s.tolist()
        else:  # strings (object or pandas' str dtype), mixed objects, categories
            values = [_object_out(v) for v in s.tolist()]
        cols.append({"name": str(name), "dtype": str(s.dtype), "values": values})
    return {"rows": len(df), "columns": cols}


def frame_from_data(data: dict[str, Any]) -> Any:
    """Inverse of :func:`frame_to_data`; ValueError/KeyError/TypeError on malformed data."""
    import numpy as np
    import pandas as pd

    out = {}
    for col in data["columns"]:
        dtype, values = col["dtype"], col["values"]
        if len(values) != data["rows"]:
            raise ValueError(f"column {col['name']!r} has {len(values)} values, "
                             f"expected {data['rows']}")
        kind = np.dtype(dtype).kind if dtype in _NUMPY_DTYPES else "O"
        if kind == "f":
            out[col["name"]] = pd.Series([_float_in(v) for v in values], dtype="float64"
                                         ).astype(dtype)
        elif kind in "iub":
            out[col["name"]] = pd.Series(values, dtype=dtype)
        else:
            out[col["name"]] = pd.Series([_object_in(v) for v in values], dtype=object)
            if dtype != "object":
                out[col["name"]] = out[col["name"]].astype(pd.api.types.pandas_dtype(dtype))
    return pd.DataFrame(out, index=pd.RangeIndex(data["rows"]))


def seal_json(payload: dict[str, Any]) -> dict[str, Any]:
    """``payload`` plus ``sha256``: the hash of its canonical JSON (sorted keys) without it.

    Floats are written by ``repr`` and read back exactly, so the hash of what is read equals
    the hash of what was written unless a byte of the content changed."""
    body = {k: v for k, v in payload.items() if k != "sha256"}
    return {**body, "sha256": text_sha256(json.dumps(body, sort_keys=True, allow_nan=False))}


def check_seal(payload: Any, what: str) -> dict[str, Any]:
    """``payload`` if its ``sha256`` matches its content, else :class:`IntegrityError`."""
    if not isinstance(payload, dict) or "sha256" not in payload:
        raise IntegrityError(f"{what} has no content hash (written by an older varbench?)")
    try:
        ok = seal_json(payload)["sha256"] == payload["sha256"]
    except (TypeError, ValueError):  # non-finite numbers or other non-JSON data
        ok = False
    if not ok:
        raise IntegrityError(f"{what} does not match its content hash (changed or corrupt)")
    return payload


# ----------------------------------------------------------------------------- record files
def jsonl_rows(p: Path, text: str, *, what: str) -> list[dict[str, Any]]:
    """The JSON objects of ``text`` (the JSONL file ``p``), one a line, blank lines skipped;
    UsageError ``"<what>='<p>': line N ..."`` for a line that is not a JSON object."""
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise UsageError(f"{what}={str(p)!r}: line {i} is not valid JSON ({err})") from None
        if not isinstance(row, dict):
            raise UsageError(f"{what}={str(p)!r}: line {i} is not a JSON object")
        rows.append(row)
    return rows


def parquet_rows(p: Path, *, what: str, extra: str) -> list[dict[str, Any]]:
    """The rows of the Parquet file ``p`` as dicts; UsageError naming ``what``, the path and
    the extra to install (``pip install 'varbench[<extra>]'``) when pyarrow is missing."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UsageError(f"{what}={str(p)!r}: reading .parquet needs pyarrow; pip install "
                         f"'varbench[{extra}]'") from None
    try:
        return pq.read_table(p).to_pylist()
    except Exception as err:  # noqa: BLE001 - a corrupt file: name it
        raise UsageError(f"{what}={str(p)!r}: cannot read parquet file ({err})") from None
