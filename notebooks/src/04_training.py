# %% [md]
# # 04 · Training runs, and does measured variance predict them?
#
# Variance reports are a prediction: a scheme and group size with lower variance per sampled
# token should reach a given held-out accuracy with fewer sampled tokens. This notebook checks
# that prediction on a small scale. It trains the warm-started `tiny` policy on `sort` with the
# GRPO/PPO loop of docs/science.md section 7 for several scheme x G cells at the **same budget of sampled
# tokens**, judges each run on fixed held-out prompts (never the training loss), and sets the
# realised tokens-to-threshold beside the warm start's variance x tokens for the same cells.
#
# The headline claim behind it (docs/science.md section 8) is that OTB with a small group matches large
# group baselines with far fewer sampled tokens. A notebook-sized run cannot settle that; it
# shows the workflow and how wide the uncertainty is. `varbench validate` runs the full grid.

# %%
import os

FAST = os.environ.get("VARBENCH_NOTEBOOK_FAST") == "1"  # the test suite's small setting

import time
import warnings

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from IPython.display import Markdown, display

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets
from varbench.analysis import estimator_variance
from varbench.tasks import get_task
from varbench.train import TrainConfig, train, warm_start
from varbench.analysis.validate_stats import (
    cell_table,
    rank_correlation_ci,
    t2t_table,
    threshold_of,
)

# After the varbench imports: its report layer selects the headless Agg backend when imported.
%matplotlib inline
torch.set_num_threads(1)  # tiny models gain nothing from more threads on a shared CPU
T_START = time.perf_counter()

CELLS = [("centered", 8), ("normalized", 8), ("rloo", 4), ("otb", 4)]
if not FAST:
    CELLS += [("centered", 4), ("otb", 8)]
SEEDS = (0,) if FAST else (0, 1)
BUDGET = 3000 if FAST else 8000        # sampled (policy) tokens per run
EVAL_PROMPTS = 32 if FAST else 64      # fixed held-out prompts
THRESHOLD_FRAC = 0.3                   # threshold = acc0 + 0.3 * (1 - acc0)
BASE = dict(task="sort", policy="tiny", prompts_per_step=8, lr=1e-3, agg="token-mean",
            steps=100_000, token_budget=BUDGET, eval_prompts=EVAL_PROMPTS, eval_samples=4)
print(f"FAST={FAST}: {len(CELLS)} cells x {len(SEEDS)} seed(s), {BUDGET} tokens per run")

# %% [md]
# ## Train every cell at the same token budget
#
# All runs start from the same cached warm start and are judged on the same held-out prompts
# with the same evaluation random stream, so differences between runs are paired. Evaluations
# are spaced by sampled responses (every 128), i.e. equally in tokens whatever G is.

