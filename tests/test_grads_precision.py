"""varbench.grads.precision: the float64-throughout copy (dtype-keeping RMS norms and
attention), its attention function against torch's, and the temporary functional attention."""

from __future__ import annotations

import contextlib

import pytest
import torch
from _fixtures_grads import batch, tiny_llama

from varbench.grads.precision import (
    ATTN_NAME,
    KeepDtypeRMSNorm,
    batched_backward_attention,
    exact_float64,
    functional_attention,
    fused_attention_kernel,
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


def test_matmul_attention_softmax_runs_in_float32_for_bf16():
    """Regression: the swap used for forward-mode AD built the scores and the softmax in the
    model dtype (bf16). Now its only bf16 error is the final rounding of the output."""
    g = torch.Generator().manual_seed(0)
    B, H, L, D = 2, 4, 256, 64
    q, k = ((2 * torch.randn(B, H, L, D, generator=g)).bfloat16() for _ in range(2))
    v = torch.randn(B, H, L, D, generator=g).bfloat16()
    module = torch.nn.Module().eval()
    out, weights = keep_dtype_attention(module, q, k, v, None, D**-0.5)
    assert out.dtype == weights.dtype == torch.bfloat16
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double(), v.double(), is_causal=True).transpose(1, 2)
    bound = 2**-8 * ref.abs() * 1.01 + 1e-5  # half a bf16 ulp (+ float32 arithmetic)
    assert bool(((out.double() - ref).abs() <= bound).all())
    # what the swap computed before: every step in bf16 (the bound is not vacuous)
    scores = (q @ k.transpose(2, 3)) * D**-0.5
    scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), -1e30)
    old = (torch.softmax(scores, -1) @ v).transpose(1, 2)
    assert not bool(((old.double() - ref).abs() <= bound).all())


def test_fused_attention_detection(monkeypatch):
    model = tiny_llama()
    assert model.config._attn_implementation == "sdpa"
    assert fused_attention_kernel(model) is None  # CPU sdpa: has a batched backward
    cuda = torch.backends.cuda
    for flag in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "cudnn_sdp_enabled"):
        monkeypatch.setattr(cuda, flag, lambda: False)
    assert fused_attention_kernel(model, device="cuda") is None  # math only: fine
    monkeypatch.setattr(cuda, "flash_sdp_enabled", lambda: True)
    assert fused_attention_kernel(model, device="cuda") == "sdpa (flash CUDA kernels)"
    monkeypatch.setattr(cuda, "mem_efficient_sdp_enabled", lambda: True)
    assert "flash / memory-efficient" in fused_attention_kernel(model, device="cuda:0")
    assert fused_attention_kernel(tiny_llama(attn="eager"), device="cuda") is None
    model.config._attn_implementation = "flash_attention_2"
    assert fused_attention_kernel(model) == "flash_attention_2"  # on any device
    assert fused_attention_kernel(torch.nn.Linear(2, 2), device="cuda") is None


def _sdpa_node(fn) -> str:
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    out = fn(q)
    return type(out.grad_fn).__name__


def test_batched_backward_attention_switches_to_math_and_says_so(monkeypatch):
    """On a pretend CUDA device the switch restricts sdpa to the math backend (the same flags
    govern the CPU kernels: the fused CPU kernel disappears from the graph) and yields a note;
    on the CPU nothing changes."""
    model = tiny_llama()
    attn = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q):
        return attn(q, q, q, is_causal=True)

    fused = _sdpa_node(sdpa)
    assert "Flash" in fused  # this build's CPU sdpa runs its fused kernel by default
    with batched_backward_attention(model) as note:
        assert note is None and _sdpa_node(sdpa) == fused
    with batched_backward_attention(model, device="cuda") as note:
        assert "math SDPA" in note and "sdpa (" in note
        assert "Flash" not in _sdpa_node(sdpa)
    assert _sdpa_node(sdpa) == fused  # restored
    calls = []
    model.config._attn_implementation = "flash_attention_2"
    monkeypatch.setattr(model, "set_attn_implementation", lambda name: calls.append(name))
    with batched_backward_attention(model) as note:
        assert "flash_attention_2" in note and calls == ["sdpa"]
    assert calls == ["sdpa", "flash_attention_2"]


