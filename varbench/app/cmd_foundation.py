"""`varbench tasks`, `varbench sample`, `varbench warmstart`: the foundation's subcommands."""

from __future__ import annotations

import argparse
import time

import torch

from varbench._util.bounds import argtype
from varbench._util.checks import check_device
from varbench.app.specs import (
    add_policy_flags,
    parse_knobs,
    policy_kwargs,
    resolve_policy,
    resolve_task,
)
from varbench.models.presets import presets
from varbench.tasks.base import get_task, task_names


def register(sub: argparse._SubParsersAction) -> None:
    """Add the tasks / sample / warmstart subcommands."""
    p = sub.add_parser("tasks", help="list tasks with their rewards and knobs")
    p.set_defaults(func=_tasks)

    p = sub.add_parser("sample", help="sample G responses per prompt and print them with rewards")
    p.add_argument("--task", default="sort", help=TASK_HELP)
    p.add_argument("--policy", default="tiny",
                   help=f"a preset {presets()} or a local checkpoint directory (default tiny)")
    p.add_argument("-G", type=argtype("G", "-G"), default=8,
                   help="responses per prompt (default 8)")
    p.add_argument("--prompts", type=argtype("n_prompts", "--prompts"), default=2,
                   help="number of prompts P (default 2)")
    p.add_argument("--seed", type=argtype("seed", "--seed"), default=0)
    p.add_argument("--split", default="heldout", choices=["train", "heldout"])
    p.add_argument("--reward", default=None, help="reward name (default: the task's first)")
    p.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE",
                   help="task knob, VALUE a TOML literal, e.g. --knob n=4 (repeatable)")
    p.add_argument("--warm", action="store_true",
                   help="warm-start the policy on the task's demonstrations first (cached)")
    p.add_argument("--temperature", type=argtype("temperature", "--temperature"), default=1.0)
    add_policy_flags(p)
    p.set_defaults(func=_sample)

    p = sub.add_parser("warmstart", help="supervised warm start into a held-out accuracy band")
    p.add_argument("--task", default="sort", help=TASK_HELP)
    p.add_argument("--policy", "--preset", dest="preset", default="tiny",
                   help=f"a preset {presets()} or a local checkpoint directory (default tiny)")
    p.add_argument("--knob", action="append", default=[], metavar="KEY=VALUE",
                   help="task knob, VALUE a TOML literal, e.g. --knob n=4 (repeatable)")
    p.add_argument("--target", type=float, nargs=2, default=(0.2, 0.6), metavar=("LO", "HI"))
    p.add_argument("--seed", type=argtype("seed", "--seed"), default=0)
    p.add_argument("--max-steps", type=argtype("max_steps", "--max-steps"), default=2000)
    p.add_argument("--cache-dir", default=None, help="default $VARBENCH_CACHE or ~/.cache/varbench")
    p.add_argument("--out", default=None, help="also save the policy to this directory")
    add_policy_flags(p)
    p.set_defaults(func=_warmstart)


TASK_HELP = (f"a task: one of {task_names()}, MODULE:ATTR (a Task subclass or factory), or a "
             "data file .jsonl/.json/.csv/.parquet or datasets directory (default sort)")


def _tasks(args: argparse.Namespace) -> int:
    for name in task_names():
        t = get_task(name)
        print(t.describe())
        for knob, text in t.knob_help.items():
            print(f"    {knob:<10} {text}")
    from varbench.tasks import DatasetTask

    print("dataset tasks: --task FILE (.jsonl, .json, .csv, .parquet or a datasets directory); "
          "knobs:")
    for knob, text in DatasetTask.knob_help.items():
        print(f"    {knob:<14} {text}")
    print("your own: --task MODULE:ATTR (a Task subclass or a factory); see docs/tasks.md")
    return 0


def _builder_counts(rewards: torch.Tensor) -> tuple[dict[str, int], int]:
    """Responses with a non-zero Delta per scheme, and groups whose rewards all agree."""
    from varbench.estimators import advantages

    P, G = rewards.shape
    mask = torch.ones(P, G, 1)
    counts = {}
    for scheme in ("raw", "centered"):
        adv = advantages(scheme, rewards, mask)
        counts[scheme] = int((adv.abs().amax(-1) > 0).sum())
    agree = int((rewards.amax(-1) == rewards.amin(-1)).sum())
    return counts, agree


