"""Presets, the char-level tokenizer, save/load round trips and checkpoint safety."""

from __future__ import annotations

import json

import pytest
import torch
from _fixtures_foundation import one_thread  # noqa: F401

from varbench.models import (
    MARKUP,
    build_policy,
    build_tokenizer,
    check_tokenizer_covers,
    load_policy,
    presets,
    resolve_policy,
    save_policy,
)
from varbench.tasks import get_task, task_names

pytestmark = pytest.mark.usefixtures("one_thread")


def n_params(policy):
    return sum(p.numel() for p in policy.model.parameters())


def test_presets_sizes_and_architecture():
    assert {"tiny", "small"} <= set(presets())
    tiny, small = build_policy("tiny"), build_policy("small")
    assert 50_000 <= n_params(tiny) <= 200_000
    assert 1_000_000 <= n_params(small) <= 3_000_000
    assert type(tiny.model).__name__ == "LlamaForCausalLM"
    assert tiny.model.config.vocab_size == len(tiny.tokenizer)
    assert tiny.model.config.eos_token_id == tiny.tokenizer.eos_token_id
    assert not tiny.model.training


def test_build_is_seeded_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = build_policy("micro", seed=5)
    after = torch.rand(1)
    assert torch.equal(before, after)
    b, c = build_policy("micro", seed=5), build_policy("micro", seed=6)
    sa, sb, sc = (x.model.state_dict() for x in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_tied_and_untied_embeddings():
    tied = build_policy("micro", tie_embeddings=True)
    untied = build_policy("micro", tie_embeddings=False)
    emb = lambda p: p.model.model.embed_tokens.weight  # noqa: E731
    assert tied.model.lm_head.weight.data_ptr() == emb(tied).data_ptr()
    assert untied.model.lm_head.weight.data_ptr() != emb(untied).data_ptr()


def test_tokenizer_round_trip_and_fixed_ids():
    tok = build_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "<sum>3+5=<call>3+5</call><out>8</out><ans>8"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    for m in MARKUP:  # markup tags are single tokens
        assert len(tok(m, add_special_tokens=False)["input_ids"]) == 1
    assert len(tok("12 3", add_special_tokens=False)["input_ids"]) == 4
    for name in task_names():  # one vocabulary serves every task
        check_tokenizer_covers(tok, get_task(name).alphabet, what=name)
    with pytest.raises(ValueError, match=r"cannot represent \['x', 'Y'\]"):
        check_tokenizer_covers(tok, "1xY", what="test")


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


def test_resolve_policy():
    assert resolve_policy("micro").name == "micro"
    with pytest.raises(ValueError, match=r"policy='no/such/dir'.*tiny"):
        resolve_policy("no/such/dir")


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
