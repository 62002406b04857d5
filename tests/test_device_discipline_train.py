"""Device discipline of the sampler and the training loop (issue 16), without a GPU.

Inside ``strict_device()`` every tensor made without an explicit device lands on ``meta``: a
mix with the (CPU) model raises, so passing means every tensor follows the model's device. The
model is built before entering the context; results must equal those of a run outside it.
``HostSyncs`` counts host syncs per varbench call site: under rollout/ and train/ no site may
sync more often when the same number of steps processes more tokens (more responses per prompt,
more prompts); a constant number per step is allowed, one per token or per response is not.
"""

from __future__ import annotations

import pytest
import torch
from _devicecheck import HostSyncs, growing_sites, strict_device
from _fixtures_arch import build

from varbench.models import Policy, build_tokenizer
from varbench.rollout import sample
from varbench.tasks import get_task
from varbench.train.config import TrainConfig
from varbench.train.loop import train

pytestmark = pytest.mark.usefixtures("one_thread")

ARCHS = ("llama", "qwen2")  # gemma2's transformers forward fails under a meta default device


def policy(arch: str) -> Policy:
    return Policy(model=build(arch, seed=0, attn="sdpa"), tokenizer=build_tokenizer(),
                  name=arch)


def same_batch(a, b) -> None:
    for name in ("tokens", "mask", "env_mask", "logprobs", "sum_pi_sq", "entropy", "rewards"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=0, atol=0,
                                   msg=name)
    assert a.texts == b.texts


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("task_name", ["sort", "toolsum"])
def test_sampler_under_strict_device_equals_plain(arch, task_name):
    pol, task = policy(arch), get_task(task_name)
    prompts = task.prompts(3, seed=1)
    want = sample(pol, task, prompts, 4, seed=5)
    with strict_device():
        got = sample(pol, task, prompts, 4, seed=5)
    same_batch(got, want)
    assert got.tokens.device.type == "cpu"
    if task_name == "toolsum":  # the environment loop really ran
        assert got.env_mask.sum() > 0


def _config(**kw) -> TrainConfig:
    return TrainConfig(**{**dict(policy="tiny", warm_start=False, G=4, prompts_per_step=2,
                                 steps=3, lr=1e-3, eval_every=2, eval_prompts=2,
                                 eval_samples=2, seed=3, reward="positional"), **kw})


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("extra", [{}, {"epochs": 2, "minibatches": 2, "kl_coef": 0.1}],
                         ids=["single-update", "ppo-kl"])
def test_training_steps_under_strict_device_equal_plain(arch, extra):
    pol = policy(arch)
    cfg = _config(**extra)
    want = train(cfg, policy=pol, progress=False)
    with strict_device():
        got = train(cfg, policy=pol, progress=False)
    num = [c for c in want.records.columns if not c.startswith("time/")]
    assert want.records["grad/norm"].iloc[1:].gt(0).sum() >= 2  # updates happened
    for c in num:
        torch.testing.assert_close(torch.tensor(got.records[c].to_numpy()),
                                   torch.tensor(want.records[c].to_numpy()),
                                   rtol=0, atol=0, equal_nan=True, msg=c)
    for a, b in zip(got.policy.model.parameters(), want.policy.model.parameters(),
                    strict=True):
        assert a.device.type == "cpu"
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _count(fn) -> HostSyncs:
    with HostSyncs() as h:
        fn()
    return h


@pytest.mark.parametrize("task_name", ["sort", "toolsum"])
def test_sampler_host_syncs_do_not_grow_with_responses(task_name):
    pol, task = policy("llama"), get_task(task_name)
    prompts = task.prompts(4, seed=2)
    # the same number of decode steps (max_new_tokens), 4x the responses
    small = _count(lambda: sample(pol, task, prompts[:2], 2, seed=0, max_new_tokens=12))
    large = _count(lambda: sample(pol, task, prompts, 4, seed=0, max_new_tokens=12))
    assert small.total("rollout/") > 0  # the counter sees the sampler's syncs at all
    assert growing_sites(small, large, prefix="rollout/") == {}


def test_training_host_syncs_do_not_grow_with_tokens():
    pol = policy("llama")
    small = _count(lambda: train(_config(G=2, prompts_per_step=2), policy=pol,
                                 progress=False))
    large = _count(lambda: train(_config(G=8, prompts_per_step=4), policy=pol,
                                 progress=False))
    assert small.total("train/") > 0
    grown = {**growing_sites(small, large, prefix="train/"),
             **growing_sites(small, large, prefix="rollout/")}
    assert grown == {}
