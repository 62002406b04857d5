"""varbench.models.head: the output head read from the model (tied/untied, bias, soft-capping,
logit scale), the body's final hidden states, and the refusals that send callers to the plain
full-logits path."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from _fixtures_models import KINDS, V, ids_and_mask, tiny_lm

from varbench.models.forward import forward_logits
from varbench.models.head import OutputHead, final_hidden, read_head


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_head_logits_equal_the_models_own(kind, tied):
    model = tiny_lm(kind, tied=tied)
    head, why = read_head(model)
    assert head is not None, why
    out = model.get_output_embeddings()
    assert head.weight is out.weight  # the parameter itself, not a copy
    assert (head.weight is model.get_input_embeddings().weight) == tied
    assert (head.bias is not None) == (kind == "gptj")
    want_scale = {"cohere": 0.37, "granite": 1 / 2.5}.get(kind, 1.0)
    assert head.scale == pytest.approx(want_scale, rel=1e-12)
    assert head.softcap == (3.0 if kind == "gemma2" else None)
    ids, am = ids_and_mask(left=kind != "gemma2")
    with torch.no_grad():
        want = forward_logits(model, ids, am).logits
        h = final_hidden(model, ids, am)
        got = head.logits(h.reshape(-1, h.shape[-1]), torch.float64).reshape(want.shape)
    assert h.shape == (*ids.shape, model.config.hidden_size if kind != "gptj" else 16)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_final_hidden_is_differentiable():
    model = tiny_lm("llama")
    ids, am = ids_and_mask()
    h = final_hidden(model, ids, am)
    assert h.requires_grad
    (g,) = torch.autograd.grad(h.sum(), model.model.embed_tokens.weight)
    assert torch.isfinite(g).all() and g.abs().sum() > 0


def test_grad_linear_is_the_derivative_of_scale_and_cap():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(7, 5, generator=g, dtype=torch.float64)
    h = torch.randn(4, 5, generator=g, dtype=torch.float64)
    for scale, cap in ((1.0, None), (0.3, None), (1.0, 2.0), (1.7, 0.5)):
        head = OutputHead(w, None, scale, cap)
        u = (h @ w.T).requires_grad_(True)
        z = u * scale
        z = z if cap is None else cap * torch.tanh(z / cap)
        gz = torch.randn(4, 7, generator=g, dtype=torch.float64)
        (want,) = torch.autograd.grad(z, u, gz)
        torch.testing.assert_close(head.logits(h, torch.float64), z.detach(), rtol=1e-14,
                                   atol=1e-14)
        got = head.grad_linear(head.logits(h, torch.float64), gz.clone())
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_unknown_architecture_is_refused_with_its_name():
    model = tiny_lm("llama")
    model.config.model_type = "not_a_known_lm"
    head, why = read_head(model)
    assert head is None
    assert "not_a_known_lm" in why and "LlamaForCausalLM" in why


class _DoubledLogits(tf.LlamaForCausalLM):
    """A Llama whose forward changes the logits after the head (not in the module tree)."""

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = 2 * out.logits
        return out


def test_probe_refuses_a_model_whose_forward_changes_the_logits():
    base = tiny_lm("llama")
    model = _DoubledLogits(base.config).to(torch.float64).eval()
    model.load_state_dict(base.state_dict())
    head, why = read_head(model)
    assert head is None and "differ from the model's own" in why


def test_head_that_is_not_linear_is_refused():
    model = tiny_lm("llama")
    model.get_output_embeddings = lambda: None
    head, why = read_head(model)
    assert head is None and "not a torch.nn.Linear" in why


def test_probe_runs_once_per_model_and_restores_training_mode():
    model = tiny_lm("qwen2").train()
    calls = []
    model.model.register_forward_hook(lambda m, a, o: calls.append(1))
    head, _ = read_head(model)
    assert head is not None and model.training  # probed in eval mode, mode restored
    n = len(calls)
    assert n == 2  # the model's forward and the body alone
    assert read_head(model)[0] is not None and len(calls) == n  # cached
    assert read_head(model)[0].vocab_size == V
