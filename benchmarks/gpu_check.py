"""One command that proves varbench on a GPU: every phase on CUDA in float32 and bfloat16
against a float64 reference, timed, with peak memory, as a PASS/FAIL table (exit 1 on a FAIL).

    python benchmarks/gpu_check.py                    # CUDA: check size + realistic size
    python benchmarks/gpu_check.py --device cpu --quick   # CPU smoke run (tests run this)

Phases (each on the candidate device and dtype, compared to the reference on the same inputs):
forward statistics (logp, entropy, sum pi^2, w_t); exact token / prefix / sequence gradient
norms; sampling with the KV cache (the sampler's own log-probs and entropies of the tokens it
drew against a full forward of the reference on those tokens); one proxy cell (the token
records of the proxy analysis); one variance cell with an exact reference (enumerated response
table: g* and the exact variance / MSE of two schemes); one cancellation cell (shared-step
residuals and cancellation ratios after one PPO inner step with GSPO's sequence ratio, and the
per-token gradient vectors, sketched by one S on both sides); training (the clipped loss and
gradient norm of three AdamW steps on one fixed batch, and three steps of the real training
loop, whose gradient-norm and entropy records are compared with the same loop run in float64
on the candidate's device: the sampler's generator lives there). Only the phases with a
batched (vmapped) backward
(``BATCHED_BACKWARD``) run under math attention; the others use the model's default attention
(fused SDPA kernels on CUDA), as users get it.

Then ``cli``: one CLI run of each analysis (``varbench proxy``, ``variance``, ``cancellation``)
on a saved checkpoint, as one process and as a 2-rank ``torchrun``; every table of the 2-rank
run must equal the one-process run's (``CLI_TOL``). ``varbench train`` refuses several ranks
(it is not data-parallel), so the training loop is checked by the ``train`` phase instead.

Model sizes, all Qwen2-shaped (GQA, q/k/v biases) and built locally from a transformers
``Qwen2Config`` (nothing is downloaded), the final norm scaled so the logits have std
``LOGIT_STD`` (a random init's softmax is otherwise near-uniform, and its statistics the same
for any model):
- ``check`` (``quick`` under ``--quick``): the embedded tokenizer's vocabulary, small enough
  for an exact float64 reference on the CPU (rows say ``ref cpu/float64``); the variance cell
  keeps flat (unsketched) gradients.
- ``quick-vocab`` (``--quick``): Qwen2-0.5B's real 151936-token vocabulary with its tied head
  on a 2-layer body, against float64 on the CPU; every phase but the variance cell (its exact
  table enumerates the vocabulary) and the real loop (ids past the tokenizer decode to "": no
  reward, no gradient; the fixed-batch rows use seeded rewards), and without the ``w_t`` /
  ``W_t`` rows (``VOCAB_SCALE_BOUND``: near 1 for any model there). The CPU stand-in for the
  ``realistic`` size: the same vocabulary, tying and head path, on a 2-layer hidden-32 body.
- ``realistic`` (CUDA only; ``--no-realistic`` to skip): Qwen2-0.5B's shape (hidden 896,
  24 layers, 14 heads, 2 KV heads, MLP 4864, vocabulary 151936, tied head), against its
  float64 copy on the same GPU (``ref cuda/float64``); the variance cell is skipped as above.
  Sequence length of the norms phase: ``--seq`` (checked against the model's context).

Tolerance per row: ``err`` is the max absolute difference over the max absolute reference
value (normwise relative), or the max absolute difference for log-probabilities and losses
(nats). TF32 is off, so float32 is float32. Times are measured after one warm-up pass of the
candidate on CUDA, with CUDA synchronised; peak memory is ``torch.cuda.max_memory_allocated`` after
``torch.cuda.reset_peak_memory_stats`` at the start of each phase (CPU: not measured).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from varbench.analysis.cancellation import ppo_logps
from varbench.analysis.oracle import enumerate_distribution, response_table
from varbench.analysis.proxy import token_records
from varbench.analysis.trie import shared_steps
from varbench.analysis.variance_cells import table_cells
from varbench.estimators.coefficients import sample_weights
from varbench.estimators.loss import policy_loss
from varbench.estimators.registry import advantages
from varbench.grads import (
    CountSketch,
    exact_float64,
    forward_stats,
    sequence_grad_norms,
    token_grad_norms,
    token_vectors,
)
from varbench.grads.precision import batched_backward_attention
from varbench.models.forward import forward_logits
from varbench.models.logits import token_logprobs
from varbench.models.presets import Policy
from varbench.models.tokenizer import build_tokenizer
from varbench.rollout.sampler import sample
from varbench.tasks import get_task

PHASES = ("forward", "norms", "sampling", "proxy", "variance", "cancellation", "train")

# Tolerances by (candidate dtype, kind): "rel" = normwise relative error, "nats" = absolute
# difference of log-probabilities / losses. float32 with TF32 off; bf16 keeps 8 bits.
TOLERANCES = {
    ("float32", "rel"): 2e-4, ("float32", "norm"): 2e-3, ("float32", "nats"): 1e-4,
    ("bfloat16", "rel"): 5e-2, ("bfloat16", "norm"): 1.5e-1, ("bfloat16", "nats"): 5e-2,
}

QWEN2_VOCAB = 151936  # Qwen2-0.5B's vocabulary, its head tied to the embedding
# Standard deviation of the random-init logits: the final norm's weight is set so that
# ``softmax`` is far from uniform. At the init scale (0.02, std ~0.1-0.6) the tokenizer-size
# distributions are near-uniform: the entropy is log V and w_t 1 to 1e-5 for ANY model. Over
# the real vocabulary w_t = 1 - 2 pi_y + sum pi^2 stays ~1 (sum pi^2 ~ exp(std^2) / V) at any
# std bfloat16 logits can hold to the 0.05-nat tolerance (2.5: 0.048 measured), so there w_t
# and W_t check the statistics' arithmetic and the tokenizer-size model their model dependence
# (``VOCAB_SCALE_BOUND``).
LOGIT_STD = 1.0
# Quantities a different random model of the same logit scale reproduces at the real
# vocabulary within the float32 tolerance (measured: w_t 2.3e-5, W_t 1.6e-4 of 2e-4): rows
# that cannot fail, so the real-vocabulary sizes do not emit them. There w_t is
# ``proxy_from_logprobs`` of the logp and sum_pi_sq rows, which can (the one formula of
# every path, checked as a row at the tokenizer-vocabulary size).
VOCAB_SCALE_BOUND = {("forward", "w_t"), ("proxy", "W_t")}
SIZES = {  # Qwen2-shaped bodies; the vocabulary is the embedded tokenizer's unless "vocab"
    "quick": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    # --quick's real-vocabulary tied-head model: Qwen2-0.5B's vocabulary and tying, 2 layers
    "quick-vocab": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64, vocab=QWEN2_VOCAB, tied=True),
    "check": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256),
    "realistic": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                      num_attention_heads=14, num_key_value_heads=2,
                      max_position_embeddings=2048, vocab=QWEN2_VOCAB, tied=True),
}
# Phases with a batched (vmapped) backward need math attention; every other phase runs the
# model's default (fused SDPA kernels on CUDA), as users get it.
BATCHED_BACKWARD = ("norms", "proxy", "variance", "cancellation")
# Phases that enumerate the vocabulary (the variance cell's exact response table): run on the
# tokenizer-vocabulary sizes only.
ENUMERATES_VOCAB = ("variance",)


@dataclasses.dataclass
class Row:
    size: str
    phase: str
    dtype: str
    quantity: str
    err: float
    tol: float
    ref: str
    time_s: float = math.nan
    peak_mib: float = math.nan

    @property
    def passed(self) -> bool:
        return math.isfinite(self.err) and self.err <= self.tol


def qwen2_policy(size: str, seed: int = 0) -> Policy:
    """A randomly initialised Qwen2ForCausalLM of ``SIZES[size]`` with the embedded tokenizer."""
    tok = build_tokenizer()
    shape = dict(SIZES[size])
    vocab, tied = shape.pop("vocab", len(tok)), shape.pop("tied", False)
    # ids past the tokenizer's 30 decode to "" (the rewards are seeded in the fixture batch)
    cfg = Qwen2Config(vocab_size=vocab, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=tied, rms_norm_eps=1e-6, **shape)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # logit_v = norm(h) . E_v: std sqrt(hidden) * init * weight
        model.model.norm.weight.fill_(
            LOGIT_STD / (cfg.initializer_range * math.sqrt(cfg.hidden_size)))
    model.eval()
    return Policy(model=model, tokenizer=tok, name=f"qwen2-{size}", meta={"size": size})


def on(policy: Policy, device: torch.device, dtype: torch.dtype) -> Policy:
    """A copy of ``policy`` on ``device`` in ``dtype`` (float64: the verified float64 copy)."""
    model = exact_float64(policy.model) if dtype == torch.float64 else copy.deepcopy(
        policy.model).to(dtype=dtype)
    return dataclasses.replace(policy, model=model.to(device).eval())


def batch_to(batch, device: torch.device):
    """A RolloutBatch with every tensor on ``device``."""
    moved = {f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
             if isinstance(getattr(batch, f.name), torch.Tensor)}
    return dataclasses.replace(batch, **moved)


def max_err(got, ref, mask=None, *, relative: bool = True) -> float:
    """max |got - ref| over ``mask`` (all entries by default), in float64; divided by max |ref|
    when ``relative``. inf when nothing is compared, the shapes differ or the reference is all
    zero (such a row can never pass)."""
    got = torch.as_tensor(got).detach().double().cpu()
    ref = torch.as_tensor(ref).detach().double().cpu()
    if mask is not None:
        mask = torch.as_tensor(mask).cpu().bool()
        got, ref = got[mask], ref[mask]
    if got.shape != ref.shape or ref.numel() == 0 or not bool(ref.abs().max() > 0):
        return math.inf
    diff = float((got - ref).abs().max())
    return diff / float(ref.abs().max()) if relative else diff


class Timer:
    """Wall time (CUDA events when on CUDA) and peak memory of one phase."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __enter__(self) -> Timer:
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start, self.end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            self.start.record()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.end.record()
            torch.cuda.synchronize()
            self.time_s = self.start.elapsed_time(self.end) / 1000
            self.peak_mib = torch.cuda.max_memory_allocated() / 2**20
        else:
            self.time_s = time.perf_counter() - self.t0
            self.peak_mib = math.nan


