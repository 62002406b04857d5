"""The GRPO/PPO training loop of docs/science.md section 7, top to bottom (cleanrl style).

Per step: draw prompts; sample G responses each from the current policy (temperature 1); score;
compute Delta with the configured scheme; store ``logp_old`` (and, with a KL term, the frozen
reference's log-probs) detached; run ``epochs`` x ``minibatches`` clipped-ratio updates over the
same responses; record everything; every ``eval_every`` steps measure held-out exact-match
accuracy (sampled and greedy) on a fixed set of held-out prompts.

Run it:  ``varbench train --scheme otb -G 4 --steps 50 --out runs/otb4``
or from Python: ``train(TrainConfig(scheme="otb", G=4), run_dir="runs/otb4")``.

One seed drives everything through explicit generators: ``train_gen`` draws prompts, sampling
seeds and minibatch orders; evaluation uses a fixed seed of its own, so evaluating more or less
often never changes the training stream. Checkpoints store the generator state, so a resumed run
reproduces an uninterrupted one's records exactly (timing columns aside).

Speed (``benchmarks/bench_train.py``, against the loop before these changes): an update's
teacher-forced forward runs each group's prompt once and the G responses on its repeated keys
and values (``response_logprobs(..., shared_prompt=True)``: ``P Lp + P G (T - 1)`` positions
instead of ``P G (Lp + T)``); the sampler's rewards are used as they are (texts are scored
once) and, for a float32/float64 model without a reference model, its log-probs are
``logp_old``; AdamW runs torch's fused kernel. The update is the same up to float64 rounding
(tests/test_train_loop.py against tests/reference_train.py); the random draws are unchanged.
``update_forward="sampler"`` drops the update's forward: the loss backpropagates through the
sampler's own calls (``sample(..., differentiable=True)``), the same gradient up to rounding
(the same test), worth it for responses of a few tokens only (the config field's docstring).

Data-parallel under torchrun (``varbench.train.parallel``): rank 0 samples, scores and
computes Delta; each rank runs the update's forward and backward on its share of the groups;
the gradients are summed before clipping; rank 0 evaluates and writes. Equals one process up to
float rounding (tests/test_distributed_train.py).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from varbench._util.checks import UsageError
from varbench._util.config import resolve_dtype
from varbench._util.distributed import lead_first, rank_world
from varbench._util.locks import dir_lock
from varbench._util.progress import show_progress
from varbench.estimators import advantages, kl_penalty, policy_loss
from varbench.estimators.coefficients import sample_weights
from varbench.grads import token_grad_norms
from varbench.models import Policy
from varbench.rollout import check_differentiable, sample
from varbench.rollout.logprobs import logprob_rows
from varbench.rollout.sampler import check_rollout_memory
from varbench.train import parallel, setup
from varbench.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from varbench.train.collapse import CollapseDetector
from varbench.train.config import TrainConfig, with_defaults
from varbench.train.records import RecordWriter, as_records, read_records

_EVAL_SEED_OFFSET = 1_000_003  # sampling seed of evaluations: eval_seed + this


@dataclass
class TrainResult:
    """What :func:`train` returns: the records (one row per step, row 0 = start) and the policy."""

    records: pd.DataFrame
    policy: Policy
    run_dir: Path | None
    stopped: str  # "steps" or "token_budget": why the run ended


def lr_at(config: TrainConfig, step: int) -> float:
    """Learning rate of update step ``step`` (1-based): linear warmup, then the schedule."""
    if config.warmup_steps and step <= config.warmup_steps:
        return config.lr * step / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    frac = min(1.0, (step - config.warmup_steps - 1) / span)
    if config.lr_schedule == "linear":
        return config.lr * (1.0 - frac)
    if config.lr_schedule == "cosine":
        return config.lr * 0.5 * (1.0 + math.cos(math.pi * frac))
    return config.lr


def minibatch_loss(
    config: TrainConfig,
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    logp_ref: torch.Tensor | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy loss aggregated by ``config.agg`` plus ``kl_coef`` x the KL estimator.

    Shapes ``[p, G, T]``. The policy part is ``-min(r A, clip(r, 1-eps_lo, 1+eps_hi) A)``
    (docs/science.md section 7) from ``varbench.estimators.policy_loss``; the KL term uses the same
    aggregation weights so its scale does not depend on the mode's normaliser.
    """
    clip = (config.clip_low, config.clip_high)
    loss, metrics = policy_loss(logp, logp_old, adv, mask, config.agg, clip=clip,
                                ratio=config.ratio)
    if config.transform != "none":
        # v: the per-token weight multiplying A in the gradient (aggregation weight x ratio x
        # clip indicator), transformed within each group and detached; the surrogate's
        # gradient is sum v~ (-A) grad logp, while the recorded loss value stays the
        # untransformed one.
        v = sample_weights(logp, logp_old, adv, mask, config.agg, clip=clip, ratio=config.ratio,
                           transform=config.transform)
        surrogate = torch.where(mask, v * -adv.detach() * logp, 0).sum()
        loss = loss.detach() + (surrogate - surrogate.detach())
    kl_loss = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if config.kl_coef > 0 and logp_ref is not None:
        kl_tok = kl_penalty(logp, logp_ref, kind=config.kl_kind)  # [p, G, T]
        kl_loss = setup.aggregate(kl_tok, mask, config.agg)
    total = loss + config.kl_coef * kl_loss
    out = {"loss/policy": float(loss.detach()), "loss/kl": float(kl_loss.detach()),
           "loss/total": float(total.detach())}
    out.update({f"ppo/{k}": float(v) for k, v in metrics.items()})
    return total, out


