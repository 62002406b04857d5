"""varbench.app.specs: one parser for KEY=VALUE, one resolver for policies, dtypes, devices."""

from __future__ import annotations

import pytest
import torch

from varbench._util.checks import UsageError
from varbench.app.specs import (
    parse_knob,
    parse_knobs,
    policy_states,
    resolve_device,
    resolve_dtype,
    resolve_policy,
    resolve_task,
)
from varbench.models import build_policy, save_policy


@pytest.mark.parametrize("text,expected", [
    ("n=3", ("n", 3)),
    ("eps=1e-4", ("eps", 1e-4)),
    ("flag=true", ("flag", True)),
    ("items=[1, 2]", ("items", [1, 2])),
    ('name="x y"', ("name", "x y")),
    ("verifier=number", ("verifier", "number")),  # a bare word is a string
    (" k = 2 ", ("k", 2)),
    ("path=a=b", ("path", "a=b")),
])
def test_knob_values_are_toml_literals(text, expected):
    assert parse_knob(text) == expected


@pytest.mark.parametrize("text", ["n", "=3", ""])
def test_bad_knob_names_the_flag_and_value(text):
    with pytest.raises(UsageError, match=r"--scheme-option .* is not valid; expected KEY=VALUE"):
        parse_knob(text, flag="--scheme-option")


def test_later_knob_wins():
    assert parse_knobs(["n=2", "n=4", "distinct=false"]) == {"n": 4, "distinct": False}


def test_dtype_and_device():
    assert resolve_dtype("auto") is None and resolve_dtype(None) is None
    assert resolve_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(UsageError, match=r"--dtype='half' is not valid; choose one of"):
        resolve_dtype("half")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(UsageError, match=r"--device='bogus' is not valid"):
        resolve_device("bogus")
    if not torch.cuda.is_available():
        assert resolve_device(None) == torch.device("cpu")
        with pytest.raises(UsageError, match="no CUDA device"):
            resolve_device("cuda")


def test_policy_specs(tmp_path):
    pol = resolve_policy("micro", seed=3)
    ref = build_policy("micro", seed=3)
    assert all(torch.equal(a, b) for a, b in zip(pol.model.parameters(),
                                                 ref.model.parameters(), strict=True))
    save_policy(ref, tmp_path / "ckpt")
    loaded = resolve_policy(str(tmp_path / "ckpt"), dtype="float64")
    assert next(loaded.model.parameters()).dtype == torch.float64
    with pytest.raises(UsageError, match=r"policy='/no/such' is not valid; choose a preset"):
        resolve_policy("/no/such")
    with pytest.raises(UsageError, match="warm start needs a preset"):
        resolve_policy(str(tmp_path / "ckpt"), task=resolve_task("sort"), warm=True)
    states = policy_states(str(tmp_path / "ckpt"), ["random", "warm"], resolve_task("sort"))
    assert list(states) == ["ckpt"]  # a checkpoint is used as it is
    with pytest.raises(UsageError, match=r"states='cold' is not valid"):
        policy_states("micro", ["cold"], resolve_task("sort"))


def test_task_spec_applies_knobs():
    assert resolve_task("sort", {"n": 2}).knobs["n"] == 2
    with pytest.raises(ValueError, match="no knob 'm'"):
        resolve_task("sort", {"m": 2})
