"""varbench.grads.seqnorms: per-sequence norms from one batched backward against the flat
per-sequence gradients of sequence_grads (one backward per sequence) and a brute force, both
Gram branches, tied weights, coefficients, parameter filters and argument errors. (Every
architecture of the matrix is covered in tests/test_grads_arch.py.)"""

from __future__ import annotations

import pytest
import torch
from _fixtures_grads import batch, tiny_llama
from reference_grads import brute_sequence_grads

import varbench
from varbench.grads import exact_float64, seqnorms, sequence_grads
from varbench.grads.seqnorms import sequence_grad_norms

RTOL = 1e-10  # float64 throughout; observed ~1e-15

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_matches_one_backward_per_sequence(tied, padding):
    model = exact_float64(tiny_llama(tied=tied))
    ids, rm, am = batch(padding, B=4)
    want = brute_sequence_grads(model, ids, rm, am).pow(2).sum(-1)
    got = varbench.sequence_grad_norms(model, ids, rm, am)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
    torch.testing.assert_close(got, sequence_grads(model, ids, rm, am).pow(2).sum(-1),
                               rtol=RTOL, atol=0)


@pytest.mark.parametrize("branch", ["ghost", "formed"])
def test_both_gram_branches_and_coefficients(monkeypatch, branch):
    """Ghost (Gram) and formed-gradient branches agree with weighted per-sequence gradients."""
    model = exact_float64(tiny_llama())
    ids, rm, am = batch("left", B=3)
    c = torch.randn(rm.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    flat = []
    for b in range(3):
        lp = varbench.grads.token_logprobs(
            model(input_ids=ids[b:b + 1], attention_mask=am[b:b + 1],
                  position_ids=(am[b:b + 1].cumsum(-1) - 1).clamp(min=0)).logits, ids[b:b + 1])
        g = torch.autograd.grad((lp * c[b:b + 1] * rm[b:b + 1]).sum(), list(model.parameters()))
        flat.append(torch.cat([x.reshape(-1) for x in g]))
    want = torch.stack(flat).pow(2).sum(-1)
    real = seqnorms._self_norm
    if branch == "formed":  # force the formed gradient for every dense factor
        monkeypatch.setattr(seqnorms, "_self_norm", lambda f: real(f) if f.ids is not None
                            else (f.L.transpose(1, 2) @ f.R).pow(2).sum((1, 2)))
    else:
        monkeypatch.setattr(seqnorms, "_self_norm", lambda f: seqnorms._pair(f, f))
    got = sequence_grad_norms(model, ids, rm, am, coefficients=c)
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0)


def test_params_filter_methods_and_dtypes():
    model = tiny_llama()
    ids, rm, am = batch()
    got, methods = sequence_grad_norms(model, ids, rm, am, params="mlp", with_methods=True)
    assert got.dtype == torch.float32 and set(methods) == {
        n for n, _ in model.named_parameters() if "mlp" in n}
    assert all(v == "ghost (linear)" for v in methods.values())
    want = sequence_grads(exact_float64(model), ids, rm, am, params="mlp").pow(2).sum(-1)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=0)
    g64 = sequence_grad_norms(model, ids, rm, am, params="mlp", accumulate=torch.float64)
    assert g64.dtype == torch.float64
    _, methods = sequence_grad_norms(model, ids, rm, am, with_methods=True)
    assert methods["model.norm.weight"] == "per-module vjp"


def test_argument_errors():
    model = tiny_llama()
    ids, rm, am = batch()
    with pytest.raises(ValueError, match="coefficients"):
        sequence_grad_norms(model, ids, rm, am, coefficients=torch.ones(2, 2))
    with pytest.raises(ValueError, match="NaN or inf"):
        sequence_grad_norms(model, ids, rm, am, coefficients=torch.full(rm.shape, float("nan")))
    with pytest.raises(ValueError, match="response_mask"):
        sequence_grad_norms(model, ids, rm[:, :3], am)


@pytest.mark.parametrize("padding", ["right", "left"])
def test_row_chunks_equal_one_batch_and_the_budget_picks_them(monkeypatch, padding):
    """rows=1, 2, B: the same norms (float64), the same routes, one forward per chunk; with a
    CPU budget of one sequence's estimate the default is one row per chunk (issue 27 point 3:
    every response in one backward does not fit at scale)."""
    model = exact_float64(tiny_llama(tied=True))
    ids, rm, am = batch(padding, B=5)
    c = torch.randn(rm.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want, routes = sequence_grad_norms(model, ids, rm, am, coefficients=c, rows=5,
                                       with_methods=True)
    calls = []
    hook = model.register_forward_pre_hook(lambda m, a, k: calls.append(1), with_kwargs=True)
    try:
        for rows in (1, 2):
            calls.clear()
            got, r = sequence_grad_norms(model, ids, rm, am, coefficients=c, rows=rows,
                                         with_methods=True)
            torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
            assert r == routes and len(calls) >= -(-5 // rows)
    finally:
        hook.remove()
    from varbench.models import memplan

    L = ids.shape[1]
    assert seqnorms.sequence_rows(model, 5, L, "cpu") == 5  # a tiny model: one chunk
    shape = memplan.ModelShape.from_model(model)
    one = (memplan.fixed_bytes(shape, "sequence_norms", 5, L)
           + memplan.unit_bytes(shape, "sequence_norms", L))
    monkeypatch.setattr(seqnorms, "SEQUENCE_CPU_BYTES", one)  # the plan's room for one row
    assert seqnorms.sequence_rows(model, 5, L, "cpu") == 1
    torch.testing.assert_close(sequence_grad_norms(model, ids, rm, am, coefficients=c), want,
                               rtol=RTOL, atol=0)
    with pytest.raises(ValueError, match="rows"):
        sequence_grad_norms(model, ids, rm, am, rows=0)


def test_given_routes_keep_the_guards():
    """Given routes (seqnorms.sequence_routes) skip only the forms' recognition: the numbers
    are those decided on the values; a module without a route, a route of the wrong kind for
    its module and a wrong form (its self-check fails) raise, naming the module."""
    import dataclasses

    from varbench._util.checks import UsageError
    from varbench.grads.seqnorms import SequenceRoute, sequence_routes

    model = exact_float64(tiny_llama(tied=True))
    ids, rm, am = batch("left", B=3)
    routes = sequence_routes(model, ids, rm, am)
    assert routes["lm_head"].kind == "factor" and routes["model.norm"].kind == "rms"
    assert torch.equal(sequence_grad_norms(model, ids, rm, am, routes=routes),
                       sequence_grad_norms(model, ids, rm, am))
    with pytest.raises(UsageError, match="no entry for module 'model.norm'"):
        sequence_grad_norms(model, ids, rm, am,
                            routes={k: v for k, v in routes.items() if k != "model.norm"})
    with pytest.raises(UsageError, match="'factor' given for 'model.norm'"):
        sequence_grad_norms(model, ids, rm, am, routes={**routes, "model.norm": routes["lm_head"]})
    with pytest.raises(UsageError, match="route 'vjp' .* given for 'lm_head'"):
        sequence_grad_norms(model, ids, rm, am, routes={**routes, "lm_head": SequenceRoute("vjp")})
    emb = routes["model.embed_tokens"]
    wrong = dataclasses.replace(emb, forms=(dataclasses.replace(emb.forms[0], scale=3.0),))
    with pytest.raises(RuntimeError, match="self-check failed for Embedding"):
        sequence_grad_norms(model, ids, rm, am, routes={**routes, "model.embed_tokens": wrong})
