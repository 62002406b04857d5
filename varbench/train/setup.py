"""What the training loop needs around it: config checks against the registries, the task and
policy a config names, scoring, held-out evaluation, and the KL term's aggregation.

Kept out of ``loop.py`` so that the loop reads top to bottom as the algorithm.
"""

from __future__ import annotations

import torch

from varbench._util.checks import UsageError, UsageTypeError, check_choice, check_device
from varbench._util.config import resolve_dtype
from varbench.estimators import AGGREGATION_MODES, aggregation_weights, schemes
from varbench.models import Policy
from varbench.rollout import RolloutBatch, sample
from varbench.tasks import Prompt, Task, get_task
from varbench.train.config import TrainConfig

EXACT = "exact"  # the exact-match reward every task defines (held-out accuracy)


def check_config(config: TrainConfig) -> None:
    """Validate the names a config takes from registries (scheme, aggregation mode, task)."""
    if not isinstance(config, TrainConfig):
        raise UsageTypeError(f"config must be a TrainConfig, got {type(config).__name__}")
    check_choice("scheme", config.scheme, schemes())
    check_choice("agg", config.agg, AGGREGATION_MODES)
    check_device("device", config.device)  # a typo or an absent GPU, before any work
    build_task(config)  # any task spec (name, MODULE:ATTR, data file), resolved before any work


def build_task(config: TrainConfig) -> tuple[Task, str]:
    """The task ``config.task`` names (any task spec) and its training reward name."""
    task = get_task(config.task, **dict(config.task_options))
    reward = task.check_reward(config.reward)
    if EXACT not in task.rewards:
        raise UsageError(
            f"task {config.task!r} has no {EXACT!r} reward (its rewards: {list(task.rewards)}); "
            "held-out accuracy needs an exact-match reward"
        )
    return task, reward


def policy_for(config: TrainConfig, task: Task) -> Policy:
    """The policy ``config.policy`` names, built by the one policy builder
    (:func:`varbench.train.policies.build_policy`): a preset is warm-started on ``task`` unless
    ``warm_start`` is false; a checkpoint directory is used as it is unless ``warm_start_dir``."""
    from varbench.train.policies import build_policy, is_checkpoint_dir

    is_dir = is_checkpoint_dir(config.policy)
    warm = config.warm_start_dir if is_dir else config.warm_start
    return build_policy(config.policy, task=task, warm=warm, seed=config.seed,
                        warm_seed=config.warm_start_seed,
                        trust_remote_code=config.trust_remote_code,
                        add_task_tokens=config.add_task_tokens)


def own_policy(policy: Policy, config: TrainConfig, task: Task,
               device: torch.device | str | None = None) -> Policy:
    """The policy the loop trains: a deep copy of a caller's ``policy`` (whose object is never
    changed) on ``device`` (default ``config.device``; data-parallel: the rank's own) in
    ``config.dtype`` ("auto": its own), bound to ``task``."""
    import copy

    from varbench.train.policies import prepare_for_task

    dtype = resolve_dtype(config.dtype, "dtype")
    if dtype is None and next(policy.model.parameters()).dtype == torch.float16:
        from varbench._util.checks import UsageError

        raise UsageError(f"dtype='auto' on {policy.name!r}, a float16 checkpoint, would train "
                         "in float16, which needs loss scaling; choose dtype='bfloat16' or "
                         "'float32'")
    device = config.device if device is None else device
    check_device("device", str(device), dtype=dtype)
    model = copy.deepcopy(policy.model).to(device=device, dtype=dtype)
    own = Policy(model=model, tokenizer=copy.deepcopy(policy.tokenizer), name=policy.name,
                 meta=copy.deepcopy(policy.meta))
    return prepare_for_task(own, task, add_task_tokens=config.add_task_tokens)


