"""varbench.models.logits: the statistics of pi (log-probs, entropy, sum_pi_sq, the
Logit-Gradient Proxy) against float64 brute force, stable for any logit scale (docs/science.md
section 2.3)."""

from __future__ import annotations

import warnings

import pytest
import torch
from _fixtures_models import KINDS, ids_and_mask, tiny_lm
from reference_models import brute_pi_stats, brute_topk, plain_token_stats

from varbench.grads import forward_stats
from varbench.models.forward import forward_logits
from varbench.models.head import OutputHead, read_head
from varbench.models.logits import (
    head_logprobs,
    head_stats,
    logit_proxy,
    pi_stats,
    proxy_from_logprobs,
    sequence_logprobs,
    sequence_stats,
    stat_dtype,
    sum_pi_sq,
    token_logprobs,
    upcast,
)


def test_sum_pi_sq_matches_softmax_and_is_stable():
    z = torch.randn(5, 7, 31, dtype=torch.float64)
    torch.testing.assert_close(
        sum_pi_sq(z), torch.softmax(z, -1).pow(2).sum(-1), rtol=1e-12, atol=0
    )
    big = torch.tensor([[1e4, 1e4 - 1.0, -1e4], [-1e4, -1e4, -1e4]], dtype=torch.float32)
    s = sum_pi_sq(big)
    assert torch.all(torch.isfinite(s))
    e = torch.exp(torch.tensor(-1.0))
    want = torch.tensor([(1 + e**2) / (1 + e) ** 2, 1 / 3])
    torch.testing.assert_close(s, want, rtol=1e-5, atol=0)
    assert sum_pi_sq(torch.full((3, 10), 1e4, dtype=torch.bfloat16)).dtype == torch.float32


def test_logit_proxy_is_squared_logit_gradient():
    z = torch.randn(4, 6, 17, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 17, (4, 6))
    w = logit_proxy(z, y)
    for idx in [(0, 0), (3, 5), (2, 1)]:
        (g,) = torch.autograd.grad(torch.log_softmax(z[idx], -1)[y[idx]], z)
        torch.testing.assert_close(w[idx], g.pow(2).sum(), rtol=1e-12, atol=0)
    e_y = torch.nn.functional.one_hot(y, 17).double()
    torch.testing.assert_close(w, (e_y - torch.softmax(z, -1)).pow(2).sum(-1), rtol=1e-12, atol=0)
    assert torch.all((w >= 0) & (w < 2))
    with pytest.raises(ValueError, match="tokens has shape"):
        logit_proxy(z, y[:, :3])


