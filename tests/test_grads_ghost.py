"""varbench.grads.ghost: the ghost engine (ghost mode, weight mode and the switch between
them) against explicitly formed per-token gradients, Embedding padding_idx and biased
linears end to end through token_grad_norms."""

from __future__ import annotations

import pytest
import torch
from _fixtures_grads import batch
from reference_grads import brute_token_grads, norms_from_grads

from varbench.grads.exact import token_grad_norms
from varbench.grads.precision import exact_float64

RTOL = 1e-8  # float64 throughout (exact_float64): observed agreement ~1e-14


def _ghost_reference(D_chunks, A, bias):
    """Per-token weight gradients ``g_c = D_c^T [A, 1]`` formed explicitly -> (tok, pre)."""
    a = torch.cat([A, torch.ones(A.shape[0], 1, dtype=A.dtype)], 1) if bias else A
    g = torch.cat([torch.einsum("cto,ti->coi", d, a[: d.shape[1]]) for d in D_chunks])
    flat = g.reshape(g.shape[0], -1)
    return flat.pow(2).sum(-1), flat.cumsum(0).pow(2).sum(-1)


@pytest.mark.parametrize("ratio", [0.0, 1.0, 1e9])  # always weight / cost model / always ghost
@pytest.mark.parametrize("kind", ["linear", "linear_bias", "embedding_pad"])
def test_ghost_module_modes_match_explicit_gradients(monkeypatch, ratio, kind):
    """GhostModule alone on random inputs and cotangents, chunks of growing prefixes: the ghost
    mode, the weight mode and the switch between them (converting the running prefix from
    position to weight space) give the explicitly formed per-token gradients' norms."""
    from varbench.grads import ghost

    monkeypatch.setattr(ghost, "WEIGHT_RATIO", ratio)
    g = torch.Generator().manual_seed(0)
    L, n_in, n_out = 20, 6, 5
    if kind == "embedding_pad":
        mod = torch.nn.Embedding(n_in, n_out, padding_idx=2).double()
        ids = torch.randint(0, n_in, (L,), generator=g)
        ids[[1, 7, 12]] = 2  # the padding row gets no gradient from these positions
        A = torch.nn.functional.one_hot(ids, n_in).double() * (ids != 2).double()[:, None]
        inp = ids
    else:
        mod = torch.nn.Linear(n_in, n_out, bias=kind == "linear_bias").double()
        A = inp = torch.randn(L, n_in, generator=g, dtype=torch.float64)
    gm = ghost.GhostModule(mod, 0, L)
    chunks, modes, tok, pre = [], [], [], []
    for C, t in [(3, 4), (4, 9), (2, 12), (5, 20)]:  # C tokens, forward over positions [0, t)
        gm.hook(mod, (inp[None, :t],), None)
        D = torch.randn(C, t, n_out, generator=g, dtype=torch.float64)
        chunks.append(D)
        a, b = gm.norms(D.clone())
        tok.append(a)
        pre.append(b)
        modes.append(gm.weight_mode)
    want_tok, want_pre = _ghost_reference(chunks, A, kind == "linear_bias")
    torch.testing.assert_close(torch.cat(tok), want_tok, rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.cat(pre), want_pre, rtol=1e-12, atol=0)
    if ratio == 0.0:
        assert all(modes)
    elif ratio == 1e9:
        assert not any(modes)
    else:
        assert not modes[0] and modes[-1]  # the cost model switches within this sequence


def test_embedding_padding_idx_real_tokens():
    """Attended tokens equal to the Embedding's padding_idx get no embedding gradient (torch's
    rule); the ghost engine must count them as zero, like the brute force."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=11, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=3, attn_implementation="sdpa",
    )
    model = exact_float64(LlamaForCausalLM(cfg))
    assert model.model.embed_tokens.padding_idx == 3
    ids, rm, am = batch("right", L=24, B=2)
    ids = ids % 11
    ids[:, [2, 6, 9, 15]] = 3  # real, attended occurrences of the pad id
    got = token_grad_norms(model, ids, rm, am, chunk_size=5, progress=False)
    g, _, _ = brute_token_grads(model, ids, rm, am)
    tok, pre, _ = norms_from_grads(g, rm)
    torch.testing.assert_close(got.token_sq, tok, rtol=RTOL, atol=0)
    torch.testing.assert_close(got.prefix_sq, pre, rtol=RTOL, atol=0)


def test_biased_linears_long_sequences():
    """Attention and MLP biases (a ones column in A) through both ghost modes end to end."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=23, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attention_bias=True, mlp_bias=True, attn_implementation="sdpa",
    )
    model = exact_float64(LlamaForCausalLM(cfg))
    ids, rm, am = batch("left", L=24, B=2)
    got = token_grad_norms(model, ids, rm, am, chunk_size=5, groups=True, progress=False)
    g, _, _ = brute_token_grads(model, ids, rm, am)
    tok, pre, diag = norms_from_grads(g, rm)
    torch.testing.assert_close(got.token_sq, tok, rtol=RTOL, atol=0)
    torch.testing.assert_close(got.prefix_sq, pre, rtol=RTOL, atol=0)
    torch.testing.assert_close(got.diag_prefix_sq, diag, rtol=RTOL, atol=0)


