"""varbench.models.presets: preset sizes and architecture, seeded builds, tied embeddings."""

from __future__ import annotations

import pytest
import torch

from varbench.models import build_preset, presets

pytestmark = pytest.mark.usefixtures("one_thread")


def n_params(policy):
    return sum(p.numel() for p in policy.model.parameters())


def test_presets_sizes_and_architecture():
    assert {"tiny", "small"} <= set(presets())
    tiny, small = build_preset("tiny"), build_preset("small")
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
    a = build_preset("micro", seed=5)
    after = torch.rand(1)
    assert torch.equal(before, after)
    b, c = build_preset("micro", seed=5), build_preset("micro", seed=6)
    sa, sb, sc = (x.model.state_dict() for x in (a, b, c))
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_tied_and_untied_embeddings():
    tied = build_preset("micro", tie_embeddings=True)
    untied = build_preset("micro", tie_embeddings=False)
    emb = lambda p: p.model.model.embed_tokens.weight  # noqa: E731
    assert tied.model.lm_head.weight.data_ptr() == emb(tied).data_ptr()
    assert untied.model.lm_head.weight.data_ptr() != emb(untied).data_ptr()
