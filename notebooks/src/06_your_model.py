# %% [md]
# # 06 · Your model, your data
#
# varbench's analyses run on any causal LM checkpoint directory and any file of prompts with
# checkable answers. This notebook walks through that path with a stand-in for your own files:
# a JSONL of arithmetic word problems and a Qwen2-architecture checkpoint with a byte-level BPE
# tokenizer and a chat template, saved in bfloat16 (both built locally by the scripts in
# `examples/your_model/`). Set `DATA` and `CHECKPOINT` below to your own paths to run it on
# yours; the knobs name your columns and your verifier (docs/tasks.md).
#
# What it shows: a data file as a task (splits, chat template, verifier); why the toy tasks
# refuse a BPE tokenizer and how `add_task_tokens` fixes that; sampling in bfloat16; and whether
# the Logit-Gradient Proxy's agreement with exact per-token gradient norms survives bfloat16 on
# the same weights.

# %%
import os

FAST = os.environ.get("VARBENCH_NOTEBOOK_FAST") == "1"  # the test suite's small setting

import importlib.util
import tempfile
import time
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display

warnings.filterwarnings("ignore", message="IProgress not found")  # tqdm without ipywidgets
from varbench.analysis import proxy_correlation
from varbench.rollout import sample
from varbench.tasks import get_task
from varbench.train.policies import build_policy

# After the varbench imports: its report layer selects the headless Agg backend when imported.
%matplotlib inline
torch.set_num_threads(1)
T_START = time.perf_counter()

# Your files: a data file (.jsonl/.json/.csv/.parquet or a datasets directory) and a checkpoint
# directory (config.json + weights + tokenizer). None: build the example stand-ins.
DATA = None
CHECKPOINT = None
KNOBS = {"verifier": "number", "solution_key": "solution", "max_new_tokens": 6 if FAST else 24}

# %% [md]
# ## The stand-in files
#
# Skipped when `DATA` and `CHECKPOINT` point at your own.

# %%
EXAMPLES = Path("..").resolve() / "examples" / "your_model"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


work = Path(tempfile.mkdtemp(prefix="varbench-06-"))
if DATA is None:
    DATA = _load("make_word_problems").write_jsonl(work / "word_problems.jsonl", n=200, seed=0)
if CHECKPOINT is None:
    CHECKPOINT = _load("build_checkpoint").build(work / "ckpt", DATA,
                                                 hidden=32 if FAST else 64, layers=2,
                                                 vocab_size=320 if FAST else 512)
print(Path(DATA).read_text().splitlines()[0])

# %% [md]
# ## The data file is a task
#
# Problems are split by their text (a seeded hash), so train and held-out never share one. Once
# the policy is built the task is bound to its tokenizer: with a chat template, prompts are
# formatted by it.

# %%
task = get_task(str(DATA), **KNOBS)
print(task.describe())
policy = build_policy(str(CHECKPOINT), task=task)  # dtype "auto": the checkpoint's bfloat16
print(type(policy.model).__name__, next(policy.model.parameters()).dtype,
      f"{sum(p.numel() for p in policy.model.parameters()):,} parameters")
prompt = task.prompts(1, split="heldout")[0]
print(repr(prompt.text), "-> answer", prompt.answer)

# %% [md]
# ## A toy task on a byte-level BPE
#
# `sort` answers in exactly n tokens, so each symbol of its alphabet must be one token. A byte
# BPE splits `<sort>`: varbench refuses before any work, and `add_task_tokens` adds the symbols
# as tokens (resizing the embeddings) when asked.

# %%
try:
    build_policy(str(CHECKPOINT), task=get_task("sort"))
except ValueError as err:
    print("refused:", str(err)[:160], "...")
sorter = build_policy(str(CHECKPOINT), task=get_task("sort"), add_task_tokens=True)
print("added tokens:", sorter.meta["added_tokens"], "vocabulary", len(sorter.tokenizer))

# %% [md]
# ## Sampling in bfloat16
#
# The model runs in bfloat16; the recorded log-probabilities and entropies are float32.

# %%
batch = sample(policy, task, task.prompts(2, seed=0), 4, seed=0)
print("logprobs dtype:", batch.logprobs.dtype, "| mean reward", float(batch.rewards.mean()))
for text in batch.texts[0][:2]:
    print(repr(text))

# %% [md]
# ## The proxy in bfloat16 vs float32, on the same weights
#
# The same bfloat16 weights, upcast to float32 (exactly), against the bfloat16 model: the
# Spearman correlation of the proxy w_t with the exact per-token gradient norm, with its 95%
# bootstrap CI over sequences.

# %%
pol32 = build_policy(str(CHECKPOINT), task=task, dtype=torch.float32)
n_prompts, G = (2, 2) if FAST else (6, 4)
res = proxy_correlation({"float32": pol32, "bfloat16": policy}, task, n_prompts=n_prompts, G=G,
                        n_boot=50 if FAST else 200, progress=False)
corr = res.records["correlations"]
rows = corr[(corr["quantity"] == "w_t vs token_sq") & (corr["scope"] == "pooled")
            & (corr["method"] == "spearman")].set_index("state")
fig, ax = plt.subplots(figsize=(4, 3))
for i, state in enumerate(rows.index):
    r = rows.loc[state]
    ax.errorbar(i, r["estimate"], yerr=[[r["estimate"] - r["ci_low"]], [r["ci_high"] - r["estimate"]]],
                fmt="o", capsize=4)
ax.set_xticks(range(len(rows)), rows.index)
ax.set_ylabel("Spearman(w_t, ||g_t||^2)")
plt.show()
rows[["estimate", "ci_low", "ci_high", "n_seq"]].round(3)

# %% [md]
# ## Interpretation
#
# Generated from the records above.

# %%
f32, b16 = rows.loc["float32"], rows.loc["bfloat16"]
overlap = f32["ci_low"] <= b16["ci_high"] and b16["ci_low"] <= f32["ci_high"]
lines = [
    f"- {task.describe()}",
    f"- Spearman(w_t, token_sq): float32 {f32['estimate']:.3f} [{f32['ci_low']:.3f}, "
    f"{f32['ci_high']:.3f}], bfloat16 {b16['estimate']:.3f} [{b16['ci_low']:.3f}, "
    f"{b16['ci_high']:.3f}] over {int(f32['n_seq'])} sequences: the intervals "
    f"{'overlap' if overlap else 'do not overlap'}.",
    f"- Mean sampled reward of the (untrained) checkpoint: {float(batch.rewards.mean()):.3f}; "
    "warm-start it on the data's solutions (`varbench warmstart --policy DIR --task DATA "
    "--knob solution_key=solution`) before measuring estimator variance.",
    f"- Notebook wall time: {time.perf_counter() - T_START:.0f} s.",
]
display(Markdown("\n".join(lines)))
