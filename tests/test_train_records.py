"""varbench.train.records: records.csv appends, exact floats, truncation on resume and a
partial last row."""

from __future__ import annotations

import math

import pytest

from varbench.train.records import FIELDS, RecordWriter, read_records


def test_records_append_truncate_and_partial_row(tmp_path):
    path = tmp_path / "records.csv"
    w = RecordWriter(path)
    for s in range(5):
        w.write({"step": s, "train/reward_mean": 0.1 * s, "grad/norm": 1.0 / 3.0})
    df = read_records(path)
    assert list(df["step"]) == [0, 1, 2, 3, 4]
    assert df["grad/norm"].iloc[0] == 1.0 / 3.0  # exact float round trip
    assert math.isnan(df["eval/acc_greedy"].iloc[0])
    # A kill mid-write leaves a row without its newline: it is dropped, the rest kept.
    with open(path, "a") as fh:
        fh.write("5,12,3")
    assert list(read_records(path)["step"]) == [0, 1, 2, 3, 4]
    RecordWriter(path, resume_step=2)
    assert list(read_records(path)["step"]) == [0, 1, 2]
    with pytest.raises(ValueError, match="not_a_key"):
        RecordWriter(path, resume_step=2).write({"step": 3, "not_a_key": 1})
    assert len(FIELDS) == len(set(FIELDS))
