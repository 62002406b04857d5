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
from varbench.models import build_preset, save_policy


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
    ref = build_preset("micro", seed=3)
    assert all(torch.equal(a, b) for a, b in zip(pol.model.parameters(),
                                                 ref.model.parameters(), strict=True))
    save_policy(ref, tmp_path / "ckpt")
    loaded = resolve_policy(str(tmp_path / "ckpt"), dtype="float64")
    assert next(loaded.model.parameters()).dtype == torch.float64
    with pytest.raises(UsageError, match=r"policy='/no/such' is not valid; choose a preset"):
        resolve_policy("/no/such")
    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "4"}\n')
    with pytest.raises(UsageError, match="needs demonstrations; this task has none"):
        resolve_policy(str(tmp_path / "ckpt"), task=resolve_task(str(data)), warm=True)
    states = policy_states(str(tmp_path / "ckpt"), ["random", "warm"], resolve_task("sort"))
    assert list(states) == ["ckpt"]  # a checkpoint is used as it is
    with pytest.raises(UsageError, match=r"states='cold' is not valid"):
        policy_states("micro", ["cold"], resolve_task("sort"))


def test_task_spec_applies_knobs():
    assert resolve_task("sort", {"n": 2}).knobs["n"] == 2
    with pytest.raises(ValueError, match="no knob 'm'"):
        resolve_task("sort", {"m": 2})


USER_ESTIMATOR = '''
import torch

def loo(rewards, mask, **options):
    """rloo written by a user, keyword-shaped."""
    R = rewards if rewards.dim() == 2 else (rewards * mask).sum(-1)
    G = R.shape[1]
    # rloo's own arithmetic (G/(G-1) times the centred reward), so results agree bit for bit
    d = R - R.amin(1, keepdim=True)
    A = (d - d.mean(1, keepdim=True)) * (G / (G - 1)) if G > 1 else R
    return A.unsqueeze(-1).expand(mask.shape) * mask
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "user_adv_mod.py").write_text(USER_ESTIMATOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_adv_mod:loo"
    from varbench.estimators import unregister_scheme

    unregister_scheme("user_adv_mod:loo")


def test_resolve_scheme(user_module):
    from varbench.app.specs import resolve_scheme
    from varbench.estimators import advantages, schemes

    assert resolve_scheme("rloo") == "rloo"
    assert resolve_scheme(user_module) == user_module and user_module in schemes()
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, 3, dtype=torch.bool)
    assert torch.equal(advantages(user_module, rewards, mask), advantages("rloo", rewards, mask))
    with pytest.raises(UsageError, match=r"scheme='nope' is not valid; choose one of"):
        resolve_scheme("nope")
    with pytest.raises(UsageError, match="cannot import module"):
        resolve_scheme("no_such_mod_xyz:fn")


def test_trainer_takes_a_user_estimator_like_a_registered_one(tmp_path, user_module):
    """`varbench train --scheme MODULE:FUNCTION` trains exactly as the registered scheme."""
    import pandas as pd

    from varbench.app.cli import main

    common = ["train", "--policy", "micro", "--no-warm-start", "--task", "sort", "--knob", "n=2",
              "--steps", "2", "--prompts-per-step", "2", "-G", "3", "--eval-prompts", "2",
              "--eval-samples", "1", "--eval-every", "2"]
    assert main([*common, "--scheme", user_module, "--out", str(tmp_path / "a")]) == 0
    assert main([*common, "--scheme", "rloo", "--out", str(tmp_path / "b")]) == 0
    a = pd.read_csv(tmp_path / "a" / "records.csv")
    b = pd.read_csv(tmp_path / "b" / "records.csv")
    cols = [c for c in a.columns if not c.startswith("time/")]
    pd.testing.assert_frame_equal(a[cols], b[cols])