# %%
task = get_task("sort", n=3)
warm_start("tiny", task, seed=0, progress=False)  # build (or load) the shared starting point
curves, records = [], {}
for scheme, G in CELLS:
    for seed in SEEDS:
        cfg = TrainConfig(**BASE, scheme=scheme, G=G, seed=seed,
                          eval_every=max(1, 128 // (BASE["prompts_per_step"] * G)))
        t0 = time.perf_counter()
        out = train(cfg, progress=False)
        df = out.records
        records[scheme, G, seed] = df
        ev = df.dropna(subset=["eval/acc_sampled"])
        curves.append(pd.DataFrame({
            "task": "sort", "scheme": scheme, "G": G, "seed": seed, "step": ev["step"],
            "tokens": ev["tokens/sampled"], "acc_sampled": ev["eval/acc_sampled"],
            "acc_greedy": ev["eval/acc_greedy"]}))
        print(f"{scheme:>10} G={G:<2} seed={seed}: {int(df['step'].max())} steps, final held-out "
              f"acc {ev['eval/acc_sampled'].iloc[-1]:.3f} ({time.perf_counter() - t0:.1f} s)")
curves = pd.concat(curves, ignore_index=True)

# %% [md]
# ## Held-out accuracy and gradient norm against sampled tokens
#
# Left: sampled held-out accuracy (4 samples per prompt); the dotted line is the threshold used
# below. Right: the global gradient norm before clipping — a collapse shows first as a surge.

# %%
acc0 = float(curves.loc[curves["step"] == 0, "acc_sampled"].mean())
threshold = threshold_of(acc0, THRESHOLD_FRAC)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
for (scheme, G), c in curves.groupby(["scheme", "G"], sort=False):
    m = c.groupby("tokens")["acc_sampled"].mean()
    ax1.plot(m.index, m.values, marker="o", ms=3, label=f"{scheme} G={G}")
for (scheme, G, seed), df in records.items():
    d = df.dropna(subset=["grad/norm"])
    ax2.plot(d["tokens/sampled"], d["grad/norm"], lw=1, label=f"{scheme} G={G} s{seed}")
ax1.axhline(threshold, color="k", ls=":", lw=1)
ax1.set_xlabel("sampled tokens")
ax1.set_ylabel("held-out accuracy (sampled)")
ax1.legend(fontsize=8)
ax2.set_xlabel("sampled tokens")
ax2.set_ylabel("grad norm (before clipping)")
ax2.set_yscale("log")
plt.tight_layout()
plt.show()

# %% [md]
# ## The prediction: warm-start variance x tokens against tokens-to-threshold
#
# `estimator_variance` at the warm start for the same scheme x G cells, in the training's
# aggregation mode. Only variance x tokens enters the prediction, so a small sampled reference
# suffices. Tokens-to-threshold of a run that never reaches the threshold is its final token
# count (a lower bound).

# %%
policy = warm_start("tiny", task, seed=0, progress=False)
schemes = list(dict.fromkeys(s for s, _ in CELLS))
Gs = sorted({G for _, G in CELLS})
var = estimator_variance(policy, task, schemes=schemes, Gs=Gs, modes=(BASE["agg"],),
                         M=8 if FAST else 16, n_prompts=1 if FAST else 2, reference="sampled",
                         n_ref=64, sketch_dim=256, seed=0, progress=False,
                         min_responses=0)  # only the point estimates enter the prediction
v = var.records["cells"][["scheme", "G", "variance", "variance_x_tokens", "variance_x_tokens_se"]]
t2t = cell_table(t2t_table(curves, {"sort": threshold}))
pred = t2t.merge(v, on=["scheme", "G"])
rho, rho_lo, rho_hi = rank_correlation_ci(pred["variance_x_tokens"].to_numpy(),
                                          pred["t2t_mean"].to_numpy())
fig, ax = plt.subplots(figsize=(6, 4))
ax.errorbar(pred["variance_x_tokens"], pred["t2t_mean"], xerr=pred["variance_x_tokens_se"],
            fmt="o", capsize=3)
for r in pred.itertuples():
    ax.annotate(f"{r.scheme} G={r.G}", (r.variance_x_tokens, r.t2t_mean), fontsize=8,
                xytext=(4, 4), textcoords="offset points")
ax.set_xscale("log")
ax.set_xlabel("warm-start variance x tokens (token-mean)")
ax.set_ylabel("tokens to threshold (mean over seeds)")
plt.show()
pred[["scheme", "G", "seeds", "reached", "t2t_mean", "t2t_is_lower_bound", "final_acc_mean",
      "variance_x_tokens"]]

# %% [md]
# ## Interpretation
#
# Generated from the runs and the variance analysis above.

# %%
lines = [f"- Warm-start held-out accuracy {acc0:.3f}; threshold {threshold:.3f} "
         f"({THRESHOLD_FRAC:.0%} of the remaining gap); budget {BUDGET} sampled tokens per run."]
for r in pred.sort_values("t2t_mean").itertuples():
    bound = " (lower bound: not reached by every seed)" if r.t2t_is_lower_bound else ""
    lines.append(f"- {r.scheme} G={r.G}: reached the threshold in {r.reached}/{r.seeds} run(s), "
                 f"mean tokens-to-threshold {r.t2t_mean:.0f}{bound}, final accuracy "
                 f"{r.final_acc_mean:.3f}; warm-start variance x tokens {r.variance_x_tokens:.3g}.")
lines.append(f"- Spearman rank correlation of variance x tokens with tokens-to-threshold over "
             f"{len(pred)} cells: {rho:.2f} (bootstrap 95% CI {rho_lo:.2f} to {rho_hi:.2f}). "
             "A positive value is what the prediction expects; with this few cells and seeds the "
             "interval is wide and the check is weak evidence either way.")
surges = {k: int(df["collapse/grad_surge"].fillna(0).sum()) for k, df in records.items()}
flagged = [f"{s} G={G} s{seed}" for (s, G, seed), n in surges.items() if n]
lines.append("- Gradient-norm surges flagged: " + (", ".join(flagged) if flagged else "none") + ".")
lines.append(f"- Notebook wall time: {time.perf_counter() - T_START:.0f} s.")
display(Markdown("\n".join(lines)))
