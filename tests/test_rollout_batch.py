"""varbench.rollout.batch: the flat [B, L] view of a RolloutBatch (row p * G + i = left-padded
prompt then right-padded response) and the way back to [P, G, T]."""

from __future__ import annotations

import torch
from _fixtures_grads import rollout_batch


def test_flat_view_layout():
    rb = rollout_batch(P=2, G=3, T=6, Lp=4)
    assert (rb.P, rb.G, rb.T) == (2, 3, 6)
    f = rb.flat()
    assert f.prompt_len == 4
    assert f.input_ids.shape == f.attention_mask.shape == f.response_mask.shape == (6, 10)
    assert f.input_ids.dtype == f.attention_mask.dtype == torch.long
    assert f.response_mask.dtype == rb.mask.dtype
    for p in range(2):
        for i in range(3):
            b = p * 3 + i
            assert f.input_ids[b].tolist() == rb.prompt_ids[p].tolist() + rb.tokens[p, i].tolist()
            real = ((rb.mask[p, i] + rb.env_mask[p, i]) > 0).long()
            assert f.attention_mask[b].tolist() == rb.prompt_mask[p].tolist() + real.tolist()
            assert f.response_mask[b].tolist() == [0.0] * 4 + rb.mask[p, i].tolist()
    # the environment token is attended but not a response token; left padding is neither
    assert f.attention_mask[1 * 3 + 2, 4 + 2] == 1 and f.response_mask[1 * 3 + 2, 4 + 2] == 0
    assert f.attention_mask[3, 0] == 0 and f.attention_mask[0, 0] == 1


def test_to_groups_inverts_flat():
    rb = rollout_batch()
    f = rb.flat()
    assert torch.equal(rb.to_groups(f.input_ids), rb.tokens)
    assert torch.equal(rb.to_groups(f.response_mask), rb.mask)
    x = torch.arange(6 * 10 * 2).reshape(6, 10, 2)  # a trailing axis is kept
    g = rb.to_groups(x)
    assert g.shape == (2, 3, 6, 2) and torch.equal(g[1, 2, 5], x[5, 9])
