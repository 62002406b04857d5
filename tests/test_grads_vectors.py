"""The one sketch (CountSketch) and the one "per-token vectors once, many coefficient sets"
path (token_vectors + combine) against slow references, in float64."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from _fixtures_grads import rollout_batch, tiny_llama
from reference_grads import brute_group_gradients, brute_token_grads, dense_count_sketch
from scipy.stats import norm

from varbench.grads import exact_float64
from varbench.grads.vectors import (
    CountSketch,
    TokenVectors,
    combine,
    param_blocks,
    token_vectors,
)

RTOL = 1e-8  # float64 throughout (exact_float64), as the other exact-path tests
# Sketch vs its dense matrix: the same float64 terms summed in a different order.
SKETCH_RTOL, SKETCH_ATOL = 1e-12, 1e-15
ALPHA = 1e-6  # total false-failure rate of each statistical test (Bonferroni over its checks)


def _xy(numels, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = sum(numels)
    x = torch.randn(D, generator=g, dtype=torch.float64)
    return x, x + torch.randn(D, generator=g, dtype=torch.float64)


def _moments(x, y, K):
    """Exact E and Var of <Sx, Sy> and Var of ||Sx||^2 for a CountSketch with K buckets."""
    xx, yy, xy = float(x @ x), float(y @ y), float(x @ y)
    return {
        "mean_ip": xy,
        "var_ip": (xx * yy + xy**2 - 2 * float((x**2 * y**2).sum())) / K,
        "var_sq": 2 / K * (xx**2 - float((x**4).sum())),
    }


def test_count_sketch_matches_dense_reference_and_legacy_draws():
    numels, K, seed = [7, 5, 11], 4, 3
    sk = CountSketch(numels, K, seed)
    S = dense_count_sketch(sk)
    x = torch.randn(3, sum(numels), generator=torch.Generator().manual_seed(1),
                    dtype=torch.float64)
    got = sk.apply(x)
    torch.testing.assert_close(got, x @ S.T, rtol=SKETCH_RTOL, atol=SKETCH_ATOL)
    torch.testing.assert_close(sk.apply(x[0]), got[0], rtol=0, atol=0)  # any leading shape
    # per-parameter chunks (what token_vectors feeds) == the flat vector
    parts = list(torch.split(x, numels, dim=-1))
    assert torch.equal(sk(parts), got)
    # float32 inputs stay float32 (the signs are cast once, exactly)
    got32 = sk.apply(x.float())
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32.double(), x @ S.T, rtol=1e-6, atol=1e-6)
    # The hash is the one the variance analysis has always drawn (its numbers must not move):
    # buckets of every parameter, then signs of every parameter, from one CPU generator.
    g = torch.Generator().manual_seed(seed)
    want_b = [torch.randint(0, K, (n,), generator=g) for n in numels]
    want_s = [torch.randint(0, 2, (n,), generator=g).float() * 2 - 1 for n in numels]
    for b, s, wb, ws in zip(sk.buckets, sk.signs, want_b, want_s, strict=True):
        assert torch.equal(b, wb) and torch.equal(s, ws)
    assert sk.description == "countsketch(K=4, seed=3)"
    assert all(torch.equal(a, b) for a, b in zip(CountSketch(numels, K, seed).buckets,
                                                  sk.buckets, strict=True))
    linear = sk.apply(2 * x[0] - 3 * x[1])
    torch.testing.assert_close(linear, 2 * got[0] - 3 * got[1], rtol=1e-12, atol=1e-14)


def test_count_sketch_moments_exact_by_enumeration():
    """Every one of the K^D * 2^D hashes of a D=4, K=3 sketch, equally likely: the exact
    mean and variances equal the documented formulas (and the variance is NOT the Gaussian
    JL's 2 ||x||^4 / K)."""
    numels, K = [2, 2], 3
    x, y = _xy(numels, seed=4)
    D = sum(numels)
    ips, sqs = [], []
    for h in itertools.product(range(K), repeat=D):
        hb = torch.tensor(h)
        for s in itertools.product((-1.0, 1.0), repeat=D):
            sv = torch.tensor(s)
            sk = CountSketch.from_hashes([hb[:2], hb[2:]], [sv[:2], sv[2:]], K)
            sx, sy = sk.apply(x), sk.apply(y)
            ips.append(float(sx @ sy))
            sqs.append(float(sx @ sx))
    ips, sqs = torch.tensor(ips, dtype=torch.float64), torch.tensor(sqs, dtype=torch.float64)
    m = _moments(x, y, K)
    torch.testing.assert_close(ips.mean().item(), m["mean_ip"], rtol=1e-12, atol=0)
    torch.testing.assert_close(sqs.mean().item(), float(x @ x), rtol=1e-12, atol=0)
    torch.testing.assert_close(ips.var(unbiased=False).item(), m["var_ip"], rtol=1e-10, atol=0)
    torch.testing.assert_close(sqs.var(unbiased=False).item(), m["var_sq"], rtol=1e-10, atol=0)
    gaussian = 2 * float(x @ x) ** 2 / K
    assert abs(m["var_sq"] / gaussian - 1) > 0.01


def test_count_sketch_seeded_draws_follow_the_formulas():
    """Over N seeds: the mean of <Sx, Sy> is within z exact SEs (SE from the formula) of
    <x, y>; the sample variances of <Sx, Sy> and ||Sx||^2 are within z asymptotic SEs
    (sqrt((m4 - s^4) / N), normal approximation) of the formulas. z: two-sided, ALPHA over 3.
    A few heavy coordinates make the ``- sum_i x_i^4`` term large (~20% here), so the same check
    rejects the Gaussian JL variance ``2 ||x||^4 / K``: the test can tell the two apart."""
    numels, K, N = [50, 30], 16, 4000
    x, y = _xy(numels)
    x[[3, 17, 60]] *= 10.0
    ips, sqs = [], []
    for seed in range(N):
        sk = CountSketch(numels, K, seed)
        sx, sy = sk.apply(x), sk.apply(y)
        ips.append(float(sx @ sy))
        sqs.append(float(sx @ sx))
    ips, sqs = torch.tensor(ips, dtype=torch.float64), torch.tensor(sqs, dtype=torch.float64)
    m = _moments(x, y, K)
    z = norm.ppf(1 - ALPHA / 6)
    assert abs(ips.mean().item() - m["mean_ip"]) < z * (m["var_ip"] / N) ** 0.5
    for vals, want in ((ips, m["var_ip"]), (sqs, m["var_sq"])):
        c = vals - vals.mean()
        s2, m4 = float(c.pow(2).mean()), float(c.pow(4).mean())
        se = ((m4 - s2**2) / N) ** 0.5
        assert abs(s2 - want) < z * se, (s2, want, se)
    # power: the same check rejects the Gaussian JL formula for ||Sx||^2
    gaussian = 2 * float(x @ x) ** 2 / K
    assert abs(s2 - gaussian) > z * se, (s2, gaussian, se)


def test_count_sketch_state_device_and_checks():
    model = tiny_llama()
    sk = CountSketch.for_model(model, 8, seed=1)
    p = next(model.parameters())
    assert sk.device == p.device and all(b.device == p.device for b in sk.buckets)
    assert sk.n_params == sum(q.numel() for q in model.parameters())
    sub = CountSketch.for_model(model, 8, seed=1, params=r"\.mlp\.")
    assert sub.n_params < sk.n_params
    # state built on another device (meta here) stays there; inputs elsewhere are refused
    # instead of copying the state per call
    meta = CountSketch([3, 4], 2, 0, device="meta")
    assert all(b.device.type == "meta" for b in meta.buckets + meta.signs)
    assert meta.apply(torch.zeros(7, device="meta")).device.type == "meta"
    with pytest.raises(ValueError, match="state is on meta"):
        meta.apply(torch.zeros(7))
    with pytest.raises(ValueError, match="dim=0"):
        CountSketch([3], 0)
    with pytest.raises(TypeError, match="seed"):
        CountSketch([3], 2, 1.5)
    with pytest.raises(ValueError, match="expected"):
        sk.apply(torch.zeros(3))
    with pytest.raises(ValueError, match="gradient tensors"):
        CountSketch([3, 4], 2)([torch.zeros(1, 3)])
    with pytest.raises(ValueError, match="built for"):
        sub.check_params(list(model.parameters()))
    with pytest.raises(ValueError, match=r"in \[0, 2\)"):
        CountSketch.from_hashes([torch.tensor([0, 2])], [torch.tensor([1.0, 1.0])], 2)
    with pytest.raises(ValueError, match="only"):
        CountSketch.from_hashes([torch.tensor([0, 1])], [torch.tensor([1.0, 0.0])], 2)


def _brute_vectors(model, rb):
    """``[P, G, T, D]`` per-token gradients by one full-length backward per token."""
    flat = rb.flat()
    g, _, _ = brute_token_grads(model, flat.input_ids, flat.response_mask, flat.attention_mask)
    return g[:, flat.prompt_len :].reshape(rb.P, rb.G, rb.T, -1)


def test_token_vectors_match_brute_force_flat_and_sketched():
    model = exact_float64(tiny_llama())
    rb = rollout_batch()
    ref = _brute_vectors(model, rb)
    flat = token_vectors(model, rb, sketch_dim=None, chunk_size=3)
    assert flat.sketch == "flat" and flat.dim == flat.n_params == ref.shape[-1]
    torch.testing.assert_close(flat.vec, ref, rtol=RTOL, atol=1e-14)
    torch.testing.assert_close(flat.token_sq, ref.pow(2).sum(-1), rtol=RTOL, atol=0)
    off = rb.mask == 0
    assert (flat.vec[off] == 0).all() and (flat.token_sq[off] == 0).all()
    # (one chunk size throughout: chunks of another size round differently, ~1e-16)
    big = token_vectors(model, rb, sketch_dim=10**9, chunk_size=3)  # K >= D: flat
    assert big.sketch == "flat" and torch.equal(big.vec, flat.vec)

    sk = CountSketch.for_model(model, 8, seed=5)
    by_dim = token_vectors(model, rb, sketch_dim=8, sketch_seed=5, chunk_size=3)
    by_obj = token_vectors(model, rb, sketch=sk, chunk_size=3)
    assert by_dim.sketch == by_obj.sketch == "countsketch(K=8, seed=5)" and by_dim.dim == 8
    assert torch.equal(by_dim.vec, by_obj.vec) and torch.equal(by_dim.token_sq, flat.token_sq)
    S = dense_count_sketch(sk)
    torch.testing.assert_close(by_dim.vec, ref @ S.T, rtol=RTOL, atol=1e-13)
    assert (by_dim.vec[off] == 0).all()
    # the result holds response positions only: its storage is [P, G, T, K], not a view into
    # a [B, Lp + T, K] buffer (flat vectors of long prompts would be mostly zeros)
    for tv in (flat, by_dim):
        assert tv.vec.is_contiguous()
        assert tv.vec.untyped_storage().nbytes() == tv.vec.numel() * tv.vec.element_size()
    with pytest.raises(TypeError, match="CountSketch"):
        token_vectors(model, rb, sketch="countsketch")


def test_combine_matches_brute_force_group_loop_flat_and_sketched():
    """combine(token_vectors(...)) == a brute-force autograd loop over sequences (one backward
    of sum_t c_t log p_t each, summed per group), flat and sketched, one and many sets."""
    model = exact_float64(tiny_llama(seed=2))
    rb = rollout_batch(seed=3)
    g = torch.Generator().manual_seed(7)
    sets = torch.randn(3, rb.P, rb.G, rb.T, generator=g, dtype=torch.float64)
    refs = torch.stack([brute_group_gradients(model, rb, c) for c in sets])  # [3, P, D]
    flat = token_vectors(model, rb, sketch_dim=None)
    sk = CountSketch.for_model(model, 6, seed=11)
    sketched = token_vectors(model, rb, sketch=sk)
    S = dense_count_sketch(sk)
    for tv, want in ((flat, refs), (sketched, refs @ S.T)):
        many = combine(tv, sets)  # [3, P, K]
        assert many.shape == (3, rb.P, tv.dim)
        torch.testing.assert_close(many, want, rtol=RTOL, atol=1e-13)
        for s in range(3):
            torch.testing.assert_close(combine(tv.vec, sets[s]), want[s], rtol=RTOL, atol=1e-13)
    # coefficients off the mask multiply exact zeros: they change nothing
    noisy = sets[0] + 5.0 * (rb.mask == 0)
    torch.testing.assert_close(combine(flat, noisy), combine(flat, sets[0]), rtol=0, atol=0)
    with pytest.raises(ValueError, match="coeffs has shape"):
        combine(flat, sets[0, :1])


def test_token_vectors_exact_norms_stock_preset():
    """Flat vectors of a stock preset (float64 parameters): ``token_sq == ||vec||^2``."""
    from varbench.models import build_preset
    from varbench.rollout.sampler import sample
    from varbench.tasks import get_task

    pol = build_preset("micro", seed=1, dtype=torch.float64)
    task = get_task("arith", digits=1)
    batch = sample(pol, task, task.prompts(1, seed=0), 6, seed=0, max_new_tokens=5)
    tv = token_vectors(pol.model, batch, sketch_dim=None)
    assert isinstance(tv, TokenVectors)
    torch.testing.assert_close(tv.token_sq, tv.vec.pow(2).sum(-1), rtol=1e-10, atol=1e-12)
    assert tv.sketch == "flat" and tv.dim == tv.n_params
    assert (tv.vec[batch.mask == 0] == 0).all()


def test_streamed_sketch_is_the_stored_sketch_in_bounded_memory():
    """The streamed hash (generator states per chunk, redrawn per application) is the same S as
    the stored one, for chunks that split parameters anywhere; token_vectors agrees bit for
    bit on the CPU."""
    numels, K, seed = [7, 5, 11], 4, 3
    stored = CountSketch(numels, K, seed)
    assert not stored.streamed
    x = torch.randn(3, sum(numels), generator=torch.Generator().manual_seed(2),
                    dtype=torch.float64)
    for chunk in (1, 3, 4, 100):
        streamed = CountSketch(numels, K, seed, stream=True, chunk=chunk)
        assert streamed.streamed and streamed.buckets is None and streamed.signs is None
        for a, b in zip(streamed.hashes(), stored.hashes(), strict=True):
            assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
        torch.testing.assert_close(streamed.apply(x), stored.apply(x), rtol=1e-15, atol=1e-15)
    # large D streams by default: no per-coordinate state
    big = CountSketch([CountSketch.STORE_BYTES // 12 + 1], 8, 0)
    assert big.streamed and "streamed" in repr(big)
    model = exact_float64(tiny_llama())
    rb = rollout_batch()
    sk_s = CountSketch.for_model(model, 8, seed=5)
    numels = [p.numel() for p in model.parameters()]
    sk_t = CountSketch(numels, 8, 5, stream=True, chunk=97)
    a = token_vectors(model, rb, sketch=sk_s, chunk_size=3)
    b = token_vectors(model, rb, sketch=sk_t, chunk_size=3)
    torch.testing.assert_close(a.vec, b.vec, rtol=1e-13, atol=1e-15)


def test_token_vectors_of_a_bf16_model_are_float32_on_the_models_device():
    model = tiny_llama().to(torch.bfloat16)
    rb = rollout_batch()
    tv = token_vectors(model, rb, sketch_dim=8, chunk_size=4)
    assert tv.vec.dtype == tv.token_sq.dtype == torch.float32
    assert tv.vec.device == next(model.parameters()).device
    ref = token_vectors(model.float(), rb, sketch_dim=8, chunk_size=4)
    # same weights (bf16 values are exact in float32): only the bf16 backward rounds
    rel = (tv.token_sq - ref.token_sq).abs().sum() / ref.token_sq.abs().sum()
    assert rel < 0.05


def test_param_blocks_fit_the_budget_and_partition_in_order():
    numels = [10, 3, 50, 2, 7]
    # everything fits: one block at the requested chunk
    assert param_blocks(numels, 4, 10**9, 8) == [([0, 1, 2, 3, 4], 4)]
    blocks = param_blocks(numels, 4, 4 * 13 * 8, 8)  # room for 13 numbers per row at C = 4
    assert [i for idx, _ in blocks for i in idx] == list(range(len(numels)))
    for idx, c in blocks:
        size = sum(numels[i] for i in idx)
        if len(idx) > 1:
            assert c == 4 and c * size * 8 <= 4 * 13 * 8
        else:  # a lone parameter: C lowered until it fits, never below 1
            assert 1 <= c <= 4 and (c * size * 8 <= 4 * 13 * 8 or c == 1)
    assert param_blocks([50], 4, 8, 8) == [([0], 1)]  # larger than the budget at C = 1


def test_token_vectors_in_parameter_blocks_equal_the_brute_force():
    """Streaming the parameters in blocks under a memory budget (several parameters per block,
    and large ones alone with fewer tokens per harness pass) gives the same vectors and exact
    norms (float64, RTOL)."""
    model = exact_float64(tiny_llama())
    rb = rollout_batch()
    ref = _brute_vectors(model, rb)
    numels = [p.numel() for p in model.parameters() if p.requires_grad]
    block_bytes = 8 * 3 * 400  # 400 float64 numbers per row at C = 3
    blocks = param_blocks(numels, 3, block_bytes, 8)
    assert len(blocks) > 1 and any(len(i) > 1 for i, _ in blocks)  # grouped blocks
    assert any(c < 3 for _, c in blocks)  # and a lone parameter at a lowered C
    flat = token_vectors(model, rb, sketch_dim=None, chunk_size=3, block_bytes=block_bytes)
    torch.testing.assert_close(flat.vec, ref, rtol=RTOL, atol=1e-14)
    torch.testing.assert_close(flat.token_sq, ref.pow(2).sum(-1), rtol=RTOL, atol=0)
    sk = CountSketch.for_model(model, 8, seed=5)
    blocked = token_vectors(model, rb, sketch=sk, chunk_size=3, block_bytes=block_bytes)
    torch.testing.assert_close(blocked.vec, ref @ dense_count_sketch(sk).T, rtol=RTOL,
                               atol=1e-13)
    with pytest.raises(ValueError, match="block_bytes"):
        token_vectors(model, rb, sketch=sk, block_bytes=0)


def test_count_sketch_hash_drawn_in_chunks_is_the_cpu_whole_draw():
    """The hash is drawn on the sketch's device in chunks of ``chunk`` coordinates (so stored
    and streamed agree on CUDA too); on the CPU it is the whole draw of the seed's generator,
    buckets of every parameter first, then signs."""
    numels = [700, 45]
    g = torch.Generator().manual_seed(9)
    buckets = [torch.randint(0, 6, (n,), generator=g) for n in numels]
    signs = [torch.randint(0, 2, (n,), generator=g).float() * 2 - 1 for n in numels]
    for kw in ({}, {"chunk": 64}, {"chunk": 64, "stream": True}):
        bs, ss = CountSketch(numels, 6, 9, **kw).hashes()
        for got, want in zip(bs + ss, buckets + signs, strict=True):
            assert torch.equal(got, want), kw


def test_packed_auto_chunk_keeps_tokens_times_rows_in_the_measured_budget(monkeypatch):
    """With a measured (CUDA) budget, faked here, token_vectors shrinks its automatic packed
    chunk so that tokens x rows fits (each cotangent's backward spans the chunk's rows), as
    token_grad_norms does; an explicit chunk_size is kept; the vectors stay exact."""
    import varbench.grads.exact as exact
    import varbench.grads.vectors as vectors

    model = exact_float64(tiny_llama())
    rb = rollout_batch()
    ref = _brute_vectors(model, rb)
    sizes = []
    real = exact.token_chunks
    monkeypatch.setattr(vectors, "free_device_bytes", lambda d: 1 << 30)
    monkeypatch.setattr(vectors, "token_plan",  # the plan allows 16 cotangents
                        lambda *a, chunk_size=None, **kw: SimpleNamespace(chunk=chunk_size or 16))
    monkeypatch.setattr(exact, "token_chunks",
                        lambda m, c, pack=False: sizes.append(c) or real(m, c, pack=pack))
    got = vectors.token_vectors(model, rb, sketch_dim=None, pack=True)
    offs = [0]
    for n in rb.mask.reshape(-1, rb.mask.shape[-1]).count_nonzero(1).tolist():
        offs.append(offs[-1] + n)
    assert sizes and sizes[0] == exact.packed_chunk(offs, 16) < 16
    torch.testing.assert_close(got.vec, ref, rtol=RTOL, atol=1e-14)
    vectors.token_vectors(model, rb, sketch_dim=None, pack=True, chunk_size=16)
    assert sizes[-1] == 16


@pytest.mark.parametrize("arch", ["gpt2", "qwen2", "gemma2", "opt", "phi3", "gpt_neox"])
def test_token_vectors_match_brute_force_across_architectures(arch):
    """Flat and sketched per-token vectors of other architectures (float64, left-padded prompt,
    a shorter response, an environment token) equal one full-length backward per token, at the
    response positions only."""
    from _fixtures_arch import build

    model = exact_float64(build(arch))
    rb = rollout_batch()
    ref = _brute_vectors(model, rb)
    flat = token_vectors(model, rb, sketch_dim=None, chunk_size=4)
    assert flat.vec.shape == (rb.P, rb.G, rb.T, flat.n_params)
    torch.testing.assert_close(flat.vec, ref, rtol=RTOL, atol=1e-13)
    torch.testing.assert_close(flat.token_sq, ref.pow(2).sum(-1), rtol=RTOL, atol=1e-13)
    sk = CountSketch.for_model(model, 8, seed=3)
    sketched = token_vectors(model, rb, sketch=sk, chunk_size=4)
    torch.testing.assert_close(sketched.vec, ref @ dense_count_sketch(sk).T, rtol=RTOL,
                               atol=1e-12)
