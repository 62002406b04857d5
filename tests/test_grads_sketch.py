"""varbench.grads.sketch: sketched norms from forward-mode Gaussian probes (chi-square exact)
and the probes themselves (seeded, not a sketch of gradient vectors)."""

from __future__ import annotations

import pytest
import torch
from _fixtures_grads import batch, rollout_batch, tiny_llama, trained_llama
from scipy.stats import chi2

from varbench.grads import exact_float64, token_grad_norms
from varbench.grads.group import group_gradients, token_sketches
from varbench.grads.sequence import sequence_grads
from varbench.grads.sketch import GaussianProbes, sketched_token_norms

ALPHA = 1e-6  # total false-failure rate of each statistical test (Bonferroni over entries)


def _chi2_band(k: int, n_tests: int) -> tuple[float, float]:
    """Two-sided band for chi2_k / k holding all n_tests entries with prob >= 1 - ALPHA."""
    a = ALPHA / n_tests
    return chi2.ppf(a / 2, k) / k, chi2.ppf(1 - a / 2, k) / k


def test_sketched_norms_are_unbiased():
    """Gaussian probes: k * estimate / exact ~ chi2_k exactly, for every token and prefix."""
    model = exact_float64(trained_llama())
    ids, rm, am = batch("left")
    ex = token_grad_norms(model, ids, rm, am, progress=False)
    k = 400
    est = sketched_token_norms(model, ids, rm, am, k=k, seed=123)
    on = rm == 1
    lo, hi = _chi2_band(k, 2 * int(on.sum()))
    for e, x in ((est.token_sq, ex.token_sq), (est.prefix_sq, ex.prefix_sq)):
        r = e[on] / x[on]
        assert torch.all((r > lo) & (r < hi)), (r.min(), r.max(), lo, hi)
    torch.testing.assert_close(est.diag_prefix_sq, est.token_sq.cumsum(-1) * rm)
    # reported std tracks the theoretical sqrt(2/k) relative std
    rel = (est.token_sq_std[on] / ex.token_sq[on]).mean()
    assert 0.7 * (2 / k) ** 0.5 < rel < 1.3 * (2 / k) ** 0.5
    again = sketched_token_norms(model, ids, rm, am, k=k, seed=123)
    assert torch.equal(again.probes, est.probes)  # one seed -> same numbers
    assert torch.all(est.token_sq[~on] == 0) and torch.all(est.prefix_sq[~on] == 0)


def test_gaussian_probes_are_seeded_and_not_a_sketch():
    """The Gaussian survives only as forward-mode probe directions (sketched_token_norms needs
    iid probes); it is not accepted where a sketch of gradient vectors is."""
    p = GaussianProbes(8, 3)
    assert not hasattr(p, "apply")
    a, b = p.direction(2, 50, torch.float64, "cpu"), p.direction(2, 50, torch.float64, "cpu")
    assert torch.equal(a, b) and not torch.equal(a, p.direction(3, 50, torch.float64, "cpu"))
    with pytest.raises(ValueError, match="k=0"):
        GaussianProbes(0)
    model = tiny_llama()
    ids, rm, am = batch()
    with pytest.raises(TypeError, match="CountSketch"):
        sequence_grads(model, ids, rm, am, sketch=p)
    with pytest.raises(TypeError, match="CountSketch"):
        group_gradients(model, rollout_batch(), torch.zeros(2, 3, 6), sketch=p)
    with pytest.raises(TypeError, match="CountSketch"):
        token_sketches(model, rollout_batch(), p)


def test_gaussian_probe_drawn_on_its_device():
    """On the CPU a probe is the historical float64 draw of its own seed (then cast); on a
    device without values (meta) nothing is drawn on the host and the shape is kept."""
    probes = GaussianProbes(3, seed=1)
    g = torch.Generator().manual_seed(1 * 1_000_003 + 2)
    want = torch.randn(10, generator=g, dtype=torch.float64)
    assert torch.equal(probes.direction(2, 10, torch.float64, "cpu"), want)
    assert torch.equal(probes.direction(2, 10, torch.float32, "cpu"), want.float())
    meta = probes.direction(2, 10, torch.bfloat16, torch.device("meta"))
    assert meta.device.type == "meta" and meta.dtype == torch.bfloat16 and meta.shape == (10,)