def _logits(seed, shape=(3, 4, 11), scale=3.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
    y = torch.randint(0, shape[-1], shape[:-1], generator=g)
    return z.to(dtype), y


@pytest.mark.parametrize("seed", range(3))
def test_pi_stats_match_the_float64_brute_force(seed):
    z, y = _logits(seed)
    s = pi_stats(z, y)
    logp, ent, sq = brute_pi_stats(z, y)
    for got, want in zip(s[:3], (logp, ent, sq), strict=True):
        assert got.dtype == torch.float64 and got.shape == y.shape
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(sum_pi_sq(z), sq, rtol=1e-12, atol=1e-14)
    # float32 logits: computed in float32, close to the float64 truth
    s32 = pi_stats(z.float(), y)
    assert s32.logp.dtype == s32.entropy.dtype == s32.sum_pi_sq.dtype == torch.float32
    for got, want in zip(s32[:3], (logp, ent, sq), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_masked_logits_give_finite_entropy_and_sum_pi_sq():
    """A -inf logit (a masked vocabulary entry) contributes exactly 0, never NaN."""
    z, y = _logits(5, shape=(2, 6, 9))
    z[..., 3] = float("-inf")
    z[1, 2, :] = float("-inf")
    z[1, 2, 4] = 0.0  # one live entry: pi is one-hot there
    y[1, 2] = 4
    y = torch.where(y == 3, 0, y)  # the sampled token is never a masked one
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        s = pi_stats(z.to(dtype), y)
        for x in (*s[:4], sum_pi_sq(z.to(dtype)), logit_proxy(z.to(dtype), y)):
            assert torch.isfinite(x).all(), dtype
    s = pi_stats(z, y)
    logp, ent, sq = brute_pi_stats(z, y)
    torch.testing.assert_close(s.entropy, ent, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(s.sum_pi_sq, sq, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(s.logp, logp, rtol=1e-12, atol=1e-14)
    assert s.entropy[1, 2].item() == 0.0 and s.sum_pi_sq[1, 2].item() == 1.0
    assert s.logp[1, 2].item() == 0.0 and logit_proxy(z, y)[1, 2].item() == 0.0


def test_reduced_precision_logits_are_computed_in_float32():
    z, y = _logits(1, dtype=torch.bfloat16)
    s = pi_stats(z, y)
    want = pi_stats(z.float(), y)  # the same bf16 values, upcast first
    for got, ref in zip(s[:4], want[:4], strict=True):
        assert got.dtype == torch.float32
        assert torch.equal(got, ref)
    assert sum_pi_sq(z).dtype == torch.float32 and torch.equal(sum_pi_sq(z), want.sum_pi_sq)
    assert logit_proxy(z.half(), y).dtype == torch.float32
    assert [stat_dtype(d) for d in (torch.bfloat16, torch.float16, torch.float32,
                                     torch.float64)] == [torch.float32] * 3 + [torch.float64]
    for d in (torch.float32, torch.float64):
        x = z.to(d)
        assert upcast(x) is x  # no copy
    assert upcast(z).dtype == torch.float32


def test_proxy_from_logprobs_equals_logit_proxy():
    z, y = _logits(2)
    s = pi_stats(z, y)
    logp, sq = s.logp.clone(), s.sum_pi_sq.clone()
    w = proxy_from_logprobs(s.logp, s.sum_pi_sq)
    assert torch.equal(s.logp, logp) and torch.equal(s.sum_pi_sq, sq)  # inputs not modified
    torch.testing.assert_close(w, logit_proxy(z, y), rtol=0, atol=0)
    blogp, _, bsq = brute_pi_stats(z, y)
    torch.testing.assert_close(w, 1 - 2 * blogp.exp() + bsq, rtol=1e-12, atol=1e-14)
    assert ((w >= 0) & (w < 2)).all()
    # the in-place path (no autograd) and the differentiable path give the same numbers
    lp = s.logp.clone().requires_grad_(True)
    w_grad = proxy_from_logprobs(lp, s.sum_pi_sq)
    assert w_grad.requires_grad
    torch.testing.assert_close(w_grad.detach(), w, rtol=1e-15, atol=1e-15)


def test_logit_proxy_is_differentiable():
    z, y = _logits(4, shape=(2, 3, 5), scale=1.0)
    z.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: logit_proxy(x, y), (z,))
    # d w / d z against the closed form: w = ||e_y - p||^2, dw/dz = 2 J^T (p - e_y), with
    # J = diag(p) - p p^T the softmax Jacobian
    (g,) = torch.autograd.grad(logit_proxy(z, y).sum(), z)
    p = torch.softmax(z.detach(), -1)
    d = p - torch.nn.functional.one_hot(y, 5).double()
    want = 2 * (p * d - p * (p * d).sum(-1, keepdim=True))
    torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-14)


def test_token_logprobs_alignment_and_shape_errors():
    z, ids = _logits(6, shape=(2, 5, 7))
    lp = token_logprobs(z, ids)
    assert lp.shape == (2, 5) and (lp[:, 0] == 0).all()
    for b in range(2):
        for t in range(1, 5):
            want = torch.log_softmax(z[b, t - 1], -1)[ids[b, t]]
            torch.testing.assert_close(lp[b, t], want, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match=r"tokens has shape \[2, 4\], expected \[2, 5\]"):
        pi_stats(z, ids[:, :4])


# ---- the chunked path from hidden states + output head (issue: never the full [B, L, V]) ----

def _head(seed, H=6, V=13, bias=False, scale=1.0, cap=None):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 2
    b = torch.randn(V, generator=g, dtype=torch.float64) if bias else None
    return OutputHead(w, b, scale, cap)


def _plain_logits(h, head):
    u = torch.nn.functional.linear(h, head.weight, head.bias) * head.scale
    return u if head.softcap is None else head.softcap * torch.tanh(u / head.softcap)


HEADS = [dict(), dict(bias=True), dict(scale=0.4), dict(cap=1.5), dict(bias=True, scale=3.0,
                                                                        cap=4.0)]


@pytest.mark.parametrize("opts", HEADS)
def test_head_stats_equal_the_brute_force_for_every_chunk_size(opts):
    head = _head(0, **opts)
    g = torch.Generator().manual_seed(1)
    h = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 13, (2, 5), generator=g)
    z = _plain_logits(h, head)
    logp, ent, sq = brute_pi_stats(z, y)
    tv, ti, mp = brute_topk(z, 4)
    for chunk in range(1, 11):
        s = head_stats(h, head, y, chunk=chunk, top_k=4, max_prob=True)
        for got, want in zip(s[:3], (logp, ent, sq), strict=True):
            assert got.dtype == torch.float64 and got.shape == y.shape
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(s.proxy, 1 - 2 * logp.exp() + sq, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(s.max_prob, mp, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(s.topk_logp, tv, rtol=1e-12, atol=1e-14)
        assert torch.equal(s.topk_ids, ti)
        torch.testing.assert_close(s.hidden_sq, h.square().sum(-1), rtol=1e-14, atol=0)
    # the logits-input entry gives the same numbers, chunked or not
    for chunk in (1, 3, 10):
        s = pi_stats(z, y, chunk=chunk, top_k=2)
        torch.testing.assert_close(s.entropy, ent, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(s.topk_logp, tv[..., :2], rtol=1e-12, atol=1e-14)
    assert pi_stats(z, y).max_prob is None and pi_stats(z, y).topk_logp is None


def test_statistics_are_float32_for_reduced_precision_and_float64_on_request():
    head = _head(2, bias=True, cap=3.0)
    g = torch.Generator().manual_seed(3)
    h = torch.randn(4, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, 13, (4,), generator=g)
    hb = OutputHead(head.weight.bfloat16(), head.bias.bfloat16(), head.scale, head.softcap)
    s = head_stats(h.bfloat16(), hb, y)
    assert all(x.dtype == torch.float32 for x in s[:4])
    # the matmul in bfloat16 as the model's head does, then cap and statistics in float32
    zb = torch.nn.functional.linear(h.bfloat16(), hb.weight, hb.bias).float()
    want = pi_stats(3.0 * torch.tanh(zb / 3.0), y)
    for got, ref in zip(s[:4], want[:4], strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    s64 = head_stats(h.float(), OutputHead(head.weight.float(), head.bias.float(), 1.0, 3.0), y,
                     dtype=torch.float64)
    assert s64.logp.dtype == torch.float64
    with pytest.raises(TypeError, match="dtype=torch.int64 is not valid"):
        head_stats(h, head, y, dtype=torch.int64)
    with pytest.raises(ValueError, match="chunk"):
        head_stats(h, head, y, chunk=0)
    with pytest.raises(ValueError, match="tokens has shape"):
        head_stats(h, head, y[:2])


@pytest.mark.parametrize("opts", HEADS)
def test_head_logprobs_gradients_equal_the_plain_path(opts):
    """Values and gradients (hidden, weight, bias) of sum(a log pi(y) + b H) in float64."""
    head = _head(4, **opts)
    w = head.weight.clone().requires_grad_(True)
    b = None if head.bias is None else head.bias.clone().requires_grad_(True)
    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, 4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 13, (3, 4), generator=g)
    a, c = torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(3, 4, generator=g,
                                                                           dtype=torch.float64)
    params = [h, w] + ([b] if b is not None else [])
    lsm = torch.log_softmax(_plain_logits(h, OutputHead(w, b, head.scale, head.softcap)), -1)
    lp0, ent0 = lsm.gather(-1, y[..., None]).squeeze(-1), -(lsm.exp() * lsm).sum(-1)
    want = torch.autograd.grad((a * lp0 + c * ent0).sum(), params, retain_graph=True)
    want_lp = torch.autograd.grad((a * lp0).sum(), params)
    for chunk in (1, 2, 5, 12):
        hd = OutputHead(w, b, head.scale, head.softcap)
        lp, ent = head_logprobs(h, hd, y, entropy=True, chunk=chunk)
        torch.testing.assert_close(lp, lp0, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(ent, ent0, rtol=1e-12, atol=1e-13)
        got = torch.autograd.grad((a * lp + c * ent).sum(), params)
        for x, ref in zip(got, want, strict=True):
            torch.testing.assert_close(x, ref, rtol=1e-10, atol=1e-12)
        got = torch.autograd.grad((a * head_logprobs(h, hd, y, chunk=chunk)).sum(), params)
        for x, ref in zip(got, want_lp, strict=True):
            torch.testing.assert_close(x, ref, rtol=1e-10, atol=1e-12)


def test_head_logprobs_passes_gradcheck():
    head = _head(6, H=3, V=5, bias=True, scale=0.7, cap=2.0)
    w = head.weight.clone().requires_grad_(True)
    b = head.bias.clone().requires_grad_(True)
    h = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 4, 2, 2])

    def f(h, w, b):
        lp, ent = head_logprobs(h, OutputHead(w, b, 0.7, 2.0), y, entropy=True, chunk=3)
        return lp, ent

    assert torch.autograd.gradcheck(f, (h, w, b))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_sequence_stats_equal_the_plain_path(kind, tied):
    model = tiny_lm(kind, tied=tied)
    ids, am = ids_and_mask(left=kind != "gemma2")
    with torch.no_grad():
        z = forward_logits(model, ids, am).logits
    for start, chunk in ((1, 1), (4, 7), (4, None)):
        logp, ent, sq = brute_pi_stats(z[:, start - 1:-1], ids[:, start:])
        s = sequence_stats(model, ids, am, start=start, chunk=chunk, hidden_sq=True)
        for got, want in zip(s[:3], (logp, ent, sq), strict=True):
            assert got.shape == (3, 10 - start)
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
        assert s.hidden_sq.shape == (3, 10 - start) and (s.hidden_sq > 0).all()


@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama", True), ("gemma2", True),
                                       ("cohere", False), ("gptj", False), ("granite", True)])
def test_sequence_logprobs_gradients_equal_the_plain_path(kind, tied):
    """Every parameter's gradient of sum(a log pi + c H) equals the full-logits path's."""
    model = tiny_lm(kind, tied=tied)
    ids, am = ids_and_mask(left=kind != "gemma2")
    g = torch.Generator().manual_seed(7)
    a, c = torch.randn(3, 7, generator=g, dtype=torch.float64), torch.randn(3, 7, generator=g,
                                                                           dtype=torch.float64)
    params = [p for p in model.parameters() if p.requires_grad]
    lp0, ent0 = plain_token_stats(model, ids, am, start=3)
    want = torch.autograd.grad((a * lp0 + c * ent0).sum(), params, allow_unused=True)
    for chunk in (1, 5, None):
        lp, ent = sequence_logprobs(model, ids, am, start=3, entropy=True, chunk=chunk)
        torch.testing.assert_close(lp, lp0, rtol=1e-12, atol=1e-12)
        got = torch.autograd.grad((a * lp + c * ent).sum(), params, allow_unused=True)
        for x, ref in zip(got, want, strict=True):
            if ref is None:
                assert x is None
            else:
                torch.testing.assert_close(x, ref, rtol=1e-10, atol=1e-12)


def test_chunked_path_never_holds_more_than_a_chunk_of_logits(monkeypatch):
    """The model's own head never runs, and the head's logits are made chunk rows at a time."""
    model = tiny_lm("llama")
    ids, am = ids_and_mask()
    assert read_head(model)[0] is not None  # the probe runs the model's own head, once
    model.lm_head.register_forward_hook(lambda *a: pytest.fail("full logits were computed"))
    rows = []
    real = OutputHead.logits

    def spy(self, hidden, dtype):
        rows.append(hidden.shape[0])
        return real(self, hidden, dtype)

    monkeypatch.setattr(OutputHead, "logits", spy)
    rows.clear()
    with torch.no_grad():
        forward_stats(model, ids, (am > 0).float() * (torch.arange(10) > 2), am, chunk=4)
    lp = sequence_logprobs(model, ids, am, chunk=4)
    lp.sum().backward()
    assert rows and max(rows) <= 4


def test_reduced_precision_model_gives_float32_statistics_and_gradients():
    model = tiny_lm("llama", dtype=torch.bfloat16)
    ids, am = ids_and_mask()
    with torch.no_grad():
        z = forward_logits(model, ids, am).logits  # bfloat16
    s = sequence_stats(model, ids, am)
    want = pi_stats(z[:, :-1], ids[:, 1:])  # the same bfloat16 logits, upcast
    for got, ref in zip(s[:4], want[:4], strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    lp = sequence_logprobs(model, ids, am)
    assert lp.dtype == torch.float32
    (gw,) = torch.autograd.grad(lp.sum(), model.lm_head.weight)
    z2 = forward_logits(model, ids, am).logits.float()
    (gw0,) = torch.autograd.grad(token_logprobs(z2, ids).sum(), model.lm_head.weight)
    assert gw.dtype == torch.bfloat16
    torch.testing.assert_close(gw.float(), gw0.float(), rtol=2e-2, atol=2e-2 * gw0.abs().max())


def test_unreadable_head_falls_back_with_a_warning():
    model = tiny_lm("llama")
    model.config.model_type = "unheard_of"
    ids, am = ids_and_mask()
    with pytest.warns(UserWarning, match="fall back to the full"):
        s = sequence_stats(model, ids, am, hidden_sq=True, top_k=2)
    with torch.no_grad():
        z = forward_logits(model, ids, am).logits
    logp, ent, sq = brute_pi_stats(z[:, :-1], ids[:, 1:])
    torch.testing.assert_close(s.entropy, ent, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s.logp, logp, rtol=1e-10, atol=1e-12)
    h = forward_logits(model, ids, am, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(s.hidden_sq, h[:, :-1].square().sum(-1), rtol=1e-10, atol=0)
    lp, ent2 = sequence_logprobs(model, ids, am, entropy=True)  # warned once per reason
    torch.testing.assert_close(lp, logp, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ent2, ent, rtol=1e-10, atol=1e-12)
    (g,) = torch.autograd.grad(lp.sum(), model.lm_head.weight)
    assert torch.isfinite(g).all()


def test_sequence_functions_check_start():
    model = tiny_lm("llama")
    ids, am = ids_and_mask()
    for bad in (0, 11, 2.0):
        with pytest.raises(ValueError, match=f"start={bad!r} is not valid"):
            sequence_stats(model, ids, am, start=bad)
        with pytest.raises(ValueError, match="start="):
            sequence_logprobs(model, ids, am, start=bad)


@pytest.mark.parametrize("readable", [True, False])
def test_mask_limits_the_work_and_zeroes_the_rest(readable):
    """Only the masked-in positions reach the head; values and gradients equal the unmasked
    path's there and are 0 elsewhere (chunked path and fallback)."""
    model = tiny_lm("llama", tied=True)
    if not readable:
        model.config.model_type = "unheard_of_too"
    ids, am = ids_and_mask()
    mask = (torch.arange(7) % 3 != 1).repeat(3, 1)  # [B, L - 3]
    mask[2] = False  # a row with nothing to compute
    sel = mask.bool()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = sequence_stats(model, ids, am, start=3, top_k=2, hidden_sq=True)
        part = sequence_stats(model, ids, am, start=3, mask=mask, top_k=2, hidden_sq=True)
        for got, want in zip(part, full, strict=True):
            if want is None:
                assert got is None
                continue
            assert got.shape == want.shape
            torch.testing.assert_close(got[sel], want[sel], rtol=1e-12, atol=1e-14)
            assert (got[~sel] == 0).all()
        a = torch.randn(3, 7, dtype=torch.float64)
        lp0, ent0 = sequence_logprobs(model, ids, am, start=3, entropy=True)
        lp, ent = sequence_logprobs(model, ids, am, start=3, mask=mask, entropy=True)
    torch.testing.assert_close(lp, lp0 * sel, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ent, ent0 * sel, rtol=1e-12, atol=1e-14)
    params = list(model.parameters())
    want = torch.autograd.grad(((a * lp0 + ent0) * sel).sum(), params)
    got = torch.autograd.grad((a * lp + ent).sum(), params)
    for x, ref in zip(got, want, strict=True):
        torch.testing.assert_close(x, ref, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"mask has shape \[3, 6\], expected \[3, 7\]"):
        sequence_stats(model, ids, am, start=3, mask=mask[:, 1:])