def synthetic_inputs(vocab: int, B: int, L: int, seed: int = 0):
    """``[B, L]`` ids, response mask and attention mask: row 1 left-padded by 3, responses from
    position L // 4, one hole (an environment token) in the last row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (B, L), generator=g)
    am = torch.ones(B, L, dtype=torch.long)
    if B > 1:
        am[1, :3] = 0
    ids = ids * am
    rm = torch.zeros(B, L)
    rm[:, L // 4:] = 1
    rm[-1, L // 2] = 0
    return ids, rm * am, am


def fixture_batch(ref: Policy, task, prompts, G: int):
    """One batch for every device (same tokens): sampled by the reference, then the first
    token tied within two halves of each group (so the prefix trie has shared steps, each
    with advantages of both signs: the fixed rewards 0 and 1 open the first half) and
    seeded rewards in {0, 0.5, 1} (a random-init policy earns 0 everywhere: advantages, losses
    and gradients would all be 0 and prove nothing). The sampling statistics (log-probs,
    entropies, sum pi^2) are the reference's on the edited tokens: the sampler's would be
    stale there, and every PPO ratio would read that mismatch instead of the model's step."""
    batch = sample(ref, task, prompts, G, seed=0)
    tokens = batch.tokens.clone()
    # not one token for the whole group: sum_i A_i grad logp_0 would cancel exactly, and Adam
    # (g / (|g| + eps)) turns float32's rounding residue of that 0 into a full step
    tokens[:, :, 0] = tokens[:, :2, 0].repeat_interleave(G // 2, dim=1)
    g = torch.Generator().manual_seed(0)
    rewards = torch.randint(0, 3, batch.rewards.shape, generator=g).to(batch.rewards) / 2
    rewards[:, 0], rewards[:, 1] = 0.0, 1.0  # never an all-agree group
    batch = dataclasses.replace(batch, tokens=tokens, rewards=rewards)
    flat = batch.flat()
    dev = ref.device
    st = forward_stats(ref.model, flat.input_ids.to(dev), flat.response_mask.to(dev),
                       flat.attention_mask.to(dev))
    P, G_, T = tokens.shape
    m = batch.mask != 0

    def resp(x):  # [B, L] -> [P, G, T] response positions, 0 off the mask
        x = x[:, flat.prompt_len:].reshape(P, G_, T).to(batch.logprobs)
        return torch.where(m, x, torch.zeros_like(x))

    return dataclasses.replace(batch, logprobs=resp(st.logp), entropy=resp(st.entropy),
                               sum_pi_sq=resp(st.sum_pi_sq))


# --- phases: each returns {quantity: (value, kind, mask or None)} on the given policy ------

def phase_forward(pol, ctx) -> dict:
    ids, rm, am = (x.to(pol.device) for x in ctx["inputs"])
    st = forward_stats(pol.model, ids, rm, am)
    return {"logp": (st.logp, "nats", rm), "entropy": (st.entropy, "rel", rm),
            "sum_pi_sq": (st.sum_pi_sq, "rel", rm), "w_t": (st.proxy, "rel", rm)}


def phase_norms(pol, ctx) -> dict:
    ids, rm, am = (x.to(pol.device) for x in ctx["inputs"])
    r = token_grad_norms(pol.model, ids, rm, am, progress=False)
    seq = sequence_grad_norms(pol.model, ids, rm, am)
    return {"token_sq": (r.token_sq, "norm", rm), "prefix_sq": (r.prefix_sq, "norm", rm),
            "sequence_sq": (seq, "norm", None)}


def phase_sampling(pol, ctx) -> dict:
    """The sampler's own statistics of the tokens it drew (KV-cache decode) against a full
    forward of the reference model on those tokens (on the reference device)."""
    batch = sample(pol, ctx["task"], ctx["prompts"], ctx["G"], seed=ctx["seed"])
    flat = batch.flat()
    ref = ctx["ref_policy"]
    dev = ref.device
    st = forward_stats(ref.model, flat.input_ids.to(dev), flat.response_mask.to(dev),
                       flat.attention_mask.to(dev))
    P, G, T = batch.tokens.shape
    lp = st.logp[:, flat.prompt_len:].reshape(P, G, T)
    ent = st.entropy[:, flat.prompt_len:].reshape(P, G, T)
    mask = batch.mask.cpu()
    return {"logp (KV cache)": (batch.logprobs, "nats", mask, lp),
            "entropy (KV cache)": (batch.entropy, "rel", mask, ent)}


def phase_proxy(pol, ctx) -> dict:
    rec = token_records(pol, batch_to(ctx["batch"], pol.device), state="check")
    return {c: (torch.tensor(rec[c].to_numpy()), "rel" if c.startswith(("w", "W")) else "norm",
                None) for c in ("w_t", "W_t", "token_sq", "prefix_sq")}


def phase_variance(pol, ctx) -> dict:
    task = ctx["variance_task"]  # sort n = 1: every response enumerated (V of them)
    dist = enumerate_distribution(pol, task, task.prompts(1, seed=0)[0])
    table = response_table(pol, dist, sketch_dim=ctx["sketch_dim"], sketch_seed=1)
    cells, _ = table_cells(table, 4, 8, schemes=("centered", "rloo"), exact=True)
    exact = cells[cells["method"] == "exact"].sort_values(["scheme", "mode"])
    out = {"g* (exact reference)": (table.reference(), "norm", None)}
    for col in ("variance", "mse"):
        out[f"exact {col}"] = (torch.tensor(exact[col].to_numpy(dtype=float)), "norm", None)
    return out


CANCEL_CLIP = (0.99, 100.0)  # ratios in [0.01, 101]


def shared_sketch(pol, ctx) -> CountSketch | None:
    """The cancellation phase's CountSketch on ``pol``'s device: None (``token_vectors`` draws
    it from seed 1) where the reference is on the same device type, so both draw one S; else
    the reference device's S (seed 1), its hashes moved to ``pol``'s device (CPU and CUDA
    generators draw different S for one seed)."""
    ref = ctx["ref_policy"]
    if ctx["sketch_dim"] is None or pol.device.type == ref.device.type:
        return None
    if "sketch_hashes" not in ctx:
        ctx["sketch_hashes"] = CountSketch.for_model(ref.model, ctx["sketch_dim"], 1).hashes()
    bs, ss = ctx["sketch_hashes"]
    return CountSketch.from_hashes([b.to(pol.device) for b in bs],
                                   [s.to(pol.device) for s in ss], ctx["sketch_dim"],
                                   device=pol.device)


def phase_cancellation(pol, ctx) -> dict:
    """Shared-step residuals after one PPO inner step, with GSPO's sequence ratio, and the
    per-token gradient vectors they read.

    With a token ratio every member of a shared step (one prefix, one token) has the same
    ratio, so ``c`` is constant there and ``rel_residual`` = ``|sum A| / sum |A|`` whatever the
    model (a row that cannot fail); the sequence ratio differs across members. ``grad_ratio``
    equals ``rel_residual`` (the members' token gradients are one vector), so the vectors get
    their own row."""
    batch = batch_to(ctx["batch"], pol.device)
    mask = batch.mask != 0
    rewards = batch.rewards.to(batch.logprobs.dtype)
    adv = advantages("centered", rewards, mask, logprobs=batch.logprobs,
                     sum_pi_sq=batch.sum_pi_sq)
    # one PPO inner step (k = 1) on the device: the ratios, hence c, depend on the model (at
    # k = 0 every shared-step quantity is a function of the batch alone)
    # a step well above bfloat16's weight resolution, under a clip wide enough that no member
    # leaves it (a clipped member has c = 0, and a step of only clipped members proves nothing)
    logps = ppo_logps(pol, batch, adv, [1], lr=1e-3, clip=CANCEL_CLIP)
    c = sample_weights(logps[1], batch.logprobs, adv, mask, "seq-mean-token-sum",
                       ratio="sequence", clip=CANCEL_CLIP)
    tv = token_vectors(pol.model, batch, sketch_dim=ctx["sketch_dim"], sketch_seed=1,
                       sketch=shared_sketch(pol, ctx))
    df = shared_steps(batch.tokens, adv, c, mask, env_mask=batch.env_mask,
                      token_grads=tv.vec)
    df = df.sort_values(["p", "t", "token"]).reset_index(drop=True)
    # rel_residual where the members' advantages have both signs (< 1 for any c > 0); where
    # they share one sign it is 1 for any c. Both sides select alike unless a c is 0 (then
    # the shapes differ: a FAIL)
    mixed = df[df["rel_residual"] < 1 - 1e-6]
    out = {"residual (k=1)": (torch.tensor(df["residual"].to_numpy(dtype=float)), "norm", None),
           "rel_residual (k=1, mixed signs)": (
               torch.tensor(mixed["rel_residual"].to_numpy(dtype=float)), "norm", None)}
    out[f"token vectors ({tv.sketch})"] = (tv.vec, "norm", None)
    with torch.no_grad():
        lr_ = (logps[1] - batch.logprobs)[mask].abs().mean()
    out["mean |log ratio| (k=1)"] = (lr_, "norm", None)
    return out


def phase_train(pol, ctx) -> dict:
    """Three AdamW steps of the clipped loss on one fixed batch (the losses and gradient
    norms are compared), then three steps of the real loop (``LOOP_RECORDS`` against the float64
    loop on the candidate's device)."""
    model = copy.deepcopy(pol.model).train()
    dev = pol.device
    batch = batch_to(ctx["batch"], dev)
    flat = batch.flat()
    P, G, T = batch.tokens.shape
    mask = batch.mask
    adv = advantages("centered", batch.rewards.double(), mask != 0).to(dev)
    old = batch.logprobs
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, gnorms = [], []
    for _ in range(3):
        opt.zero_grad()
        logits = forward_logits(model, flat.input_ids, flat.attention_mask).logits
        lp = token_logprobs(logits.float(), flat.input_ids)[:, flat.prompt_len:]
        loss, _ = policy_loss(lp.reshape(P, G, T), old.to(lp.dtype), adv.to(lp.dtype),
                              mask.to(lp.dtype), "token-mean")
        loss.backward()
        gnorms.append(torch.stack([p.grad.double().norm() for p in model.parameters()
                                   if p.grad is not None]).norm())
        losses.append(loss.detach().double())
        opt.step()
    out = {"loss x3 (fixed batch)": (torch.stack(losses), "nats", None),
           "grad norm x3": (torch.stack(gnorms), "norm", None)}
    if ctx.get("loop") and pol is not ctx["ref_policy"]:
        # the real loop against the float64 loop ON THE CANDIDATE'S DEVICE: the sampler draws
        # from a generator on the model's device, and CPU and CUDA generators draw other tokens
        refs = ctx.setdefault("loop_refs", {})
        if pol.device.type not in refs:
            ref = ctx["ref_policy"]
            ref = dataclasses.replace(ref, model=copy.deepcopy(ref.model).to(pol.device))
            refs[pol.device.type] = _loop_steps(ref, ctx)
        recs, want = _loop_steps(pol, ctx), refs[pol.device.type]
        for j, col in enumerate(LOOP_RECORDS):  # one row per record: each on its own scale
            out[f"loop x3 {col}"] = (recs[:, j] if recs.dim() == 2 else recs, "norm", None,
                                     want[:, j] if want.dim() == 2 else want)
    return out


# The loop's records compared with the reference loop's. Not loss/total: on-policy (one
# epoch, ratio 1) with centred advantages it is -mean(A) = 0 for any model. The loop runs on
# the tokenizer-vocabulary sizes only (``loop``): a real-vocabulary model's ids past the
# tokenizer decode to "", so every reward and gradient of its loop is 0, and its mean entropy
# is set by the logit scale (a wrong model matches it); its tied head's training is the
# fixed-batch rows (seeded rewards).
LOOP_RECORDS = ("grad/norm", "policy/entropy")


def _loop_steps(pol, ctx) -> torch.Tensor:
    from varbench.models.io import save_policy
    from varbench.train.config import TrainConfig
    from varbench.train.loop import train

    with tempfile.TemporaryDirectory() as tmp:
        model = copy.deepcopy(pol.model)
        ckpt = save_policy(dataclasses.replace(
            pol, model=model if model.dtype == torch.float64 else model.float()),
            Path(tmp) / "ckpt")
        dtype = str(next(pol.model.parameters()).dtype).removeprefix("torch.")
        cfg = TrainConfig(policy=str(ckpt), warm_start=False, task="sort",
                          reward="inclusion_adjacency",  # partial credit: rewards differ
                          task_options={"n": 2}, steps=3, G=ctx["G"], prompts_per_step=4,
                          eval_every=3, eval_prompts=2, eval_samples=1, dtype=dtype,
                          device=str(pol.device), seed=ctx["seed"])
        df = train(cfg, run_dir=Path(tmp) / "run", resume=False, progress=False).records
    steps = df[df["step"] >= 1] if "step" in df else df.iloc[:0]
    if len(steps) != 3 or not all(c in steps for c in LOOP_RECORDS):
        return torch.tensor([math.nan])  # not three recorded steps: a FAIL
    return torch.tensor(steps[list(LOOP_RECORDS)].to_numpy(dtype=float))


PHASE_FNS: dict[str, Callable] = {
    "forward": phase_forward, "norms": phase_norms, "sampling": phase_sampling,
    "proxy": phase_proxy, "variance": phase_variance, "cancellation": phase_cancellation,
    "train": phase_train,
}


def _compare(kind: str, dtype: str, got, ref, mask) -> tuple[float, float]:
    tol = TOLERANCES[(dtype, kind)]
    err = max_err(got, ref, mask, relative=kind != "nats")
    return err, tol


def run_size(size: str, device: torch.device, ref_device: torch.device, dtypes: list[str],
             phases: list[str], *, seq: int, batch_rows: int, sketch_dim: int | None,
             loop: bool, say: Callable[[str], None]) -> list[Row]:
    """Every phase of one model size on ``device`` in each dtype against float64 on
    ``ref_device``."""
    base = qwen2_policy(size)
    if "vocab" in SIZES[size]:
        phases = [ph for ph in phases if ph not in ENUMERATES_VOCAB]
    ctx_len = base.context_length
    if seq > ctx_len:
        raise SystemExit(f"--seq {seq} exceeds the {size} model's context {ctx_len}")
    ref = on(base, ref_device, torch.float64)
    task = get_task("sort", n=2)
    prompts = task.prompts(1, seed=0)
    G = 8
    batch = fixture_batch(ref, task, prompts, G)
    ctx = {"inputs": synthetic_inputs(ref.model.config.vocab_size, batch_rows, seq),
           "task": task, "variance_task": get_task("sort", n=1), "prompts": prompts, "G": G,
           "seed": 0, "batch": batch,
           "ref_policy": ref, "sketch_dim": sketch_dim,
           "loop": loop and "vocab" not in SIZES[size]}
    refs = {}
    for ph in phases:
        t0 = time.perf_counter()
        refs[ph] = PHASE_FNS[ph](ref, ctx)
        say(f"  reference {size} {ph}: {time.perf_counter() - t0:.1f}s")
    rows: list[Row] = []
    ref_tag = f"{ref_device.type}/float64"
    for dtype in dtypes:
        cand = on(base, device, getattr(torch, dtype))
        if device.type == "cuda":
            phase_norms(cand, ctx)  # warm-up: kernels, allocator, cuBLAS handles
        for ph in phases:
            attn = (batched_backward_attention(cand.model) if ph in BATCHED_BACKWARD
                    else contextlib.nullcontext(None))
            with attn as note, Timer(device) as tm:
                got = PHASE_FNS[ph](cand, ctx)
            if note:
                say(f"  {note}")
            for q, item in got.items():
                if "vocab" in SIZES[size] and (ph, q) in VOCAB_SCALE_BOUND:
                    continue  # cannot fail at this vocabulary (VOCAB_SCALE_BOUND)
                value, kind, mask = item[:3]
                want = item[3] if len(item) > 3 else refs[ph].get(q, (None,))[0]
                err, tol = _compare(kind, dtype, value, want, mask)
                rows.append(Row(size, ph, dtype, q, err, tol, ref_tag, tm.time_s, tm.peak_mib))
            say(f"  {size} {ph} {dtype}: {tm.time_s:.2f}s")
        del cand
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# One CLI run of each analysis on a saved checkpoint, as one process and as 2 torchrun ranks
# (gloo; each rank on the CPU, or its own GPU under NCCL with 2 GPUs): every table of the
# two runs must agree (the one-process run is the 2-rank run's reference).
CLI_RUNS = {
    "proxy": ["proxy", "--task", "sort", "--knob", "n=2", "--n-prompts", "3", "--n-boot", "20"],
    "variance": ["variance", "--task", "sort", "--knob", "n=2", "--reward",
                 "inclusion_adjacency", "--n-prompts", "3", "-G", "2", "-M", "6", "--schemes",
                 "centered", "otb", "--reference", "sampled", "--n-ref", "16", "--sketch-dim",
                 "64", "--min-responses", "0"],
    "cancellation": ["cancellation", "--task", "sort", "--knob", "n=2", "--n-prompts", "3",
                     "-G", "4", "--inner-steps", "0", "1", "--modes", "seq-mean-token-sum",
                     "--sketch-dim", "32"],
}
CLI_TOL = 1e-5  # float32 model, same thread count: reductions of other batch splits round apart


def _torchrun(argv: list[str], out: Path, timeout: int = 300) -> tuple[int, str]:
    """``torchrun --nproc_per_node 2 -m varbench ARGV --out OUT`` (one launch per command: a
    command leaves the process group when done); (exit code, output tail). A launch past
    ``timeout`` is killed with its ranks (its own process group) and counts as failed."""
    import os
    import signal
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "varbench", *argv, "--out", str(out)], env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        return 124, (text or "")[-2000:] + f"\n(killed after {timeout}s)"
    return proc.returncode, (text or "")[-2000:]


