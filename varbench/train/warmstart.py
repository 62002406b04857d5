"""Warm start: supervised training on correct demonstrations until held-out sampled accuracy
enters a target band, so RL and variance measurements start from a policy that is neither
hopeless nor solved.

    policy = warm_start("tiny", get_task("sort"), target=(0.2, 0.6), seed=0)

Accuracy is measured the way RL sees the policy: responses *sampled* at temperature 1 on
held-out prompts, scored with the task's reward (default: its first, ``exact``). When an
evaluation overshoots the band, training rewinds to the previous evaluation and continues
with half the learning rate and twice as frequent evaluations. The result is cached on disk
under a hash of the whole configuration ($VARBENCH_CACHE, else ~/.cache/varbench); a second call
loads it, and a corrupt entry is rebuilt with a warning that says so.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

from varbench._util.bounds import check_knob
from varbench._util.checks import UsageError, check_positive_int
from varbench._util.io import atomic_dir, verify_digest, write_digest, writing
from varbench._util.locks import dir_lock
from varbench._util.progress import show_progress
from varbench.models.io import load_policy, save_policy
from varbench.models.logits import sequence_logprobs
from varbench.models.presets import Policy, presets
from varbench.rollout.sampler import sample
from varbench.tasks.base import Prompt, Task, get_task
from varbench.train.policies import (
    build_policy,
    check_policy_spec,
    is_checkpoint_dir,
    prepare_for_task,
)

_VERSION = "warmstart-v1"  # bump when the training recipe changes: invalidates old caches


def default_cache_dir() -> Path:
    """$VARBENCH_CACHE, else ~/.cache/varbench."""
    env = os.environ.get("VARBENCH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "varbench"


def demo_tokens(task: Task, tokenizer, prompt: Prompt) -> tuple[list[int], list[int], int]:
    """Token ids of prompt + demonstration, a loss mask (1 on policy tokens), the prompt length.

    Multi-turn demonstrations are rebuilt turn by turn through ``task.env_step`` so tool output
    is context (mask 0) exactly as the sampler would append it. Variable-length and multi-turn
    responses end with EOS.
    """
    p_ids = tokenizer(prompt.text, add_special_tokens=True)["input_ids"]
    demo = task.demonstration(prompt)
    ids, mask = list(p_ids), [0] * len(p_ids)
    if task.multi_turn and task.turn_end:
        done, rest = "", demo
        while task.turn_end in rest:
            cut = rest.index(task.turn_end) + len(task.turn_end)
            seg, rest = rest[:cut], rest[cut:]
            done += seg
            seg_ids = tokenizer(seg, add_special_tokens=False)["input_ids"]
            ids += seg_ids
            mask += [1] * len(seg_ids)
            reply = task.env_step(prompt, done)
            if reply is None or not rest.startswith(reply):
                raise UsageError(
                    f"demonstration of task {task.name!r} disagrees with its environment after "
                    f"{done!r}: env replied {reply!r}"
                )
            done, rest = done + reply, rest[len(reply):]
            r_ids = tokenizer(reply, add_special_tokens=False)["input_ids"]
            ids += r_ids
            mask += [0] * len(r_ids)
        demo = rest
    d_ids = tokenizer(demo, add_special_tokens=False)["input_ids"]
    if not task.fixed_length:
        d_ids = d_ids + [tokenizer.eos_token_id]
    ids += d_ids
    mask += [1] * len(d_ids)
    return ids, mask, len(p_ids)


def _sft_batch(task: Task, tokenizer, prompts: list[Prompt], device) -> tuple[torch.Tensor, ...]:
    """[B, L] right-padded input ids, attention mask and target mask (1 where loss counts)."""
    rows = [demo_tokens(task, tokenizer, p) for p in prompts]
    L = max(len(r[0]) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.full((len(rows), L), pad, dtype=torch.long)
    attn = torch.zeros((len(rows), L), dtype=torch.long)
    tgt = torch.zeros((len(rows), L), dtype=torch.float32)
    for b, (x, m, _) in enumerate(rows):
        ids[b, : len(x)] = torch.tensor(x)
        attn[b, : len(x)] = 1
        tgt[b, : len(m)] = torch.tensor(m, dtype=torch.float32)
    return ids.to(device), attn.to(device), tgt.to(device)


def sft_loss(model, ids: torch.Tensor, attn: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of the target tokens (``tgt`` [B, L] marks tokens to predict)."""
    nll = -sequence_logprobs(model, ids, attn)  # [B, L - 1], chunked, float32 at least
    w = tgt[:, 1:]
    return (nll * w).sum() / w.sum().clamp(min=1)


