"""Tests of varbench.analysis.oracle: exact enumeration of a fixed-length task's responses."""

from __future__ import annotations

import math

import pytest
import torch

from varbench.analysis.oracle import enumerate_distribution
from varbench.models import build_preset, forward_logits
from varbench.models.logits import token_logprobs
from varbench.rollout.sampler import sample
from varbench.tasks import get_task


@pytest.fixture(scope="module")
def micro64():
    return build_preset("micro", seed=3, dtype=torch.float64)


def _batch_logp(model, batch):
    flat = batch.flat()
    logits = forward_logits(model, flat.input_ids, flat.attention_mask).logits
    return batch.to_groups(token_logprobs(logits, flat.input_ids) * flat.response_mask)


def test_probabilities_sum_to_one_and_match_sampling(micro64):
    task = get_task("sort", n=2, max_value=2)
    prompt = task.prompts(1, seed=0)[0]
    dist = enumerate_distribution(micro64, task, prompt, reward="positional")
    assert dist.responses.shape == (30**2, 2)
    assert dist.total_prob == pytest.approx(1.0, abs=1e-12)
    # The sampler's empirical mean reward agrees with the exact J within 4 standard errors.
    batch = sample(micro64, task, [prompt], G=4000, seed=1, reward="positional")
    mc = float(batch.rewards.double().mean())
    se = (dist.reward_variance() / 4000) ** 0.5
    assert abs(mc - dist.mean_reward) < 4 * se
    # Exact probability of sampled responses equals the sampler's recorded log-probs.
    idx = (batch.tokens[0, :20].long() * 30 ** torch.tensor([1, 0])).sum(-1)
    torch.testing.assert_close(
        dist.logp[idx], batch.logprobs[0, :20].double().sum(-1), rtol=0, atol=1e-5
    )


