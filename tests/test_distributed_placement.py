"""A checkpoint larger than its device is refused before any weight is read (no layer-wise
placement), with the bytes it needs and the device's; free memory is faked."""

from __future__ import annotations

import pytest
import torch

from varbench._util.checks import UsageError
from varbench.models import build_preset, memplan
from varbench.models.io import load_policy


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    pol = build_preset("micro", seed=0)
    pol.model.save_pretrained(d)
    pol.tokenizer.save_pretrained(d)
    n_bytes = sum(p.numel() * p.element_size() for p in pol.model.parameters())
    return d, n_bytes


def _fake_free(monkeypatch, free: int) -> list:
    asked = []

    def fake(device):
        asked.append(str(device))
        return free

    monkeypatch.setattr(memplan, "free_device_bytes", fake)
    return asked


def test_too_large_for_the_device_is_refused_before_loading(ckpt, monkeypatch):
    d, n_bytes = ckpt
    asked = _fake_free(monkeypatch, n_bytes // 2)
    loaded = []
    import transformers

    real = transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: loaded.append(a) or real(*a, **k))
    with pytest.raises(UsageError, match=r"does not fit cpu: its parameters alone need") as e:
        load_policy(d, device="cpu")
    assert memplan.gib(n_bytes // 2) in str(e.value)  # the device's free bytes, named
    assert asked == ["cpu"] and not loaded  # refused from config.json, no weight read


def test_fits_parameters_but_not_one_row(ckpt, monkeypatch):
    d, n_bytes = ckpt
    _fake_free(monkeypatch, n_bytes + 16)  # parameters fit, 8 bytes of budget do not
    with pytest.raises(UsageError, match=r"does not fit: one row of sampling needs"):
        load_policy(d, device="cpu")


def test_fits_is_loaded(ckpt, monkeypatch):
    d, n_bytes = ckpt
    _fake_free(monkeypatch, 64 * n_bytes + 2**30)
    pol = load_policy(d, device="cpu")
    assert sum(p.numel() * p.element_size() for p in pol.model.parameters()) == n_bytes


def test_bfloat16_halves_what_is_needed(ckpt, monkeypatch):
    d, n_bytes = ckpt
    # float32 parameters do not fit 3/4 of their bytes; in bfloat16 (half) they do
    _fake_free(monkeypatch, int(0.75 * n_bytes))
    with pytest.raises(UsageError, match="parameters alone"):
        load_policy(d, device="cpu", dtype=torch.float32)
    try:
        pol = load_policy(d, device="cpu", dtype=torch.bfloat16)
    except UsageError as err:  # then only the sampled row beside them may be short
        assert "parameters alone" not in str(err) and "one row of sampling" in str(err)
    else:
        assert next(pol.model.parameters()).dtype == torch.bfloat16


def test_the_commands_policy_path_checks_the_device(ckpt, monkeypatch):
    from varbench.train.policies import build_policy as resolve

    d, n_bytes = ckpt
    _fake_free(monkeypatch, n_bytes // 2)
    with pytest.raises(UsageError, match="parameters alone"):
        resolve(str(d), device="cpu")
