"""Training throughput: sampled tokens/s of today's loop against the loop before the issue-17
work (``_old_train_loop.py``, kept in the benchmark only) and against trl's GRPOTrainer, side by
side, on the ``tiny`` and ``small`` presets at G in {4, 32} (sort, 3 numbers, P = 8 prompts per
step, N = 16 steps, the window timed is steps 2..N), with new/old and new/trl ratios of wall
time, CPU time and peak memory.

    .venv/bin/python benchmarks/bench_train.py                              # new vs old
    .venv/bin/python benchmarks/bench_train.py --trl-python .venv-trl/bin/python

Every contender runs in its own process (its peak resident memory is its own), the contenders
alternate run by run (a change in machine load hits all alike), each with the same number of
torch threads. Reported: sampled tokens per second of wall time and of CPU time (CPU time is
the figure to trust on a shared machine), and the process's peak resident set size.

Timing window. varbench: a run of N steps minus a run of 1 step with the same seed (setup,
the step-0 evaluation, step 1 and one final evaluation cancel), i.e. steps 2..N. trl: its
callbacks' clocks at the end of step 1 and of step N, i.e. steps 2..N.

The same work on both sides: the same randomly initialised policy (saved by varbench, loaded by
trl), the same prompts distribution and exact-match reward, G responses per prompt at
temperature 1 without top-k/top-p, exactly 3 completion tokens (varbench's sort always samples
3 tokens, EOS being an ordinary token; trl gets ``min_new_tokens = max_completion_length = 3``),
one BOS (the tokenizer's), GRPO advantages ``(R - mean) / (std + 1e-4)`` per group (varbench
``normalized`` with ``eps=1e-4``, trl ``scale_rewards="group"``), the per-sequence token mean
(varbench ``seq-mean-token-mean``, trl ``loss_type="grpo"``), clip 0.2, no KL term (beta 0),
one update per sampled batch, AdamW (lr 1e-4, betas 0.9/0.999, no weight decay), constant lr,
gradient-norm clip 1.0, gradient checkpointing off, float32.

Remaining differences (trl's design, not settings): trl generates with ``model.generate``
(transformers' generation loop, its DynamicCache, the prompt re-encoded per step from text)
where varbench uses its own sampler; trl suppresses EOS before 3 tokens with a logits
processor (the draws come from a slightly different distribution than pi; its loss uses pi);
trl logs every step (its metrics gathering is part of its step); trl's dataloader, accelerate
wrapper and Trainer bookkeeping run in its step; varbench records its own per-step statistics
(entropy, advantages, clip fraction). Both compute log pi_old from the update's own forward
(one update per batch).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
PRESETS = ("tiny", "small")
GS = (4, 32)


def _config(preset: str, G: int, P: int, steps: int, lr: float):
    from varbench.train.config import TrainConfig

    return TrainConfig(policy=preset, warm_start=False, G=G, prompts_per_step=P, steps=steps,
                       lr=lr, scheme="normalized", scheme_options={"eps": 1e-4},
                       agg="seq-mean-token-mean", eval_every=10**6, eval_prompts=1,
                       eval_samples=1)


def run_varbench(which: str, preset: str, G: int, P: int, steps: int, lr: float) -> dict:
    """In a worker process: steps 2..N of the new or old loop (N-step run minus 1-step run)."""
    if which == "new":
        from varbench.train.loop import train
    else:
        sys.path.insert(0, str(BENCH))
        from _old_train_loop import train
    cfg = _config(preset, G, P, steps, lr)
    clocks = []
    for n in (1, steps):
        w0, c0 = time.perf_counter(), time.process_time()
        df = train(cfg.replace(steps=n), progress=False).records
        clocks.append((time.perf_counter() - w0, time.process_time() - c0))
    body = df[df["step"] >= 2]
    return {"wall_s": clocks[1][0] - clocks[0][0], "cpu_s": clocks[1][1] - clocks[0][1],
            "tokens": float(body["tokens/step_sampled"].sum()),
            "mean_length": float(body["train/response_len"].mean())}


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _spawn(cmd: list[str], env: dict) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return {"error": " | ".join(tail)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def contender(name: str, preset: str, G: int, args, policy_dir: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(BENCH.parent)}
    common = [preset, str(G), str(args.prompts), str(args.steps), str(args.lr), str(args.threads)]
    if name == "trl":
        cmd = [args.trl_python, str(BENCH / "_trl_grpo_worker.py"), policy_dir, *common[1:]]
    else:
        cmd = [sys.executable, __file__, "--worker", name, *common]
    return _spawn(cmd, env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=16, help="steps per run (N; timed: 2..N)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step (P)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--repeat", type=int, default=1, help="alternating repeats (medians)")
    ap.add_argument("--presets", default=",".join(PRESETS))
    ap.add_argument("--G", default=",".join(map(str, GS)))
    ap.add_argument("--trl-python", default=None, help="python of a venv with trl installed")
    ap.add_argument("--worker", nargs=7, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        which, preset, G, P, steps, lr, threads = args.worker
        import torch

        torch.set_num_threads(int(threads))
        res = run_varbench(which, preset, int(G), int(P), int(steps), float(lr))
        print(json.dumps({**res, "peak_mib": _peak_mib()}))
        return
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the window is steps 2..N)")
    import torch

    from varbench.models import build_policy, save_policy

    presets = args.presets.split(",")
    gs = [int(g) for g in args.G.split(",")]
    names = ["new", "old"] + (["trl"] if args.trl_python else [])
    print(f"bench_train: sort n=3, P={args.prompts}, N={args.steps} steps (timed 2..N), "
          f"{args.threads} torch thread(s), {args.repeat} repeat(s), torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for preset in presets:
            dirs[preset] = str(Path(tmp) / preset)
            save_policy(build_policy(preset, seed=0), dirs[preset])
        # contenders alternate, repeat by repeat, so a change in machine load hits all alike
        for _ in range(args.repeat):
            for preset in presets:
                for G in gs:
                    for name in names:
                        res.setdefault((preset, G, name), []).append(
                            contender(name, preset, G, args, dirs[preset]))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    head = (f"{'preset':<6} {'G':>3} {'contender':<9} {'tok/s wall':>10} {'tok/s CPU':>10} "
            f"{'ms/step':>8} {'peak MiB':>9} {'len':>5}   new/this: {'wall':>6} {'CPU':>6} "
            f"{'mem':>6}")
    print(head)
    print("-" * len(head))
    for preset in presets:
        for G in gs:
            new = _median(res[(preset, G, "new")])
            for name in names:
                r = _median(res[(preset, G, name)])
                if "error" in r:
                    print(f"{preset:<6} {G:>3} {name:<9} failed: {r['error']}")
                    continue
                ratio = ""
                if name != "new" and "error" not in new:
                    # throughput ratios (new/this, > 1: new is faster) and memory new/this
                    rw = (new["tokens"] / new["wall_s"]) / (r["tokens"] / r["wall_s"])
                    rc = (new["tokens"] / new["cpu_s"]) / (r["tokens"] / r["cpu_s"])
                    ratio = f"{rw:>6.2f} {rc:>6.2f} {new['peak_mib'] / r['peak_mib']:>6.2f}"
                print(f"{preset:<6} {G:>3} {name:<9} {r['tokens'] / r['wall_s']:>10.0f} "
                      f"{r['tokens'] / r['cpu_s']:>10.0f} "
                      f"{1000 * r['wall_s'] / (args.steps - 1):>8.1f} {r['peak_mib']:>9.0f} "
                      f"{r['mean_length']:>5.2f}   {'':>8}{ratio}")
    print("ratios: sampled tokens/s of new over the contender (wall, CPU) and peak memory new "
          "over the contender; targets: new/old >= 3, new/trl >= 2")


def _median(runs: list[dict]) -> dict:
    """Per-key median over repeats (a failed run reports its error)."""
    bad = [r for r in runs if "error" in r]
    if bad:
        return bad[0]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


if __name__ == "__main__":
    sys.exit(main())
