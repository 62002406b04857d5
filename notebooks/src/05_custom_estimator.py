# %% [md]
# # 05 · Writing and checking your own advantage estimator
#
# A new advantage estimator is a function `fn(rewards[P, G], mask[P, G, T], **options) ->
# A[P, G, T]` (varbench also takes the scheme shape `fn(rewards, mask, opts)` and verl's
# `fn(token_level_rewards, response_mask, index, **kw)`, told apart by signature). Two
# things can go wrong that a training curve hides for a long time: it can break the tensor
# contract (leak values into padding, depend on the order of the group), and
# it can change the *direction* of the policy gradient, so that training optimises something
# other than the reward. A baseline that does not depend on the sampled response leaves the
# expected gradient unchanged (docs/science.md section 2); anything else has to be measured.
#
# `varbench.testing.check_estimator` does both: contract checks, then the bias of the resulting
# policy-gradient estimate against the exact gradient of a small enumerable task (raw, and after
# the best positive rescaling, since a positive scale such as centered's `(G-1)/G` only changes
# the step size), and its variance at equal token budget against baselines. Here we write two
# estimators — one sound, one subtly wrong — check both, then register the sound one and measure
# it on the `tiny` policy like any built-in scheme.

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
from varbench.estimators import advantages, outcome_rewards, register_scheme, schemes
from varbench.rollout import sample
from varbench.tasks import get_task
from varbench.testing import check_estimator
from varbench.train import warm_start

# After the varbench imports: its report layer selects the headless Agg backend when imported.
%matplotlib inline
torch.set_num_threads(1)  # tiny models gain nothing from more threads on a shared CPU
T_START = time.perf_counter()

NUM_STEPS = 1000 if FAST else 3000  # sampled steps in the bias test (each: G responses x 3 prompts)
M = 8 if FAST else 16               # groups per prompt in the variance analysis
print(f"FAST={FAST}: bias test with {NUM_STEPS} steps, variance with M={M}")

# %% [md]
# ## Two candidate estimators
#
# - `loo_median`: `A_i = R_i - median_{j != i} R_j`. The baseline is computed from the *other*
#   responses only, which are independent of response i, so the estimate stays unbiased.
# - `length_bonus`: centered advantages plus a small bonus for longer responses,
#   `A_i = R_i - mean_j R_j + 0.05 |o_i|`. It looks harmless, but the bonus is correlated with
#   the sampled response, so it adds a gradient toward long responses that no reward asked for.

# %%
def loo_median(rewards, mask, **options):
    """A_i = R_i - median of the other responses' rewards; [P,G] x [P,G,T] -> [P,G,T]."""
    R = outcome_rewards(rewards, mask.bool())          # [P, G]
    P, G = R.shape
    if G == 1:
        base = torch.zeros_like(R)                     # no other response: no baseline
    else:
        others = R.unsqueeze(1).expand(P, G, G)        # [P, i, j]
        keep = ~torch.eye(G, dtype=torch.bool).expand(P, G, G)
        base = others[keep].reshape(P, G, G - 1).median(dim=-1).values
    return (R - base).unsqueeze(-1) * mask.to(R.dtype)


def length_bonus(rewards, mask, **options):
    """Centered advantage plus 0.05 x response length (a direction-changing mistake)."""
    m = mask.bool()
    R = outcome_rewards(rewards, m)
    A = R - R.mean(dim=1, keepdim=True) + 0.05 * m.sum(-1).to(R.dtype)
    return A.unsqueeze(-1) * m.to(R.dtype)

# %% [md]
# ## Check both
#
# Required rows decide pass/fail; `info` rows are measured and reported. A bias test fails when
# the bias is significant at `alpha` (its false-alarm rate) *and* larger than `tolerance`
# relative to `||g*||`. The same check runs from the shell as `varbench check MODULE:FUNCTION`
# and inside a user's test suite through the pytest plugin
# (`def test_mine(varbench_check): varbench_check("mypkg.adv:my_estimator")`).

# %%
results = {}
for fn in (loo_median, length_bonus):
    results[fn.__name__] = check_estimator(fn, G=4, num_steps=NUM_STEPS, seed=0)
    print(results[fn.__name__], end="\n\n")