def _tables_err(got: Path, ref: Path) -> float:
    """Largest normwise relative difference over every numeric column of every table of two
    report directories; inf when the tables, their columns or a text column differ."""
    names = sorted(p.name for p in (ref / "tables").glob("*.csv"))
    if not names or names != sorted(p.name for p in (got / "tables").glob("*.csv")):
        return math.inf
    worst = 0.0
    for n in names:
        fa, fb = (got / "tables" / n).read_bytes(), (ref / "tables" / n).read_bytes()
        if not fb.strip() or not fa.strip():  # an empty table: equal only to an empty one
            if fa.strip() != fb.strip():
                return math.inf
            continue
        a, b = pd.read_csv(got / "tables" / n), pd.read_csv(ref / "tables" / n)
        if list(a.columns) != list(b.columns) or len(a) != len(b) or not len(b):
            return math.inf
        for col in b.columns:
            if pd.api.types.is_numeric_dtype(b[col]) and pd.api.types.is_numeric_dtype(a[col]):
                x = torch.tensor(a[col].to_numpy(dtype=float))
                y = torch.tensor(b[col].to_numpy(dtype=float))
                if not torch.equal(x.isnan(), y.isnan()):
                    return math.inf
                keep = ~y.isnan()
                if keep.any() and y[keep].abs().max() > 0:
                    worst = max(worst, max_err(x[keep], y[keep]))
                elif keep.any() and x[keep].abs().max() > 0:
                    return math.inf
            elif a[col].astype(str).tolist() != b[col].astype(str).tolist():
                return math.inf
    return worst


