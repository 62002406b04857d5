"""varbench.models.io: save/load round trips, policy resolution and checkpoint safety."""

from __future__ import annotations

import json

import pytest
import torch

from varbench.models import build_policy, load_policy, save_policy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("tie", [False, True])
def test_save_load_round_trip(tmp_path, tie):
    p = build_policy("micro", seed=2, tie_embeddings=tie)
    save_policy(p, tmp_path / "ck")
    assert (tmp_path / "ck" / "model.safetensors").is_file()
    q = load_policy(tmp_path / "ck")
    x = torch.tensor([[1, 5, 12, 13, 20], [0, 1, 5, 12, 13]])
    m = (x != 0).long()
    with torch.no_grad():
        assert torch.allclose(p.model(x, attention_mask=m).logits,
                              q.model(x, attention_mask=m).logits, atol=0)
    assert q.tokenizer("<sort>12=")["input_ids"] == p.tokenizer("<sort>12=")["input_ids"]
    assert q.tokenizer.padding_side == "left"
    assert q.model.config.tie_word_embeddings == tie
    assert q.meta["seed"] == 2
    assert load_policy(tmp_path / "ck", dtype=torch.float64).model.dtype == torch.float64


def test_load_refuses_hub_names_and_bad_dirs(tmp_path):
    with pytest.raises(ValueError, match=r"policy='gpt2'.*local checkpoint directory"):
        load_policy("gpt2")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="config.json"):
        load_policy(tmp_path / "empty")
    p = build_policy("micro")
    save_policy(p, tmp_path / "noweights")
    (tmp_path / "noweights" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="holds no weights"):
        load_policy(tmp_path / "noweights")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_checkpoint_names_the_file(tmp_path, damage):
    save_policy(build_policy("micro"), tmp_path / "ck")
    f = tmp_path / "ck" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100] if damage == "truncate" else b"\x00garbage" * 10)
    with pytest.raises(ValueError, match=r"corrupt or truncated checkpoint file .*safetensors"):
        load_policy(tmp_path / "ck")


def test_remote_code_never_runs_by_default(tmp_path):
    ck = tmp_path / "ck"
    save_policy(build_policy("micro"), ck)
    marker = tmp_path / "ran.txt"
    (ck / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
        "from transformers import LlamaForCausalLM as EvilForCausalLM\n"
    )
    cfg = json.loads((ck / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "evil.EvilForCausalLM"}
    (ck / "config.json").write_text(json.dumps(cfg))
    try:
        load_policy(ck)
    except ValueError:
        pass  # refusing is fine too; running the file is not
    assert not marker.exists()
