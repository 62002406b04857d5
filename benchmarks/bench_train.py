"""Training throughput: sampled tokens/s of today's loop ("new"; "bptt": the same loop with
``update_forward="sampler"``) against the loop before the issue-17 work (``_old_train_loop.py``,
kept in the benchmark only) and against trl's GRPOTrainer, side by side, on the ``tiny`` and
``small`` presets at G in {4, 32} (sort, 3 numbers, P = 8 prompts per step, N = 16 steps, the
window timed is steps 2..N; ``--task toolsum``: the multi-turn task, without trl), with
this/old and this/trl ratios of wall time, CPU time and peak memory.

    .venv/bin/python benchmarks/bench_train.py                              # new vs old
    .venv/bin/python benchmarks/bench_train.py --trl-python .venv-trl/bin/python

Every contender runs in its own process (its peak resident memory is its own), the contenders
alternate run by run (a change in machine load hits all alike), each with the same number of
torch threads. Reported: sampled tokens per second of wall time and of CPU time (CPU time is
the figure to trust on a shared machine), and the process's peak resident set size.

Timing window. varbench: a run of N steps minus a run of 1 step with the same seed (setup,
the step-0 evaluation, step 1 and one final evaluation cancel), i.e. steps 2..N, both after
an untimed 1-step run that pays the process's one-off costs. trl: its
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

The floor table. Below the ratios, per preset and G: the sampler's model calls alone (prefill,
T - 1 decode calls; the same log-probs as the sampler's, tests/test_benchmarks_bench_train.py)
plus the backward alone of one call over the ``[B, T - 1]`` response tokens an update feeds,
with transformers' modules as they are and nothing else: no update forward, loss, optimizer
step, tokenizer or scoring. Each contender's ms/step over that floor is the most any loop,
varbench's or another, could gain over it on this machine: new/old >= 3 needs ``old /floor``
well above 3, since a real step also pays for everything the floor leaves out. The second
floor (``+fwd``) adds the forward of that one call with its graph: the least a loop pays whose
update runs a forward of its own (varbench's, the old loop's and trl's all do); only a loop
that backpropagates through the sampler's forward (below) can step under it. ``bptt`` times
the least such a loop pays (:func:`bptt_step`: the sampler's calls with their graph, a loss on
their log-probs, backward, clip, AdamW; its gradient is the teacher-forced one, tested in
float64), ``tf`` the same for a loop with its own update forward (the sampler's calls +
:func:`tf_update`, the faster of the shared-prompt and flat forwards), and ``old/3`` is the
step time new/old >= 3 asks for: where ``old/3`` is below ``floor`` no loop reaches 3x, where
it is below both ``tf`` and ``bptt`` neither kind of loop does, before any sampling draw,
scoring, advantage or statistic is paid for.

Backpropagating through the sampler's own forward instead of a teacher-forced one is an option,
not the default (``update_forward="sampler"``, the ``bptt`` contender): one forward fewer per
step pays on sort's 3 tokens (small G = 4: 1.26x), not on toolsum's ~19 (0.62x at tiny G = 4),
where decoding with autograd on costs more than the forward it saves and the saved keys and
values grow as T^2; its floats differ from the teacher-forced update's by rounding, so the
published claims grid stays on the default.

Levers measured and not taken (tiny/small, sort, this machine): ``torch.compile`` of the model
(fwd+bwd 11.7 -> 9.4 ms on tiny, 38 s of compilation per process and per new shape); eager
attention instead of SDPA (tiny fwd+bwd 12.4 vs 7.8 ms); SDPA's math backend (mixed: from 26%
faster to 10% slower by cell and path); a hand-written functional forward of the Llama preset
(1.24x fwd+bwd; it would not be the user's model).
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


def _config(preset: str, G: int, P: int, steps: int, lr: float, task: str = "sort"):
    from varbench.train.config import TrainConfig

    return TrainConfig(task=task, policy=preset, warm_start=False, G=G, prompts_per_step=P,
                       steps=steps,
                       lr=lr, scheme="normalized", scheme_options={"eps": 1e-4},
                       agg="seq-mean-token-mean", eval_every=10**6, eval_prompts=1,
                       eval_samples=1)


def run_varbench(which: str, preset: str, G: int, P: int, steps: int, lr: float,
                 task: str = "sort") -> dict:
    """In a worker process: steps 2..N of the new or old loop (N-step run minus 1-step run)."""
    if which in ("new", "bptt"):
        from varbench.train.loop import train
    else:
        sys.path.insert(0, str(BENCH))
        from _old_train_loop import train
    cfg = _config(preset, G, P, steps, lr, task)
    if which == "bptt":  # today's loop, backpropagating through the sampler's calls
        cfg = cfg.replace(update_forward="sampler")
    clocks = []
    # a first, untimed 1-step run pays the process's one-off costs (first calls of each op,
    # allocator growth), which would otherwise fall on the timed 1-step run and be
    # subtracted from the N-step one (trl's window starts after its warm-up step too)
    for n in (1, 1, steps):
        w0, c0 = time.perf_counter(), time.process_time()
        df = train(cfg.replace(steps=n), progress=False).records
        clocks.append((time.perf_counter() - w0, time.process_time() - c0))
    body = df[df["step"] >= 2]
    return {"wall_s": clocks[2][0] - clocks[1][0], "cpu_s": clocks[2][1] - clocks[1][1],
            "tokens": float(body["tokens/step_sampled"].sum()),
            "mean_length": float(body["train/response_len"].mean())}


def sampling_calls(model, batch, G: int, cache=None):
    """The sampler's model calls alone for ``batch`` (its prompts and tokens, [P, G, T]): the
    prefill of the P prompts, the cache repeated G times, T - 1 decode calls on the P G rows.
    Returns the ``[P G, T]`` log pi of the batch's tokens from those calls (the benchmark's
    test checks them against the sampler's: the floor times the same work). ``cache``: the
    sampler's preallocated one by default; a differentiable ``autograd_cache`` to
    backpropagate through the calls."""
    import torch

    from varbench.models.arch import stepper
    from varbench.models.forward import position_ids_from_mask
    from varbench.models.logits import stat_dtype
    from varbench.rollout.kvcache import grow_cache

    P, _, T = batch.tokens.shape
    pids, pmask = batch.prompt_ids, batch.prompt_mask.long()
    toks = batch.tokens.reshape(P * G, T)
    Lp = pids.shape[1]
    step = stepper(model)
    cache = grow_cache(model, Lp + T) if cache is None else cache
    cache, z = step(pids, pmask, position_ids_from_mask(pmask), cache)
    cache.batch_repeat_interleave(G)
    logits = [z.repeat_interleave(G, 0)]
    attn = torch.cat([pmask.repeat_interleave(G, 0), torch.ones_like(toks)], 1)
    pos = position_ids_from_mask(attn)
    for t in range(T - 1):
        cache, z = step(toks[:, t:t + 1], attn[:, : Lp + t + 1], pos[:, Lp + t:Lp + t + 1], cache)
        logits.append(z)
    z = torch.stack(logits, 1)
    z = z.to(stat_dtype(z.dtype))  # [P G, T, V], float32 or better, as the sampler's
    return torch.log_softmax(z, -1).gather(-1, toks[..., None])[..., 0]


def floor_ms(preset: str, G: int, P: int, reps: int = 30, task: str = "sort") -> dict:
    """In a worker process: a lower bound on one training step's wall time, any implementation.

    A step must sample: at least one model call per token (the prefill of the P prompts, then
    T - 1 decode calls on the B = P G rows with a KV cache: the sampler's own calls,
    :func:`sampling_calls`, timed alone under inference mode, without its bookkeeping). An
    update must backpropagate through the model over at least the B (T - 1) response tokens it
    feeds (the prompts' positions come on top): the backward alone of one call on the
    ``[B, T - 1]`` fed tokens (a forward and backward minus the same forward with its graph;
    one call is the fewest ops and positions any update backpropagates through). The floor is
    the sum of the two medians, with transformers' own modules run as they are (what varbench
    runs for any user's model) and no loss, optimizer step, update forward or bookkeeping.
    ``tf_floor_ms`` adds the forward of that one call with its graph (``fwd_ms``): the floor
    of a loop whose update runs a forward of its own rather than backpropagating through
    the sampler's.
    """
    import torch

    from varbench.rollout import sample
    from varbench.train import setup

    cfg = _config(preset, G, P, 1, 1e-4, task)
    task, reward = setup.build_task(cfg)
    policy = setup.policy_for(cfg, task)
    model = policy.model.eval()
    batch = sample(policy, task, task.prompts(P, split="train", seed=0), G, seed=0,
                   reward=reward)
    # the response tokens a forward must be fed (the last one is only predicted)
    toks = batch.tokens.reshape(P * G, batch.T)[:, : max(1, batch.T - 1)]

    def forward() -> torch.Tensor:
        return model(input_ids=toks).logits

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - t0))
        return statistics.median(times)

    with torch.inference_mode():
        out = {"calls_ms": timed(lambda: sampling_calls(model, batch, G))}
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = setup.make_optimizer(params, cfg)  # for bptt_step, the last one timed
    # fresh gradients every call (an update's zero_grad(set_to_none=True)), not accumulated
    out["fwd_ms"] = timed(forward)  # with its graph, as an update's forward runs
    out["bwd_ms"] = max(0.0, timed(lambda: torch.autograd.grad(forward().sum(), params))
                        - out["fwd_ms"])
    out["floor_ms"] = out["calls_ms"] + out["bwd_ms"]
    # a loop whose update runs its own forward (teacher-forced, as varbench's, old's and
    # trl's do) pays that forward on top: at least one call on the fed tokens, with its graph
    out["tf_floor_ms"] = out["floor_ms"] + out["fwd_ms"]
    out["bptt_ms"] = timed(lambda: bptt_step(model, batch, G, params, optimizer))
    # the same for a loop with its own update forward: the sampler's calls + one update
    # (teacher-forced log-probs, each prompt once or the flat rows, whichever is faster here)
    out["tf_ms"] = out["calls_ms"] + min(
        timed(lambda s=shared: tf_update(model, batch, params, optimizer, s))
        for shared in (True, False))
    return out


def tf_update(model, batch, params, optimizer, shared_prompt: bool) -> None:
    """One update of a loop with its own forward: the teacher-forced log-probs of ``batch``
    (``response_logprobs``, each prompt once when ``shared_prompt``), a token-mean loss,
    backward, clip, AdamW; no sampling, scoring, advantages or statistics."""
    import torch

    from varbench.rollout import response_logprobs

    lp = response_logprobs(model, batch, shared_prompt=shared_prompt)  # [P, G, T]
    coef = torch.linspace(-1, 1, lp.shape[0] * lp.shape[1], dtype=lp.dtype,
                          device=lp.device).reshape(lp.shape[0], lp.shape[1], 1)
    loss = -(coef * lp).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()


def bptt_step(model, batch, G: int, params, optimizer) -> None:
    """The least a step costs that backpropagates through the sampler's own model calls:
    those calls with their graph (a differentiable cache), a token-mean loss on their
    log-probs, the backward, the gradient-norm clip and the fused AdamW step. No draws,
    scoring, advantages or statistics: a lower bound on such a loop, which varbench does not
    run (the bench module's docstring says why)."""
    import torch

    from varbench.rollout.kvcache import autograd_cache

    lp = sampling_calls(model, batch, G, cache=autograd_cache(model))  # [P G, T]
    # fixed per-row coefficients standing in for the advantages (the work does not depend on them)
    coef = torch.linspace(-1, 1, lp.shape[0], dtype=lp.dtype, device=lp.device)[:, None]
    loss = -(coef * lp).mean()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()


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
    common = [preset, str(G), str(args.prompts), str(args.steps), str(args.lr), str(args.threads),
              args.task]
    if name == "trl":
        cmd = [args.trl_python, str(BENCH / "_trl_grpo_worker.py"), policy_dir, *common[1:-1]]
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
    ap.add_argument("--task", default="sort", choices=("sort", "toolsum"),
                    help="sort (3 tokens; trl too) or toolsum (multi-turn, ~30 tokens; no trl)")
    ap.add_argument("--worker", nargs=8, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        which, preset, G, P, steps, lr, threads, task = args.worker
        import torch

        torch.set_num_threads(int(threads))
        if which == "floor":
            print(json.dumps(floor_ms(preset, int(G), int(P), task=task)))
            return
        res = run_varbench(which, preset, int(G), int(P), int(steps), float(lr), task)
        print(json.dumps({**res, "peak_mib": _peak_mib()}))
        return
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the window is steps 2..N)")
    import torch

    from varbench.models import build_preset, save_policy

    presets = args.presets.split(",")
    gs = [int(g) for g in args.G.split(",")]
    names = ["new", "bptt", "old"] + (["trl"] if args.trl_python else [])
    if args.trl_python and args.task != "sort":
        ap.error("--trl-python runs trl's GRPOTrainer on sort only (it has no tool environment)")
    print(f"bench_train: {args.task}, P={args.prompts}, N={args.steps} steps (timed 2..N), "
          f"{args.threads} torch thread(s), {args.repeat} repeat(s), torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    res: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for preset in presets:
            dirs[preset] = str(Path(tmp) / preset)
            save_policy(build_preset(preset, seed=0), dirs[preset])
        # contenders alternate, repeat by repeat, so a change in machine load hits all alike
        for _ in range(args.repeat):
            for preset in presets:
                for G in gs:
                    for name in [*names, "floor"]:
                        res.setdefault((preset, G, name), []).append(
                            contender(name, preset, G, args, dirs[preset]))
        floors = {(preset, G): _median(res[(preset, G, "floor")])
                  for preset in presets for G in gs}
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    refs = [n for n in ("old", "trl") if n in names]
    head = (f"{'preset':<6} {'G':>3} {'contender':<9} {'tok/s wall':>10} {'tok/s CPU':>10} "
            f"{'ms/step':>8} {'peak MiB':>9} {'len':>5}   "
            + "   ".join(f"this/{n}: {'wall':>5} {'CPU':>5} {'mem':>5}" for n in refs))
    print(head)
    print("-" * len(head))
    for preset in presets:
        for G in gs:
            meds = {n: _median(res[(preset, G, n)]) for n in names}
            for name in names:
                r = meds[name]
                if "error" in r:
                    print(f"{preset:<6} {G:>3} {name:<9} failed: {r['error']}")
                    continue
                cells = []
                for ref in refs:
                    o = meds[ref]
                    if ref == name or "error" in o:
                        cells.append(f"{'':>9} {'-':>5} {'-':>5} {'-':>5}")
                        continue
                    # throughput ratios (this/ref, > 1: this is faster) and memory this/ref
                    rw = (r["tokens"] / r["wall_s"]) / (o["tokens"] / o["wall_s"])
                    rc = (r["tokens"] / r["cpu_s"]) / (o["tokens"] / o["cpu_s"])
                    cells.append(f"{'':>9} {rw:>5.2f} {rc:>5.2f} "
                                 f"{r['peak_mib'] / o['peak_mib']:>5.2f}")
                print(f"{preset:<6} {G:>3} {name:<9} {r['tokens'] / r['wall_s']:>10.0f} "
                      f"{r['tokens'] / r['cpu_s']:>10.0f} "
                      f"{1000 * r['wall_s'] / (args.steps - 1):>8.1f} {r['peak_mib']:>9.0f} "
                      f"{r['mean_length']:>5.2f}   " + "   ".join(cells))
    print("ratios: sampled tokens/s of the contender over old's and trl's (wall, CPU) and peak "
          "memory over theirs; targets: new/old >= 3, new/trl >= 2; bptt: today's loop with "
          "update_forward='sampler'")
    _print_floors(floors, res, presets, gs, names, args.steps)


def _print_floors(floors: dict, res: dict, presets, gs, names, steps: int) -> None:
    """The step-time floors (``floor_ms``) beside each contender's ms/step: the most any
    implementation could gain over it on this machine (contender ms/step / floor), and the
    same over the floor of a loop with its own update forward (``tf_floor_ms``)."""
    head = (f"{'preset':<6} {'G':>3} {'sample calls':>12} {'backward':>9} {'floor':>7} "
            f"{'update fwd':>10} {'+fwd':>6} {'tf':>6} {'bptt':>6} {'old/3':>6}   "
            + "  ".join(f"{n + ' ms':>8} {'/floor':>6} {'/+fwd':>6}" for n in names))
    print("\nfloor (ms per step): the sampler's model calls alone + the backward alone of one "
          "call on the [B, T - 1] fed response tokens; +fwd: floor + that call's forward with "
          "its graph (a loop whose update runs its own forward); tf: the sampler's calls + one "
          "teacher-forced update (tf_update), no bookkeeping; bptt: the least a step costs "
          "that backpropagates through the sampler's calls (bptt_step); old/3: the step time "
          "new/old >= 3 needs; /floor, /+fwd: contender ms/step over those floors, the most a "
          "loop could gain over that contender on this machine")
    print(head)
    print("-" * len(head))
    for preset in presets:
        for G in gs:
            f = floors[(preset, G)]
            if "error" in f:
                print(f"{preset:<6} {G:>3} floor failed: {f['error']}")
                continue
            old = _median(res[(preset, G, "old")])
            target = float("nan") if "error" in old else 1000 * old["wall_s"] / (steps - 1) / 3
            cells = []
            for n in names:
                r = _median(res[(preset, G, n)])
                ms = float("nan") if "error" in r else 1000 * r["wall_s"] / (steps - 1)
                cells.append(f"{ms:>8.1f} {ms / f['floor_ms']:>6.2f} "
                             f"{ms / f['tf_floor_ms']:>6.2f}")
            print(f"{preset:<6} {G:>3} {f['calls_ms']:>12.1f} {f['bwd_ms']:>9.1f} "
                  f"{f['floor_ms']:>7.1f} {f['fwd_ms']:>10.1f} {f['tf_floor_ms']:>6.1f} "
                  f"{f['tf_ms']:>6.1f} {f['bptt_ms']:>6.1f} {target:>6.1f}   "
                  + "  ".join(cells))


def _median(runs: list[dict]) -> dict:
    """Per-key median over repeats (a failed run reports its error)."""
    bad = [r for r in runs if "error" in r]
    if bad:
        return bad[0]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


if __name__ == "__main__":
    sys.exit(main())
