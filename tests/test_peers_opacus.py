"""varbench's per-sequence gradients against the real Opacus (GradSampleModule) on a 2-layer
Llama: responses of unequal lengths, a padded row, float32 and float64."""

from __future__ import annotations

import pytest
import torch
from _fixtures_peers import TOL, rel_diff, require

opacus = require("opacus")

from varbench.grads.params import select_params  # noqa: E402
from varbench.grads.sequence import sequence_grads  # noqa: E402
from varbench.models import build_policy  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sequence_grads_match_opacus_grad_samples(dtype):
    model = build_policy("micro", seed=0, dtype=dtype, attn_implementation="eager").model
    gen = torch.Generator().manual_seed(0)
    B, L = 5, 9
    ids = torch.randint(4, 30, (B, L), generator=gen)
    attn = torch.ones(B, L, dtype=torch.long)
    resp = torch.zeros(B, L, dtype=dtype)
    resp[:, 4:] = 1
    resp[1, 7:] = 0  # a shorter response, right-padded
    attn[1, 7:] = 0
    resp[3, 5:] = 0
    ours = sequence_grads(model, ids, resp, attn)
    gsm = opacus.GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=False)
    gsm.train()  # Opacus records activations only in training mode (Llama has no dropout)
    logits = gsm(input_ids=ids, attention_mask=attn).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    (lp * resp[:, 1:]).sum().backward()
    params = dict(model.named_parameters())
    theirs = torch.cat([params[n].grad_sample.reshape(B, -1)
                        for n, _ in select_params(model, None)], 1)
    assert theirs.shape == ours.shape
    assert rel_diff(ours, theirs) <= TOL[dtype]
    gsm._close()
