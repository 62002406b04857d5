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


# ---- shared_prompt: each prompt once, its keys and values repeated G times

@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gpt2", "mistral_sliding"])
def test_shared_prompt_equals_the_flat_forward_values_and_gradients(arch):
    """Values and every parameter's gradient of ``shared_prompt=True`` equal the flat forward's
    in float64 (left-padded prompt, a shorter response, an environment token), for all groups
    and a subset; a sliding-window model takes the flat path (its cache is not plain)."""
    from _fixtures_arch import build

    model = exact_float64(build(arch, seed=3))
    rb = rollout_batch(P=3, seed=4)
    rb.prompt_mask[2, :3] = 0  # a second, longer left padding
    rb.prompt_ids[2, :3] = 0
    params = [p for p in model.parameters() if p.requires_grad]
    for groups in (None, torch.tensor([2, 0])):
        flat = response_logprobs(model, rb, groups)
        shared = response_logprobs(model, rb, groups, shared_prompt=True)
        assert (flat[(rb.mask if groups is None else rb.mask[groups]) != 0] < 0).all()
        torch.testing.assert_close(shared, flat, rtol=1e-10, atol=1e-12)
        w = torch.randn(flat.shape, dtype=flat.dtype, generator=torch.Generator().manual_seed(0))
        g_flat = torch.autograd.grad((w * flat).sum(), params)
        g_shared = torch.autograd.grad((w * shared).sum(), params)
        for a, b in zip(g_shared, g_flat, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)


def test_shared_prompt_path_is_taken_for_a_full_attention_model():
    """The shared path really runs (not the fallback) where the cache is plain, and not where
    it is sliding-window."""
    from _fixtures_arch import build

    from varbench.rollout.logprobs import _shared_prompt_logprobs

    rb = rollout_batch(P=2, seed=1)
    groups = torch.arange(2)
    assert _shared_prompt_logprobs(build("llama"), rb, groups) is not None
    assert _shared_prompt_logprobs(build("mistral_sliding"), rb, groups) is None
