"""varbench.train.setup: what the loop needs around it (config checks, the task and policy a
config names, scoring, held-out evaluation, the KL term's aggregation)."""

from __future__ import annotations

import pytest
import torch
from _fixtures_grads import rollout_batch

from varbench._util.checks import UsageError, UsageTypeError
from varbench.models import build_preset, save_policy
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


def test_policy_for_warm_starts_presets_only(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(policies, "build_policy",
                        lambda spec, **kw: calls.append((str(spec), kw)) or "policy")
    task = SortTask()
    assert setup.policy_for(TrainConfig(policy="micro", seed=3, warm_start_seed=5), task) == \
        "policy"
    assert calls[-1] == ("micro", {"task": task, "warm": True, "seed": 3, "warm_seed": 5,
                                   "trust_remote_code": False, "add_task_tokens": False})
    setup.policy_for(TrainConfig(policy="micro", warm_start=False), task)
    assert calls[-1][1]["warm"] is False
    ck = save_policy(build_preset("micro"), tmp_path / "ck")
    setup.policy_for(TrainConfig(policy=str(ck), warm_start=True), task)
    assert calls[-1][0] == str(ck) and calls[-1][1]["warm"] is False  # used as it is
    setup.policy_for(TrainConfig(policy=str(ck), warm_start_dir=True, add_task_tokens=True),
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


def test_master_weight_adamw_keeps_updates_bf16_would_round_away():
    """Updates of 1e-4 on a weight of 1 vanish in bfloat16 (spacing 2**-7 there); the float32
    masters accumulate them and the model follows once they add up."""
    cfg = TrainConfig(lr=1e-4, adam_beta1=0.0, adam_beta2=0.0)
    w16 = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    plain = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = setup.make_optimizer([w16], cfg)
    ref = torch.optim.AdamW([plain], lr=1e-4, betas=(0.0, 0.0), weight_decay=0.0)
    assert isinstance(opt, setup.MasterWeightAdamW)
    for _ in range(100):
        for p, o in ((w16, opt), (plain, ref)):
            o.zero_grad()
            (-p.float().sum()).backward()  # gradient -1: Adam steps by +lr each time
        masters = setup.grads_for_clipping(opt, [w16])
        assert masters[0].dtype == torch.float32 and torch.equal(masters[0].grad, -torch.ones(4))
        opt.step()
        ref.step()
    assert torch.equal(plain.detach(), torch.ones(4, dtype=torch.bfloat16))  # rounded away
    assert torch.allclose(opt.master[0], torch.full((4,), 1.01), atol=1e-5)
    assert torch.equal(w16.detach(), opt.master[0].to(torch.bfloat16))
    # state_dict carries the masters: a fresh optimizer resumes them exactly
    other = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    again = setup.make_optimizer([other], cfg)
    again.load_state_dict(opt.state_dict())
    assert torch.equal(again.master[0], opt.master[0]) and torch.equal(other, w16)
    assert type(setup.make_optimizer([torch.nn.Parameter(torch.ones(2))], cfg)) is \
        torch.optim.AdamW


def test_train_never_changes_the_callers_policy_and_trains_bf16():
    from varbench.train.loop import train

    pol = build_preset("micro", seed=1)
    before = {k: v.clone() for k, v in pol.model.state_dict().items()}
    cfg = TrainConfig(policy="micro", warm_start=False, reward="positional", steps=2,
                      eval_every=2, eval_prompts=4, eval_samples=1, G=4, prompts_per_step=4,
                      lr=1e-2, dtype="bfloat16", seed=0)
    res = train(cfg, policy=pol, progress=False)
    assert res.policy is not pol and res.policy.model is not pol.model
    assert next(res.policy.model.parameters()).dtype == torch.bfloat16
    after = pol.model.state_dict()
    assert all(v.dtype == torch.float32 and torch.equal(v, after[k]) for k, v in before.items())
    trained = res.policy.model.state_dict()
    assert any(not torch.equal(v.to(torch.bfloat16), trained[k]) for k, v in before.items())
    assert res.records["grad/norm"].dropna().gt(0).any()  # a step with informative groups
    with pytest.raises(UsageError, match="float16.*loss scaling"):
        TrainConfig(dtype="float16")


def test_dtype_auto_on_a_float16_checkpoint_is_refused_like_explicit_float16():
    """issue 29: 'auto' trained a float16 checkpoint in float16, which explicit float16 refuses
    (no loss scaling)."""
    from varbench.train.config import TrainConfig

    pol = build_preset("micro", seed=0)
    pol.model.to(torch.float16)
    with pytest.raises(UsageError, match=r"dtype='auto' on .*float16 checkpoint.*loss scaling"):
        setup.own_policy(pol, TrainConfig(dtype="auto", task="sort"), SortTask())
    with pytest.raises(UsageError, match="float16.*loss scaling"):
        TrainConfig(dtype="float16")
