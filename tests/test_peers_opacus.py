"""varbench's per-sequence gradients against the real Opacus (GradSampleModule) on a 2-layer
Llama: responses of unequal lengths, a padded row, float32 and float64."""

from __future__ import annotations

import pytest
import torch
from _fixtures_peers import TOL, opacus_case, rel_diff, require

require("opacus")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sequence_grads_match_opacus_grad_samples(dtype):
    ours, theirs = opacus_case(dtype)
    assert theirs.shape == ours.shape
    assert rel_diff(ours, theirs) <= TOL[dtype]
