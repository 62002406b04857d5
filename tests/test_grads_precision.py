"""varbench.grads.precision: the float64-throughout copy (dtype-keeping RMS norms and
attention), its attention function against torch's, and the temporary functional attention."""

from __future__ import annotations

import pytest
import torch
from _fixtures_grads import batch, tiny_llama

from varbench.grads.precision import (
    ATTN_NAME,
    KeepDtypeRMSNorm,
    exact_float64,
    functional_attention,
    keep_dtype_attention,
)
from varbench.models.forward import forward_logits


def test_exact_float64_is_a_float64_copy_with_dtype_keeping_norms():
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    new = exact_float64(model)
    assert new is not model
    assert all(p.dtype == torch.float64 for p in new.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the original untouched
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.config._attn_implementation == "sdpa"
    assert new.config._attn_implementation == ATTN_NAME
    norms = [m for m in new.modules() if isinstance(m, KeepDtypeRMSNorm)]
    stock = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == len(stock) == 2 * 2 + 1  # two per layer and the final norm
    assert not [m for m in new.modules() if type(m).__name__ == "LlamaRMSNorm"]
    # same parameter names (filters and groups carry over), the norm weights are Parameters
    assert [n for n, _ in new.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert new.model.norm.weight is dict(new.named_parameters())["model.norm.weight"]
    with pytest.raises(TypeError, match="needs a transformers model with .config"):
        exact_float64(torch.nn.Linear(2, 2))


def test_keep_dtype_rmsnorm_stays_in_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=g, dtype=torch.float64) * 10
    w = torch.nn.Parameter(torch.rand(16, generator=g, dtype=torch.float64) + 0.5)
    got = KeepDtypeRMSNorm(w, 1e-6)(x)
    want = w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-14, atol=0)
    stock = tiny_llama().model.norm.double()  # transformers' RMSNorm casts to float32 inside
    stock.weight.data.copy_(w.data)
    gap = ((stock(x) - want).abs() / want.abs()).max()
    assert gap > 1e-12  # why the replacement exists (else the test proves nothing)


@pytest.mark.parametrize("masked", [False, True])
def test_keep_dtype_attention_equals_torch_attention_float64(masked):
    g = torch.Generator().manual_seed(1)
    B, H, Hkv, L, D = 2, 4, 2, 6, 8  # grouped-query attention: keys repeated per head
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, L, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, L, D, generator=g, dtype=torch.float64)
    keep = torch.ones(L, L, dtype=torch.bool).tril().expand(B, 1, L, L).clone()
    if masked:
        keep[1, :, :, :2] = False  # a left-padded row: its first two keys are padding
        keep[1, :, :2, :] = False
        keep[1, :, :2, 0] = True  # pad queries keep one key (sdpa gives NaN on a fully masked row)
    module = torch.nn.Module().eval()
    out, weights = keep_dtype_attention(module, q, k, v, keep if masked else None, D**-0.5)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
        attn_mask=keep if masked else None, is_causal=not masked)
    assert out.shape == (B, L, H, D) and out.dtype == torch.float64
    torch.testing.assert_close(out, want.transpose(1, 2), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, H, L, dtype=torch.float64))
    none = torch.zeros(B, 1, L, L, dtype=torch.bool)  # every key masked: finite, uniform
    out0, w0 = keep_dtype_attention(module, q, k, v, none, D**-0.5)
    assert torch.isfinite(out0).all()
    torch.testing.assert_close(w0, torch.full_like(w0, 1 / L))


def test_functional_attention_is_temporary_and_changes_no_number():
    model = tiny_llama().double()
    ids, _, am = batch("left")
    with torch.no_grad():
        ref = forward_logits(model, ids, am).logits
        with functional_attention(model):
            assert model.config._attn_implementation == ATTN_NAME
            inside = forward_logits(model, ids, am).logits
    assert model.config._attn_implementation == "sdpa"
    real = am.bool()
    torch.testing.assert_close(inside[real], ref[real], rtol=1e-10, atol=1e-12)
    with functional_attention(torch.nn.Linear(2, 2)):  # no config: a no-op
        pass


def test_exact_float64_refuses_a_norm_it_cannot_reproduce():
    """An RMS norm of neither form is refused by name; a copy that computes something else
    (a perturbed weight) is refused naming the first differing module."""
    from _fixtures_grads import tiny_llama

    from varbench.grads.precision import verify_copy

    class WeirdRMSNorm(torch.nn.Module):
        def __init__(self, n):
            super().__init__()
            # not 1: with w = 1, 2 w x_hat would be Gemma's (1 + w) x_hat
            self.weight = torch.nn.Parameter(torch.linspace(0.2, 1.7, n))
            self.eps = 1e-6

        def forward(self, x):
            return 2 * self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    model = tiny_llama()
    model.model.norm = WeirdRMSNorm(16)
    with pytest.raises(ValueError, match="WeirdRMSNorm at 'norm' is neither"):
        exact_float64(model)
    model = tiny_llama()
    copy64 = exact_float64(model)
    with torch.no_grad():
        copy64.model.layers[1].mlp.down_proj.weight.mul_(1.5)
    with pytest.raises(ValueError, match=r"first differing module: 'model.layers.1.mlp.down_proj'"):
        verify_copy(model, copy64)


def test_gemma2_float64_nan_is_reported_clearly():
    """transformers' Gemma2 in float64 returns NaN for left-padded rows: the gradient harness
    and the sampler's step say so (naming the model) instead of failing in multinomial, and the
    exact_float64 copy stays finite."""
    from _fixtures_arch import build
    from _fixtures_grads import batch

    from varbench.grads.exact import token_grad_norms
    from varbench.models.arch import stepper

    model = build("gemma2").double()
    ids, rm, am = batch("left")
    with pytest.raises(ValueError, match="Gemma2ForCausalLM in torch.float64 returned NaN"):
        token_grad_norms(model, ids, rm, am)
    with pytest.raises(ValueError, match="returned NaN logits"):
        stepper(model)(ids, am, (am.cumsum(-1) - 1).clamp(min=0), None)
    r = token_grad_norms(exact_float64(build("gemma2")), ids, rm, am)
    assert torch.isfinite(r.prefix_sq).all()