def exact_token_weights(model: torch.nn.Module, batch) -> torch.Tensor:
    """``[P, G, T]`` exact per-token gradient norms ||grad_theta log pi(y_t)||^2 of ``batch``'s
    responses under ``model`` (the exact harness; 0 off the policy's tokens), in float32 or
    better: OTB's exact token weights."""
    flat = batch.flat()
    dev = next(model.parameters()).device
    ids, resp, attn = (x.to(dev) for x in (flat.input_ids, flat.response_mask,
                                           flat.attention_mask))
    tok = token_grad_norms(model, ids, resp, attn, progress=False).token_sq
    P, G, T = batch.tokens.shape
    return tok[:, -T:].reshape(P, G, T)


def train(
    config: TrainConfig,
    run_dir: str | Path | None = None,
    *,
    policy: Policy | None = None,
    resume: bool = False,
    progress: bool | None = None,
) -> TrainResult:
    """Run ``config``; write ``run_dir/records.csv`` (+ checkpoints) when ``run_dir`` is given.

    ``policy`` overrides ``config.policy``; a deep copy of it is trained (in ``config.dtype``
    on ``config.device``), so the caller's object never changes; the trained policy is
    ``result.policy``. bfloat16 trains through float32 master weights and AdamW states
    (:class:`varbench.train.setup.MasterWeightAdamW`). ``resume=True`` continues from the
    latest checkpoint in ``run_dir`` (a fresh start when there is none).
    """
    setup.check_config(config)
    parallel.check_world(config)
    run_dir = Path(run_dir) if run_dir is not None else None
    if resume and run_dir is None:
        raise UsageError("resume=True needs run_dir (where the checkpoints are)")
    if config.checkpoint_every and run_dir is None:
        raise UsageError("checkpoint_every > 0 needs run_dir (where to write checkpoints)")
    parallel.check_same_config(config)
    if run_dir is None or rank_world()[0] != 0:  # data-parallel: rank 0 writes, the rest read
        return _train(config, run_dir, policy, resume, progress)
    run_dir.mkdir(parents=True, exist_ok=True)
    with dir_lock(run_dir, what="training run directory"):  # one writer of records/checkpoints
        return _train(config, run_dir, policy, resume, progress)


