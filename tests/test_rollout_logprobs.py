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


@pytest.mark.parametrize("shared", [False, True])
def test_rows_in_checkpointed_chunks_equal_one_pass_values_and_gradients(model, shared):
    """The training step's log-probs a chunk of groups at a time (``rows``, checkpointed under
    grad mode) equal one pass in float64: values and every parameter's gradient of a loss
    that mixes the groups (so each chunk's backward needs the whole loss's cotangents)."""
    rb = rollout_batch(P=3, seed=1)
    groups = torch.tensor([2, 0, 1])
    w = torch.linspace(0.5, 2.0, 3 * rb.G * rb.T, dtype=torch.float64).reshape(3, rb.G, rb.T)

    def grads(**kw):
        model.zero_grad(set_to_none=True)
        lp = response_logprobs(model, rb, groups, shared_prompt=shared, **kw)
        loss = (lp * w).sum() + lp.sum().square()  # not separable over chunks
        loss.backward()
        return lp.detach(), [p.grad.clone() for p in model.parameters()]

    ref, g_ref = grads()
    for rows in (rb.G, 2 * rb.G, 2 * rb.G + 1, 1):
        got, g = grads(rows=rows)
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)
        for a, b in zip(g, g_ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-13)
    with torch.no_grad():
        torch.testing.assert_close(response_logprobs(model, rb, groups, rows=rb.G), ref,
                                   rtol=1e-12, atol=1e-14)
    assert any(bool((b != 0).any()) for b in g_ref)


def test_logprob_rows_follow_the_plan_of_a_faked_budget(monkeypatch, model):
    from varbench.models import memplan
    from varbench.rollout.logprobs import logprob_rows

    rb = rollout_batch(P=3, seed=1)
    assert logprob_rows(model, rb, 3) is None  # the CPU: no measured budget, one pass
    shape = memplan.ModelShape.from_model(model)
    L = rb.prompt_ids.shape[1] + rb.T
    two = (memplan.fixed_bytes(shape, "train_logprobs", 3 * rb.G, L)
           + 2 * memplan.unit_bytes(shape, "train_logprobs", L)) / memplan.HEADROOM
    monkeypatch.setattr(memplan, "device_budget", lambda device, fraction=0.5: int(two) + 1)
    assert logprob_rows(model, rb, 3) == 2
    monkeypatch.setattr(memplan, "device_budget", lambda device, fraction=0.5: 1 << 40)
    assert logprob_rows(model, rb, 3) is None  # every row fits: one pass
    monkeypatch.setattr(memplan, "device_budget", lambda device, fraction=0.5: 16)
    with pytest.raises(ValueError, match="does not fit"):
        logprob_rows(model, rb, 3)
