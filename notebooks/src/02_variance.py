# %% [md]
# # 02 · Gradient variance by advantage scheme and group size
#
# Every group estimator `g_hat = sum_i sum_t omega A_{i,t} grad log pi(y_{i,t})` aims at the same
# policy gradient; schemes differ in the baseline they subtract and so in how noisy (and how
# biased) one group's estimate is. docs/science.md section 5 defines what a variance report shows: total
# variance of `g_hat` across independent groups, bias and cosine against a reference gradient
# `g*`, MSE, and the variance at equal token budget (variance x tokens), the axis on which
# "a small group with a good baseline matches a big group" is judged.
#
# Here `g*` is exact: `sort` with 3 numbers has `30^3` possible responses, so varbench enumerates
# them all. Schemes share their sampled groups, so scheme-vs-`centered` ratios are paired and
# their standard errors are small. Bias matters as much as variance: `centered` is unbiased only
# up to the factor `(G-1)/G`, and `otb` puts each sample inside its own baseline.

# %%
import os

FAST = os.environ.get("VARBENCH_NOTEBOOK_FAST") == "1"  # the test suite's small setting

import time
import warnings

import matplotlib.pyplot as plt
import numpy as np
import torch
from IPython.display import Markdown, display

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets
from varbench.analysis import estimator_variance
from varbench.tasks import get_task
from varbench.train import warm_start

# After the varbench imports: its report layer selects the headless Agg backend when imported.
%matplotlib inline
torch.set_num_threads(1)  # tiny models gain nothing from more threads on a shared CPU
T_START = time.perf_counter()

SCHEMES = ("raw", "centered", "normalized", "rloo", "otb", "otb_loo")
GS = (2, 4, 8) if FAST else (2, 4, 8, 16)
M = 8 if FAST else 32          # independent groups per prompt (jackknife SEs over these)
N_PROMPTS = 1 if FAST else 3   # prompts; results are averaged over them
print(f"FAST={FAST}: schemes {SCHEMES}, G in {GS}, M={M} groups x {N_PROMPTS} prompt(s)")

# %% [md]
# ## The policy and the analysis
#
# The warm-started `tiny` policy (cached after the first run). For each prompt,
# `estimator_variance` samples `M * max(G)` responses once; group `m` of size `G` is a slice of
# them. Per-token gradients are computed once (count-sketched to 256 dimensions) and every
# scheme's estimate is a contraction of the same vectors.

# %%
task = get_task("sort", n=3)
policy = warm_start("tiny", task, seed=0, progress=False)
# min_responses="auto" (the default) samples at least 4096 responses per prompt because OTB's
# intervals need them (with fewer they are too narrow: 90% coverage at 512 responses); the FAST
# test run turns the floor off and its report says so in the notes.
res = estimator_variance(policy, task, schemes=SCHEMES, Gs=GS, M=M, n_prompts=N_PROMPTS,
                         reference="exact", sketch_dim=256, seed=0, progress=False,
                         min_responses=0 if FAST else "auto")
cells = res.records["cells"]
paired = res.records["paired"]
print(res.records["reference"][["prompt_text", "reference", "ref_norm", "mean_reward_sampled"]]
      .to_string(index=False))
cells[["scheme", "G", "variance", "variance_se", "bias", "cosine", "mse", "frac_all_agree"]].round(4)

# %% [md]
# ## Variance against group size, and at equal token budget
#
# Left: total variance of one group's estimate (log scale; error bars are jackknife SEs).
# Right: variance x sampled tokens per group — lower is better at a fixed sampling budget.

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
for scheme in SCHEMES:
    c = cells[cells["scheme"] == scheme].sort_values("G")
    ax1.errorbar(c["G"], c["variance"], yerr=c["variance_se"], marker="o", capsize=3, label=scheme)
    ax2.errorbar(c["tokens_per_group"], c["variance_x_tokens"], yerr=c["variance_x_tokens_se"],
                 marker="o", capsize=3, label=scheme)
for ax in (ax1, ax2):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
ax1.set_xlabel("group size G")
ax1.set_ylabel("tr Cov(g_hat)")
ax2.set_xlabel("sampled tokens per group")
ax2.set_ylabel("variance x tokens")
ax1.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [md]
# ## Bias beside variance
#
# Left: mean cosine between one group's estimate and the exact `g*` (1 is perfect). Right:
# paired variance ratio to `centered` on the very same groups (below 1: less variance), with
# its jackknife SE. A low variance is worth little if the cosine or the scale is off.
#
# A special case to keep in mind when reading `raw`: `sort` has one correct answer `y*` per
# prompt and an exact-match reward, so `g* = pi(y*) grad log pi(y*)` and every `raw` estimate is
# a non-negative multiple of `g*`. Its cosine is 1 whenever the group contains a correct answer
# and 0 otherwise; baselines add the (large) score functions of the wrong answers.

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
for scheme in SCHEMES:
    c = cells[cells["scheme"] == scheme].sort_values("G")
    ax1.errorbar(c["G"], c["cosine"], yerr=c["cosine_se"], marker="o", capsize=3, label=scheme)