class MasterWeightAdamW:
    """AdamW whose parameters are float32 master copies of low-precision model parameters.

    ``grads_to_master()`` copies the model's gradients into the masters (float32) and returns
    the masters (clip their norm: computed in float32); ``step()`` updates the masters and
    rounds them into the model. ``state_dict()`` is AdamW's with each master under
    ``state[i]["master"]``, so checkpoints restore the float32 weights exactly.
    """

    def __init__(self, params, **kwargs) -> None:
        self.model_params = list(params)
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.model_params]
        self.opt = torch.optim.AdamW(self.master, **kwargs)
        self.param_groups = self.opt.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:
            p.grad = None
        self.opt.zero_grad(set_to_none=set_to_none)

    def grads_to_master(self) -> list[torch.Tensor]:
        for m, p in zip(self.master, self.model_params, strict=True):
            m.grad = None if p.grad is None else p.grad.detach().float()
        return self.master

    @torch.no_grad()
    def step(self) -> None:
        self.opt.step()
        for m, p in zip(self.master, self.model_params, strict=True):
            p.copy_(m)

    def state_dict(self) -> dict:
        sd = self.opt.state_dict()
        sd["state"] = {i: dict(sd["state"].get(i, {})) for i in range(len(self.master))}
        for i, m in enumerate(self.master):
            sd["state"][i]["master"] = m.detach().clone()
        return sd

    @torch.no_grad()
    def load_state_dict(self, sd: dict) -> None:
        sd = {**sd, "state": {k: dict(v) for k, v in sd["state"].items()}}
        for k, st in sd["state"].items():
            m = st.pop("master", None)
            if m is not None:
                self.master[int(k)].copy_(m)
                self.model_params[int(k)].copy_(m)
        sd["state"] = {k: v for k, v in sd["state"].items() if v}
        self.opt.load_state_dict(sd)


def make_optimizer(params, config: TrainConfig):
    """AdamW over ``params``, through float32 master weights when they are bf16/fp16.

    torch's fused AdamW kernel where it has one (CPU and CUDA): the same update as the
    per-tensor loop (tests/test_train_loop.py compares them in float64) in one kernel per
    tensor group instead of ~10 small ops per parameter tensor.
    """
    kwargs = dict(lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                  eps=config.adam_eps, weight_decay=config.weight_decay)
    params = list(params)
    if params and params[0].dtype in (torch.bfloat16, torch.float16):
        return MasterWeightAdamW(params, **kwargs, fused=_fusable(params))
    return torch.optim.AdamW(params, **kwargs, fused=_fusable(params))


def _fusable(params: list[torch.Tensor]) -> bool | None:
    """True when every parameter is a floating tensor on the CPU or CUDA (the devices of torch's
    fused AdamW), else None (torch's default choice)."""
    ok = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point()
                              for p in params)
    return True if ok else None


def grads_for_clipping(optimizer, params):
    """The tensors whose gradient norm is clipped and recorded: the float32 masters of a
    :class:`MasterWeightAdamW` (grads copied in now), else ``params``."""
    if isinstance(optimizer, MasterWeightAdamW):
        return optimizer.grads_to_master()
    return params


def score(task: Task, batch: RolloutBatch, prompts: list[Prompt], reward: str
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``([P, G] training reward, [P, G] exact match)`` of the batch's decoded responses, on the
    batch's device.

    A reward the sampler already computed (``batch.meta["reward"]``, in ``batch.rewards``) is
    taken from the batch instead of scoring the texts again.
    """
    P, G = batch.P, batch.G
    dev = batch.mask.device
    have = batch.meta.get("reward")

    def scored(name: str) -> torch.Tensor:
        if name == have:
            return batch.rewards.to(device=dev, dtype=torch.float32)
        vals = [task.score(prompts[p], batch.texts[p][i], name) for p in range(P)
                for i in range(G)]
        return torch.tensor(vals, dtype=torch.float32, device=dev).reshape(P, G)

    e = scored(EXACT)
    r = e if reward == EXACT else scored(reward)
    return r, e


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
                         temperature=config.temperature, reward=reward)
        r, e = score(task, sampled, prompts, reward)
        greedy = sample(policy, task, prompts, 1, seed=seed, greedy=True, reward=EXACT)
        _, g = score(task, greedy, prompts, reward)
    policy.model.train(was_training)
    return {"eval/acc_sampled": float(e.mean()), "eval/acc_greedy": float(g.mean()),
            "eval/reward_sampled": float(r.mean())}


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """``sum omega * per_token`` with the aggregation mode's weights (scalar)."""
    omega = aggregation_weights(mask, mode, dtype=per_token.dtype)
    return (omega * per_token).sum()
