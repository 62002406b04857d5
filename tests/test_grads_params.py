"""varbench.grads.params: parameter filters (regex, modules, names) and the default groups."""

from __future__ import annotations

import pytest
import torch
from _fixtures_grads import batch, tiny_llama
from reference_grads import brute_token_grads, norms_from_grads

from varbench.grads.exact import token_grad_norms
from varbench.grads.params import default_group, group_index, select_params
from varbench.grads.precision import exact_float64

RTOL = 1e-8  # float64 throughout (exact_float64): observed agreement ~1e-14


def test_param_filters():
    model = exact_float64(tiny_llama())
    ids, rm, am = batch()
    g, names, sizes = brute_token_grads(model, ids, rm, am)
    parts = dict(zip(names, torch.split(g, sizes, dim=-1), strict=True))
    want = [n for n in names if "mlp" in n]
    ref = norms_from_grads(torch.cat([parts[n] for n in want], -1), rm)
    by_regex = token_grad_norms(model, ids, rm, am, params=r"\.mlp\.", progress=False)
    mods = [layer.mlp for layer in model.model.layers]
    by_module = token_grad_norms(model, ids, rm, am, params=mods, progress=False)
    by_name = token_grad_norms(model, ids, rm, am, params=want, progress=False)
    for got in (by_regex, by_module, by_name):
        torch.testing.assert_close(got.prefix_sq, ref[1], rtol=RTOL, atol=0)
    with pytest.raises(ValueError, match="selects no trainable"):
        token_grad_norms(model, ids, rm, am, params="nope", progress=False)
    with pytest.raises(ValueError, match="not trainable parameters"):
        token_grad_norms(model, ids, rm, am, params=["nope"], progress=False)
    with pytest.raises(TypeError, match="params must be"):
        token_grad_norms(model, ids, rm, am, params=3, progress=False)


def test_select_params_order_tied_weights_and_frozen_parameters():
    model = tiny_llama(tied=True)
    model.model.norm.weight.requires_grad_(False)
    names = [n for n, _ in select_params(model)]
    assert names == [n for n, p in model.named_parameters() if p.requires_grad]
    assert "model.norm.weight" not in names
    assert "lm_head.weight" not in names  # the tied head is the embedding, counted once
    assert [n for n, _ in select_params(model, ["model.embed_tokens.weight"])] == [
        "model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="not trainable parameters"):
        select_params(model, ["model.norm.weight"])


@pytest.mark.parametrize(
    ("name", "group"),
    [
        ("model.embed_tokens.weight", "embed"),
        ("model.layers.0.self_attn.q_proj.weight", "block0.attn"),
        ("model.layers.0.input_layernorm.weight", "block0.attn"),
        ("model.layers.1.mlp.up_proj.weight", "block1.mlp"),
        # Llama's norm before the MLP, although "attention" is in its name
        ("model.layers.1.post_attention_layernorm.weight", "block1.mlp"),
        ("model.layers.12.adapter.weight", "block12.other"),
        ("model.norm.weight", "norm"),
        ("lm_head.weight", "head"),
        ("transformer.wte.weight", "embed"),
        ("transformer.wpe.weight", "embed"),
        ("transformer.h.3.attn.c_attn.weight", "block3.attn"),
        ("transformer.h.3.ln_1.weight", "block3.attn"),
        ("transformer.h.3.mlp.c_fc.weight", "block3.mlp"),
        ("transformer.h.3.ln_2.bias", "block3.mlp"),
        ("transformer.ln_f.weight", "norm"),
        ("score.weight", "other"),
    ],
)
def test_default_group_names(name, group):
    assert default_group(name) == group


def test_group_index_first_seen_order_callables_and_the_head():
    model = tiny_llama(tied=False)
    names = [n for n, _ in select_params(model)]
    groups, idx = group_index(model, names, True)
    assert groups == ["embed", "block0.attn", "block0.mlp", "block1.attn", "block1.mlp", "norm",
                      "head"]
    assert [groups[i] for i in idx] == [default_group(n, head_name="lm_head.weight")
                                        for n in names]
    assert default_group("out.weight", head_name="out.weight") == "head"
    g2, i2 = group_index(model, names, lambda n: "mlp" if "mlp" in n else "rest")
    assert g2 == ["rest", "mlp"] and len(i2) == len(names)
    with pytest.raises(TypeError, match="groups must be a bool or a callable"):
        group_index(model, names, "layers")
