"""varbench.grads.projected (coefficient-first Kronecker sketches, issue 26) over the
architecture matrix of tests/_fixtures_arch.py, against the brute force of
tests/reference_grads.py (one torch.autograd.grad per response token) on float64 copies.

Tolerances and bounds:
- identity projection, float64: RTOL_64 = 1e-10 relative to the largest entry (the rows are
  the exact per-response gradients; only summation order differs, observed <= 1e-15).
- mixtral (router and experts excluded with ``params``): RTOL_ROUTER = 1e-8, because its
  router's softmax runs in float32 even in the float64 copy (transformers casts the routing
  weights with ``dtype=torch.float``), and the remaining parameters' gradients pass through it;
  observed 1.0e-10 (the same with one response per forward, so not batching).
- unbiasedness: the mean of <S a, S b> over N_SEEDS independent seeds lies within 4 standard
  errors of the exact <a, b>, the SE from the exact variance formula (block_pair_variance plus
  the CountSketch's) over sqrt(N_SEEDS); the sample variance over seeds lies within
  [0.6, 1.6] x the formula (N_SEEDS = 400: the sample variance of these quartic forms has a
  relative sd of sqrt((kurtosis - 1) / N) ~ 0.1-0.2 for kurtosis up to ~15).
- fixed seed: each estimated inner product is within 6 exact standard deviations of the exact
  value (Chebyshev: probability <= 1/36 per pair whatever the distribution) and their mean
  squared z-score is at most 4 (its expectation is 1).
"""

from __future__ import annotations

import functools
import math
import re

import pytest
import torch
from _fixtures_arch import ARCHS, build
from _fixtures_grads import batch, rollout_batch, trained_llama
from reference_grads import brute_group_gradients, brute_token_grads

from varbench._util.checks import UsageError
from varbench.grads import batch_sketches, exact_float64
from varbench.grads.projected import (
    Block,
    block_pair_variance,
    kron_pair_var,
    projection_blocks,
    projection_sd,
    response_sketches,
)

pytestmark = pytest.mark.usefixtures("one_thread")

RTOL_64 = 1e-10
RTOL_ROUTER = 1e-8
N_SEEDS = 400
NAMES = [n for n in ARCHS if n != "mixtral"]  # mixtral: its router has no per-response rule
NO_MLP = r"^(?!.*\.mlp\.)"  # mixtral without its router and experts


@functools.cache
def _case(name: str, padding: str = "left"):
    """(float64 model, ids, rm, am, coefficients [2, B, L], exact rows [2, B, P])."""
    m64 = exact_float64(build(name))
    ids, rm, am = batch(padding, B=3, L=9)
    params = NO_MLP if name == "mixtral" else None
    g, names, _ = brute_token_grads(m64, ids, rm, am,
                                    params=None if params is None else _names(m64, params))
    c = torch.randn(2, *rm.shape, generator=torch.Generator().manual_seed(3),
                    dtype=torch.float64)
    c[1] = c[1].mean(1, keepdim=True)  # a sequence-level set broadcast over tokens
    return m64, ids, rm, am, c, torch.einsum("sbl,blp->sbp", c * rm, g), params


def _names(model, pattern):
    return [n for n, p in model.named_parameters() if p.requires_grad and re.search(pattern, n)]


def _close(got, want, rtol):
    err = float((got.double() - want.double()).abs().max() / want.abs().max().clamp(min=1e-30))
    assert err <= rtol, f"max error {err:.2e} relative to the largest entry > {rtol}"


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("name", [*NAMES, "mixtral"])
def test_identity_rows_are_the_exact_per_response_gradients(name, padding):
    m64, ids, rm, am, c, want, params = _case(name, padding)
    r = response_sketches(m64, ids, rm, am, coefficients=c, projection="identity",
                          params=params)
    assert r.vec.shape == want.shape and r.vec.dtype == torch.float64
    tol = RTOL_ROUTER if name == "mixtral" else RTOL_64
    _close(r.vec, want, tol)
    assert all(b.kind in ("kron", "exact") for b in r.blocks)
    assert any(v.startswith("projected") for v in r.methods.values())
    # one coefficient set: [B, K]
    one = response_sketches(m64, ids, rm, am, coefficients=c[0], projection="identity",
                            params=params)
    _close(one.vec, want[0], tol)


