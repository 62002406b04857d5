"""varbench.train.checkpoint: bit-exact resume, keeping the latest, corrupt files named, tied
weights."""

from __future__ import annotations

import pytest
import torch

from varbench.train.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)


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


def test_flipped_bit_and_unreadable_file_are_refused_by_name(tmp_path, monkeypatch):
    """Regression: flipped bits in a checkpoint's safetensors loaded silently."""
    from varbench._util.checks import UsageError

    model, opt = _model_and_opt(0)
    gen = torch.Generator().manual_seed(0)
    _train_steps(model, opt, gen, 1)
    ckpt = save_checkpoint(tmp_path, 1, model, opt, {"g": gen}, {})
    weights = ckpt / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-3] ^= 0x01  # one bit of one weight: the file still parses
    weights.write_bytes(bytes(data))
    with pytest.raises(UsageError, match=r"model\.safetensors.*content hash.*refusing"):
        load_checkpoint(ckpt, *_model_and_opt(1), {"g": torch.Generator()})
    data[-3] ^= 0x01
    weights.write_bytes(bytes(data))
    load_checkpoint(ckpt, *_model_and_opt(1), {"g": torch.Generator()})  # restored: loads
    (ckpt / "extra.bin").write_bytes(b"payload")
    with pytest.raises(UsageError, match=r"extra\.bin.*not covered"):
        load_checkpoint(ckpt, *_model_and_opt(1), {"g": torch.Generator()})
    (ckpt / "extra.bin").unlink()
    import varbench._util.io as vio

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(vio, "file_sha256", denied)
    with pytest.raises(UsageError, match="permission denied") as err:
        load_checkpoint(ckpt, *_model_and_opt(1), {"g": torch.Generator()})
    assert "corrupt" not in str(err.value) and weights.exists()


@pytest.mark.parametrize("failure", ["oserror", "safetensors"])
def test_a_full_disk_during_a_checkpoint_names_it(tmp_path, monkeypatch, failure):
    """ENOSPC while the weights are written (an OSError without a file name, or safetensors'
    SafetensorError wrapping it) is an OSError naming the checkpoint; no partial checkpoint is
    left (issue 32)."""
    import errno

    from safetensors import SafetensorError

    from varbench.train import checkpoint

    def full(*a, **k):
        if failure == "oserror":
            raise OSError(errno.ENOSPC, "No space left on device")
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: '
                              'StorageFull, message: "No space left on device" })')

    monkeypatch.setattr(checkpoint, "save_model", full)
    model, opt = _model_and_opt(0)
    with pytest.raises(OSError) as err:
        save_checkpoint(tmp_path, 3, model, opt, {}, {"step": 3})
    assert err.value.errno == errno.ENOSPC and "step_000003" in err.value.filename
    assert latest_checkpoint(tmp_path) is None


def test_a_full_disk_during_train_is_exit_2_naming_the_path(tmp_path, monkeypatch, capsys):
    import errno

    from varbench.app.cli import main
    from varbench.train import checkpoint

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_model", full)
    out = tmp_path / "run"
    assert main(["train", "--policy", "micro", "--no-warm-start", "--steps", "1",
                 "--eval-every", "1", "--eval-prompts", "2", "-G", "2", "--prompts-per-step",
                 "2", "--knob", "n=2", "--checkpoint-every", "1", "--device", "cpu",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "No space left on device" in err and str(out / "checkpoints") in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
