"""The architecture matrix: every family of tests/_fixtures_arch.py through the gradient harness
(token / prefix / diagonal prefix / sequence / per-group norms, both methods), sequence_grad_norms,
forward_stats, the tail-exact norms, the forward-mode sketch probes and ``sample``, against the
brute force of tests/reference_grads.py (one torch.autograd.grad per response token) on the
verified float64 copy, and bf16 against float64 on the same weights. Padding left and right,
with an environment token inside the response. A new architecture is one line in ARCHS.

Tolerances:
- float64 (exact_float64 copy, brute force on the same copy): RTOL_64 = 1e-9 relative to the
  largest entry; observed <= 2e-15 on every architecture (the only differences are summation
  order).
- bf16 model, norms accumulated in float32, against the float64 brute force on the SAME
  (bf16-rounded) weights: RTOL_BF16 = 5e-2 per entry. Justification: bf16 has a unit roundoff
  of 2^-9 = 2e-3; a per-token gradient passes through two blocks of bf16 matmuls, norms and
  softmaxes forward and backward (each rounding its output at least once, ~10-20 roundings on
  the path), and a squared norm doubles a relative error; the Gemma family further multiplies
  by sqrt(hidden) and (1 + w). Observed max 2.0e-2 (gemma3), most architectures <= 7e-3.
  Accumulating the norms in bf16 itself (the bug this guards against) gave errors up to 91%.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from _fixtures_arch import ARCHS, build
from _fixtures_grads import batch
from reference_grads import brute_token_grads, norms_from_grads

from varbench.grads import (
    exact_float64,
    forward_stats,
    tail_token_norms,
    token_grad_norms,
)
from varbench.grads.exact import token_chunks
from varbench.grads.params import group_index
from varbench.grads.precision import verify_copy
from varbench.grads.seqnorms import sequence_grad_norms, sequence_routes
from varbench.grads.sketch import GaussianProbes, jvp_token_probes
from varbench.models import build_tokenizer
from varbench.models.forward import forward_logits
from varbench.models.presets import Policy
from varbench.rollout.sampler import sample
from varbench.tasks import get_task

# tiny models: one intra-op thread (two threads thrash on the shared two-core machine)
pytestmark = pytest.mark.usefixtures("one_thread")

RTOL_64 = 1e-9
RTOL_BF16 = 5e-2
NAMES = list(ARCHS)
PADS = ["right", "left"]


@functools.cache
def _models(name: str):
    m32 = build(name)
    return m32, exact_float64(m32)


@functools.cache
def _brute(name: str, padding: str, bf16: bool = False):
    """(model, ids, rm, am, per-token grads [B, L, P], names, numels) on the float64 copy."""
    m32, m64 = _models(name)
    if bf16:
        m64 = exact_float64(copy.deepcopy(m32).to(torch.bfloat16))
    ids, rm, am = batch(padding, B=2, L=9)
    g, names, sizes = brute_token_grads(m64, ids, rm, am)
    return m64, ids, rm, am, g, names, sizes


def _close(got, want, rtol):
    scale = want.abs().max().clamp(min=1e-30)
    err = float((got.double() - want.double()).abs().max() / scale)
    assert err <= rtol, f"max error {err:.2e} relative to the largest entry > {rtol}"
    return err


def _last(x, rm):
    cols = torch.arange(rm.shape[1]).expand_as(rm)
    return x[torch.arange(rm.shape[0]), (cols * (rm != 0)).max(1).values]


@pytest.mark.parametrize("padding", PADS)
@pytest.mark.parametrize("name", NAMES)
def test_token_norms_match_brute_force(name, padding):
    m64, ids, rm, am, g, names, sizes = _brute(name, padding)
    tok, pre, diag = norms_from_grads(g, rm)
    for method in ("ghost", "materialize"):
        r = token_grad_norms(m64, ids, rm, am, groups=True, method=method)
        _close(r.token_sq, tok, RTOL_64)
        _close(r.prefix_sq, pre, RTOL_64)
        _close(r.diag_prefix_sq, diag, RTOL_64)
        _close(r.sequence_sq, _last(pre, rm), RTOL_64)
        assert set(r.methods) == set(names)
    # per-group breakdown against the brute force sliced by parameter
    gnames, gidx = group_index(m64, names, True)
    assert r.group_names == gnames
    slices = torch.split(g, sizes, dim=-1)
    for k in range(len(gnames)):
        gk = torch.cat([s for s, i in zip(slices, gidx, strict=True) if i == k], -1)
        t_k, p_k, _ = norms_from_grads(gk, rm)
        _close(r.group_token_sq[..., k], t_k, RTOL_64)
        _close(r.group_prefix_sq[..., k], p_k, RTOL_64)


@pytest.mark.parametrize("padding", PADS)
@pytest.mark.parametrize("name", NAMES)
def test_packed_token_norms_match_brute_force(name, padding):
    """Several sequences per forward (``pack=True``, chunk 3: the middle chunk spans both rows
    and the second row continues into the last one): the same norms and groups, both methods."""
    m64, ids, rm, am, g, names, sizes = _brute(name, padding)
    assert any(lo < hi for _, _, lo, hi, _ in token_chunks(rm, 3, pack=True))
    tok, pre, diag = norms_from_grads(g, rm)
    gnames, gidx = group_index(m64, names, True)
    slices = torch.split(g, sizes, dim=-1)
    for method in ("ghost", "materialize"):
        r = token_grad_norms(m64, ids, rm, am, groups=True, method=method, chunk_size=3,
                             pack=True)
        _close(r.token_sq, tok, RTOL_64)
        _close(r.prefix_sq, pre, RTOL_64)
        _close(r.diag_prefix_sq, diag, RTOL_64)
        _close(r.sequence_sq, _last(pre, rm), RTOL_64)
        for k in range(len(gnames)):
            gk = torch.cat([s for s, i in zip(slices, gidx, strict=True) if i == k], -1)
            t_k, p_k, _ = norms_from_grads(gk, rm)
            _close(r.group_token_sq[..., k], t_k, RTOL_64)
            _close(r.group_prefix_sq[..., k], p_k, RTOL_64)


def test_methods_record_how_each_module_was_handled():
    """Scaled and position-deriving embeddings are factored exactly (scale recorded); a tied
    head is materialised with its reason; GPT-2's Conv1D is factored."""
    r = token_grad_norms(*_brute("gemma_untied", "right")[:4])
    assert r.methods["model.embed_tokens.weight"] == "ghost (embedding, scale 4)"
    r = token_grad_norms(*_brute("opt", "left")[:4])
    assert r.methods["model.decoder.embed_positions.weight"] == "ghost (embedding)"
    assert r.methods["model.decoder.embed_tokens.weight"].startswith("materialize: weight shared")
    r = token_grad_norms(*_brute("gpt2", "right")[:4])
    assert r.methods["transformer.h.0.attn.c_attn.weight"] == "ghost (conv1d)"