def test_gradient_batch_gives_exact_policy_gradient(micro64):
    """sum_y pi R grad log pi (the oracle's coefficient set) == grad of J = sum_y pi(y) R(y)."""
    task = get_task("sort", n=2, max_value=1)
    prompt = task.prompts(1, seed=0)[0]
    dist = enumerate_distribution(micro64, task, prompt, reward="positional")
    model = micro64.model
    params = [p for p in model.parameters() if p.requires_grad]
    batch, coef = dist.gradient_batch()
    assert batch.tokens.shape[1] < dist.responses.shape[0]  # zero-reward responses dropped
    g_oracle = torch.autograd.grad((coef * _batch_logp(model, batch)).sum(), params)
    # Brute force: differentiate J itself over the full response space.
    full, _ = dist.gradient_batch(min_weight=-1.0)
    lp = _batch_logp(model, full).sum(-1)  # [1, N]
    J = (lp.exp() * full.rewards.double()).sum()
    g_true = torch.autograd.grad(J, params)
    assert float(J.detach()) == pytest.approx(dist.mean_reward, rel=1e-12)
    for a, b in zip(g_oracle, g_true, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_variable_length_task_refused(micro64):
    task = get_task("arith")
    with pytest.raises(ValueError, match="variable-length"):
        enumerate_distribution(micro64, task, task.prompts(1)[0])


# ---- exact group statistics from an enumerated table; Monte Carlo and coverage against them --


def _peaked_policy():
    """A random micro policy with a sharpened head: on ``<sort>1=`` (n = 1) the correct token
    has probability ~0.13, so G = 4 groups mix all-agree and mixed reward configurations."""
    pol = build_preset("micro", seed=1, dtype=torch.float64)
    with torch.no_grad():
        pol.model.get_output_embeddings().weight.mul_(6)
    return pol


@pytest.fixture(scope="module")
def table1():
    from varbench.analysis.oracle import response_table

    task = get_task("sort", n=1, max_value=9)
    pol = _peaked_policy()
    dist = enumerate_distribution(pol, task, task.prompts(6, seed=0)[5])
    return response_table(pol, dist, sketch_dim=None)  # flat: exact contraction


def _sketched(table, K=64):
    """The same table with every vector count-sketched (exact statistics then live there)."""
    from dataclasses import replace

    from varbench.grads.vectors import CountSketch

    S = CountSketch([table.vec.shape[-1]], K, seed=5)
    return replace(table, vec=S.apply(table.vec.double()), sketch="countsketch(K=64)")


def test_exact_moments_known_answers(table1):
    """centered's projection is (G-1)/G, rloo's 1; rloo/centered variance = (G/(G-1))^2; the
    all-agree share is sum_k q_k^G."""
    from varbench.analysis.variance_cells import table_cells

    q = float((table1.probs * table1.rewards).sum())
    for G in (2, 4):
        cells, paired = table_cells(table1, G, 8, schemes=["centered", "rloo", "normalized"],
                                    exact=True)
        c = cells.set_index("scheme")
        assert set(c["method"]) == {"exact"}
        assert c.loc["centered", "projection"] == pytest.approx((G - 1) / G, rel=1e-6)
        assert c.loc["rloo", "projection"] == pytest.approx(1.0, rel=1e-6)
        mse = c.loc["rloo", "mse"]
        assert c.loc["rloo", "bias2_debiased"] == pytest.approx(0.0, abs=1e-9 * mse)
        v = paired[(paired["scheme"] == "rloo") & (paired["stat"] == "variance")].iloc[0]
        assert v["ratio"] == pytest.approx((G / (G - 1)) ** 2, rel=1e-9)
        assert c.loc["centered", "frac_all_agree"] == pytest.approx(q**G + (1 - q) ** G, rel=1e-9)
        assert c.loc["centered", "frac_zero"] == pytest.approx(q**G + (1 - q) ** G, rel=1e-9)


def test_exact_cells_of_a_sketch_say_their_error(table1):
    """A table small enough to contract flat (D = its parameter count) against the same table
    count-sketched to K = 64 under 40 sketch seeds: flat cells are ``exact`` with SE 0; sketched
    ones ``exact-sketched``, their SE the sketch's (> 0; variance / MSE and the ratios from the
    cells' exact quadratic forms, whose traces are the cells' values) and their
    95% intervals covering the flat value in >= 36 of 40 draws for variance, MSE and
    projection of every reward-only scheme and for the paired ratios (nominal minus two
    binomial SEs of 40 draws: 0.95 - 2 * 0.034 = 0.88 -> 36 / 40)."""
    from dataclasses import replace

    from varbench.analysis.variance_cells import table_cells
    from varbench.grads.vectors import CountSketch

    schemes = ["centered", "rloo", "normalized", "topk"]
    G = 4
    flat, fpair = table_cells(table1, G, 8, schemes=schemes, exact=True)
    assert table1.sketch_k is None and set(flat["method"]) == {"exact"}
    assert (flat[[f"{k}_se" for k in ("variance", "mse", "projection")]] == 0).all().all()
    flat, fpair = flat.set_index("scheme"), fpair.set_index(["scheme", "baseline", "stat"])
    hits: dict[tuple, int] = {}
    off = []
    for seed in range(40):
        S = CountSketch([table1.vec.shape[-1]], 64, seed=100 + seed)
        tab = replace(table1, vec=S.apply(table1.vec.double()), sketch=S.description)
        assert tab.sketch_k == 64
        sk, spair = table_cells(tab, G, 64, schemes=schemes, exact=True)
        if seed < 2:  # the forms behind the SDs are the cells' own moments (traces, 1e-9)
            from varbench.analysis.oracle import exact_moments
            from varbench.analysis.variance_cells import _coef_fn

            ref = tab.reference()
            for sch in schemes:
                ex = exact_moments(tab, _coef_fn(sch, "seq-mean-token-sum", topk_k=1,
                                                 max_len=tab.mask.shape[1]), G, ref)
                rows = ex["rows"]
                for k in ("variance", "mse"):
                    assert ex["forms"][k].trace(rows @ rows.T) == pytest.approx(ex[k],
                                                                                rel=1e-9)
        assert set(sk["method"]) == {"exact-sketched"} and set(spair["method"]) == {
            "exact-sketched"}
        for r in sk.itertuples():
            for k in ("variance", "mse", "projection"):
                assert getattr(r, f"{k}_se") > 0 or k == "projection"  # along g*: 0
                lo, hi = getattr(r, f"{k}_ci_low"), getattr(r, f"{k}_ci_high")
                want = flat.loc[r.scheme, k]
                # a projection along g* on every sketch (topk here) has no sketch error: its
                # width-0 interval covers when the value equals the flat one to rounding
                hit = lo <= want <= hi or (getattr(r, f"{k}_se") < 1e-9
                                           and getattr(r, k) == pytest.approx(want, rel=1e-9))
                hits[r.scheme, k] = hits.get((r.scheme, k), 0) + hit
            off.append(abs(r.variance / flat.loc[r.scheme, "variance"] - 1))
        for r in spair.itertuples():
            want = fpair.loc[(r.scheme, r.baseline, r.stat), "ratio"]
            # rloo / centered variance is (G/(G-1))^2 on any sketch: no sketch error, width 0
            hit = (r.ratio_ci_low <= want <= r.ratio_ci_high
                   or r.ratio_sketch_sd < 1e-6 and r.ratio == pytest.approx(want, rel=1e-9))
            hits[r.scheme, r.baseline, r.stat] = hits.get((r.scheme, r.baseline, r.stat), 0) + hit
    assert max(off) > 1e-3  # the sketch does move the values: the test can fail
    assert len(hits) == 4 * 3 + 3 * 2 and min(hits.values()) >= 36, hits


def test_exact_cells_equal_a_large_monte_carlo(table1):
    """Exact variance, MSE and projection of every reward-only scheme lie within 4 SE of a
    Monte Carlo over 3,000 groups drawn from the same table (sketched to K = 64)."""
    from varbench.analysis.variance_cells import table_cells

    tab = _sketched(table1)
    schemes = ["centered", "rloo", "normalized", "topk"]
    for G in (2, 4):
        ex, _ = table_cells(tab, G, 8, schemes=schemes, exact=True)
        mc, _ = table_cells(tab, G, 3_000, schemes=schemes, seed=G, n_boot=0,
                            interval="normal")
        ex, mc = ex.set_index("scheme"), mc.set_index("scheme")
        assert set(ex["method"]) == {"exact-sketched"} and set(mc["method"]) == {"mc"}
        for s in schemes:
            for k in ("variance", "mse", "projection"):
                se = mc.loc[s, f"{k}_se"]
                assert abs(ex.loc[s, k] - mc.loc[s, k]) < 4 * se, (G, s, k)


def test_interval_coverage_fast(table1):
    """Studentized bootstrap intervals of 60 replicates of M = 64 groups cover the truth of
    centered's and OTB's variance, MSE and projection and of the paired otb / centered
    variance and MSE ratios: coverage >= 0.85 for each (nominal 0.95; 60 replicates have a
    binomial SE of ~3 points; on the slow test's setup a normal interval with the same SE
    covered 0.86-0.90 over 1,000 replicates). The slow test measures within 2 points."""
    from varbench.analysis.variance_cells import table_cells

    tab = _sketched(table1)
    ex, _ = table_cells(tab, 4, 8, schemes=["centered"], exact=True)
    truth = {(r.scheme, k): getattr(r, k) for r in ex.itertuples()
             for k in ("variance", "mse", "projection")}
    truth.update(_mc_truth(tab, 4, ["otb"], 100_000))  # relative SE ~0.1%
    for k in ("variance", "mse"):
        truth["otb/centered", k] = truth["otb", k] / truth["centered", k]
    cov = _coverage_all(tab, 4, 64, 60, truth, ["centered", "otb"], n_boot=400)
    assert len(cov) == 2 * 3 + 2
    assert min(cov.values()) >= 0.85, cov


def _mc_truth(tab, G, schemes, n_groups, *, chunk=20_000, seed=12_345):
    """Monte Carlo truth of the schemes without an exact cell (one home: tests/_coverage.py)."""
    from _coverage import mc_truth

    return mc_truth(tab, G, schemes, n_groups, chunk=chunk, seed=seed)


def _coverage_all(tab, G, M, reps, truth, schemes, *, interval="studentized", n_boot=1000):
    """Coverage of every cell interval and every paired ratio interval vs centered."""
    from varbench.analysis.variance_cells import table_cells

    hits: dict[tuple[str, str], list[bool]] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # [M, M] and [n_boot, M] tensors: threads only add overhead
    try:
        runs = [table_cells(tab, G, M, schemes=list(schemes), seed=1000 + r, n_boot=n_boot,
                            interval=interval) for r in range(reps)]
    finally:
        torch.set_num_threads(threads)
    for cells, paired in runs:
        for row in cells.itertuples():
            for k in ("variance", "mse", "projection"):
                lo, hi = getattr(row, f"{k}_ci_low"), getattr(row, f"{k}_ci_high")
                hits.setdefault((row.scheme, k), []).append(lo <= truth[row.scheme, k] <= hi)
        for row in paired.itertuples():
            key = f"{row.scheme}/{row.baseline}"
            if (key, row.stat) in truth:
                hits.setdefault((key, row.stat), []).append(
                    row.ratio_ci_low <= truth[key, row.stat] <= row.ratio_ci_high)
    return {key: sum(v) / len(v) for key, v in hits.items()}


COVERAGE_REPS = 1000
# Measured below the target at M = 128 (512 responses) with the default studentized interval
# (1,000 replicates: otb variance 0.902, otb MSE 0.897, otb / otb_exact variance 0.907 and MSE
# 0.908; the misses are samples that lack the rare large groups, truth above the interval; a
# calibrated (double) bootstrap-t did not change them: 0.887 / 0.877 over 300 replicates).
# More responses do: estimator_variance samples PROXY_MIN_RESPONSES (4096) per prompt when a
# label reads the proxy weights, and test_interval_coverage_at_the_response_floor_slow checks
# these quantities there. At M = 128 they are guarded at >= 0.88 against regressions.
SHORTFALL = {("otb", "variance"), ("otb", "mse"), ("otb/otb_exact", "variance"),
             ("otb/otb_exact", "mse")}


def _coverage_setup():
    from varbench.analysis.oracle import response_table
    from varbench.train.policies import build_policy as build_trained

    task = get_task("sort", n=2, max_value=2)
    pol = build_trained("micro", task=task, warm=True, progress=False)
    dist = enumerate_distribution(pol, task, task.prompts(1, seed=0)[0])
    return _sketched(response_table(pol, dist, sketch_dim=None), K=256)


@pytest.mark.slow
def test_interval_coverage_slow():
    """1,000 replicates of M = 128 groups (G = 4) on the enumerable warm micro setup (sort
    n = 2, 900 responses): every interval a cell reports (variance, MSE, projection of
    centered, rloo, normalized, otb, otb_exact; the paired otb / centered, otb_exact /
    centered, normalized / centered variance and MSE ratios, rloo / centered MSE, otb /
    otb_exact) covers its truth within 2 points of nominal 0.95 plus two binomial SEs
    (sqrt(0.95 * 0.05 / 1000) = 0.7 points): |coverage - 0.95| <= 0.034, except the
    measured SHORTFALL (>= 0.88). Truth: exact cells for the reward-only schemes, a
    400,000-group Monte Carlo from the same table for OTB (relative SE ~0.3%, against
    interval half-widths of 30-40%)."""
    from varbench.analysis.variance_cells import table_cells

    tab = _coverage_setup()
    exact = ["centered", "rloo", "normalized"]
    ex, _ = table_cells(tab, 4, 8, schemes=exact, exact=True)
    truth = {(r.scheme, k): getattr(r, k) for r in ex.itertuples()
             for k in ("variance", "mse", "projection")}
    truth.update(_mc_truth(tab, 4, ["otb", "otb_exact"], 400_000))
    for a, b in (("otb", "centered"), ("otb_exact", "centered"), ("normalized", "centered"),
                 ("otb", "otb_exact")):
        for k in ("variance", "mse"):
            truth[f"{a}/{b}", k] = truth[a, k] / truth[b, k]
    # rloo / centered variance is (G / (G-1))^2 on every sample: a zero-width interval, tested
    # in test_exact_moments_known_answers; its MSE ratio is random
    truth["rloo/centered", "mse"] = truth["rloo", "mse"] / truth["centered", "mse"]
    cov = _coverage_all(tab, 4, 128, COVERAGE_REPS, truth, [*exact, "otb", "otb_exact"])
    se = (0.95 * 0.05 / COVERAGE_REPS) ** 0.5
    print("coverage", {k: round(v, 3) for k, v in sorted(cov.items())})
    assert len(cov) == 5 * 3 + 4 * 2 + 1
    assert all(abs(v - 0.95) <= 0.02 + 2 * se for k, v in cov.items() if k not in SHORTFALL), cov
    assert all(cov[k] >= 0.88 for k in SHORTFALL), cov


@pytest.mark.slow
def test_interval_coverage_at_the_response_floor_slow():
    """The SHORTFALL quantities (OTB with proxy weights: variance, MSE, ratio to otb_exact) at
    the response floor estimator_variance applies to them: PROXY_MIN_RESPONSES / G groups of
    G = 4, 1,000 replicates, the same 2-point target plus two binomial SEs as every other
    interval (|coverage - 0.95| <= 0.034)."""
    from varbench.analysis.variance_report import PROXY_MIN_RESPONSES

    tab = _coverage_setup()
    G = 4
    truth = _mc_truth(tab, G, ["otb", "otb_exact"], 400_000)
    for k in ("variance", "mse"):
        truth["otb/otb_exact", k] = truth["otb", k] / truth["otb_exact", k]
    cov = _coverage_all(tab, G, PROXY_MIN_RESPONSES // G, COVERAGE_REPS, truth,
                        ["otb", "otb_exact"])
    cov = {k: v for k, v in cov.items() if k in SHORTFALL}
    print("coverage at the floor", {k: round(v, 3) for k, v in sorted(cov.items())})
    assert set(cov) == SHORTFALL
    se = (0.95 * 0.05 / COVERAGE_REPS) ** 0.5
    assert all(abs(v - 0.95) <= 0.02 + 2 * se for v in cov.values()), cov


def test_interval_functions_edge_cases():
    """A deterministic paired ratio gets a zero-width interval; intervals contain the value."""
    from varbench.stats.intervals import group_intervals, paired_ratio_interval, sketch_sd

    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 5, generator=g, dtype=torch.float64) ** 3  # heavy-ish tails
    ref = torch.randn(5, generator=g, dtype=torch.float64)
    r = paired_ratio_interval(2 * x, x, ref, stat="variance")
    assert r["value"] == pytest.approx(4.0) and r["ci_low"] == r["ci_high"] == r["value"]
    for method in ("studentized", "normal"):
        iv = group_intervals(x, ref, method=method, n_boot=200)
        for k, v in iv.items():
            assert v["ci_low"] <= v["value"] <= v["ci_high"], (method, k)
            assert v["se"] > 0
    sd = sketch_sd(x, ref, K=16)
    assert all(v > 0 for v in sd.values())
    assert sketch_sd(x, ref, K=64)["variance"] < sd["variance"]  # ~1/sqrt(K)
    zero = sketch_sd(x, torch.zeros(5, dtype=torch.float64), K=16)  # g* = 0: no projection
    assert math.isnan(zero["projection"]) and zero["variance"] == sd["variance"]
