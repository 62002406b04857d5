"""varbench.estimators.aggregation: the per-token weights of each aggregation mode."""

from __future__ import annotations

import pytest
import torch
from _fixtures_estimators import loss_inputs
from reference_estimators import ref_aggregation_weights

import varbench.estimators as E


@pytest.mark.parametrize("mode", E.AGGREGATION_MODES)
@pytest.mark.parametrize("seed", range(3))
def test_aggregation_matches_loop(mode, seed):
    _, _, _, mask = loss_inputs(seed)
    got = E.aggregation_weights(mask.double(), mode, max_len=7 if seed else None)
    torch.testing.assert_close(got, ref_aggregation_weights(mask, mode, 7 if seed else None))


def test_aggregation_golden():
    # Two sequences of lengths 2 and 3 (T = 4): total 5 tokens, B = 2.
    mask = torch.tensor([[[1, 1, 0, 0], [1, 1, 1, 0]]], dtype=torch.float64)
    w = E.aggregation_weights(mask, "token-mean")
    assert w[0, 0].tolist() == [1 / 5, 1 / 5, 0, 0]
    w = E.aggregation_weights(mask, "seq-mean-token-mean")
    assert w[0, 0].tolist() == [1 / 4, 1 / 4, 0, 0]  # 1 / (B |o| ) = 1 / (2 * 2)
    assert w[0, 1].tolist() == [1 / 6, 1 / 6, 1 / 6, 0]  # 1 / (2 * 3)
    assert E.aggregation_weights(mask, "seq-mean-token-sum")[0, 1, 0].item() == 1 / 2
    assert E.aggregation_weights(mask, "seq-mean-token-sum-norm")[0, 1, 0].item() == 1 / 8
    assert E.aggregation_weights(mask, "seq-mean-token-sum-norm", max_len=10)[0, 1, 0] == 1 / 20


def test_aggregation_errors():
    with pytest.raises(ValueError, match="mode='mean'.*token-mean"):
        E.aggregation_weights(torch.ones(1, 1, 2), "mean")
    with pytest.raises(ValueError, match="max_len=0"):
        E.aggregation_weights(torch.ones(1, 1, 2), "seq-mean-token-sum-norm", max_len=0)
    with pytest.raises(ValueError, match="no valid token"):
        E.aggregation_weights(torch.zeros(1, 1, 2), "token-mean")


@pytest.mark.parametrize("conventions", ["varbench", "verl"])
@pytest.mark.parametrize("mode", E.AGGREGATION_MODES)
def test_per_group_equals_one_call_per_group(mode, conventions):
    """``per_group=True`` on ``[M, G, T]`` is bitwise one call per ``mask[m : m + 1]`` (the
    variance analysis's M groups in one pass, one check)."""
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(4, 3, 5, generator=g) > 0.4).double()
    mask[1, 2] = 0  # an empty response (verl drops it from its group's count)
    mask[2, :, 0] = 1
    kw = dict(max_len=7, dtype=torch.float64, conventions=conventions)
    want = torch.cat([E.aggregation_weights(mask[m : m + 1], mode, **kw) for m in range(4)])
    assert torch.equal(E.aggregation_weights(mask, mode, per_group=True, **kw), want)
    if mode == "token-mean":
        mask[3] = 0
        with pytest.raises(ValueError, match="no valid token in some group"):
            E.aggregation_weights(mask, mode, per_group=True, **kw)
    with pytest.raises(ValueError, match="per_group"):
        E.aggregation_weights(torch.ones(5), mode, per_group=True)
