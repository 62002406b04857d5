"""varbench.train.records: records.csv appends, exact floats, truncation on resume and a
partial last row."""

from __future__ import annotations

import math

import pytest

from varbench._util.checks import UsageError
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


def _history(path, steps):
    w = RecordWriter(path)
    for s in steps:
        w.write({"step": s, "train/reward_mean": s / 7, "tokens/sampled": 10 * s})


def test_resume_refuses_a_missing_gapped_or_foreign_history(tmp_path):
    """Regression: a missing or short records.csv resumed with a gapped history, exit 0."""
    path = tmp_path / "records.csv"
    with pytest.raises(UsageError, match=r"records file .* is missing .* step 4"):
        RecordWriter(path, resume_step=4)
    _history(path, range(3))
    with pytest.raises(UsageError, match=r"missing steps \[3, 4\]"):
        RecordWriter(path, resume_step=4)
    _history(path, [0, 1, 2, 2, 3, 4])  # two writers interleaved
    with pytest.raises(UsageError, match=r"duplicated steps \[2\]"):
        RecordWriter(path, resume_step=4)
    _history(path, range(6))
    last = {"step": 4, "train/reward_mean": 4 / 7, "tokens/sampled": 40}
    RecordWriter(path, resume_step=4, last_row=last)  # whole and matching: fine
    assert list(read_records(path)["step"]) == [0, 1, 2, 3, 4]
    with pytest.raises(UsageError, match=r"differs from the checkpoint's in \['tokens/sampled'\]"):
        RecordWriter(path, resume_step=4, last_row={**last, "tokens/sampled": 41})
    assert list(read_records(path)["step"]) == [0, 1, 2, 3, 4]  # refused: file left as it was


def test_train_resume_refuses_missing_or_short_records(tmp_path):
    from varbench.train.config import TrainConfig
    from varbench.train.loop import train

    cfg = TrainConfig(policy="micro", warm_start=False, reward="positional", steps=4,
                      eval_every=2, eval_prompts=4, eval_samples=1, G=2, prompts_per_step=2,
                      checkpoint_every=2, seed=1)
    run = tmp_path / "run"
    train(cfg, run, progress=False)
    text = (run / "records.csv").read_text()
    (run / "records.csv").unlink()
    with pytest.raises(UsageError, match="records file .* is missing"):
        train(cfg.replace(steps=6), run, resume=True, progress=False)
    (run / "records.csv").write_text("\n".join(text.splitlines()[:3]) + "\n")  # steps 0, 1
    with pytest.raises(UsageError, match=r"missing steps \[2, 3, 4\]"):
        train(cfg.replace(steps=6), run, resume=True, progress=False)
    (run / "records.csv").write_text(text)
    assert list(train(cfg.replace(steps=6), run, resume=True, progress=False).records["step"]
                ) == list(range(7))


def test_resume_checks_the_whole_history_against_the_checkpoint(tmp_path):
    """Regression (issue 32): only the last row was compared with the checkpoint; an edited
    middle row was kept silently, a garbage step or an extra cell was a traceback."""
    from varbench._util.checks import UsageError
    from varbench.train.records import RecordWriter

    path = tmp_path / "records.csv"
    w = RecordWriter(path)
    for step in range(4):
        w.write({"step": step, "lr": 0.1 * step})
    digest, last = w.digest, {"step": 3, "lr": 0.1 * 3}
    again = RecordWriter(path, resume_step=3, last_row=last, records_sha256=digest)
    assert again.digest == digest  # the kept rows hash as written
    text = path.read_text()
    path.write_text(text.replace("0.1,", "0.5,", 1))  # step 1's lr edited
    with pytest.raises(UsageError, match=r"rows 0..3 of .* differ from the ones the checkpoint"):
        RecordWriter(path, resume_step=3, last_row=last, records_sha256=digest)
    lines = text.splitlines()
    path.write_text("\n".join([*lines[:2], "x" + lines[2][1:], *lines[3:]]) + "\n")
    with pytest.raises(UsageError, match="whose step is 'x'"):
        RecordWriter(path, resume_step=3, last_row=last, records_sha256=digest)
    path.write_text("\n".join([*lines[:2], lines[2] + ",9", *lines[3:]]) + "\n")
    with pytest.raises(UsageError, match="line 3 has more cells than columns"):
        RecordWriter(path, resume_step=3, last_row=last, records_sha256=digest)
    path.write_text("\n".join([lines[0] + ",extra", *lines[1:]]) + "\n")
    with pytest.raises(UsageError, match="header was changed"):
        RecordWriter(path, resume_step=3, last_row=last, records_sha256=digest)