class _DoubledGrad(torch.autograd.Function):
    """Identity forward, doubled backward: a module whose gradient is not its forward's."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return 2 * g


class _OddBackwardLinear(torch.nn.Linear):
    def forward(self, x):
        return torch.nn.functional.linear(x, _DoubledGrad.apply(self.weight), self.bias)


class _ShiftedEmbedding(torch.nn.Embedding):
    """An Embedding subclass that does not look up its first argument (rows id + 1)."""

    def forward(self, ids):
        return super().forward((ids + 1) % self.num_embeddings)


def test_unsupported_module_raises_instead_of_returning():
    """A Linear whose backward is not its forward's passes the recomputation check but fails
    the first-call self-check: an error naming the class, never a number."""
    from _fixtures_grads import tiny_llama

    model = tiny_llama().double()
    mlp = model.model.layers[0].mlp
    odd = _OddBackwardLinear(mlp.up_proj.in_features, mlp.up_proj.out_features, bias=False)
    odd = odd.double()
    odd.weight.data.copy_(mlp.up_proj.weight.data)
    mlp.up_proj = odd
    ids, rm, am = batch()
    with pytest.raises(RuntimeError, match="self-check failed for _OddBackwardLinear"):
        token_grad_norms(model, ids, rm, am)
    from varbench.grads.seqnorms import sequence_grad_norms

    with pytest.raises(RuntimeError, match="self-check failed for _OddBackwardLinear"):
        sequence_grad_norms(model, ids, rm, am)


def test_unknown_embedding_subclass_is_materialised_exactly():
    """An Embedding subclass whose forward is not a lookup of its argument is routed to the
    materialize path (recorded in methods) and the numbers stay exact."""
    from _fixtures_grads import tiny_llama

    model = exact_float64(tiny_llama())
    old = model.model.embed_tokens
    new = _ShiftedEmbedding(old.num_embeddings, old.embedding_dim).double()
    new.weight.data.copy_(old.weight.data)
    model.model.embed_tokens = new
    ids, rm, am = batch("left")
    r = token_grad_norms(model, ids, rm, am)
    assert r.methods["model.embed_tokens.weight"].startswith("materialize: _ShiftedEmbedding")
    tok, pre, _ = norms_from_grads(brute_token_grads(model, ids, rm, am)[0], rm)
    torch.testing.assert_close(r.token_sq, tok, rtol=RTOL, atol=0)
    torch.testing.assert_close(r.prefix_sq, pre, rtol=RTOL, atol=0)


@pytest.mark.parametrize("ratio", [0.0, 1.0, 1e9])  # always weight / cost model / always ghost
@pytest.mark.parametrize("kind", ["linear_bias", "embedding_pad"])
def test_row_norms_keep_one_state_per_packed_row(monkeypatch, ratio, kind):
    """GhostModule.row_norms on packed forwards (several rows per call, a row continuing into
    the next call): each row's norms and prefixes equal those of that row alone, formed
    explicitly; the other rows' inputs and cotangents never leak in."""
    from varbench.grads import ghost

    monkeypatch.setattr(ghost, "WEIGHT_RATIO", ratio)
    g = torch.Generator().manual_seed(1)
    L, n_in, n_out, n_rows = 16, 6, 5, 3
    if kind == "embedding_pad":
        mod = torch.nn.Embedding(n_in, n_out, padding_idx=2).double()
        ids = torch.randint(0, n_in, (n_rows, L), generator=g)
        ids[:, [1, 7]] = 2
        A = torch.nn.functional.one_hot(ids, n_in).double() * (ids != 2).double()[..., None]
        inp = ids
    else:
        mod = torch.nn.Linear(n_in, n_out, bias=True).double()
        A = inp = torch.randn(n_rows, L, n_in, generator=g, dtype=torch.float64)
    gm = ghost.GhostModule(mod, 0, L)
    # (rows lo..hi, t, segments (local row, k0, k1, row, fresh)); row 1 spans both calls
    calls = [(0, 1, 6, [(0, 0, 2, 0, True), (1, 2, 5, 1, True)]),
             (1, 2, 12, [(0, 0, 3, 1, False), (1, 3, 7, 2, True)])]
    per_row = {r: [] for r in range(n_rows)}
    tok, pre = [], []
    for lo, hi, t, segs in calls:
        gm.hook(mod, (inp[lo : hi + 1, :t],), None)
        C = segs[-1][2]
        D = torch.zeros(C, hi - lo + 1, t, n_out, dtype=torch.float64)
        for r, k0, k1, b, _ in segs:
            D[k0:k1, r] = torch.randn(k1 - k0, t, n_out, generator=g, dtype=torch.float64)
            per_row[b].append(D[k0:k1, r].clone())
        a, p = gm.row_norms(D.clone(), hi - lo + 1, t, segs)
        tok.append(a)
        pre.append(p)
    ref = {b: _ghost_reference(per_row[b], A[b], kind == "linear_bias") for b in range(n_rows)}
    want_tok = torch.cat([ref[0][0], ref[1][0][:3], ref[1][0][3:], ref[2][0]])
    want_pre = torch.cat([ref[0][1], ref[1][1][:3], ref[1][1][3:], ref[2][1]])
    torch.testing.assert_close(torch.cat(tok), want_tok, rtol=1e-12, atol=0)
    torch.testing.assert_close(torch.cat(pre), want_pre, rtol=1e-12, atol=0)
    assert list(gm.rows) == [2]  # only the last row's state is kept
    gm.hook(mod, (inp[:1, :4],), None)
    with pytest.raises(RuntimeError, match="no running state for sequence 0"):
        gm.row_norms(torch.zeros(1, 1, 4, n_out, dtype=torch.float64), 1, 4,
                     [(0, 0, 1, 0, False)])
    with pytest.raises(RuntimeError, match="not one row per position"):
        gm.row_norms(torch.zeros(1, 1, 4, n_out, dtype=torch.float64), 1, 5,
                     [(0, 0, 1, 0, True)])
