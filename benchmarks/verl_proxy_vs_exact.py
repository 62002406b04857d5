"""verl's variance proxy against exact per-sequence gradient norms (issue 28 point 5).

    python benchmarks/verl_proxy_vs_exact.py [--batches 4] [--figure FILE.png]

verl 0.9.1 logs ``variance_proxy/proxy2_total_power = mean_b Abar_b^2 W_b`` (``W_b`` the
logit-gradient proxy summed over the response). Here, on batches sampled by varbench from the
``tiny`` preset's supervised warm start on ``sort`` (single turn) and
``toolsum`` (multi-turn: tool tokens attended, not trained), advantages computed by verl's own
``compute_advantage`` (GRPO), and the DataProto verl would hold, each row's proxy is put beside
the exact ``||sum_t A_t grad log pi(y_t)||^2`` (ghost norms, checked against a per-row autograd
loop in tests/test_peers_verl.py). Prints per task the Spearman rank correlation over
rows and the scale ``mean exact / mean proxy`` (verl's number would have to be multiplied by it),
and draws the rows on log axes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def data_proto(batch, adv_estimator: str = "grpo"):
    """The DataProto verl's trainer holds after compute_advantage, from a varbench rollout."""
    import torch
    from verl import DataProto
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from varbench.estimators.adapters import outcome_to_token_rewards

    P, G, T = batch.tokens.shape
    Lp = batch.prompt_ids.shape[1]
    B = P * G
    real = (batch.mask + batch.env_mask).clamp(max=1)
    tok = outcome_to_token_rewards(batch.rewards.float(), batch.mask != 0).reshape(B, T)
    uid = np.repeat(np.array([f"p{p}" for p in range(P)], dtype=object), G)
    data = DataProto.from_dict(
        tensors={
            "prompts": batch.prompt_ids.unsqueeze(1).expand(P, G, Lp).reshape(B, Lp),
            "responses": batch.tokens.reshape(B, T).long(),
            "attention_mask": torch.cat([batch.prompt_mask.unsqueeze(1).expand(P, G, Lp),
                                         real], -1).reshape(B, Lp + T).long(),
            "response_mask": batch.mask.reshape(B, T).float(),
            "token_level_rewards": tok,
            "old_log_probs": batch.logprobs.reshape(B, T).float(),
            "sum_pi_squared": batch.sum_pi_sq.reshape(B, T).float(),
        },
        non_tensors={"uid": uid},
    )
    return compute_advantage(data, adv_estimator, config=AlgoConfig(adv_estimator=adv_estimator))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("-G", type=int, default=8)
    ap.add_argument("--figure", default="docs/figures/verl_proxy_vs_exact.png")
    a = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    from scipy.stats import spearmanr

    import varbench as vb
    from varbench.integrations.verl import verl_proxy_rows

    torch.set_num_threads(1)
    rows = []
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    print(f"verl variance_proxy vs exact norms: tiny preset, {a.batches} batches of "
          f"{a.prompts} prompts x G={a.G}, GRPO advantages by verl")
    print(f"{'task':<8} {'policy':<10} {'rows':>5} {'spearman':>9} {'scale exact/verl':>17}")
    for ax, task_name in zip(axes, ("sort", "toolsum"), strict=True):
        task = vb.get_task(task_name)
        for label in ("warm",):  # a random init scores 0 everywhere: no advantage, no row
            policy = vb.warm_start("tiny", task)
            px, ex = [], []
            for s in range(a.batches):
                batch = vb.sample(policy, task, task.prompts(a.prompts, seed=s), G=a.G, seed=s)
                r = verl_proxy_rows(data_proto(batch), policy.model)
                keep = r["proxy"] > 0  # rows with a non-zero advantage
                px.append(r["proxy"][keep])
                ex.append(r["exact"][keep])
            p, e = np.concatenate(px), np.concatenate(ex)
            rho = float(spearmanr(p, e).statistic)
            scale = float(e.mean() / p.mean())
            rows.append((task_name, label, len(p), rho, scale))
            print(f"{task_name:<8} {label:<10} {len(p):>5} {rho:>9.3f} {scale:>17.1f}")
            ax.loglog(p, e, ".", alpha=0.5, label=f"{label}: rho {rho:.2f}, x{scale:.0f}")
        lo = min(ax.get_xlim()[0], ax.get_ylim()[0])
        hi = max(ax.get_xlim()[1], ax.get_ylim()[1])
        ax.plot([lo, hi], [lo, hi], "k:", lw=0.8)
        ax.set(title=task_name, xlabel="verl proxy  Abar^2 W",
               ylabel="exact ||sum A grad log pi||^2")
        ax.legend(fontsize=8)
    fig.tight_layout()
    Path(a.figure).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.figure, dpi=110)
    print(f"figure: {a.figure}")


if __name__ == "__main__":
    main()
