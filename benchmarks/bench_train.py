"""Training throughput: steps/s, sampled tokens/s and the split of a step's time, for G in {4, 32}
on the ``small`` preset (sort, 3 numbers, P = 8 prompts per step); optionally trl's GRPOTrainer
on the same model, task and settings, side by side, with the sampled-tokens/s ratio.

    .venv/bin/python benchmarks/bench_train.py                      # varbench only (~1 min)
    .venv/bin/python benchmarks/bench_train.py --trl-python /tmp/trlvenv/bin/python

trl is never installed into the project's environment (it can pull another torch); point
``--trl-python`` at a separate venv that has trl and the same torch. Both sides run with the
same number of torch threads, one update per sampled batch, no KL term, temperature 1.
The first step of each run (allocator and kernel warm-up) is excluded from varbench's rates;
trl's time is its whole ``trainer.train()`` (its warm-up included, to its disadvantage by about
one step: say so when reading a close ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from varbench.models import build_policy, save_policy
from varbench.train.config import TrainConfig
from varbench.train.loop import train

PARTS = ("time/sample_s", "time/score_s", "time/adv_s", "time/update_s")


def bench_varbench(G: int, P: int, steps: int, lr: float) -> dict:
    cfg = TrainConfig(policy="small", warm_start=False, G=G, prompts_per_step=P, steps=steps,
                      lr=lr, eval_every=10**6, eval_prompts=1, eval_samples=1)
    df = train(cfg, progress=False).records
    body = df[df["step"] >= 2]  # drop step 0 (evaluation) and step 1 (warm-up)
    wall = float(body["time/step_s"].sum() - body["time/eval_s"].fillna(0).sum())
    tokens = float(body["tokens/step_sampled"].sum())
    split = {p.split("/")[1][:-2]: float(body[p].sum()) / wall for p in PARTS}
    return {"G": G, "steps_per_s": len(body) / wall, "tokens_per_s": tokens / wall,
            "step_s": wall / len(body), **{f"frac_{k}": v for k, v in split.items()}}


def bench_trl(python: str, G: int, P: int, steps: int, lr: float, threads: int) -> dict:
    worker = Path(__file__).with_name("_trl_grpo_worker.py")
    with tempfile.TemporaryDirectory() as d:
        save_policy(build_policy("small", seed=0), d)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        proc = subprocess.run([python, str(worker), d, str(G), str(P), str(steps), str(lr),
                               str(threads)], capture_output=True, text=True, env=env,
                              timeout=1800)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"error": " | ".join(tail)}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"G": G, "steps_per_s": steps / res["wall_s"], "tokens_per_s": res["tokens"] /
            res["wall_s"], "step_s": res["wall_s"] / steps, "mean_length": res["mean_length"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="steps per run (first is warm-up)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (P)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=1, help="alternating repeats (medians)")
    ap.add_argument("--trl-python", default=None, help="python of a venv with trl installed")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lr = 1e-4
    print(f"bench_train: small preset, sort n=3, P={args.prompts}, {args.steps} steps per run, "
          f"{args.threads} torch thread(s), {args.repeat} repeat(s), torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    rows: dict[int, list[dict]] = {4: [], 32: []}
    trl_rows: dict[int, list[dict]] = {4: [], 32: []}
    # Contenders alternate, repeat by repeat, so a change in machine load hits both alike.
    for _ in range(args.repeat):
        for G in (4, 32):
            rows[G].append(bench_varbench(G, args.prompts, args.steps, lr))
            if args.trl_python:
                trl_rows[G].append(bench_trl(args.trl_python, G, args.prompts, args.steps, lr,
                                             args.threads))
    for G in (4, 32):
        r = _median(rows[G])
        print(f"varbench G={G:>2}: {r['steps_per_s']:.2f} steps/s, {r['tokens_per_s']:.0f} sampled "
              f"tokens/s ({r['step_s'] * 1000:.0f} ms/step); split: sampling "
              f"{r['frac_sample']:.0%}, scoring {r['frac_score']:.0%}, advantages "
              f"{r['frac_adv']:.0%}, updates {r['frac_update']:.0%}")
    if not args.trl_python:
        print("trl: not run (pass --trl-python PATH to a venv with trl)")
        return
    for G in (4, 32):
        errors = [t["error"] for t in trl_rows[G] if "error" in t]
        if errors:
            print(f"trl GRPOTrainer G={G:>2}: failed: {errors[0]}")
            continue
        t = _median(trl_rows[G])
        print(f"trl GRPOTrainer G={G:>2}: {t['steps_per_s']:.2f} steps/s, "
              f"{t['tokens_per_s']:.0f} sampled tokens/s ({t['step_s'] * 1000:.0f} ms/step, "
              f"mean completion length {t['mean_length']:.2f})")
        ratios = [v["tokens_per_s"] / w["tokens_per_s"] for v, w in zip(rows[G], trl_rows[G],
                                                                        strict=True)]
        print(f"  ratio varbench / trl sampled tokens/s at G={G}: median "
              f"{statistics.median(ratios):.2f}x over {len(ratios)} paired repeat(s) "
              f"{[round(x, 2) for x in ratios]} (target >= 1)")


def _median(runs: list[dict]) -> dict:
    """Per-key median over repeats."""
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


if __name__ == "__main__":
    sys.exit(main())
