"""Slow reference for varbench.train: the training step as it was before the throughput work,
written out plainly (one response at a time, the per-tensor AdamW loop).

Per step: draw (prompt seed, sample seed) from the run's generator; sample G responses; score
every decoded text again; advantages; ``epochs`` x ``minibatches`` updates whose log-probs come
from :func:`per_sequence_response_logprobs` (each response alone, padding dropped) and whose
``logp_old`` is the same, under no grad, before the first update (with one update, the update's
own detached values); clipped loss; gradient-norm clip; ``torch.optim.AdamW(foreach=False)``.
"""

from __future__ import annotations

import torch
from reference_rollout import per_sequence_response_logprobs

from varbench.estimators import advantages, policy_loss
from varbench.models import Policy
from varbench.rollout import sample
from varbench.train import setup
from varbench.train.config import TrainConfig


def reference_train_steps(config: TrainConfig, policy: Policy) -> torch.nn.Module:
    """The model after ``config.steps`` reference steps from a copy of ``policy`` (no KL term,
    no transform, no dynamic filter, constant lr without warmup: what it checks)."""
    assert config.kl_coef == 0 and config.transform == "none" and not config.dynamic_filter
    assert config.lr_schedule == "constant" and config.warmup_steps == 0
    task, reward = setup.build_task(config)
    pol = setup.own_policy(policy, config, task)
    model = pol.model
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                            eps=config.adam_eps, weight_decay=config.weight_decay, foreach=False)
    gen = torch.Generator().manual_seed(config.seed)
    clip = (config.clip_low, config.clip_high)
    for _ in range(config.steps):
        prompt_seed, sample_seed = torch.randint(0, 2**62, (2,), generator=gen).tolist()
        prompts = task.prompts(config.prompts_per_step, split="train", seed=prompt_seed)
        model.eval()
        batch = sample(pol, task, prompts, config.G, seed=sample_seed,
                       temperature=config.temperature)
        P, G = batch.P, batch.G
        r = torch.tensor([[task.score(prompts[p], batch.texts[p][i], reward) for i in range(G)]
                          for p in range(P)], dtype=torch.float32)
        mask = batch.mask.bool()
        adv = advantages(config.scheme, r, mask, logprobs=batch.logprobs,
                         sum_pi_sq=batch.sum_pi_sq, **dict(config.scheme_options))
        single = config.epochs == 1 and config.minibatches == 1
        old_all = None
        if not single:
            with torch.no_grad():
                old_all = per_sequence_response_logprobs(model, batch)
        model.train()
        keep = torch.arange(P)
        for _epoch in range(config.epochs):
            order = torch.randperm(P, generator=gen)
            for mb in order.chunk(config.minibatches):
                groups = keep[mb]
                logp = per_sequence_response_logprobs(model, batch)[groups]
                old = logp.detach() if old_all is None else old_all[groups]
                loss, _ = policy_loss(logp, old, adv[groups], mask[groups], config.agg,
                                      clip=clip, ratio=config.ratio)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
                opt.step()
        model.eval()
    return model
