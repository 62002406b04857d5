# %% [md]
# # 03 · Token gradient cancellation at shared steps
#
# When several responses of one group share a step (the same context and the same next token),
# that step's gradient is `(sum_i c_i A_i) grad log pi(a | h)`, where `c_i` is the per-token
# weight the loss gives response i (aggregation weight x ratio/clip factor) and `A_i` its
# advantage. With centered advantages and a weight that is the same for every member
# (an *exchangeable* objective), a step that the whole group shares cancels exactly; per-sequence
# length normalisation, clipping after a few PPO steps and GSPO's sequence ratio break that, and
# Min-Replace / Adv-Orthogonal restore it (docs/science.md section 4). Uncancelled shared steps are a drift
# that no reward asked for.
#
# We measure this with warm-started `tiny` policies on `arith` (responses such as `12<eos>` and
# `7<eos>` differ in length) and, outside FAST mode, on the multi-turn `toolsum` (tool calls,
# environment tokens that are context but never loss): first on one group by hand, then over
# every aggregation mode, ratio kind, number of PPO inner steps and transform with
# `varbench.analysis.cancellation`.

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
from varbench.analysis import cancellation, shared_steps
from varbench.analysis.cancellation import sample_weights
from varbench.estimators import advantages
from varbench.rollout import sample
from varbench.tasks import get_task
from varbench.train import warm_start

# After the varbench imports: its report layer selects the headless Agg backend when imported.
%matplotlib inline
torch.set_num_threads(1)  # tiny models gain nothing from more threads on a shared CPU
T_START = time.perf_counter()

TASKS = ("arith",) if FAST else ("arith", "toolsum")
N_PROMPTS = 48 if FAST else 64  # groups (one per prompt) per task
G = 8                           # responses per group
INNER_STEPS = (0, 4)            # PPO steps on the batch before reading the weights (0: ratio 1)
LR = 3e-4                       # Adam step of those PPO steps (TrainConfig's default)
print(f"FAST={FAST}: tasks {TASKS}, {N_PROMPTS} groups of {G}, inner steps {INNER_STEPS}")

# %% [md]
# ## One group by hand
#
# Sample groups on `arith`, take centered advantages, and read the per-token weight `c` for two
# aggregation modes at ratio 1: `seq-mean-token-sum` (every token weighs `1/B`) and
# `seq-mean-token-mean` (every token of response i weighs `1/(B |o_i|)`). `shared_steps` lists
# the prefix-trie nodes that at least two responses share. We show the group whose full-group
# shared step cancels worst under `seq-mean-token-mean`.

# %%
tasks = [get_task(name) for name in TASKS]
policies = {t.name: warm_start("tiny", t, seed=0, progress=False) for t in tasks}
task = tasks[0]
batch = sample(policies[task.name], task, task.prompts(N_PROMPTS, seed=0), G, seed=0)
mask = batch.mask != 0
adv = advantages("centered", batch.rewards, mask)
modes = ("seq-mean-token-sum", "seq-mean-token-mean")
steps = {}
for mode in modes:
    c = sample_weights(batch.logprobs, batch.logprobs, adv, mask, mode, max_len=task.max_new_tokens)
    steps[mode] = shared_steps(batch.tokens, adv, c, mask)
full = steps[modes[1]]
full = full[full["full_group"]].fillna({"rel_residual": 0.0})
p = int(full.loc[full["rel_residual"].idxmax(), "p"]) if len(full) else 0
print(f"prompt {batch.meta['prompt_objects'][p].text!r}")
print(pd.DataFrame({"response": batch.texts[p], "reward": batch.rewards[p].tolist(),
                    "length": batch.lengths[p].tolist(), "A": adv[p, :, 0].tolist()}).to_string())
cols = ["t", "token_str", "size", "full_group", "sum_A", "residual", "rel_residual"]
to_str = policies[task.name].tokenizer.convert_ids_to_tokens
pd.concat({m: steps[m][steps[m]["p"] == p].assign(token_str=lambda d: to_str(d["token"].tolist()))[cols]
           for m in modes}, names=["mode", "row"])

# %% [md]
# ## Every configuration
#
# `cancellation` repeats this for each aggregation mode x ratio kind (token / GSPO sequence) x
# inner steps x transform, on each task. The relative residual `|sum c A| / sum |c A|` at a
# shared step is 0 for exact cancellation and 1 for none; SEs treat groups as independent
# clusters.

# %%
res = cancellation(policies, tasks, n_prompts=N_PROMPTS, G=G, inner_steps=INNER_STEPS,
                   lr=LR, seed=0, progress=False)
conf = res.records["configs"]
conf[["task", "mode", "ratio", "inner_steps", "transform", "full_residual_rel",
      "full_residual_rel_se", "n_full_active", "shared_residual_rel", "mean_abs_log_ratio"]].round(4)

