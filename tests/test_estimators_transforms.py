"""varbench.estimators.transforms: Min-Replace and Adv-Orthogonal (golden values, detached
outputs, and the property that they cancel the shared step)."""

from __future__ import annotations

import torch
from _fixtures_estimators import random_case
from hypothesis import given, settings
from hypothesis import strategies as st

import varbench.estimators as E


def test_transforms_golden_and_detached():
    v = torch.tensor([[1.0, 2.0, 4.0]], requires_grad=True)
    a = torch.tensor([[1.0, 0.0, -1.0]])
    assert E.min_replace(v).tolist() == [[1.0, 1.0, 1.0]]
    # A.v = 1 - 4 = -3, A.A = 2 -> v~ = v + 1.5 A = [2.5, 2, 2.5]
    out = E.adv_orthogonal(v, a)
    assert out.tolist() == [[2.5, 2.0, 2.5]]
    assert not out.requires_grad and not E.min_replace(v).requires_grad
    assert E.adv_orthogonal(v, torch.zeros(1, 3)).tolist() == [[1.0, 2.0, 4.0]]
    mask = torch.tensor([[1, 1, 0]])
    assert E.min_replace(v, mask).tolist() == [[1.0, 1.0, 0.0]]


SETTINGS = settings(max_examples=25, deadline=None, derandomize=True)


shapes = st.tuples(
    st.integers(1, 3), st.integers(1, 6), st.integers(1, 6), st.integers(0, 10_000)
)


@SETTINGS
@given(shapes, st.booleans())
def test_transforms_cancel_the_shared_step(shape, per_token):
    P, G, T, seed = shape
    rewards, mask, _ = random_case(P, G, T, seed)
    gen = torch.Generator().manual_seed(seed)
    A = E.advantages("centered", rewards, mask)[..., 0]  # [P, G], every response has t = 0
    v = torch.rand(P, G, generator=gen, dtype=torch.float64) + 0.1
    if per_token:
        A, v = A.unsqueeze(-1).expand(P, G, T), v.unsqueeze(-1) * torch.rand(
            P, G, T, generator=gen, dtype=torch.float64
        )
        A = torch.where(mask, A, 0)
    m = mask if per_token else None
    ortho = E.adv_orthogonal(v, torch.randn(v.shape, generator=gen, dtype=torch.float64), m)
    r = torch.randn(v.shape, generator=gen, dtype=torch.float64)
    # per position: orthogonal at every column (the per-response form equals it for [P, G])
    for x in (r, A):
        assert ((E.adv_orthogonal(v, x, m, per="position") * x).sum(1).abs() < 1e-12).all()
    if not per_token:
        assert torch.equal(E.adv_orthogonal(v, r), E.adv_orthogonal(v, r, per="position"))
    # per response (the definition): the responses' mean weights are orthogonal to their
    # mean advantages over the whole group, and each token moves by lambda_p * A
    for x in (r, A):
        out = E.adv_orthogonal(v, x, m)
        if per_token:
            n = mask.sum(-1).clamp(min=1)
            vi = torch.where(mask, out, 0).sum(-1) / n
            xi = torch.where(mask, x, 0).sum(-1) / n
        else:
            vi, xi = out, x
        assert ((vi * xi).sum(1).abs() < 1e-12).all()
    # Min-Replace cancels against centered advantages (sum_i A_i = 0 over the group); in the
    # per-token case at positions every response reaches (t = 0).
    mr = E.min_replace(v, m)
    prod = (mr * A).sum(1)
    assert (prod[..., 0].abs() < 1e-12).all() if per_token else (prod.abs() < 1e-12).all()
    assert ortho.shape == v.shape
