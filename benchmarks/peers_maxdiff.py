"""Print the max relative difference of each varbench counterpart against the real peer
function (verl 0.9.1) over the random batches of tests/_fixtures_peers.py (the tests' seeds
0-2): the figures of docs/peers.md. Needs the peers extra (`make setup`).

    .venv/bin/python benchmarks/peers_maxdiff.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

SEEDS = (0, 1, 2)  # the seeds of tests/test_peers_verl.py

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _fixtures_peers import (  # noqa: E402
    TRL_LOSSES,
    opacus_case,
    rel_diff,
    trl_loss_case,
    verl_batch,
)
from verl.trainer.ppo import core_algos as core  # noqa: E402
from verl.workers.config import FSDPActorConfig  # noqa: E402

import varbench.estimators as E  # noqa: E402


def rows(b, dtype):
    args = {"token_level_rewards": b["tok"].clone(), "response_mask": b["mask"],
            "index": b["index"]}
    flat = (b["tok"], b["mask"], b["index"])
    for kw in ({}, {"norm_adv_by_std_in_grpo": False}, {"epsilon": 0.5}):
        yield f"compute_grpo_outcome_advantage{kw or ''}", \
            core.compute_grpo_outcome_advantage(**args, **kw)[0], \
            E.to_flat("normalized")(*flat, **kw)[0]
    for name, scheme in (("compute_rloo_outcome_advantage", "rloo"),
                         ("compute_opo_outcome_advantage", "opo"),
                         ("compute_reinforce_plus_plus_baseline_outcome_advantage",
                          "reinforce_pp_baseline")):
        yield name, getattr(core, name)(**args)[0], E.to_flat(scheme)(*flat)[0]
    st = {"old_log_probs": b["logp"], "sum_pi_squared": b["sum_pi_sq"],
          "rollout_is_weights": b["is_w"]}
    yield "compute_optimal_token_baseline_advantage", \
        core.compute_optimal_token_baseline_advantage(**args, **st)[0], \
        E.to_flat("otb")(*flat, **st)[0]
    gen = torch.Generator().manual_seed(1)
    lm = torch.randn(b["mask"].shape, generator=gen, dtype=dtype)
    for mode in E.AGGREGATION_MODES:
        yield f"agg_loss[{mode}]", core.agg_loss(lm, b["mask"], mode), \
            (E.aggregation_weights(b["mask"], mode, conventions="verl", dtype=dtype) * lm).sum()
    old = b["logp"]
    logp = old + torch.randn(old.shape, generator=gen, dtype=dtype) * 0.8 * b["mask"]
    adv = torch.randn(old.shape[0], 1, generator=gen, dtype=dtype) * 2 * b["mask"]
    cfg = FSDPActorConfig(strategy="fsdp", rollout_n=4, ppo_micro_batch_size_per_gpu=1,
                          clip_ratio=0.2, clip_ratio_c=3.0)
    yield "compute_policy_loss_vanilla (clip_ratio_c=3)", \
        core.compute_policy_loss_vanilla(old, logp, adv, b["mask"], config=cfg)[0], \
        E.policy_loss(logp, old, adv, b["mask"], clip_ratio_c=3.0, conventions="verl")[0]
    near = old + torch.randn(old.shape, generator=gen, dtype=dtype) * 0.05 * b["mask"]
    lp1, lp2 = (near.clone().requires_grad_() for _ in range(2))
    tadv = E.to_flat("otb")(*flat, old_log_probs=old, sum_pi_squared=b["sum_pi_sq"])[0]
    w, _ = core.compute_policy_loss_gspo(old, lp1, tadv, b["mask"], "token-mean", config=cfg)
    g, _ = E.policy_loss(lp2, old, tadv, b["mask"], clip=(0.2, 0.2), ratio="sequence-token",
                         conventions="verl")
    w.backward()
    g.backward()
    yield "compute_policy_loss_gspo (gradient)", lp1.grad, lp2.grad
    ref = -torch.rand(old.shape, generator=gen, dtype=dtype) * 4
    for kind in ("k1", "k2", "k3"):
        yield f"kl_penalty[{kind}]", core.kl_penalty(logp, ref, kind), \
            E.kl_penalty(logp, ref, kind, clamp=kind == "k3")


def trl_rows(tmp: Path):
    """TRL 1.16.0: its four losses (value and max over parameter gradients) on a real
    GRPOTrainer, and the advantages of a real one-step run for each scale_rewards."""
    import datasets
    import trl

    from varbench.integrations.trl import VarbenchCallback
    from varbench.models import build_preset

    def reward(completions, **kwargs):
        return [float(c.count("1")) - 0.5 * float(c.count("2")) for c in completions]

    def trainer(**kw):
        policy = build_preset("micro", seed=0)
        ds = datasets.Dataset.from_dict({"prompt": ["<sort>3,1,2", "<add>1+2="] * 8})
        args = trl.GRPOConfig(output_dir=str(tmp), per_device_train_batch_size=8,
                              num_generations=4, max_completion_length=6, max_steps=1,
                              report_to=[], save_strategy="no", use_cpu=True, seed=0, **kw)
        return trl.GRPOTrainer(model=policy.model, reward_funcs=reward, args=args,
                               train_dataset=ds, processing_class=policy.tokenizer)

    for loss_type in TRL_LOSSES:
        tr = trainer(loss_type=loss_type, bf16=False, epsilon=0.2, epsilon_high=0.28)
        ours, theirs, g_ours, g_theirs, _ = trl_loss_case(tr, loss_type)
        grad = max(rel_diff(a, b) for a, b in zip(g_ours, g_theirs, strict=True))
        yield f"GRPOTrainer._compute_loss[{loss_type}] (loss; gradients)", \
            rel_diff(ours, theirs.detach()), grad
    for scale, (scheme, kw) in {"group": ("normalized", {"eps": 1e-4}),
                                "batch": ("normalized_batch", {"eps": 1e-4}),
                                "none": ("centered", {})}.items():
        tr = trainer(scale_rewards=scale)
        cb = VarbenchCallback(every=1, measures=("counts",)).attach(tr)
        tr.train()
        b = cb._last
        R = b["rewards"].reshape(2, 4)
        m = torch.ones(2, 4, 1, dtype=torch.bool)
        want = E.advantages(scheme, R, m, **kw)[..., 0].reshape(-1)
        yield f"GRPOTrainer advantages, scale_rewards={scale!r} (f32 run)", \
            rel_diff(want, b["advantages"]), float("nan")


def main() -> None:
    table: dict[str, dict[torch.dtype, float]] = {}
    for dtype in (torch.float32, torch.float64):
        for seed in SEEDS:
            for name, want, got in rows(verl_batch(seed, dtype), dtype):
                d = rel_diff(got.detach(), want.detach())
                cell = table.setdefault(name, {})
                cell[dtype] = max(cell.get(dtype, 0.0), d)
    print("| verl 0.9.1 function | max rel diff f32 | max rel diff f64 |")
    print("|---|---|---|")
    for name, d in table.items():
        print(f"| {name} | {d[torch.float32]:.2g} | {d[torch.float64]:.2g} |")
    o32, t32 = opacus_case(torch.float32)
    o64, t64 = opacus_case(torch.float64)
    print(f"| opacus GradSampleModule grad_sample | {rel_diff(o32, t32):.2g} | "
          f"{rel_diff(o64, t64):.2g} |")
    import tempfile

    print("\n| TRL 1.16.0 | max rel diff (loss or advantages) | max rel diff (gradients) |")
    print("|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, a, g in trl_rows(Path(tmp)):
            print(f"| {name} | {a:.2g} | {g:.2g} |")


if __name__ == "__main__":
    main()