def test_unhandled_module_raises_naming_it():
    m64, ids, rm, am, c, *_ = _case("llama")
    with pytest.raises(UsageError, match="MixtralTopKRouter"):
        response_sketches(exact_float64(build("mixtral")), ids, rm, am, coefficients=c)


def _exact_blocks(name):
    """Per-parameter exact gradient slices of the identity rows: name -> [2, B, rows, cols]."""
    m64, ids, rm, am, c, want, params = _case(name)
    ident = response_sketches(m64, ids, rm, am, coefficients=c, projection="identity",
                              params=params)
    return {b.names[0]: ident.vec[..., b.start:b.stop].reshape(*ident.vec.shape[:2], b.rows,
                                                               b.cols)
            for b in ident.blocks}


def _exact_var(blocks, exact, i, j):
    """Exact Var<S x_i, S x_j> of flattened rows i, j (over the response axis of [2*B])."""
    var = torch.zeros((), dtype=torch.float64)
    for blk in blocks:
        if blk.kind == "kron":
            e = exact[blk.names[0]].flatten(0, 1)
            k1, k2 = blk.inv_k()
            var += block_pair_variance(e[i], e[j], 1 / k1 if k1 else math.inf,
                                       1 / k2 if k2 else math.inf)
        elif blk.kind == "countsketch":
            x = torch.cat([exact[n].flatten(0, 1)[i].reshape(-1) for n in blk.names])
            y = torch.cat([exact[n].flatten(0, 1)[j].reshape(-1) for n in blk.names])
            var += ((x @ x) * (y @ y) + (x @ y) ** 2 - 2 * (x * x * y * y).sum()) / blk.k1
    return var


def _pairs(n):
    return [(i, j) for i in range(n) for j in range(i, n)]


@pytest.mark.parametrize("name", ["llama", "gpt2", "qwen2"])
def test_inner_products_are_unbiased_with_the_stated_variance(name):
    """Mean over seeds within 4 SE of the exact inner products; the sample variance over seeds
    matches the exact formula (so the formula and the implementation agree)."""
    m64, ids, rm, am, c, want, params = _case(name)
    exact = want.flatten(0, 1)
    gram = exact @ exact.T
    draws = []
    for seed in range(N_SEEDS):
        r = response_sketches(m64, ids, rm, am, coefficients=c, k1=4, k2=4, k_dense=8,
                              seed=seed, params=params)
        v = r.vec.flatten(0, 1)
        draws.append(v @ v.T)
    draws = torch.stack(draws)
    assert {b.kind for b in r.blocks} == {"kron", "countsketch"}
    blocks = _exact_blocks(name)
    for i, j in _pairs(exact.shape[0]):
        var = float(_exact_var(r.blocks, blocks, i, j))
        se = (var / N_SEEDS) ** 0.5
        mean = float(draws[:, i, j].mean())
        assert abs(mean - float(gram[i, j])) <= 4 * se, (i, j, mean, float(gram[i, j]), se)
        ratio = float(draws[:, i, j].var()) / var
        assert 0.6 <= ratio <= 1.6, (i, j, ratio)


@pytest.mark.parametrize("name", NAMES)
def test_fixed_seed_error_within_the_projection_variance(name):
    m64, ids, rm, am, c, want, params = _case(name)
    exact = want.flatten(0, 1)
    r = response_sketches(m64, ids, rm, am, coefficients=c, k1=4, k2=4, k_dense=8, seed=0,
                          params=params)
    v = r.vec.flatten(0, 1)
    est, gram = v @ v.T, exact @ exact.T
    blocks = _exact_blocks(name)
    z2 = []
    for i, j in _pairs(exact.shape[0]):
        sd = float(_exact_var(r.blocks, blocks, i, j)) ** 0.5
        z = (float(est[i, j]) - float(gram[i, j])) / sd
        assert abs(z) <= 6, (i, j, z)
        z2.append(z * z)
    assert sum(z2) / len(z2) <= 4


