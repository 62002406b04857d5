"""varbench.train.config: TrainConfig defaults, TOML round trip, docstrings, errors."""

from __future__ import annotations

import pytest

from varbench.train.config import TrainConfig


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


def test_with_defaults_fills_the_fields_a_saved_config_predates():
    from varbench.train.config import with_defaults

    now = TrainConfig(scheme="otb", G=4).to_dict()
    older = {k: v for k, v in now.items() if k != "update_forward"}
    assert with_defaults(older) == now
    assert with_defaults({**older, "update_forward": "sampler"}) != now
    assert with_defaults(now) == now
