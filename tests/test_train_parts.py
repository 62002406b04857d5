"""Tests of the trainer's parts that need no policy: config, records, checkpoints, collapse."""

from __future__ import annotations

import math

import pytest
import torch

from varbench.train.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from varbench.train.collapse import CollapseDetector
from varbench.train.config import TrainConfig
from varbench.train.records import FIELDS, RecordWriter, read_records

# ---------------------------------------------------------------- config


def test_config_defaults_and_roundtrip(tmp_path):
    c = TrainConfig()
    assert c.scheme == "centered" and c.task_options == {}
    text = "\n".join(
        [
            'scheme = "otb"',
            "G = 4",
            "lr = 1",  # an integer is accepted for a float field
            "dynamic_filter = true",
            "[task_options]",
            "n = 4",
        ]
    )
    p = tmp_path / "run.toml"
    p.write_text(text)
    c2 = TrainConfig.from_toml(p)
    assert c2.scheme == "otb" and c2.G == 4 and c2.lr == 1.0 and isinstance(c2.lr, float)
    assert c2.dynamic_filter is True and c2.task_options == {"n": 4}
    assert TrainConfig.from_dict(c2.to_dict()) == c2
    with pytest.raises(dataclasses_frozen_error()):
        c2.G = 8  # frozen


def dataclasses_frozen_error():
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_config_every_field_has_a_docstring():
    import ast
    import inspect

    from varbench.train import config as mod

    tree = ast.parse(inspect.getsource(mod))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrainConfig")
    body = cls.body
    names = []
    for i, node in enumerate(body):
        if isinstance(node, ast.AnnAssign):
            nxt = body[i + 1] if i + 1 < len(body) else None
            value = getattr(nxt, "value", None)
            doc = isinstance(nxt, ast.Expr) and isinstance(value, ast.Constant)
            assert doc, f"field {node.target.id} has no docstring"
            names.append(node.target.id)
    assert len(names) == len(__import__("dataclasses").fields(TrainConfig))


@pytest.mark.parametrize(
    "text, kind, needles",
    [
        ('shceme = "otb"', ValueError, ["shceme", "valid keys", "scheme"]),
        ('ratio = "seq"', ValueError, ["ratio", "'seq'", "token", "sequence"]),
        ('kl_kind = "k4"', ValueError, ["kl_kind", "k1", "k3"]),
        ("G = 0", ValueError, ["G=0"]),
        ('G = "4"', TypeError, ["'G'", "integer"]),
        ("lr = true", TypeError, ["'lr'", "number"]),
        ("minibatches = 9", ValueError, ["minibatches=9", "prompts_per_step=8"]),
        ("task_options = 3", TypeError, ["task_options", "table"]),
        ("scheme = [", ValueError, ["not valid TOML"]),
    ],
)
def test_config_errors_name_file_key_and_choices(tmp_path, text, kind, needles):
    p = tmp_path / "bad.toml"
    p.write_text(text + "\n")
    with pytest.raises(kind) as err:
        TrainConfig.from_toml(p)
    msg = str(err.value)
    assert str(p) in msg
    for n in needles:
        assert n in msg, (n, msg)


def test_config_missing_file_and_section(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.toml"):
        TrainConfig.from_toml(tmp_path / "nope.toml")
    p = tmp_path / "s.toml"
    p.write_text("[a]\nG = 2\n")
    assert TrainConfig.from_toml(p, section="a").G == 2
    with pytest.raises(ValueError, match=r"no section \[b\].*\['a'\]"):
        TrainConfig.from_toml(p, section="b")


# ---------------------------------------------------------------- records


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


# ---------------------------------------------------------------- checkpoints


def _model_and_opt(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def _train_steps(model, opt, gen, n):
    out = []
    for _ in range(n):
        x = torch.randn(16, 4, generator=gen)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def test_checkpoint_resume_is_bit_exact(tmp_path):
    model, opt = _model_and_opt(0)
    gen = torch.Generator().manual_seed(123)
    _train_steps(model, opt, gen, 3)
    save_checkpoint(tmp_path, 3, model, opt, {"train": gen}, {"tokens": 42})
    reference = _train_steps(model, opt, gen, 4)

    model2, opt2 = _model_and_opt(1)  # different init: everything must come from the checkpoint
    gen2 = torch.Generator().manual_seed(999)
    step, state = load_checkpoint(latest_checkpoint(tmp_path), model2, opt2, {"train": gen2})
    assert step == 3 and state == {"tokens": 42}
    assert _train_steps(model2, opt2, gen2, 4) == reference
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)


def test_checkpoint_keeps_latest_and_names_corrupt_file(tmp_path):
    model, opt = _model_and_opt(0)
    gen = torch.Generator().manual_seed(0)
    _train_steps(model, opt, gen, 1)
    for s in (2, 4, 6):
        save_checkpoint(tmp_path, s, model, opt, {"g": gen}, {}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000004", "step_000006"]
    latest = latest_checkpoint(tmp_path)
    (latest / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="step_000006"):
        load_checkpoint(latest, model, opt, {"g": gen})


def test_checkpoint_tied_weights(tmp_path):
    emb = torch.nn.Embedding(5, 3)
    head = torch.nn.Linear(3, 5, bias=False)
    head.weight = emb.weight  # tied, as in a tied-embedding LM
    model = torch.nn.ModuleDict({"emb": emb, "head": head})
    opt = torch.optim.Adam(model.parameters())
    save_checkpoint(tmp_path, 1, model, opt, {}, {})
    emb2 = torch.nn.Embedding(5, 3)
    head2 = torch.nn.Linear(3, 5, bias=False)
    head2.weight = emb2.weight
    model2 = torch.nn.ModuleDict({"emb": emb2, "head": head2})
    load_checkpoint(latest_checkpoint(tmp_path), model2, torch.optim.Adam(model2.parameters()), {})
    assert torch.equal(model2["emb"].weight, emb.weight)
    assert model2["head"].weight is model2["emb"].weight


# ---------------------------------------------------------------- collapse


def test_collapse_grad_surge_against_running_median():
    det = CollapseDetector(surge_factor=5.0, window=4, min_history=3)
    flags = [det.update(g, 1.0)["grad_surge"] for g in [1.0, 1.2, 100.0, 0.9, 1.1, 6.0, 4.0]]
    # 100 comes before 3 norms of history -> not flagged; later median of the last 4 norms:
    # at 6.0 the window is [1.2, 100, 0.9, 1.1] (median 1.15): 6.0 > 5.75 -> surge;
    # at 4.0 the window is [100, 0.9, 1.1, 6.0] (median 3.55): 4.0 < 17.75 -> none.
    assert flags == [0, 0, 0, 0, 0, 1, 0]
    assert det.update(float("nan"), 1.0)["grad_surge"] == 1


def test_collapse_entropy_and_state_roundtrip():
    det = CollapseDetector(entropy_floor=0.1)
    assert det.update(1.0, 2.0)["entropy"] == 0
    assert det.update(1.0, 0.21)["entropy"] == 0
    assert det.update(1.0, 0.19)["entropy"] == 1
    det2 = CollapseDetector(entropy_floor=0.1)
    det2.load_state_dict(det.state_dict())
    assert det2.update(50.0, 0.5) == det.update(50.0, 0.5)