def test_norm_var_factor_bounds_the_exact_variance():
    """``c ||a||^2 ||b||^2`` (what projection_sd uses) >= the exact variance of a Kronecker
    block, with equality approached by rank-one a = b; exact sides give 0."""
    g = torch.Generator().manual_seed(0)
    for k1, k2, rows, cols in ((4, 4, 16, 16), (2, 8, 32, 16), (16, 16, 16, 16), (3, 16, 8, 16)):
        blk = Block("kron", ("w",), 0, 1, min(k1, rows), min(k2, cols), rows, cols)
        u, v = blk.inv_k()
        for rank in (1, 4):
            a = torch.randn(rows, rank, generator=g, dtype=torch.float64) @ torch.randn(
                rank, cols, generator=g, dtype=torch.float64)
            b = a + 0.5 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
            for x, y in ((a, a), (a, b)):
                var = float(block_pair_variance(x, y, 1 / u if u else math.inf,
                                                1 / v if v else math.inf))
                bound = blk.norm_var_factor() * float(x.pow(2).sum() * y.pow(2).sum())
                assert var <= bound * (1 + 1e-12)
                if u == v == 0:
                    assert var == 0 and bound == 0
        # rank one, a = b: the bound is the variance up to the dropped ||Z||^2 <= ||a||^4 slack
        x = torch.randn(rows, 1, dtype=torch.float64) @ torch.randn(1, cols, dtype=torch.float64)
        var = float(block_pair_variance(x, x, 1 / u if u else math.inf, 1 / v if v else math.inf))
        assert var == pytest.approx(blk.norm_var_factor() * float(x.pow(2).sum()) ** 2, rel=1e-9)


def test_projection_sd_estimates_the_seed_spread_of_the_variance():
    """The variance over the projection of the sketched variance (trace of the covariance of
    the estimates), estimated per seed from the Gram of the sketch's rows and columns
    (projection_blocks, unbiased), matches its spread over 100 seeds: the root mean square of
    the estimated sd within [0.75, 1.33] x the spread (the spread's own relative sd over 100
    seeds is ~0.1); 0 for exact sketches."""
    m64, ids, rm, am, c, want, params = _case("llama")
    exact = want[0]
    ref = exact.mean(0)
    traces, sds = [], []
    for seed in range(100):
        r = response_sketches(m64, ids, rm, am, coefficients=c[0], k1=4, k2=4, k_dense=8,
                              seed=seed)
        x = r.vec
        traces.append(float((x - x.mean(0)).pow(2).sum() / (x.shape[0] - 1)))
        # reference: the sketch of the mean under the same S (linear)
        sds.append(sum(projection_blocks(x, x.mean(0), r.blocks)["variance"][1]) ** 0.5)
    spread = float(torch.tensor(traces).std())
    rms = float(torch.tensor(sds).pow(2).mean().sqrt())
    assert 0.75 * spread <= rms <= 1.33 * spread, (rms, spread)
    exact_tr = float((exact - exact.mean(0)).pow(2).sum() / (exact.shape[0] - 1))
    assert abs(float(torch.tensor(traces).mean()) - exact_tr) <= 4 * spread / 10
    ident = response_sketches(m64, ids, rm, am, coefficients=c[0], projection="identity")
    sd = projection_sd(ident.vec, ref, ident.blocks)
    assert sd == {"variance": 0.0, "mse": 0.0, "projection": 0.0}