pv = paired[paired["stat"] == "variance"]
for scheme in dict.fromkeys(pv["scheme"]):
    c = pv[pv["scheme"] == scheme].sort_values("G")
    ax2.errorbar(c["G"], c["ratio"], yerr=c["ratio_se"], marker="o", capsize=3, label=scheme)
ax2.axhline(1.0, color="k", lw=0.8)
for ax in (ax1, ax2):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("group size G")
ax2.set_yscale("log")
ax1.set_ylabel("mean cos(g_hat, g*)")
ax2.set_ylabel("variance / variance(centered), paired")
ax1.legend(fontsize=8)
plt.tight_layout()
plt.show()

# %% [md]
# ## Interpretation
#
# Generated from the records above: the paired ratios to `centered`, the cosines, and the
# small-group-against-large-group comparison at equal scheme.

# %%
def row(scheme, G):
    r = cells[(cells["scheme"] == scheme) & (cells["G"] == G)]
    return r.iloc[0] if len(r) else None


def ratio(scheme, G):
    r = pv[(pv["scheme"] == scheme) & (pv["G"] == G)]
    return r.iloc[0] if len(r) else None


lines = [f"Reference: {res.records['reference']['reference'].iloc[0]}; "
         f"{M} groups per prompt, {N_PROMPTS} prompt(s)."]
for G in GS:
    parts = []
    for scheme in ("rloo", "otb", "otb_loo"):
        r = ratio(scheme, G)
        if r is not None and np.isfinite(r["ratio"]):
            parts.append(f"{scheme} {r['ratio']:.2f} ± {r['ratio_se']:.2f}")
    cos = {s: row(s, G)["cosine"] for s in ("centered", "otb", "otb_loo") if row(s, G) is not None}
    lines.append(f"- **G = {G}**: variance relative to centered (paired): " + ", ".join(parts)
                 + "; mean cosine to g*: " + ", ".join(f"{s} {v:.2f}" for s, v in cos.items()) + ".")
r = row("raw", max(GS))
if r is not None:
    lines.append(f"- raw at G = {max(GS)}: variance {r['variance']:.3g}, mean cosine {r['cosine']:.2f}, "
                 f"fraction of all-agree groups {r['frac_all_agree']:.2f} (see the special case above).")
gmax, gmin = max(GS), (4 if 4 in GS else min(GS))
small, big = row("otb", gmin), row("centered", gmax)
if small is not None and big is not None:
    lines.append(
        f"- otb at G = {gmin} has {small['variance'] / big['variance']:.2f}x the variance of centered "
        f"at G = {gmax} with {small['tokens_per_group'] / big['tokens_per_group']:.2f}x the tokens "
        f"per group (unpaired); its cosine to g* is {small['cosine']:.2f} against {big['cosine']:.2f}.")
# ||E g_hat|| / ||g*|| per scheme (signal_norm2 is unbiased for ||E g_hat||^2), prompt by prompt.
byp = res.records["cells_by_prompt"].merge(res.records["reference"][["prompt", "ref_norm"]],
                                           on="prompt")
byp["norm_ratio"] = np.sqrt(byp["signal_norm2"].clip(lower=0)) / byp["ref_norm"]
nr = byp.groupby(["scheme", "G"])["norm_ratio"].mean()
for G in (min(GS), max(GS)):
    lines.append(f"- Estimated ||E g_hat|| / ||g*|| at G = {G}: "
                 + ", ".join(f"{s} {nr[s, G]:.2f}" for s in ("centered", "rloo", "otb", "otb_loo"))
                 + f" (centered's expected value is (G-1)/G = {(G - 1) / G:.2f}). Below 1 means the "
                 "estimate is shrunk toward zero, which also lowers its variance.")
if FAST:
    lines.append("- FAST mode: one prompt and few groups; SEs are wide. Rerun without "
                 "`VARBENCH_NOTEBOOK_FAST=1` for the fuller setting.")
lines.append(f"- Notebook wall time: {time.perf_counter() - T_START:.0f} s.")
display(Markdown("\n".join(lines)))