def cli_rows(say: Callable[[str], None], runs: dict | None = None) -> list[Row]:
    """The ``CLI_RUNS`` on a saved float32 quick checkpoint: one process against 2 ranks."""
    from varbench.app.cli import main as cli_main
    from varbench.models.io import save_policy

    runs = CLI_RUNS if runs is None else runs
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = save_policy(qwen2_policy("quick"), tmp / "ckpt")
        argv = {k: [*v, "--policy", str(ckpt), "--device", "cpu", "--dtype", "float32",
                    "--no-cache", "--no-progress"] for k, v in runs.items()}
        dp = {}
        for name, a in argv.items():
            t0 = time.perf_counter()
            code, text = _torchrun(a, tmp / "dp" / name)
            dp[name] = (code, time.perf_counter() - t0)
            if code != 0:
                say(f"  torchrun varbench {name} failed ({code}):\n{text}")
        n = torch.get_num_threads()
        torch.set_num_threads(1)  # as each rank: float32 reductions round alike
        try:
            for name, a in argv.items():
                t0 = time.perf_counter()
                code = cli_main([*a, "--out", str(tmp / "one" / name)])
                one_s = time.perf_counter() - t0
                dp_code, dp_s = dp[name]
                err = (math.inf if code != 0 or dp_code != 0
                       else _tables_err(tmp / "dp" / name, tmp / "one" / name))
                rows.append(Row("quick", "cli", "float32", f"varbench {name}: 2 ranks",
                                err, CLI_TOL, "1 process", one_s + dp_s))
                say(f"  cli {name}: {one_s:.1f}s, 2 ranks {dp_s:.1f}s")
        finally:
            torch.set_num_threads(n)
    return rows