def test_kron_pair_var_is_the_variance_over_projections():
    """kron_pair_var of one draw's sketches averages, over 1000 draws, to the exact variance of
    ``<S a, S b>`` (block_pair_variance) within 4 standard errors of the mean: both sides
    projected (k1 = 6, k2 = 5 of a 12 x 10 block), the rows side exact and the columns side
    exact, for a = b full rank, a = b rank one and a != b (the projection's bilinear form)."""
    g = torch.Generator().manual_seed(0)
    full = torch.randn(12, 10, generator=g, dtype=torch.float64)
    rank1 = torch.randn(12, 1, generator=g, dtype=torch.float64) @ torch.randn(
        1, 10, generator=g, dtype=torch.float64)
    other = full + torch.randn(12, 10, generator=g, dtype=torch.float64)
    for a, b in ((full, full), (rank1, rank1), (full, other)):
        for k1, k2 in ((6, 5), (12, 5), (6, 10)):
            blk = Block("kron", ("w",), 0, k1 * k2, k1, k2, 12, 10)
            exact = float(block_pair_variance(a, b, math.inf if k1 >= 12 else k1,
                                              math.inf if k2 >= 10 else k2))
            est = []
            for _ in range(1000):
                p1 = (torch.eye(12, dtype=torch.float64) if k1 >= 12 else
                      torch.randn(12, k1, generator=g, dtype=torch.float64) / math.sqrt(k1))
                p2 = (torch.eye(10, dtype=torch.float64) if k2 >= 10 else
                      torch.randn(10, k2, generator=g, dtype=torch.float64) / math.sqrt(k2))
                est.append(kron_pair_var((p1.T @ a @ p2)[None], (p1.T @ b @ p2)[None], 1.0,
                                         blk))
            x = torch.tensor(est)
            se = float(x.std()) / math.sqrt(len(est))
            assert abs(float(x.mean()) - exact) <= 4 * se, (k1, k2, float(x.mean()), exact)


@pytest.mark.parametrize("name", NAMES)
def test_row_chunks_equal_one_chunk(name):
    m64, ids, rm, am, c, want, params = _case(name)
    full = response_sketches(m64, ids, rm, am, coefficients=c, k1=4, k2=4, seed=5,
                             params=params, rows=ids.shape[0])
    for rows in (1, 2):
        got = response_sketches(m64, ids, rm, am, coefficients=c, k1=4, k2=4, seed=5,
                                params=params, rows=rows)
        _close(got.vec, full.vec, RTOL_64)
        assert got.methods == full.methods and got.blocks == full.blocks


@pytest.mark.parametrize("name", ["llama", "gpt2", "opt", "qwen2"])
@pytest.mark.parametrize("rows", [1, 3])
def test_one_backward_per_chunk_and_coefficient_set(name, rows):
    """A tensor hook on the input embedding's output fires once per backward through the
    model: S sets x ceil(B / rows) chunks, i.e. one backward per response per set."""
    m64, ids, rm, am, c, want, params = _case(name)
    response_sketches(m64, ids, rm, am, coefficients=c, rows=rows)  # first-call self-checks
    fired = []

    def on_forward(_mod, _args, out):
        if out.requires_grad:
            out.register_hook(lambda grad: fired.append(1))

    h = m64.get_input_embeddings().register_forward_hook(on_forward)
    try:
        response_sketches(m64, ids, rm, am, coefficients=c, rows=rows)
    finally:
        h.remove()
    B, S = ids.shape[0], c.shape[0]
    assert len(fired) == S * math.ceil(B / rows)


def test_bf16_model_accumulates_in_float32_on_its_device():
    """bf16 model, float32 accumulation, against the float64 copy of the SAME bf16 weights
    (5e-2 relative: the tolerance and its justification of test_grads_arch's RTOL_BF16)."""
    _, ids, rm, am, c, *_ = _case("llama")
    m16 = build("llama").to(torch.bfloat16)
    r = response_sketches(m16, ids, rm, am, coefficients=c, projection="identity")
    assert r.vec.dtype == torch.float32 and r.vec.device == ids.device
    want = response_sketches(exact_float64(m16), ids, rm, am, coefficients=c,
                             projection="identity").vec
    err = float((r.vec.double() - want).norm() / want.norm())
    assert err <= 5e-2, err


def test_batch_sketches_sum_to_the_group_gradients():
    """A RolloutBatch with [S, P, G, T] coefficients: identity rows summed over G are the exact
    group gradients (one backward per sequence brute force), float64."""
    model = exact_float64(trained_llama())
    rb = rollout_batch()
    coeffs = torch.randn(2, rb.P, rb.G, rb.T, generator=torch.Generator().manual_seed(1),
                         dtype=torch.float64)
    r = batch_sketches(model, rb, coeffs, projection="identity")
    assert r.vec.shape[:3] == (2, rb.P, rb.G)
    for s in range(2):
        _close(r.vec[s].sum(1), brute_group_gradients(model, rb, coeffs[s]), RTOL_64)
    one = batch_sketches(model, rb, coeffs[0], projection="identity")
    _close(one.vec, r.vec[0], RTOL_64)