def heldout_accuracy(policy: Policy, task: Task, *, n_prompts: int = 64, G: int = 2,
                     seed: int = 0, reward: str | None = None) -> float:
    """Mean reward of responses sampled at temperature 1 on held-out prompts."""
    prompts = task.prompts(n_prompts, split="heldout", seed=seed)
    batch = sample(policy, task, prompts, G, seed=seed, reward=reward)
    return float(batch.rewards.mean())


def _config(preset, task, target, seed, max_steps, batch_size, lr, eval_every, eval_prompts,
            tie_embeddings, reward) -> dict:
    return {
        "version": _VERSION, "preset": preset, "task": task.name, "knobs": task.knobs,
        "target": list(target), "seed": seed, "max_steps": max_steps, "batch_size": batch_size,
        "lr": lr, "eval_every": eval_every, "eval_prompts": eval_prompts,
        "tie_embeddings": tie_embeddings, "reward": reward,
    }


def warm_start(
    preset: str,
    task: Task | str,
    *,
    target: tuple[float, float] = (0.2, 0.6),
    seed: int = 0,
    cache_dir: str | Path | None = None,
    max_steps: int = 2000,
    batch_size: int = 64,
    lr: float = 3e-3,
    eval_every: int = 20,
    eval_prompts: int = 64,
    tie_embeddings: bool = False,
    reward: str | None = None,
    use_cache: bool = True,
    threads: int | None = None,
    add_task_tokens: bool = False,
    trust_remote_code: bool = False,
    progress: bool | None = None,
) -> Policy:
    """Train ``preset`` (a preset name or a local checkpoint directory) on ``task``'s
    demonstrations into the accuracy band ``target``.

    A checkpoint directory is trained in float32 (its stored dtype is kept in
    ``policy.meta["stored_dtype"]`` for the caller to cast back); its cache key includes the
    size and modification time of every file in it. ``add_task_tokens``: add the task's
    alphabet as tokens first (see :func:`varbench.models.tokenizer.add_task_tokens`).

    Returns the policy (eval mode) with ``policy.meta["warmstart"]`` = {accuracy, steps,
    in_band, cache}. If ``max_steps`` ends outside the band, a warning says so and the last
    policy is returned (and cached: the same config would end the same way). ``threads``:
    torch intra-op threads while training, restored afterwards (default 1 for the micro and
    tiny presets, which gain nothing from more, and whose spin-waiting threads ran ~20x slower
    on a shared two-core machine; unchanged otherwise).
    """
    if isinstance(task, str):
        task = get_task(task)
    preset = check_policy_spec(preset, arg="preset")
    is_dir = preset not in presets() and is_checkpoint_dir(preset)
    if not task.has_demonstrations:
        raise UsageError(f"task {task.name!r} has no demonstrations to warm-start on (a "
                         "dataset task: set --knob solution_key=COLUMN)")
    lo, hi = (float(x) for x in target)
    if not 0.0 <= lo < hi <= 1.0:
        raise UsageError(
            f"target={target!r} is not valid; expected (lo, hi) with 0 <= lo < hi <= 1"
        )
    for arg, v in (("max_steps", max_steps), ("batch_size", batch_size), ("seed", seed),
                   ("eval_every", eval_every), ("eval_prompts", eval_prompts), ("lr", lr)):
        check_knob(arg, v)
    reward = task.check_reward(reward)
    cfg = _config(preset, task, (lo, hi), seed, max_steps, batch_size, lr, eval_every,
                  eval_prompts, tie_embeddings, reward)
    if is_dir:  # which weights: a changed file is a new cache entry
        root_dir = Path(preset).expanduser()
        cfg["weights"] = sorted((str(f.relative_to(root_dir)), f.stat().st_size,
                                 f.stat().st_mtime_ns) for f in root_dir.rglob("*")
                                if f.is_file())
    if add_task_tokens:
        cfg["add_task_tokens"] = True
    if not type(task).__module__.startswith(("varbench.tasks.sort", "varbench.tasks.arith",
                                             "varbench.tasks.toolsum")):
        cfg["task_fingerprint"] = task.fingerprint()  # a user's class or a data file
    key = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:16]
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    label = Path(preset).name if is_dir else preset
    entry = root / "warmstart" / f"{Path(task.name).stem}-{label}-{key}"
    if not use_cache:
        return _build(preset, task, cfg, entry, False, is_dir, seed, tie_embeddings, threads,
                      lo, hi, max_steps, batch_size, lr, eval_every, eval_prompts, reward,
                      progress, target, add_task_tokens, trust_remote_code)
    # One builder per entry; a second process asking for it waits, then loads the result.
    with dir_lock(entry, what="warm-start cache entry", wait=_LOCK_WAIT_S,
                  lock_file=root / ".locks" / f"warmstart-{entry.name}.lock"):
        if entry.exists():
            try:
                verify_digest(entry, "warm-start cache entry")
                policy = load_policy(entry)
                saved = json.loads(json.dumps(policy.meta.get("warmstart", {}).get("config"),
                                              default=str))
                if saved != json.loads(json.dumps(cfg, default=str)):
                    raise UsageError(f"metadata in {str(entry / 'varbench_meta.json')!r} "
                                     "does not match the requested config")
                task.bind(policy.tokenizer)
                return policy
            except PermissionError as err:  # another user's entry: say so, never delete it
                raise UsageError(f"cannot read warm-start cache entry {str(entry)!r}: "
                                 f"permission denied ({err.filename or entry}); use a cache "
                                 "directory of your own (cache_dir / VARBENCH_CACHE)") from None
            except ValueError as err:
                warnings.warn(f"warm-start cache entry {str(entry)!r} is corrupt ({err}); "
                              "rebuilding it", stacklevel=2)
                shutil.rmtree(entry, ignore_errors=True)
        return _build(preset, task, cfg, entry, True, is_dir, seed, tie_embeddings, threads,
                      lo, hi, max_steps, batch_size, lr, eval_every, eval_prompts, reward,
                      progress, target, add_task_tokens, trust_remote_code)


