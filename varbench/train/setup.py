"""What the training loop needs around it: config checks against the registries, the task and
policy a config names, scoring, held-out evaluation, and the KL term's aggregation.

Kept out of ``loop.py`` so that the loop reads top to bottom as the algorithm.
"""

from __future__ import annotations

import torch

from varbench._util.checks import UsageError, UsageTypeError, check_choice, check_device
from varbench.estimators import AGGREGATION_MODES, aggregation_weights, schemes
from varbench.models import Policy
from varbench.rollout import RolloutBatch, sample
from varbench.tasks import Prompt, Task, get_task, task_names
from varbench.train.config import TrainConfig

EXACT = "exact"  # the exact-match reward every task defines (held-out accuracy)


def check_config(config: TrainConfig) -> None:
    """Validate the names a config takes from registries (scheme, aggregation mode, task)."""
    if not isinstance(config, TrainConfig):
        raise UsageTypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    check_choice("scheme", config.scheme, schemes())
    check_choice("agg", config.agg, AGGREGATION_MODES)
    check_choice("task", config.task, task_names())
    check_device("device", config.device)  # a typo or an absent GPU, before any work


def build_task(config: TrainConfig) -> tuple[Task, str]:
    """The task of ``config`` and its training reward name (validated)."""
    task = get_task(config.task, **dict(config.task_options))
    reward = task.check_reward(config.reward)
    if EXACT not in task.rewards:
        raise UsageError(
            f"task {config.task!r} has no {EXACT!r} reward (its rewards: {list(task.rewards)}); "
            "held-out accuracy needs an exact-match reward"
        )
    return task, reward


def build_policy(config: TrainConfig, task: Task) -> Policy:
    """The policy ``config.policy`` names (a preset is warm-started on ``task`` unless
    ``warm_start`` is false; a checkpoint directory is used as it is)."""
    from varbench.train.policies import build_policy as build
    from varbench.train.policies import is_checkpoint_dir

    warm = config.warm_start and not is_checkpoint_dir(config.policy)
    return build(config.policy, task=task, warm=warm, seed=config.seed,
                 warm_seed=config.warm_start_seed)


def score(task: Task, batch: RolloutBatch, prompts: list[Prompt], reward: str
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``([P, G] training reward, [P, G] exact match)`` of the batch's decoded responses, on the
    batch's device."""
    P, G = batch.P, batch.G
    r = torch.zeros(P, G)
    e = torch.zeros(P, G)
    for p in range(P):
        for i in range(G):
            text = batch.texts[p][i]
            e[p, i] = task.score(prompts[p], text, EXACT)
            r[p, i] = e[p, i] if reward == EXACT else task.score(prompts[p], text, reward)
    dev = batch.mask.device
    return r.to(dev), e.to(dev)


def evaluate(policy: Policy, task: Task, prompts: list[Prompt], reward: str,
             config: TrainConfig, seed: int) -> dict[str, float]:
    """Held-out exact-match accuracy (sampled and greedy) and the sampled training reward.

    The sampled accuracy averages ``config.eval_samples`` temperature-1 responses per prompt,
    drawn with the fixed ``seed`` so that every evaluation of a run (and every run) sees the
    same random stream: differences between steps and schemes are paired.
    """
    was_training = policy.model.training
    policy.model.eval()
    with torch.no_grad():
        sampled = sample(policy, task, prompts, config.eval_samples, seed=seed,
                         temperature=config.temperature)
        r, e = score(task, sampled, prompts, reward)
        greedy = sample(policy, task, prompts, 1, seed=seed, greedy=True)
        _, g = score(task, greedy, prompts, reward)
    policy.model.train(was_training)
    return {"eval/acc_sampled": float(e.mean()), "eval/acc_greedy": float(g.mean()),
            "eval/reward_sampled": float(r.mean())}


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """``sum omega * per_token`` with the aggregation mode's weights (scalar)."""
    omega = aggregation_weights(mask, mode, dtype=per_token.dtype)
    return (omega * per_token).sum()