def table(rows: list[Row]) -> pd.DataFrame:
    return pd.DataFrame([{
        "size": r.size, "phase": r.phase, "dtype": r.dtype, "quantity": r.quantity,
        "err": r.err, "tol": r.tol, "result": "PASS" if r.passed else "FAIL", "ref": r.ref,
        "time_s": r.time_s, "peak_MiB": r.peak_mib} for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="candidate device (default cuda)")
    ap.add_argument("--quick", action="store_true",
                    help="tiny shapes only (the CPU smoke run of the test suite)")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=["float32", "bfloat16"])
    ap.add_argument("--phases", nargs="+", default=list(PHASES), choices=list(PHASES))
    ap.add_argument("--no-realistic", action="store_true", help="skip the realistic size")
    ap.add_argument("--seq", type=int, default=256,
                    help="sequence length of the norms phase at the realistic size")
    ap.add_argument("--no-cli", action="store_true",
                    help="skip the CLI runs (one process against 2 torchrun ranks)")
    ap.add_argument("--csv", default=None, help="also write the table to this CSV file")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: FAIL: --device cuda but torch.cuda.is_available() is False "
              f"(torch {torch.__version__}, CUDA build {torch.version.cuda})")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    say = lambda m: print(m, flush=True)  # noqa: E731
    start = time.perf_counter()
    if device.type == "cuda":
        say(f"gpu_check on {torch.cuda.get_device_name(device)} (torch {torch.__version__}, "
            f"CUDA {torch.version.cuda})")
    plan = ([("quick", torch.device("cpu"), 16, 2, None),
             ("quick-vocab", torch.device("cpu"), 16, 2, 256)] if args.quick
            else [("check", torch.device("cpu"), 64, 3, None)])
    if device.type == "cuda" and not args.quick and not args.no_realistic:
        plan.append(("realistic", device, args.seq, 2, 256))
    rows: list[Row] = []
    for size, ref_device, seq, b, sketch in plan:
        rows += run_size(size, device, ref_device, args.dtypes, args.phases, seq=seq,
                         batch_rows=b, sketch_dim=sketch, loop=True, say=say)
    if not args.no_cli:
        rows += cli_rows(say)
    df = table(rows)
    with pd.option_context("display.max_rows", None, "display.width", 200):
        print(df.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    if args.csv:
        df.to_csv(args.csv, index=False)
    failed = int((df["result"] == "FAIL").sum())
    missing = [(p, d) for p in args.phases for d in args.dtypes
               if not ((df["phase"] == p) & (df["dtype"] == d)).any()]
    print(f"gpu_check: {len(df) - failed} PASS, {failed} FAIL"
          + (f", phases without a row: {missing}" if missing else "")
          + f" ({time.perf_counter() - start:.0f}s)")
    return 1 if failed or missing else 0


if __name__ == "__main__":
    sys.exit(main())