_LOCK_WAIT_S = 3600.0  # a warm start of the largest preset takes minutes, not hours


def _build(preset, task, cfg, entry, use_cache, is_dir, seed, tie_embeddings, threads, lo, hi,
           max_steps, batch_size, lr, eval_every, eval_prompts, reward, progress, target,
           add_task_tokens, trust_remote_code) -> Policy:
    # The one policy builder (train.policies) loads or builds it; bound to the task after the
    # float32 cast so that added task tokens' embedding rows are made in float32.
    policy = build_policy(preset, seed=seed, tie_embeddings=tie_embeddings,
                          trust_remote_code=trust_remote_code)
    if is_dir:
        stored = str(next(policy.model.parameters()).dtype).removeprefix("torch.")
        policy.model.to(torch.float32)  # SFT with float32 weights and optimizer states
        policy.meta = {**policy.meta, "stored_dtype": stored, "base": str(preset)}
    policy = prepare_for_task(policy, task, add_task_tokens=add_task_tokens)
    if threads is None and preset in ("micro", "tiny"):
        threads = 1
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(check_positive_int("threads", threads))
    try:
        policy = _train(policy, task, lo, hi, seed, max_steps, batch_size, lr, eval_every,
                        eval_prompts, reward, progress)
    finally:
        torch.set_num_threads(before)
    info = policy.meta["warmstart"]
    info["config"] = cfg
    if not info["in_band"]:
        warnings.warn(f"warm start of {preset!r} on {task.name!r} ended after {info['steps']} "
                      f"steps at held-out accuracy {info['accuracy']:.3f}, outside {target}",
                      stacklevel=2)
    if use_cache:
        info["cache"] = str(entry)
        # a crash mid-save never leaves a half-written entry; a full disk names the entry
        with writing(entry), atomic_dir(entry) as tmp:
            save_policy(policy, tmp)
            write_digest(tmp)  # checked on load: a flipped bit is rebuilt, never used
    return policy


def _train(policy, task, lo, hi, seed, max_steps, batch_size, lr, eval_every, eval_prompts,
           reward, progress) -> Policy:
    model, tok = policy.model, policy.tokenizer
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    snapshot = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), 0)
    acc, step, in_band, n_eval = 0.0, 0, False, 0
    bar = tqdm(total=max_steps, desc=f"warm start {task.name}", leave=False,
               disable=not show_progress(progress))
    while step < max_steps:
        model.train()
        prompts = task.prompts(batch_size, split="train", seed=seed * 1_000_003 + step)
        loss = sft_loss(model, *_sft_batch(task, tok, prompts, policy.device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        bar.update(1)
        if step % eval_every and step < max_steps:
            continue
        model.eval()
        n_eval += 1
        acc = heldout_accuracy(policy, task, n_prompts=eval_prompts, seed=seed + n_eval,
                               reward=reward)
        bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc:.2f}")
        if lo <= acc <= hi:
            in_band = True
            break
        if acc > hi and eval_every > 1:
            # Overshot the band: rewind to the last evaluation, go slower, look more often.
            model.load_state_dict(snapshot[0])
            opt.load_state_dict(snapshot[1])
            step = snapshot[2]
            bar.n = step
            eval_every = max(1, eval_every // 2)
            for g in opt.param_groups:
                g["lr"] *= 0.5
            continue
        snapshot = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), step)
    bar.close()
    model.eval()
    policy.meta["warmstart"] = {"accuracy": acc, "steps": step, "in_band": in_band,
                                "reward": reward, "band": [lo, hi]}
    return policy
