"""varbench.rollout.logprobs: teacher-forced log-probs of a batch's responses equal a
per-sequence loop over the unpadded responses, for all groups or a subset; exactly 0 off the
mask; differentiable."""

from __future__ import annotations

import pytest
import torch
from _fixtures_grads import rollout_batch, tiny_llama
from reference_rollout import per_sequence_response_logprobs

from varbench.grads.precision import exact_float64
from varbench.rollout import response_logprobs


@pytest.fixture(scope="module")
def model():
    return exact_float64(tiny_llama(seed=2))  # float64 throughout: tight tolerances


def test_equals_a_per_sequence_loop(model):
    rb = rollout_batch()
    with torch.no_grad():
        got = response_logprobs(model, rb)
        want = per_sequence_response_logprobs(model, rb)
    assert got.shape == (rb.P, rb.G, rb.T) and got.dtype == torch.float64
    assert (want[rb.mask != 0] < 0).all()  # a real comparison, not zeros against zeros
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_groups_subset_and_order(model):
    rb = rollout_batch(P=3, seed=1)
    with torch.no_grad():
        full = response_logprobs(model, rb)
        for groups in ([1], [2, 0], [0, 1, 2]):
            sub = response_logprobs(model, rb, groups=torch.tensor(groups))
            assert sub.shape == (len(groups), rb.G, rb.T)
            torch.testing.assert_close(sub, full[groups], rtol=1e-10, atol=1e-12)


def test_exactly_zero_off_the_mask(model):
    rb = rollout_batch()
    assert rb.env_mask.sum() > 0 and (rb.mask == 0).any()  # env tokens and padding occur
    with torch.no_grad():
        lp = response_logprobs(model, rb)
    assert (lp[rb.mask == 0] == 0).all()
    assert (lp[rb.mask != 0] != 0).all()


def test_differentiable_when_grad_is_on(model):
    rb = rollout_batch()
    lp = response_logprobs(model, rb)
    assert lp.requires_grad
    (g,) = torch.autograd.grad(lp.sum(), model.lm_head.weight)
    assert g.abs().sum() > 0
    with torch.no_grad():
        assert not response_logprobs(model, rb).requires_grad