def _train(config: TrainConfig, run_dir: Path | None, policy: Policy | None, resume: bool,
           progress: bool | None) -> TrainResult:
    # ---------------------------------------------------------------- setup
    task, reward = setup.build_task(config)
    lead = rank_world()[0] == 0  # the rank that samples, evaluates and writes (one process: it)
    device = parallel.train_device(config.device)  # under NCCL: this rank's own GPU
    if policy is None:
        with lead_first():  # a warm start is trained once (rank 0), then read from the cache
            policy = setup.policy_for(config, task)
        dtype = resolve_dtype(config.dtype, "dtype")
        policy.model.to(device=device, dtype=dtype)
    else:
        policy = setup.own_policy(policy, config, task, device=device)
    parallel.broadcast_module(policy.model)  # every rank starts from rank 0's weights
    # a step samples prompts_per_step x G responses, an evaluation eval_prompts x eval_samples:
    # refused before the first step when either cannot fit this device's memory
    T = task.max_new_tokens
    check_rollout_memory(policy, config.prompts_per_step, config.G, T)
    check_rollout_memory(policy, config.eval_prompts, config.eval_samples, T, arg="eval_samples")
    model = policy.model
    ref_model = None
    if config.kl_coef > 0:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = setup.make_optimizer(params, config)
    train_gen = torch.Generator(device="cpu").manual_seed(config.seed)  # host draws: seeds, orders
    detector = CollapseDetector(surge_factor=config.surge_factor, window=config.surge_window,
                                entropy_floor=config.entropy_floor)
    eval_prompts = task.prompts(config.eval_prompts, split="heldout", seed=config.eval_seed)
    eval_seed = config.eval_seed + _EVAL_SEED_OFFSET
    counters = {"tokens_sampled": 0, "tokens_env": 0, "wall_s": 0.0}
    rows: list[dict] = []
    start = 0
    if resume:
        # rank 0's choice, read by every rank (--out on a file system every rank sees)
        ckpt = parallel.share(latest_checkpoint(run_dir) if lead else None, device)
        if ckpt is not None:
            start, state = load_checkpoint(ckpt, model, optimizer, {"train": train_gen})
            if lead:  # the others' configs equal rank 0's (check_same_config), device aside
                _check_same_run(config, state["config"], ckpt)
            counters = state["counters"]
            detector.load_state_dict(state["detector"])
    writer = None
    if run_dir is not None and lead:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(config.to_json())
        writer = RecordWriter(run_dir / "records.csv", resume_step=start if start > 0 else None,
                              last_row=state.get("last_row") if start > 0 else None,
                              records_sha256=state.get("records_sha256") if start > 0 else None)
        if resume and start > 0:
            rows = read_records(run_dir / "records.csv").to_dict("records")

    def emit(row: dict) -> None:
        rows.append(row)
        if writer is not None:
            writer.write(row)

    show = show_progress(progress)
    bar = tqdm(total=config.steps, initial=start, disable=not show, desc=f"train {config.scheme}")

    if start == 0:  # row 0: the starting policy, before any update
        t0 = time.perf_counter()
        row = {"step": 0, "tokens/sampled": 0, "tokens/env": 0}
        if lead:  # the others' rows are replaced by rank 0's at the end
            row.update(setup.evaluate(policy, task, eval_prompts, reward, config, eval_seed))
        row["time/eval_s"] = time.perf_counter() - t0
        row["time/wall_s"] = counters["wall_s"] = row["time/eval_s"]
        emit(row)

    bptt = config.update_forward == "sampler"
    if bptt:
        check_differentiable(policy, "update_forward='sampler'",
                             "use update_forward='teacher-forced'")
    stopped = "steps"
    for step in range(start + 1, config.steps + 1):
        if config.token_budget and counters["tokens_sampled"] >= config.token_budget:
            stopped = "token_budget"
            break
        t_step = time.perf_counter()
        lr = lr_at(config, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        row: dict = {"step": step, "lr": lr}

        # ---- 1-3. rank 0 samples, scores and computes Delta; every rank gets them (share)
        prompt_seed, sample_seed = torch.randint(0, 2**62, (2,), generator=train_gen,
                                                  device=train_gen.device).tolist()
        model.eval()
        batch, rewards, exact, adv, logp_graph = None, None, None, None, None
        if lead:
            batch, rewards, exact, adv, logp_graph = _rollout(
                config, policy, task, reward, prompt_seed, sample_seed, bptt, row)
        batch, rewards, exact, adv = parallel.share((batch, rewards, exact, adv), device)
        mask = batch.mask.bool()  # [P, G, T]
        n_sampled, n_env = int(batch.mask.sum()), int(batch.env_mask.sum())
        counters["tokens_sampled"] += n_sampled
        counters["tokens_env"] += n_env
        row.update({"tokens/sampled": counters["tokens_sampled"],
                    "tokens/env": counters["tokens_env"], "tokens/step_sampled": n_sampled})

        agree = rewards.max(1).values == rewards.min(1).values  # [P]
        row.update({
            "train/reward_mean": float(rewards.mean()), "train/reward_std": float(rewards.std()),
            "train/exact_mean": float(exact.mean()),
            "train/all_agree_frac": float(agree.float().mean()),
            "train/response_len": float(batch.lengths.float().mean()),
            "policy/entropy": float(batch.entropy[mask].mean()),
        })

        # ---- optional dynamic filtering
        t0 = time.perf_counter()
        keep = torch.arange(batch.P, device=mask.device)
        if config.dynamic_filter:
            keep = (~agree).nonzero()[:, 0]
        vals = adv[mask]
        row.update({
            "adv/mean": float(vals.mean()), "adv/std": float(vals.std()),
            "adv/abs_mean": float(vals.abs().mean()),
            "adv/nonzero_frac": float((adv != 0).any(-1).float().mean()),
            "train/groups_used": len(keep),
        })
        row["time/adv_s"] = row.get("time/adv_s", 0.0) + time.perf_counter() - t0

        # ---- 4. logp_old (and the reference's) detached, then epochs x minibatches of updates
        t0 = time.perf_counter()
        if len(keep) == 0:  # every group agreed: nothing to learn this step, nothing to flag
            row.update({"collapse/grad_surge": 0, "collapse/entropy": 0})
        else:
            # With one update per step, pi_old is the policy of that update's own forward: its
            # log-probs, detached, are logp_old (ratio exactly 1) and a second forward is saved.
            single = config.epochs == 1 and config.minibatches == 1
            with torch.no_grad():  # each rank its share of the groups, gathered
                logp_old = None if single else _old_logprobs(model, batch, keep,
                                                              ref_model is not None)
                logp_ref = None
                if ref_model is not None:
                    logp_ref = parallel.sharded_logprobs(ref_model, batch, keep)
            model.train()
            stats: dict[str, list[float]] = {}
            norms: list[float] = []
            kl_sum, kl_n = 0.0, 0
            for epoch in range(config.epochs):
                order = torch.randperm(len(keep), generator=train_gen,
                                      device=train_gen.device).to(keep.device)
                for mb in order.chunk(config.minibatches):
                    groups = keep[mb]
                    # this rank's groups' log-probs in the full tensor (parallel.py); rows
                    # per forward from the memory plan (checkpointed chunks; None: one)
                    logp = (logp_graph[groups] if logp_graph is not None else
                            parallel.sharded_logprobs(model, batch, groups, rows=logprob_rows))
                    old = logp.detach() if logp_old is None else logp_old[mb]
                    ref = None if logp_ref is None else logp_ref[mb]
                    if ref is not None and epoch == 0:  # KL(pi_old || ref) on this step's samples
                        kl_tok = kl_penalty(old, ref, kind="k3", mask=mask[groups])
                        kl_sum, kl_n = kl_sum + float(kl_tok.sum()), kl_n + int(mask[groups].sum())
                    loss, metrics = minibatch_loss(config, logp, old, adv[groups], mask[groups],
                                                   ref)
                    optimizer.zero_grad(set_to_none=True)
                    if loss.requires_grad:  # a rank without groups in this minibatch: no graph
                        loss.backward()
                    clip_to = config.grad_clip if config.grad_clip > 0 else float("inf")
                    clip_params = setup.grads_for_clipping(optimizer, params)
                    parallel.all_reduce_grads(clip_params)  # the ranks' shares, summed
                    norms.append(float(torch.nn.utils.clip_grad_norm_(clip_params, clip_to)))
                    optimizer.step()
                    for k, v in metrics.items():
                        stats.setdefault(k, []).append(float(v))
            model.eval()
            if logp_ref is not None:
                row["policy/kl_ref"] = kl_sum / max(kl_n, 1)
            for key in ("loss/policy", "loss/kl", "loss/total", "ppo/clip_frac", "ppo/approx_kl"):
                if key in stats:
                    row[key] = sum(stats[key]) / len(stats[key])
            row["grad/norm"] = sum(norms) / len(norms)
            row["grad/norm_max"] = max(norms)
            row.update(detector_flags(detector, row["grad/norm"], row["policy/entropy"]))
        row["time/update_s"] = time.perf_counter() - t0

        # ---- 5. held-out evaluation every eval_every steps (and at the last step)
        last = step == config.steps or (
            config.token_budget and counters["tokens_sampled"] >= config.token_budget)
        if lead and (step % config.eval_every == 0 or last):
            t0 = time.perf_counter()
            row.update(setup.evaluate(policy, task, eval_prompts, reward, config, eval_seed))
            row["time/eval_s"] = time.perf_counter() - t0
        row["time/step_s"] = time.perf_counter() - t_step
        counters["wall_s"] += row["time/step_s"]
        row["time/wall_s"] = counters["wall_s"]
        emit(row)
        bar.update(1)
        bar.set_postfix(reward=f"{row['train/reward_mean']:.2f}", tokens=counters["tokens_sampled"])

        if lead and config.checkpoint_every and step % config.checkpoint_every == 0:
            save_checkpoint(run_dir, step, model, optimizer, {"train": train_gen},
                            {"counters": counters, "detector": detector.state_dict(),
                             "config": config.to_dict(), "last_row": row,
                             "records_sha256": writer.digest if writer else None},
                            keep=config.keep_checkpoints)
    bar.close()
    if config.token_budget and counters["tokens_sampled"] >= config.token_budget:
        stopped = "token_budget"
    rows = parallel.share(rows, device)  # every rank returns rank 0's records
    df = as_records(pd.DataFrame(rows))  # float64 columns, as a resumed run reads them back
    return TrainResult(records=df, policy=policy, run_dir=run_dir, stopped=stopped)


# Fields a resumed run may change: they decide when to stop and what to save, not the numbers.
_RESUMABLE_CHANGES = ("steps", "token_budget", "checkpoint_every", "keep_checkpoints")


def _check_same_run(config: TrainConfig, saved: dict, ckpt: Path) -> None:
    """A checkpoint resumes only the run that wrote it (same config, stopping rules aside)."""
    now = config.to_dict()
    saved = with_defaults(saved)  # a checkpoint older than a field ran with its default
    free = set(_RESUMABLE_CHANGES)
    if config.lr_schedule != "constant":
        free.discard("steps")  # the schedule's length: changing it changes every later lr
    diff = sorted(k for k in set(now) | set(saved)
                  if k not in free and now.get(k) != saved.get(k))
    if diff:
        raise UsageError(
            f"cannot resume from {str(ckpt)!r}: its run had a different config for {diff} "
            f"(checkpoint: {[saved.get(k) for k in diff]}, now: {[now.get(k) for k in diff]}); "
            f"only {sorted(free)} may change on --resume")


def _old_logprobs(model: torch.nn.Module, batch, keep: torch.Tensor, with_ref: bool
                  ) -> torch.Tensor:
    """``[k, G, T]`` log pi_old of the responses of groups ``keep``: the sampler's own
    log-probs (pi_old is the policy that sampled them, unchanged since) for a float32/float64
    model; recomputed teacher-forced for a low-precision one, whose cached decode and full
    forward round differently (the ratio of the first update must start at 1, not at their
    rounding difference), and with a reference model (``with_ref``), whose log-probs are
    teacher-forced: KL(pi_old || ref) of a run's first step is then exactly 0."""
    full = next(model.parameters()).dtype in (torch.float32, torch.float64)
    if full and not with_ref:
        return batch.logprobs[keep]
    return parallel.sharded_logprobs(model, batch, keep)


def _rollout(config: TrainConfig, policy: Policy, task, reward: str, prompt_seed: int,
             sample_seed: int, bptt: bool, row: dict) -> tuple:
    """Steps 1-3 of a step (rank 0 under torchrun): ``(batch, rewards, exact, adv,
    logp_graph)``, the sampling, scoring and advantage times recorded in ``row``.

    1. G responses for each of P training prompts (the policy, temperature 1); 2. the
    training reward and exact match (the sampler's reward reused, no rescoring); 3. Delta
    over the whole batch. ``logp_graph``: the sampler's differentiable log-probs
    (``update_forward="sampler"``), else None.
    """
    t0 = time.perf_counter()
    prompts = task.prompts(config.prompts_per_step, split="train", seed=prompt_seed)
    batch = sample(policy, task, prompts, config.G, seed=sample_seed,
                   temperature=config.temperature, reward=reward, differentiable=bptt)
    logp_graph = None  # [P, G, T] on the sampler's graph (update_forward="sampler")
    if bptt:
        logp_graph, batch.logprobs = batch.logprobs, batch.logprobs.detach()
    row["time/sample_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    rewards, exact = setup.score(task, batch, prompts, reward)  # [P, G] each
    row["time/score_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    mask = batch.mask.bool()
    weights = {"logprobs": batch.logprobs, "sum_pi_sq": batch.sum_pi_sq}
    if config.token_weights == "exact":
        weights = {"token_weights": exact_token_weights(policy.model, batch)}
    adv = advantages(config.scheme, rewards, mask, **weights, **dict(config.scheme_options))
    row["time/adv_s"] = time.perf_counter() - t0
    return batch, rewards, exact, adv, logp_graph


def detector_flags(detector: CollapseDetector, grad_norm: float, entropy: float) -> dict:
    """Collapse flags of this step as record columns."""
    flags = detector.update(grad_norm, entropy)
    return {"collapse/grad_surge": flags["grad_surge"], "collapse/entropy": flags["entropy"]}
