"""varbench against the real TRL 1.16.0: a real GRPOTrainer run on CPU with varbench's callback
(records rendered by the report writer), TRL's group-scaled advantages from that run against
varbench's schemes, and the subclass hook that puts varbench's advantages into TRL."""

from __future__ import annotations

import pytest
import torch
from _fixtures_peers import TRL_LOSSES, rel_diff, require, trl_loss_case

trl = require("trl")
datasets = require("datasets")

import varbench.estimators as E  # noqa: E402
from varbench.integrations.trl import VarbenchCallback, with_varbench_advantages  # noqa: E402
from varbench.models import build_policy  # noqa: E402
from varbench.report import write_report  # noqa: E402


def _reward(completions, **kwargs):
    return [float(c.count("1")) - 0.5 * float(c.count("2")) for c in completions]


def _trainer(tmp_path, cls=None, scale_rewards="group", steps=2, **config):
    policy = build_policy("micro", seed=0)
    tok = policy.tokenizer
    ds = datasets.Dataset.from_dict({"prompt": ["<sort>3,1,2", "<add>1+2=", "<sort>2,2,1",
                                                "<sum>4:"] * 4})
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, max_steps=steps, learning_rate=1e-3, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, seed=0, scale_rewards=scale_rewards,
        temperature=1.0, dataloader_num_workers=0, **config,
    )
    cls = cls or trl.GRPOTrainer
    return cls(model=policy.model, reward_funcs=_reward, args=args, train_dataset=ds,
               processing_class=tok)


def test_grpo_trainer_run_with_varbench_callback_renders_a_report(tmp_path):
    trainer = _trainer(tmp_path)
    cb = VarbenchCallback(every=1, sketch_dim=8, proxy_rows=3).attach(trainer)
    trainer.train()
    metrics = {r["metric"] for r in cb.records}
    assert {"groups", "all_agree_groups", "nonzero_raw", "nonzero_centered",
            "grad_var_split", "proxy_exact_corr"} <= metrics, metrics
    steps = {r["step"] for r in cb.records}
    assert steps == {1, 2}
    by = {(r["step"], r["metric"]): r["value"] for r in cb.records}
    assert by[(1, "groups")] == 2 and by[(1, "responses")] == 8
    assert by[(1, "grad_var_split")] >= 0
    assert -1 <= by[(1, "proxy_exact_corr")] <= 1
    logged = [h for h in trainer.state.log_history if "varbench/groups" in h]
    assert len(logged) == 2  # beside TRL's own logs
    out = write_report([cb.result()], tmp_path / "report")
    text = (out / "report.md").read_text()
    assert "grad_var_split" in text and "trl run" in text


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_trl_advantages_of_a_real_run_match_varbench(tmp_path, scale):
    """TRL's advantages of the batch its trainer generated = varbench's scheme on the same
    rewards: group -> normalized(eps=1e-4), batch -> normalized_batch(eps=1e-4), none ->
    centered."""
    trainer = _trainer(tmp_path, scale_rewards=scale, steps=1)
    cb = VarbenchCallback(every=1, measures=("counts",)).attach(trainer)
    trainer.train()
    b = cb._last
    R = b["rewards"].reshape(2, 4).double()
    mask = b["completion_mask"].reshape(2, 4, -1).bool() | True  # TRL: outcome per completion
    scheme, kw = {"group": ("normalized", {"eps": 1e-4}),
                  "batch": ("normalized_batch", {"eps": 1e-4}),
                  "none": ("centered", {})}[scale]
    want = E.advantages(scheme, R, mask, **kw)[..., 0].reshape(-1)
    got = b["advantages"].double()
    assert (got - want).abs().max() <= 4.8e-7 * max(1.0, float(want.abs().max()))


def test_subclass_hook_puts_varbench_advantages_into_trl(tmp_path):
    cls = with_varbench_advantages(trl.GRPOTrainer, "rloo")
    trainer = _trainer(tmp_path, cls=cls, steps=1)
    cb = VarbenchCallback(every=1, measures=("counts",)).attach(trainer)
    trainer.train()
    b = cb._last
    mask = b["completion_mask"].reshape(2, 4, -1)
    want = E.advantages("rloo", b["rewards"].reshape(2, 4).float(), mask)
    assert b["advantages"].shape == mask.reshape(8, -1).shape
    torch.testing.assert_close(b["advantages"].float(), want.reshape(8, -1), rtol=0, atol=0)


@pytest.mark.parametrize("loss_type", list(TRL_LOSSES))
def test_trl_losses_and_gradients_match_varbench_policy_loss(tmp_path, loss_type):
    """TRL's own _compute_loss on a batch with an empty completion and padding, against
    policy_loss on the same log-probs: loss and every parameter gradient."""
    trainer = _trainer(tmp_path, steps=1, loss_type=loss_type, bf16=False, epsilon=0.2,
                       epsilon_high=0.28)
    ours, theirs, g_ours, g_theirs, (logp, old, A, mask) = trl_loss_case(trainer, loss_type)
    assert rel_diff(ours, theirs.detach()) <= 4.8e-7
    for a, b in zip(g_ours, g_theirs, strict=True):
        assert rel_diff(a, b) <= 4.8e-7
    if loss_type == "dr_grpo":  # the constant is TRL's max_completion_length, not the width
        wide, _ = E.policy_loss(logp, old, A, mask, TRL_LOSSES[loss_type][0], clip=(0.2, 0.28),
                                max_len=12)
        assert rel_diff(wide, theirs.detach()) > 1e-3