# %% [md]
# ## Which choices break exchangeability
#
# Left: ratio 1 (no PPO step yet), token ratios, no transform — only the aggregation mode
# differs. Right: after the PPO inner steps, `seq-mean-token-sum` with token or sequence (GSPO)
# ratios, without and with the two restoring transforms. Bars: mean relative residual at
# full-group shared steps (error bars: cluster SE).
#
# What to expect: at a shared step every member has the same context and token, so the same
# *token* ratio; after PPO steps only asymmetric clipping (which depends on the sign of A) can
# make their weights differ. GSPO's *sequence* ratio depends on the rest of each response, and
# `seq-mean-token-mean`'s `1/|o_i|` on its length, so both can break the cancellation.

# %%
k_max = max(INNER_STEPS)
width = 0.8 / len(TASKS)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4))
for j, name in enumerate(TASKS):
    ct = conf[conf["task"] == name]
    left = ct[(ct["inner_steps"] == 0) & (ct["ratio"] == "token") & (ct["transform"] == "none")]
    right = ct[(ct["inner_steps"] == k_max) & (ct["mode"] == "seq-mean-token-sum")]
    off = (j - (len(TASKS) - 1) / 2) * width
    ax1.bar(np.arange(len(left)) + off, left["full_residual_rel"], width=width,
            yerr=left["full_residual_rel_se"].fillna(0), capsize=3, label=name)
    ax2.bar(np.arange(len(right)) + off, right["full_residual_rel"], width=width,
            yerr=right["full_residual_rel_se"].fillna(0), capsize=3, label=name)
ax1.set_xticks(np.arange(len(left)))
ax1.set_xticklabels(left["mode"], rotation=15)
ax1.set_ylabel("relative residual, full-group steps")
ax1.set_title("ratio 1: aggregation modes")
ax2.set_xticks(np.arange(len(right)))
ax2.set_xticklabels([f"{r.ratio}\n{r.transform}" for r in right.itertuples()])
ax2.set_title(f"after {k_max} PPO steps: seq-mean-token-sum")
ax1.legend()
plt.tight_layout()
plt.show()

# %% [md]
# ## Net weight per token id
#
# Across the whole `arith` batch, the signed net coefficient `sum c A` per vocabulary id
# against the total `sum |c A|` (approximate: one id sits in different contexts), at ratio 1.

# %%
tw = res.records["token_ids"]
sel = tw[(tw["task"] == task.name) & (tw["inner_steps"] == 0) & (tw["ratio"] == "token")
         & (tw["transform"] == "none") & (tw["mode"].isin(modes))]
fig, ax = plt.subplots(figsize=(10, 3.5))
bw = 0.4
for j, mode in enumerate(modes):
    d = sel[sel["mode"] == mode]
    ax.bar(np.arange(len(d)) + (j - 0.5) * bw, d["rel_net"], width=bw, label=mode)
ax.set_xticks(np.arange(len(d)))
ax.set_xticklabels(d["token_str"])
ax.set_ylabel("|net weight| / total |weight|")
ax.legend()
plt.show()

# %% [md]
# ## Interpretation
#
# Generated from the `configs` records above.

# %%
def get(name, mode, ratio, k, tf):
    r = conf[(conf["task"] == name) & (conf["mode"] == mode) & (conf["ratio"] == ratio)
             & (conf["inner_steps"] == k) & (conf["transform"] == tf)]
    return r.iloc[0]


def val(r, col="full_residual_rel"):
    v, se = r[col], r.get(f"{col}_se", float("nan"))
    if not np.isfinite(v):
        return "n/a (no active full-group step)"
    return f"{v:.3g}" + (f" ± {se:.2g}" if np.isfinite(se) else "")


lines = []
for name in TASKS:
    base = get(name, "seq-mean-token-sum", "token", 0, "none")
    lines.append(f"**{name}**: {int(base['n_full'])} full-group shared steps and "
                 f"{int(base['n_shared'])} shared steps in {N_PROMPTS} groups of {G}.")
    for mode in ("seq-mean-token-sum", "token-mean", "seq-mean-token-mean"):
        lines.append(f"- Ratio 1, {mode}: full-group relative residual "
                     f"{val(get(name, mode, 'token', 0, 'none'))}.")
    for ratio in ("token", "sequence"):
        parts = [f"{tf} {val(get(name, 'seq-mean-token-sum', ratio, k_max, tf))}"
                 for tf in ("none", "min_replace", "adv_orthogonal")]
        lr = get(name, "seq-mean-token-sum", ratio, k_max, "none")["mean_abs_log_ratio"]
        lines.append(f"- After {k_max} PPO steps, {ratio} ratio (seq-mean-token-sum): "
                     + "; ".join(parts) + f" (mean |log ratio| {lr:.3f}).")
    broken = get(name, "seq-mean-token-mean", "token", 0, "none")["full_residual_rel"]
    fixed = get(name, "seq-mean-token-mean", "token", 0, "min_replace")["full_residual_rel"]
    if np.isfinite(broken) and np.isfinite(fixed):
        lines.append(f"- Min-Replace on seq-mean-token-mean at ratio 1: residual {broken:.3g} -> "
                     f"{fixed:.3g}.")
if FAST:
    lines.append("\nFAST mode: `arith` only and few groups; rerun without "
                 "`VARBENCH_NOTEBOOK_FAST=1` for `toolsum` as well.")
lines.append(f"\nNotebook wall time: {time.perf_counter() - T_START:.0f} s.")
display(Markdown("\n".join(lines)))