@pytest.mark.parametrize("padding", PADS)
@pytest.mark.parametrize("name", NAMES)
def test_sequence_grad_norms_match_brute_force(name, padding):
    m64, ids, rm, am, g, names, _ = _brute(name, padding)
    c = torch.randn(rm.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    got, methods = sequence_grad_norms(m64, ids, rm, am, coefficients=c, with_methods=True)
    want = (g * (c * rm)[..., None]).sum(1).pow(2).sum(-1)
    _close(got, want, RTOL_64)
    _close(sequence_grad_norms(m64, ids, rm, am), _last(norms_from_grads(g, rm)[1], rm), RTOL_64)
    assert set(methods) == set(names)
    # one sequence per forward+backward (the row chunks of a large batch): same norms, routes
    one, routes = sequence_grad_norms(m64, ids, rm, am, coefficients=c, with_methods=True,
                                      rows=1)
    _close(one, want, RTOL_64)
    assert routes == methods
    # the routes decided on another model of the architecture (other weights, 6 positions)
    # and given: no value is read to decide them, the numbers and methods are the same
    other = exact_float64(build(name, seed=7))
    given = sequence_routes(other, ids[:1, :6], rm[:1, :6], am[:1, :6])
    got2, methods2 = sequence_grad_norms(m64, ids, rm, am, coefficients=c, with_methods=True,
                                         routes=given)
    assert torch.equal(got2, got) and methods2 == methods


@pytest.mark.parametrize("name", NAMES)
def test_forward_stats_match_direct_softmax(name):
    m64, ids, rm, am, *_ = _brute(name, "left")
    s = forward_stats(m64, ids, rm, am, hidden_norms=True)
    z = forward_logits(m64, ids, am).logits[:, :-1].detach()
    logp = torch.log_softmax(z, -1).gather(-1, ids[:, 1:, None])[..., 0]
    p = torch.softmax(z, -1)
    w = (torch.nn.functional.one_hot(ids[:, 1:], z.shape[-1]) - p).pow(2).sum(-1)
    m = rm[:, 1:].double()
    _close(s.logp[:, 1:], logp * m, RTOL_64)
    _close(s.proxy[:, 1:], w * m, RTOL_64)


@pytest.mark.parametrize("name", NAMES)
def test_tail_norms_match_brute_force_restricted_to_tail(name):
    m64, ids, rm, am, g, names, sizes = _brute(name, "left")
    r = tail_token_norms(m64, ids, rm, am)
    tail_params = {f"{mod}.{p}" for mod in r.group_names
                   for p, _ in m64.get_submodule(mod).named_parameters(recurse=False)}
    assert tail_params
    keep = torch.cat([torch.full((n,), nm in tail_params) for nm, n in zip(names, sizes,
                                                                            strict=True)])
    tok, pre, diag = norms_from_grads(g[..., keep], rm)
    _close(r.token_sq, tok, RTOL_64)
    _close(r.prefix_sq, pre, RTOL_64)
    _close(r.diag_prefix_sq, diag, RTOL_64)


@pytest.mark.parametrize("name", NAMES)
def test_sketch_probes_are_exact_directional_derivatives(name):
    """The forward-mode probes (through varbench's functional attention, soft-capping
    included) equal ``g_t . v_j`` of the brute-force gradients."""
    m64, ids, rm, am, g, *_ = _brute(name, "left")
    emb = m64.get_input_embeddings()
    if emb.padding_idx is not None and emb.weight is m64.get_output_embeddings().weight:
        # a tied embedding's padding id at an attended position is refused (see sketch.py)
        bad = (ids == emb.padding_idx) & (am != 0)
        if bad.any():
            with pytest.raises(ValueError, match="padding_idx of the tied"):
                jvp_token_probes(m64, ids, rm, am, GaussianProbes(1))
            ids = torch.where(bad, (emb.padding_idx + 1) % emb.weight.shape[0], ids)
            g = brute_token_grads(m64, ids, rm, am)[0]
    probes = GaussianProbes(2, seed=5)
    u = jvp_token_probes(m64, ids, rm, am, probes)
    v = torch.stack([probes.direction(j, g.shape[-1], torch.float64, "cpu") for j in range(2)])
    _close(u, torch.einsum("blp,kp->kbl", g, v), RTOL_64)


@pytest.mark.parametrize("name", NAMES)
def test_sample_records_match_teacher_forcing(name):
    """``sample`` on every architecture (KV cache, sliding windows, MoE): recorded log-probs
    equal a teacher-forced forward over the returned batch."""
    m32, _ = _models(name)
    policy = Policy(m32, build_tokenizer(), name)
    task = get_task("sort", n=3)
    b = sample(policy, task, task.prompts(2, seed=0), 2, seed=0)
    flat = b.flat()
    s = forward_stats(m32, flat.input_ids, flat.response_mask, flat.attention_mask)
    Lp = flat.input_ids.shape[1] - b.T
    torch.testing.assert_close(s.logp[:, Lp:], b.logprobs.reshape(-1, b.T) * b.mask.reshape(
        -1, b.T), rtol=0, atol=2e-5)


@pytest.mark.parametrize("name", NAMES)
def test_bf16_norms_against_float64_on_the_same_weights(name):
    m64, ids, rm, am, g, *_ = _brute(name, "left", bf16=True)
    m16 = build(name).to(torch.bfloat16)
    tok, pre, _ = norms_from_grads(g, rm)
    r = token_grad_norms(m16, ids, rm, am)
    assert r.token_sq.dtype == torch.float32
    err = (r.token_sq.double() - tok).abs() / tok.clamp(min=1e-30)
    assert float(err[rm != 0].max()) <= RTOL_BF16
    err = (r.prefix_sq.double() - pre).abs() / pre.clamp(min=1e-30)
    assert float(err[rm != 0].max()) <= RTOL_BF16
    seq = sequence_grad_norms(m16, ids, rm, am)
    want = _last(pre, rm)
    assert float(((seq.double() - want).abs() / want).max()) <= RTOL_BF16


@pytest.mark.parametrize("name", NAMES)
def test_exact_float64_reproduces_the_original(name):
    m32, m64 = _models(name)
    z = forward_logits(m32, *batch("left", B=2, L=9)[::2]).logits.detach()
    assert verify_copy(m32, m64) <= 1e-4 * (1 + float(z.abs().max()))
