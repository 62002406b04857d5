"""Per-step training records, appended to a CSV as each step finishes.

Each row is flushed and fsynced when written, so an interrupted run keeps every finished step.
A resumed run first truncates the file to the checkpoint's step (rows written after the last
checkpoint are recomputed, identically, by the resumed run), after checking the history it keeps
is whole and ends in the checkpoint's own last row. Keys are namespaced like cleanrl's
(``train/...``, ``eval/...``); a value that was not measured at a step is empty (NaN).
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import os
from collections.abc import Mapping
from pathlib import Path

import pandas as pd

from varbench._util.checks import UsageError, UsageFileNotFoundError
from varbench._util.io import atomic_write

# The fixed column set, in file order. Row 0 is the starting policy (evaluation only).
FIELDS: tuple[str, ...] = (
    "step",
    "tokens/sampled",  # cumulative policy-generated tokens (mask == 1) over training samples
    "tokens/env",  # cumulative environment (tool output) tokens: context, never loss
    "tokens/step_sampled",
    "train/reward_mean",  # the training reward on this step's samples
    "train/reward_std",
    "train/exact_mean",  # exact-match accuracy of this step's samples (== reward for exact)
    "train/all_agree_frac",  # fraction of groups whose rewards are all equal
    "train/groups_used",  # groups that reached the update (after dynamic filtering)
    "train/response_len",  # mean policy tokens per response
    "eval/acc_sampled",  # held-out exact-match accuracy, temperature-1 samples
    "eval/acc_greedy",  # held-out exact-match accuracy, greedy decoding
    "eval/reward_sampled",  # held-out mean of the training reward (reward-hacking probe)
    "loss/policy",
    "loss/kl",
    "loss/total",
    "grad/norm",  # global gradient norm before clipping, mean over the step's updates
    "grad/norm_max",
    "policy/entropy",  # mean per-token entropy of the sampling policy on this step's samples
    "policy/kl_ref",  # mean k3 KL(pi_old || ref) per token on this step's samples
    "ppo/clip_frac",
    "ppo/approx_kl",
    "adv/mean",  # over valid tokens
    "adv/std",
    "adv/abs_mean",
    "adv/nonzero_frac",  # fraction of responses with a non-zero Delta somewhere
    "lr",
    "collapse/grad_surge",  # 1 when grad/norm > surge_factor x running median
    "collapse/entropy",  # 1 when entropy < entropy_floor x its first-step value
    "time/sample_s",
    "time/score_s",
    "time/adv_s",
    "time/update_s",
    "time/eval_s",
    "time/step_s",
    "time/wall_s",  # cumulative wall time of the run (resumed runs continue the count)
)

# Columns that depend on the machine's clock, excluded when comparing two runs' records.
TIMING_FIELDS: tuple[str, ...] = tuple(f for f in FIELDS if f.startswith("time/"))


def _fmt(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        return repr(value)  # round-trips exactly
    return str(value)


class RecordWriter:
    """Append-only CSV writer of per-step records (one row per call to :meth:`write`)."""

    def __init__(self, path: str | Path, *, resume_step: int | None = None,
                 last_row: Mapping[str, object] | None = None,
                 records_sha256: str | None = None) -> None:
        """Open ``path``; with ``resume_step`` keep only rows with ``step <= resume_step``.

        Without ``resume_step`` an existing file is replaced (a fresh run). With it, the kept
        history must be whole: steps 0..resume_step once each, and (when the checkpoint saved
        it) the last row equal to ``last_row``; otherwise UsageError naming the file and the
        gap, duplicate or differing value (a resumed run never continues a broken history).
        ``records_sha256`` (the :attr:`digest` the checkpoint saved): the kept rows must hash
        to it, so an edited row anywhere in the history is refused, not only the last.
        """
        self._hash = hashlib.sha256()
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            if not self.path.is_file():
                raise UsageError(
                    f"cannot resume: records file {str(self.path)!r} is missing but the "
                    f"checkpoint is at step {resume_step} (the history would have a gap); "
                    "restore it or start the run afresh")
            kept = [r for r in _read_rows(self.path) if _step(self.path, r) <= resume_step]
            check_history(self.path, kept, resume_step, last_row)
            for r in kept:
                self._hash.update(_line(r).encode() + b"\n")
            if records_sha256 is not None and self.digest != records_sha256:
                raise UsageError(
                    f"cannot resume: the rows 0..{resume_step} of {str(self.path)!r} differ from "
                    "the ones the checkpoint recorded (their SHA-256 does not match): the file "
                    "was edited or comes from another run; restore it or start the run afresh")
            buf = io.StringIO(newline="")
            w = csv.DictWriter(buf, fieldnames=FIELDS)
            w.writeheader()
            w.writerows(kept)
            atomic_write(self.path, buf.getvalue())
        else:
            with open(self.path, "w", newline="") as fh:
                csv.DictWriter(fh, fieldnames=FIELDS).writeheader()

    def write(self, row: Mapping[str, object]) -> None:
        """Append one row; unknown keys raise ValueError naming them and the valid keys."""
        unknown = set(row) - set(FIELDS)
        if unknown:
            raise ValueError(f"record keys {sorted(unknown)} are not valid; valid: {list(FIELDS)}")
        line = _line({k: _fmt(row.get(k)) for k in FIELDS})
        with open(self.path, "a", newline="") as fh:
            fh.write(line + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        self._hash.update(line.encode() + b"\n")

    @property
    def digest(self) -> str:
        """SHA-256 of every row written (and kept on resume) so far, as the file holds them:
        saved with each checkpoint, checked on resume."""
        return self._hash.hexdigest()


def check_history(path: Path, rows: list[dict[str, str]], step: int,
                  last_row: Mapping[str, object] | None) -> None:
    """UsageError unless ``rows`` are steps 0..``step`` once each, ending in ``last_row``."""
    steps = [int(r["step"]) for r in rows]
    if steps != list(range(step + 1)):
        seen = set(steps)
        gaps = [s for s in range(step + 1) if s not in seen]
        dups = sorted({s for s in steps if steps.count(s) > 1})
        what = (f"missing steps {gaps[:10]}{'...' if len(gaps) > 10 else ''}" if gaps
                else f"duplicated steps {dups[:10]}" if dups else "steps out of order")
        raise UsageError(
            f"cannot resume: records file {str(path)!r} does not match the checkpoint at step "
            f"{step}: {what} (it holds {len(steps)} row(s) up to that step, expected "
            f"{step + 1}); restore it or start the run afresh")
    if last_row is not None:
        diff = [k for k in FIELDS if rows[-1].get(k, "") != _fmt(last_row.get(k))]
        if diff:
            raise UsageError(
                f"cannot resume: the last row (step {step}) of {str(path)!r} differs from the "
                f"checkpoint's in {diff[:5]}: the records and the checkpoint come from "
                "different runs; restore it or start the run afresh")


def as_records(df: pd.DataFrame) -> pd.DataFrame:
    """The records' one layout: the :data:`FIELDS` columns as float64, ``step`` int64 (the same
    whether the rows were kept in memory or read back on resume)."""
    df = df.reindex(columns=list(FIELDS)).replace("", float("nan")).astype(float)
    df["step"] = df["step"].astype(int)
    return df


def _csv_cell(text: str) -> str:
    return f'"{text}"' if ("," in text or '"' in text) else text


def _line(row: Mapping[str, str]) -> str:
    """One record's CSV line (cells already formatted), exactly as :meth:`write` writes it."""
    return ",".join(_csv_cell(row.get(k) or "") for k in FIELDS)