def test_math_and_eager_attention_give_the_fused_numbers_float64():
    """Per-token gradients by a batched backward, float64: the default sdpa kernel, the math
    backend the switch selects and the matmul attention agree to 1e-12, transformers' eager
    attention to float32 rounding (right padding: eager gives NaN on a fully masked pad row)."""
    ids, rm, am = batch("right")
    grads = {}
    for name in ("sdpa", "math", "eager", "matmul"):
        model = tiny_llama(attn="eager" if name == "eager" else "sdpa").double()
        params = list(model.parameters())
        ctx = {"math": batched_backward_attention(model, device="cuda"),
               "matmul": functional_attention(model)}.get(name, contextlib.nullcontext())
        with ctx:
            logits = forward_logits(model, ids, am).logits
            lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
            lp = lp[rm[:, 1:].bool()]
            eye = torch.eye(lp.numel(), dtype=lp.dtype)
            g = torch.autograd.grad(lp, params, grad_outputs=eye, is_grads_batched=True)
        grads[name] = torch.cat([x.reshape(lp.numel(), -1) for x in g], 1)
    assert torch.isfinite(grads["sdpa"]).all() and grads["sdpa"].abs().max() > 0
    for name in ("math", "matmul"):
        torch.testing.assert_close(grads[name], grads["sdpa"], rtol=1e-12, atol=1e-13)
    # transformers' eager attention rounds its softmax to float32 (also in a float64 model)
    torch.testing.assert_close(grads["eager"], grads["sdpa"], rtol=1e-5, atol=1e-6)


def test_attention_scale_of_a_module_that_passes_none():
    """GPT-2 in transformers 5.0 calls its attention function without ``scaling``: the scale is
    the one the replaced implementation would have used (its ``scaling`` attribute; sdpa's
    default; GPT-2's eager rule); an unknown case is refused by name."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from varbench.grads.precision import SOURCE_ATTN, module_attention_scale

    for by_layer, weights in ((False, True), (True, True), (False, False)):
        cfg = GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=4, n_positions=32,
                         scale_attn_by_inverse_layer_idx=by_layer, scale_attn_weights=weights)
        attn = GPT2LMHeadModel(cfg).transformer.h[1].attn
        want = (4 ** -0.5 if weights else 1.0) / (2.0 if by_layer else 1.0)
        if hasattr(attn, "scaling"):  # newer transformers precompute it
            assert module_attention_scale(attn, 4) == pytest.approx(want)
            del attn.scaling
        setattr(attn.config, SOURCE_ATTN, "eager")
        assert module_attention_scale(attn, 4) == pytest.approx(want)
        setattr(attn.config, SOURCE_ATTN, "sdpa")  # sdpa's own default, whatever the flags
        assert module_attention_scale(attn, 4) == pytest.approx(0.5)
        setattr(attn.config, SOURCE_ATTN, "my_kernel")
        with pytest.raises(ValueError, match="GPT2Attention.*'my_kernel'"):
            module_attention_scale(attn, 4)
    with pytest.raises(ValueError, match="Linear calls its attention function without a scaling"):
        module_attention_scale(torch.nn.Linear(2, 2), 4)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_exact_float64_gpt2_with_layer_scaled_attention(attn):
    """The float64 copy of a GPT-2 with layer-index attention scaling computes the original's
    function (verify_copy raises otherwise), eager or sdpa, on every transformers version,
    whether or not the model passes a scaling; functional_attention leaves no trace."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from varbench.grads.precision import SOURCE_ATTN, functional_attention

    cfg = GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=4, n_positions=32,
                     scale_attn_by_inverse_layer_idx=True, attn_implementation=attn)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval()
    copy = exact_float64(model)
    ids = torch.randint(0, 32, (2, 7))
    with torch.no_grad():
        a = model(input_ids=ids).logits.double()
        b = copy(input_ids=ids).logits
        with functional_attention(model):
            c = model(input_ids=ids).logits.double()
    assert b.dtype == torch.float64 and not hasattr(model.config, SOURCE_ATTN)
    torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c, a, rtol=1e-4, atol=1e-5)
