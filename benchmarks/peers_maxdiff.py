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
from _fixtures_peers import rel_diff, verl_batch  # noqa: E402
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


if __name__ == "__main__":
    main()