# %% [md]
# ## Bias and variance side by side
#
# Left: relative bias of each estimator after the best positive rescaling (sine of the angle
# between `E[g_hat]` and `g*`), with its SE. Right: paired variance ratio to the baselines at
# equal token budget (below 1: less variance than the baseline on the same sampled groups).

# %%
names = list(results)
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
rb = [results[n].row("bias (rescaled)") for n in names]
ax1.bar(names, [r["value"] for r in rb], yerr=[r["se"] for r in rb], capsize=4,
        color=["tab:green" if r["passed"] else "tab:red" for r in rb])
ax1.set_ylabel("relative bias after rescaling")
ax1.set_title("bias (rescaled); red = failed")
x = np.arange(len(names))
width = 0.35
for j, base in enumerate(("centered", "otb")):
    rows = [results[n].row(f"variance ratio vs {base}") for n in names]
    ax2.bar(x + (j - 0.5) * width, [r["value"] for r in rows], width=width,
            yerr=[r["se"] for r in rows], capsize=3, label=f"vs {base}")
ax2.axhline(1.0, color="k", lw=0.8)
ax2.set_xticks(x)
ax2.set_xticklabels(names)
ax2.set_ylabel("variance ratio (paired)")
ax2.legend()
plt.tight_layout()
plt.show()

# %% [md]
# ## Register the sound one and use it like a built-in scheme
#
# `register_scheme` takes the keyword form as it is (the same adapter `check_estimator` used
# above): each option the function names, or all of them for `**options`, is passed as a
# keyword. Once registered, the name works everywhere a scheme name does: `advantages`, the
# variance analysis, `TrainConfig(scheme=...)` and suites.

# %%
register_scheme("loo_median")(loo_median)

print("registered:", schemes())
task = get_task("sort", n=3)
policy = warm_start("tiny", task, seed=0, progress=False)
batch = sample(policy, task, task.prompts(2, seed=0), 4, seed=0)
print("rewards:\n", batch.rewards)
print("loo_median advantages (first token):\n", advantages("loo_median", batch.rewards, batch.mask)[..., 0])

var = estimator_variance(policy, task, schemes=("centered", "rloo", "loo_median"), Gs=(4, 8),
                         M=M, n_prompts=1, reference="exact", sketch_dim=256, seed=0,
                         progress=False)
cells = var.records["cells"]
fig, ax = plt.subplots(figsize=(6, 3.8))
for scheme, c in cells.groupby("scheme", sort=False):
    ax.errorbar(c["G"], c["variance"], yerr=c["variance_se"], marker="o", capsize=3, label=scheme)
ax.set_xscale("log", base=2)
ax.set_yscale("log")
ax.set_xlabel("group size G")
ax.set_ylabel("tr Cov(g_hat) on the tiny policy")
ax.legend()
plt.show()
cells[["scheme", "G", "variance", "variance_se", "cosine", "bias"]].round(4)

# %% [md]
# ## Interpretation
#
# Generated from the check results and the variance records above.

# %%
lines = []
for n, r in results.items():
    b = r.row("bias (rescaled)")
    s = r.row("scale along g*")
    failed = list(r.table.loc[r.table["required"] & ~r.table["passed"].astype(bool), "check"])
    lines.append(
        f"- **{n}**: {'PASSED' if r.passed else 'FAILED'}"
        + (f" ({', '.join(failed)})" if failed else "")
        + f"; relative bias after rescaling {b['value']:.3f} ± {b['se']:.3f} (p = {b['p_value']:.2g}); "
        f"scale along g* {s['value']:.2f}.")
for G in (4, 8):
    c = cells[cells["G"] == G].set_index("scheme")
    if {"loo_median", "rloo"} <= set(c.index):
        lines.append(f"- Tiny policy, G = {G}: loo_median variance {c.loc['loo_median', 'variance']:.3g} "
                     f"vs rloo {c.loc['rloo', 'variance']:.3g} (mean cosine to g* "
                     f"{c.loc['loo_median', 'cosine']:.2f} vs {c.loc['rloo', 'cosine']:.2f}).")
lines.append(f"- Notebook wall time: {time.perf_counter() - T_START:.0f} s.")
display(Markdown("\n".join(lines)))