def _step(path: Path, row: Mapping[str, str]) -> int:
    text = row.get("step", "")
    if not text.isdigit():
        raise UsageError(f"cannot resume: records file {str(path)!r} has a row whose step is "
                         f"{text!r}, not a step number; restore it or start the run afresh")
    return int(text)


def _read_rows(path: Path) -> list[dict[str, str]]:
    """The finished rows of a records file; UsageError naming it for another header or a row
    with more cells than columns."""
    text = path.read_text()
    # A row cut off by a kill mid-write lacks its newline: drop it, keep every finished row.
    if text and not text.endswith("\n"):
        text = text[: text.rfind("\n") + 1]
    reader = csv.DictReader(io.StringIO(text))
    if reader.fieldnames is not None and tuple(reader.fieldnames) != FIELDS:
        raise UsageError(f"cannot resume: records file {str(path)!r} does not have varbench's "
                         "columns (its header was changed); restore it or start the run afresh")
    rows = []
    for r in reader:
        if None in r:
            raise UsageError(f"cannot resume: records file {str(path)!r} line "
                             f"{reader.line_num} has more cells than columns; restore it or "
                             "start the run afresh")
        if r.get(FIELDS[-1]) is not None and r.get("step"):
            rows.append(r)
    return rows


def read_records(path: str | Path) -> pd.DataFrame:
    """Load a records CSV as a DataFrame (floats; empty cells NaN; ``step`` int)."""
    path = Path(path)
    if not path.is_file():
        raise UsageFileNotFoundError(f"records file {str(path)!r} does not exist")
    return as_records(pd.DataFrame(_read_rows(path), columns=list(FIELDS)))
