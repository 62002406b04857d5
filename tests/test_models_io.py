"""varbench.models.io: save/load round trips, policy resolution and checkpoint safety."""

from __future__ import annotations

import json

import pytest
import torch

from varbench.models import build_preset, load_policy, save_policy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("tie", [False, True])
def test_save_load_round_trip(tmp_path, tie):
    p = build_preset("micro", seed=2, tie_embeddings=tie)
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
    p = build_preset("micro")
    save_policy(p, tmp_path / "noweights")
    (tmp_path / "noweights" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="holds no weights"):
        load_policy(tmp_path / "noweights")


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_checkpoint_names_the_file(tmp_path, damage):
    save_policy(build_preset("micro"), tmp_path / "ck")
    f = tmp_path / "ck" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100] if damage == "truncate" else b"\x00garbage" * 10)
    with pytest.raises(ValueError, match=r"corrupt or truncated checkpoint file .*safetensors"):
        load_policy(tmp_path / "ck")


def test_remote_code_never_runs_by_default(tmp_path):
    ck = tmp_path / "ck"
    save_policy(build_preset("micro"), ck)
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


# ---- issue 29: checkpoint sanity before work, one read of the weights
def _saved_tiny(tmp_path):
    from varbench.models import build_preset, save_policy

    return save_policy(build_preset("micro", seed=0), tmp_path / "ck")


def test_model_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path):
    from transformers import AutoModelForCausalLM

    from varbench.models import load_policy

    d = _saved_tiny(tmp_path)
    m = AutoModelForCausalLM.from_pretrained(str(d))
    m.resize_token_embeddings(m.get_input_embeddings().num_embeddings - 3)
    m.save_pretrained(d, safe_serialization=True)
    with pytest.raises(ValueError, match=r"vocabulary has \d+ rows but the tokenizer has"):
        load_policy(d)


def test_missing_tokenizer_is_one_line_without_sentencepiece(tmp_path):
    from varbench.models import load_policy

    d = _saved_tiny(tmp_path)
    for f in d.glob("tokenizer*"):
        f.unlink()
    for f in ("special_tokens_map.json", "vocab.json"):
        (d / f).unlink(missing_ok=True)
    with pytest.raises(ValueError, match="has no tokenizer") as err:
        load_policy(d)
    assert "\n" not in str(err.value) and "sentencepiece" not in str(err.value)


def test_weights_are_validated_without_reading_them(tmp_path, monkeypatch):
    import safetensors

    from varbench.models import io as vio

    d = _saved_tiny(tmp_path)
    calls = []
    real = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self.h = real(*a, **k)

        def __enter__(self):
            self.h.__enter__()
            return self

        def __exit__(self, *a):
            return self.h.__exit__(*a)

        def keys(self):
            return self.h.keys()

        def get_tensor(self, k):
            calls.append(k)
            return self.h.get_tensor(k)

    monkeypatch.setattr(vio, "safe_open", Spy)
    vio._validate_weights(d)
    assert calls == []  # the payload is left to transformers' one read
    f = next(d.glob("*.safetensors"))
    f.write_bytes(f.read_bytes() + b"\0" * 8)  # padded: a layout the header does not describe
    with pytest.raises(ValueError, match="corrupt or truncated checkpoint file"):
        vio._validate_weights(d)