def _sample(args: argparse.Namespace) -> int:
    from varbench.rollout.sampler import sample
    from varbench.tasks.verifiers import describe_errors, error_counts

    task = resolve_task(args.task, parse_knobs(args.knob))
    reward = task.check_reward(args.reward)
    policy = resolve_policy(args.policy, task=task, warm=args.warm, warm_seed=args.seed,
                            **policy_kwargs(args))
    errors_before = error_counts()
    prompts = task.prompts(args.prompts, split=args.split, seed=args.seed)
    t0 = time.perf_counter()
    batch = sample(policy, task, prompts, args.G, seed=args.seed, reward=reward,
                   temperature=args.temperature, progress=None)
    dt = time.perf_counter() - t0
    print(f"policy {policy.name}{' (warm start)' if args.warm else ''} "
          f"({_dtype_name(policy)} on {policy.device}) | task {task.name} "
          f"{task.knobs} | reward {reward} | P={batch.P} G={batch.G} seed={args.seed}")
    logp = batch.logprobs.sum(-1)
    for p, prompt in enumerate(prompts):
        print(f"\nprompt {p}: {prompt.text}   (answer {prompt.answer})")
        print(f"  {'i':>3}  {'reward':>6}  {'len':>3}  {'logp':>7}  response")
        for i in range(batch.G):
            print(f"  {i:>3}  {batch.rewards[p, i].item():>6.2f}  "
                  f"{int(batch.lengths[p, i]):>3}  {logp[p, i].item():>7.2f}  "
                  f"{batch.texts[p][i]!r}")
    counts, agree = _builder_counts(batch.rewards.float().cpu())
    n = batch.P * batch.G
    print(f"\nmean reward {batch.rewards.mean().item():.3f} | responses with non-zero Delta: "
          f"raw {counts['raw']}/{n}, centered {counts['centered']}/{n} | "
          f"groups with all rewards equal: {agree}/{batch.P} | "
          f"{int(batch.lengths.sum())} tokens in {dt:.2f}s")
    for line in describe_errors(errors_before):
        print(line)
    return 0


def _dtype_name(policy) -> str:
    return str(next(policy.model.parameters()).dtype).removeprefix("torch.")


def _warmstart(args: argparse.Namespace) -> int:
    from varbench.app.specs import resolve_device, resolve_dtype
    from varbench.models.io import save_policy
    from varbench.train.policies import check_policy_spec, prepare_for_task
    from varbench.train.warmstart import warm_start

    task = resolve_task(args.task, parse_knobs(args.knob))
    check_policy_spec(args.preset, arg="--policy")
    dtype = resolve_dtype(args.dtype)
    # default: cuda when available, else cpu; checked to hold dtype before the (CPU) warm start
    device = check_device("--device", resolve_device(args.device), dtype=dtype)
    t0 = time.perf_counter()
    policy = warm_start(args.preset, task, target=tuple(args.target), seed=args.seed,
                        max_steps=args.max_steps, cache_dir=args.cache_dir,
                        add_task_tokens=args.add_task_tokens,
                        trust_remote_code=args.trust_remote_code, progress=None)
    stored = policy.meta.get("stored_dtype")
    if dtype is None and stored is not None:
        dtype = getattr(torch, stored)
    if dtype is not None or device is not None:
        policy.model.to(device=device, dtype=dtype)
    prepare_for_task(policy, task)
    info = policy.meta.get("warmstart", {})
    print(f"warm start {args.preset} on {task.name} {task.knobs}: held-out sampled accuracy "
          f"{info.get('accuracy', float('nan')):.3f} after {info.get('steps')} steps "
          f"(band {list(args.target)}, in band: {info.get('in_band')}) "
          f"in {time.perf_counter() - t0:.1f}s")
    print(f"cache: {info.get('cache')}")
    if args.out:
        print(f"saved to {save_policy(policy, args.out)}")
    return 0
