"""varbench.train.setup: what the loop needs around it (config checks, the task and policy a
config names, scoring, held-out evaluation, the KL term's aggregation)."""

from __future__ import annotations

import pytest
import torch
from _fixtures_grads import rollout_batch

from varbench._util.checks import UsageError, UsageTypeError
from varbench.models import build_policy as build_preset
from varbench.models import save_policy
from varbench.tasks import Prompt
from varbench.tasks.sort import SortTask
from varbench.train import policies, setup
from varbench.train.config import TrainConfig

pytestmark = pytest.mark.usefixtures("one_thread")


def test_check_config():
    setup.check_config(TrainConfig())
    with pytest.raises(UsageTypeError, match="config must be a TrainConfig, got dict"):
        setup.check_config({"scheme": "otb"})
    with pytest.raises(UsageError, match=r"scheme='nope' is not valid.*'centered'"):
        setup.check_config(TrainConfig(scheme="nope"))
    with pytest.raises(UsageError, match=r"agg='mean' is not valid.*'token-mean'"):
        setup.check_config(TrainConfig(agg="mean"))


def test_build_task(monkeypatch):
    task, reward = setup.build_task(TrainConfig(task="sort", task_options={"n": 2}))
    assert task.name == "sort" and task.knobs["n"] == 2 and reward == task.rewards[0]
    _, reward = setup.build_task(TrainConfig(task="sort", reward="positional"))
    assert reward == "positional"
    with pytest.raises(UsageError, match=r"reward='bogus'"):
        setup.build_task(TrainConfig(reward="bogus"))

    class NoExact(SortTask):
        rewards = ("positional",)

    monkeypatch.setattr(setup, "get_task", lambda name, **kw: NoExact(**kw))
    with pytest.raises(UsageError, match=r"has no 'exact' reward.*\['positional'\]"):
        setup.build_task(TrainConfig(task="sort", reward="positional"))


def test_build_policy_warm_starts_presets_only(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(policies, "build_policy",
                        lambda spec, **kw: calls.append((str(spec), kw)) or "policy")
    task = SortTask()
    assert setup.build_policy(TrainConfig(policy="micro", seed=3, warm_start_seed=5), task) == \
        "policy"
    assert calls[-1] == ("micro", {"task": task, "warm": True, "seed": 3, "warm_seed": 5,
                                   "trust_remote_code": False, "add_task_tokens": False})
    setup.build_policy(TrainConfig(policy="micro", warm_start=False), task)
    assert calls[-1][1]["warm"] is False
    ck = save_policy(build_preset("micro"), tmp_path / "ck")
    setup.build_policy(TrainConfig(policy=str(ck), warm_start=True), task)
    assert calls[-1][0] == str(ck) and calls[-1][1]["warm"] is False  # used as it is
    setup.build_policy(TrainConfig(policy=str(ck), warm_start_dir=True, add_task_tokens=True),
                       task)
    assert calls[-1][1]["warm"] is True and calls[-1][1]["add_task_tokens"] is True


def test_score_reads_the_decoded_responses():
    task = SortTask(n=2)
    prompts = [Prompt("<sort>31=", "13", {"data": (3, 1)}),
               Prompt("<sort>20=", "02", {"data": (2, 0)})]
    rb = rollout_batch(P=2, G=3)
    rb.texts = [["13", "31", "1"], ["02", "00", "20"]]
    r, e = setup.score(task, rb, prompts, "positional")
    assert e.tolist() == [[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    want = [[task.score(prompts[p], rb.texts[p][i], "positional") for i in range(3)]
            for p in range(2)]
    assert r.tolist() == want and r.tolist() != e.tolist()
    r2, e2 = setup.score(task, rb, prompts, "exact")
    assert torch.equal(r2, e2) and torch.equal(e2, e)
    assert r.device == rb.mask.device


def test_evaluate_is_paired_by_seed_and_restores_training_mode():
    policy = build_preset("micro", seed=0)
    policy.model.train()
    task = SortTask(n=2)
    prompts = task.prompts(3, split="heldout", seed=0)
    cfg = TrainConfig(eval_samples=2)
    a = setup.evaluate(policy, task, prompts, "positional", cfg, seed=11)
    assert policy.model.training  # restored
    assert set(a) == {"eval/acc_sampled", "eval/acc_greedy", "eval/reward_sampled"}
    assert all(0.0 <= v for v in a.values()) and a["eval/acc_sampled"] <= 1.0
    assert a["eval/reward_sampled"] > 0  # positional: random digits match some positions
    policy.model.eval()
    assert setup.evaluate(policy, task, prompts, "positional", cfg, seed=11) == a
    assert not policy.model.training


def test_aggregate_by_hand():
    mask = torch.tensor([[[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]], dtype=torch.float64)
    x = torch.tensor([[[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]]], dtype=torch.float64)
    assert setup.aggregate(x, mask, "token-mean").item() == pytest.approx((1 + 2 + 3) / 3)
    assert setup.aggregate(x, mask, "seq-mean-token-mean").item() == pytest.approx(
        ((1 + 2) / 2 + 3 / 1) / 2)
    assert setup.aggregate(x, mask, "seq-mean-token-sum").item() == pytest.approx((3 + 3) / 2)
