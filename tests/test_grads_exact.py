"""varbench.grads.exact: exact per-token / prefix norms against the one-backward-per-token
brute force (float64), group breakdowns, dtype and chunking, the materialising iterator."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from _fixtures_grads import batch, tiny_llama, trained_llama
from reference_grads import brute_token_grads, norms_from_grads

from varbench.grads.exact import token_chunks, token_grad_norms
from varbench.grads.params import select_params
from varbench.grads.precision import exact_float64

RTOL = 1e-8  # float64 throughout (exact_float64): observed agreement ~1e-14


STOCK_RTOL = 1e-4  # stock float64 vs float64-throughout truth (observed up to 4e-6)


def _check(model, padding, groups=False, chunk_size=4):
    ids, rm, am = batch(padding)
    got = token_grad_norms(model, ids, rm, am, groups=groups, chunk_size=chunk_size, progress=False)
    g, names, sizes = brute_token_grads(model, ids, rm, am)
    tok, pre, diag = norms_from_grads(g, rm)
    return got, (tok, pre, diag), (g, names, sizes), rm


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("trained", [False, True])
def test_exact_norms_match_brute_force(tied, padding, trained):
    base = trained_llama(tied=tied) if trained else tiny_llama(tied=tied)
    model = exact_float64(base)
    got, (tok, pre, diag), _, rm = _check(model, padding)
    torch.testing.assert_close(got.token_sq, tok, rtol=RTOL, atol=0)
    torch.testing.assert_close(got.prefix_sq, pre, rtol=RTOL, atol=0)
    torch.testing.assert_close(got.diag_prefix_sq, diag, rtol=RTOL, atol=0)
    assert torch.all(got.token_sq[rm == 0] == 0) and torch.all(got.prefix_sq[rm == 0] == 0)
    assert torch.all(got.token_sq[rm == 1] > 0)
    # cross terms matter: prefix and diagonal prefix differ somewhere
    assert not torch.allclose(got.prefix_sq, got.diag_prefix_sq)


def test_group_breakdown_matches_brute_force():
    model = exact_float64(tiny_llama(tied=False))
    got, (tok, pre, _), (g, names, sizes), rm = _check(model, "left", groups=True)
    assert got.group_names == [
        "embed",
        "block0.attn",
        "block0.mlp",
        "block1.attn",
        "block1.mlp",
        "norm",
        "head",
    ]
    gt = torch.split(g, sizes, dim=-1)
    sel = dict(select_params(model))
    from varbench.grads.params import group_index

    gnames, idx = group_index(model, list(sel), True)
    for k in range(len(gnames)):
        part = torch.cat([gt[i] for i in range(len(names)) if idx[i] == k], dim=-1)
        t, p, d = norms_from_grads(part, rm)
        torch.testing.assert_close(got.group_token_sq[..., k], t, rtol=RTOL, atol=1e-300)
        torch.testing.assert_close(got.group_prefix_sq[..., k], p, rtol=RTOL, atol=1e-300)
        torch.testing.assert_close(got.group_diag_prefix_sq[..., k], d, rtol=RTOL, atol=1e-300)
    torch.testing.assert_close(got.group_token_sq.sum(-1), tok, rtol=RTOL, atol=0)
    # sequence norm = last prefix norm; the breakdown of a prefix norm adds up only per group
    assert got.sequence_sq.shape == (3,)


def test_tied_head_groups_as_embedding():
    model = tiny_llama(tied=True)
    ids, rm, am = batch()
    got = token_grad_norms(model, ids, rm, am, groups=True, progress=False)
    assert "head" not in got.group_names and "embed" in got.group_names


def test_stock_modules_float64_tolerance():
    """Stock modules in float64: the fast path and the brute force apply the same float32 casts
    (RMSNorm), so they agree to RTOL with each other, but both sit ~1e-7..1e-5 away from the
    float64-throughout truth; STOCK_RTOL is the tolerance stated for that gap."""
    base = trained_llama()
    model = base.to(torch.float64)  # stock modules, float64 parameters
    got, (tok, pre, _), _, rm = _check(model, "left")
    torch.testing.assert_close(got.token_sq, tok, rtol=RTOL, atol=0)
    ids, rm, am = batch("left")
    truth = norms_from_grads(brute_token_grads(exact_float64(base), ids, rm, am)[0], rm)
    torch.testing.assert_close(got.token_sq, truth[0], rtol=STOCK_RTOL, atol=0)
    torch.testing.assert_close(got.prefix_sq, truth[1], rtol=STOCK_RTOL, atol=0)
    gap = ((got.token_sq - truth[0]).abs() / truth[0].clamp(min=1e-300))[rm == 1].max()
    assert gap > 1e-12  # the float32 cast is really there (else this test proves nothing)


def test_dtype_option_copies_and_chunk_size_is_irrelevant():
    model = tiny_llama()
    ids, rm, am = batch()
    a = token_grad_norms(model, ids, rm, am, dtype=torch.float64, chunk_size=1, progress=False)
    b = token_grad_norms(model, ids, rm, am, dtype=torch.float64, chunk_size=64, progress=False)
    assert next(model.parameters()).dtype == torch.float32  # caller's model untouched
    assert a.token_sq.dtype == torch.float64
    torch.testing.assert_close(a.prefix_sq, b.prefix_sq, rtol=1e-10, atol=0)
    c = token_grad_norms(model, ids, rm, am, progress=False)  # float32 default
    torch.testing.assert_close(c.prefix_sq.double(), a.prefix_sq, rtol=1e-3, atol=1e-6)


def test_bad_inputs():
    model = tiny_llama()
    ids, rm, am = batch()
    with pytest.raises(ValueError, match="response_mask has shape"):
        token_grad_norms(model, ids, rm[:, :-1], am)
    bad = rm.clone()
    bad[0, 0] = 1
    with pytest.raises(ValueError, match=r"response_mask\[:, 0\]"):
        token_grad_norms(model, ids, bad, am)
    with pytest.raises(ValueError, match="padded position"):
        token_grad_norms(model, ids, torch.ones_like(rm).index_fill(1, torch.tensor([0]), 0), am)
    with pytest.raises(ValueError, match="chunk_size"):
        token_grad_norms(model, ids, rm, am, chunk_size=0)
    with pytest.raises(TypeError, match="integer"):
        token_grad_norms(model, ids.float(), rm, am)


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("method", ["ghost", "materialize"])
def test_both_methods_long_sequences(method, pack):
    """L=24 > hidden 16: the ghost engine switches to forming D^T A for long prefixes (packed:
    per row, with a row's state carried over chunks that span two rows)."""
    model = exact_float64(trained_llama(tied=True))
    ids, rm, am = batch("left", L=24, B=2)
    got = token_grad_norms(model, ids, rm, am, method=method, chunk_size=5, progress=False,
                           pack=pack)
    g, _, _ = brute_token_grads(model, ids, rm, am)
    tok, pre, diag = norms_from_grads(g, rm)
    torch.testing.assert_close(got.token_sq, tok, rtol=RTOL, atol=0)
    torch.testing.assert_close(got.prefix_sq, pre, rtol=RTOL, atol=0)
    with pytest.raises(ValueError, match="method"):
        token_grad_norms(model, ids, rm, am, method="fast")


@pytest.mark.parametrize("pack", [False, True])
def test_iter_token_grads_yields_brute_force_rows(pack):
    """The materialising iterator (used by analysis) yields exactly the per-token gradients,
    one sequence per forward or several (``pack``: chunks across left-padded rows)."""
    from varbench.grads.exact import iter_token_grads

    model = exact_float64(tiny_llama())
    ids, rm, am = batch("left")
    g, _, _ = brute_token_grads(model, ids, rm, am)
    plist = [p for _, p in select_params(model)]
    seen, multi = 0, 0
    for rows, cols, flat in iter_token_grads(model, ids, rm, am, plist, 5, progress=False,
                                             pack=pack):
        torch.testing.assert_close(torch.cat(flat, dim=1), g[rows, cols], rtol=RTOL,
                                   atol=1e-14)
        seen += cols.numel()
        multi += int(rows.unique().numel() > 1)
    assert seen == int(rm.sum())
    assert (multi > 0) == pack  # packed chunks do span sequences


def test_fused_attention_is_switched_for_library_callers(monkeypatch):
    """A fused kernel without a batched backward (CUDA flash SDPA, faked here) is switched to
    math SDPA inside the harness itself, with a warning naming it; the numbers are unchanged."""
    import varbench.grads.precision as precision

    model = exact_float64(tiny_llama())
    ids, rm, am = batch("right")
    plain = token_grad_norms(model, ids, rm, am, chunk_size=4, progress=False)
    monkeypatch.setattr(precision, "fused_attention_kernel",
                        lambda m, d=None: "sdpa (flash CUDA kernels)")
    with pytest.warns(UserWarning, match="flash CUDA kernels.*math SDPA"):
        got = token_grad_norms(model, ids, rm, am, chunk_size=4, progress=False)
    torch.testing.assert_close(got.token_sq, plain.token_sq, rtol=RTOL, atol=0)


def _spans(rm, chunk_size):
    """The most rows one packed chunk of ``token_chunks`` spans."""
    return max(hi - lo + 1 for _, _, lo, hi, _ in token_chunks(rm, chunk_size, pack=True))


@pytest.mark.parametrize("chunk_size", [4, 16])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("padding", ["right", "left"])
@pytest.mark.parametrize("method", ["ghost", "materialize"])
def test_packed_norms_match_brute_force(method, padding, tied, chunk_size):
    """``pack=True`` (several sequences per forward: chunks spanning 2 rows at chunk 4, all 3
    at chunk 16) gives the brute-force norms and groups, and the unpacked numbers to RTOL."""
    model = exact_float64(trained_llama(tied=tied))
    ids, rm, am = batch(padding)
    assert _spans(rm, chunk_size) == (2 if chunk_size == 4 else 3)
    kw = {"groups": True, "chunk_size": chunk_size, "method": method, "progress": False}
    got = token_grad_norms(model, ids, rm, am, pack=True, **kw)
    one = token_grad_norms(model, ids, rm, am, pack=False, **kw)
    g, names, sizes = brute_token_grads(model, ids, rm, am)
    tok, pre, diag = norms_from_grads(g, rm)
    torch.testing.assert_close(got.token_sq, tok, rtol=RTOL, atol=0)
    torch.testing.assert_close(got.prefix_sq, pre, rtol=RTOL, atol=0)
    torch.testing.assert_close(got.diag_prefix_sq, diag, rtol=RTOL, atol=0)
    torch.testing.assert_close(got.sequence_sq, one.sequence_sq, rtol=RTOL, atol=0)
    for a, b in ((got.group_token_sq, one.group_token_sq),
                 (got.group_prefix_sq, one.group_prefix_sq)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=1e-300)
    assert got.methods == one.methods
    if method == "ghost":
        assert any(v.startswith("ghost") for v in got.methods.values())


def test_packed_norms_skip_a_row_without_response_tokens():
    """A row with no response token inside a packed forward (it runs, contributes nothing) and
    the rows around it keep their own prefix sums."""
    model = exact_float64(tiny_llama(tied=False))
    ids, rm, am = batch("left", B=4)
    rm[1] = 0
    assert _spans(rm, 16) == 4  # rows 0..3 in one forward, row 1 empty
    g, _, _ = brute_token_grads(model, ids, rm, am)
    tok, pre, _ = norms_from_grads(g, rm)
    for method in ("ghost", "materialize"):
        got = token_grad_norms(model, ids, rm, am, chunk_size=16, method=method, pack=True,
                               progress=False)
        torch.testing.assert_close(got.token_sq, tok, rtol=RTOL, atol=0)
        torch.testing.assert_close(got.prefix_sq, pre, rtol=RTOL, atol=0)
        assert torch.all(got.prefix_sq[1] == 0)


def test_pack_defaults_off_on_the_cpu():
    """CPU default: one sequence per forward, the same numbers bit for bit as pack=False."""
    model = tiny_llama()
    ids, rm, am = batch("right")
    a = token_grad_norms(model, ids, rm, am, chunk_size=4, progress=False)
    b = token_grad_norms(model, ids, rm, am, chunk_size=4, progress=False, pack=False)
    assert torch.equal(a.prefix_sq, b.prefix_sq) and torch.equal(a.token_sq, b.token_sq)


def test_packed_chunk_keeps_tokens_times_rows_within_the_budget():
    """packed_chunk against the plan itself: the packed chunks of its size hold at most
    ``budget`` (token, row) cotangent rows, and every larger size up to the budget does not."""
    from varbench.grads.exact import packed_chunk

    g = torch.Generator().manual_seed(3)
    for _ in range(30):
        B, L = int(torch.randint(1, 7, (1,), generator=g)), 12
        rm = (torch.rand(B, L, generator=g) < 0.5).float()
        rm[:, 0] = 0
        offs = [0]
        for n in rm.count_nonzero(1).tolist():
            offs.append(offs[-1] + n)
        budget = int(torch.randint(1, 40, (1,), generator=g))
        c = packed_chunk(offs, budget)

        def worst(k, rm=rm):
            return max(((stop - start) * (hi - lo + 1)
                        for start, stop, lo, hi, _ in token_chunks(rm, k, pack=True)), default=0)

        assert 1 <= c <= budget
        assert worst(c) <= budget
        assert all(worst(k) > budget for k in range(c + 1, budget + 1))


def test_packed_auto_chunk_shrinks_to_the_measured_budget(monkeypatch):
    """With a measured (CUDA) budget, faked here, the automatic packed chunk size is shrunk
    so that tokens x rows fits; an explicit chunk_size is kept. The norms stay exact."""
    import varbench.grads.exact as exact

    model = exact_float64(tiny_llama())
    ids, rm, am = batch("left")
    sizes = []
    real = exact.token_chunks
    monkeypatch.setattr(exact, "free_device_bytes", lambda d: 1 << 30)
    monkeypatch.setattr(exact, "token_plan",  # the plan allows 16 cotangents
                        lambda *a, chunk_size=None, **kw: SimpleNamespace(chunk=chunk_size or 16))
    monkeypatch.setattr(exact, "token_chunks",
                        lambda m, c, pack=False: sizes.append(c) or real(m, c, pack=pack))
    got = exact.token_grad_norms(model, ids, rm, am, pack=True, progress=False)
    assert sizes == [8]  # 18 tokens over rows of 7, 6, 5: chunks of 8 span 2 rows (16 <= 16)
    exact.token_grad_norms(model, ids, rm, am, pack=True, chunk_size=16, progress=False)
    assert sizes == [8, 16]
    tok, pre, _ = norms_from_grads(brute_token_grads(model, ids, rm, am)[0], rm)
    torch.testing.assert_close(got.token_sq, tok, rtol=RTOL, atol=0)
    torch.testing.assert_close(got.prefix_sq, pre, rtol=RTOL, atol=0)
