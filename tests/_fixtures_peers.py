"""Random verl-layout batches for the peer tests (tests/test_peers_*.py).

One batch mixes every edge case at once: groups of unequal sizes (1 to 5) shuffled across
rows, tied rewards, an all-equal group, empty responses (mask all 0) and padding of varied
length. Rows are ``[B, T]``; the outcome reward sits on the last valid
token (verl's layout; on the last column for an empty row), so ``token_level_rewards.sum(-1)``
is the reward of every row.
"""

from __future__ import annotations

import importlib
import os

import numpy as np
import pytest
import torch

TOL = {torch.float32: 4.8e-7, torch.float64: 1e-15}
"""Max relative difference allowed against a peer (relative to max(1, |reference|))."""
TOL_SUMS = {torch.float32: 4.8e-7, torch.float64: 1e-14}
"""OTB: ratios of sums over up to G * T terms that the two libraries add in different orders
(cumsum and group sums), so float64 rounding reaches a few tens of ulps."""


def require(module: str):
    """Import a peer module; where ``VARBENCH_REQUIRE_PEERS=1`` (``make test``, CI) a missing peer
    fails the run instead of skipping it (a skipped peer test is not a passed one)."""
    if os.environ.get("VARBENCH_REQUIRE_PEERS") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module, reason="the peers extra is not installed")


def verl_batch(seed: int, dtype: torch.dtype, *, empty: bool = True) -> dict:
    """``{"tok", "mask", "index", "R", "logp", "sum_pi_sq", "is_w"}`` for ``B`` ~ 20 rows."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1, 2, 3, 4, 5, 4, 3]
    ids = np.concatenate([np.full(n, g) for g, n in enumerate(sizes)])
    ids = ids[torch.randperm(len(ids), generator=gen).numpy()]
    B, T = len(ids), 7
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    if empty:
        lengths[torch.randperm(B, generator=gen)[:2]] = 0
    mask = (torch.arange(T) < lengths.unsqueeze(-1)).to(dtype)
    R = torch.randint(0, 3, (B,), generator=gen).to(dtype) / 2  # ties
    R = R + torch.randn(B, generator=gen, dtype=dtype) * (torch.rand(B, generator=gen) < 0.5)
    R[ids == 3] = 0.75  # an all-equal group
    last = (lengths - 1).clamp(min=0).where(lengths > 0, torch.full_like(lengths, T - 1))
    tok = torch.zeros(B, T, dtype=dtype).scatter_(1, last.unsqueeze(-1), R.unsqueeze(-1))
    logp = -torch.rand(B, T, generator=gen, dtype=dtype) * 3 * mask
    sum_pi_sq = (0.05 + 0.95 * torch.rand(B, T, generator=gen, dtype=dtype)) * mask
    is_w = (0.5 + torch.rand(B, T, generator=gen, dtype=dtype)) * mask
    return {"tok": tok, "mask": mask, "index": ids, "R": R, "logp": logp,
            "sum_pi_sq": sum_pi_sq, "is_w": is_w}


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """``max |got - want| / max(1, max |want|)`` (0 for empty tensors)."""
    if want.numel() == 0:
        return 0.0
    scale = max(1.0, float(want.abs().max()))
    return float((got.to(want.dtype) - want).abs().max()) / scale


def opacus_case(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(varbench's sequence_grads, Opacus's grad samples) ``[B, P]`` on a 2-layer Llama:
    responses of unequal lengths, a right-padded row."""
    import opacus

    from varbench.grads.params import select_params
    from varbench.grads.sequence import sequence_grads
    from varbench.models import build_preset

    model = build_preset("micro", seed=0, dtype=dtype, attn_implementation="eager").model
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
    gsm._close()
    return ours, theirs


TRL_LOSSES = {  # TRL loss_type -> varbench aggregation mode, max_len (dr_grpo: the constant)
    "grpo": ("seq-mean-token-mean", None),
    "bnpo": ("token-mean", None),
    "dapo": ("token-mean", None),
    "dr_grpo": ("seq-mean-token-sum-norm", 6),
}


def trl_loss_case(trainer, loss_type: str):
    """TRL's own ``_compute_loss`` and varbench's ``policy_loss`` on the same log-probs of a
    batch with an empty completion and padding: ``(ours, theirs, grads_ours, grads_theirs,
    (logp, old, adv, mask))``. The trainer was built with ``loss_type``, epsilon 0.2 / 0.28 and
    ``max_completion_length=6``."""
    from varbench.estimators import policy_loss

    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model.train()
    gen = torch.Generator().manual_seed(0)
    B, Lp, T = 8, 4, 6
    prompt_ids = torch.randint(4, 30, (B, Lp), generator=gen)
    completion_ids = torch.randint(4, 30, (B, T), generator=gen)
    lengths = torch.tensor([6, 3, 0, 5, 6, 1, 4, 2])
    cmask = (torch.arange(T) < lengths[:, None]).long()
    ids = torch.cat([prompt_ids, completion_ids], 1)
    attn = torch.cat([torch.ones(B, Lp, dtype=torch.long), cmask], 1)
    with torch.no_grad():
        logp0, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, attn, T)
    old = logp0 + 0.3 * torch.randn(B, T, generator=gen)  # ratios away from 1: clipping bites
    adv = torch.randn(B, generator=gen)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": torch.ones(B, Lp, dtype=torch.long),
              "completion_ids": completion_ids, "completion_mask": cmask, "advantages": adv,
              "old_per_token_logps": old, "num_items_in_batch": cmask.sum()}
    params = [p for p in model.parameters() if p.requires_grad]
    theirs = trainer._compute_loss(model, inputs)
    g_theirs = torch.autograd.grad(theirs, params)
    logp, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, attn, T)
    mode, max_len = TRL_LOSSES[loss_type]
    A = adv[:, None].expand(B, T)
    ours, _ = policy_loss(logp, old, A, cmask, mode, clip=(0.2, 0.28), max_len=max_len)
    g_ours = torch.autograd.grad(ours, params)
    return ours, theirs, g_ours, g_theirs, (logp.detach(), old, A, cmask)
