"""Sampling throughput: varbench's KV-cache sampler against ``model.generate``, side by side.

    .venv/bin/python benchmarks/bench_sampling.py            # small preset, G in {4, 32}
    .venv/bin/python benchmarks/bench_sampling.py --G 4 32 128 --new-tokens 64 --repeats 5

Both sample from the same ``small`` policy with the same settings: temperature 1, no top-k /
top-p filtering, the same left-padded prompts (P prompts x G copies), exactly ``--new-tokens``
tokens per row (a fixed-length task for varbench; no EOS stop for generate). The varbench time
includes what generate does not do: per-token log-probs, sum_pi_sq and entropy, decoding and
scoring. Runs alternate between the contenders; the median of ``--repeats`` is reported,
and the ratio is the median of the per-pair ratios (each pair runs back to back). Both are given
as wall-clock tokens/s and as tokens per CPU-second of this process (``time.process_time``:
with one thread it does not count time the process waited for a core, so it is the steadier
number on a shared machine). Ratio > 1 means varbench is faster. Where it gains: each prompt
is prefilled once and its KV cache copied G times, the KV cache is written in place instead of
concatenated every step, and finished rows leave the batch (not exercised here: no EOS stop).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import GenerationConfig

from varbench.models import build_preset
from varbench.rollout import sample
from varbench.rollout.sampler import encode_prompts
from varbench.tasks import get_task


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--G", type=int, nargs="+", default=[4, 32])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads for both contenders (default 1: on a shared "
                         "machine spin-waiting threads make timings of small models noise)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    policy = build_preset(args.preset, seed=0, device=args.device)
    task = get_task("sort", n=8)
    prompts = task.prompts(args.prompts, seed=0)
    T = args.new_tokens
    ids, mask = encode_prompts(policy.tokenizer, prompts)
    gcfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                            max_new_tokens=T, min_new_tokens=0, eos_token_id=None,
                            pad_token_id=policy.tokenizer.pad_token_id)
    print(f"preset={args.preset} ({sum(p.numel() for p in policy.model.parameters()):,} params) "
          f"device={args.device} threads={torch.get_num_threads()} P={args.prompts} "
          f"new_tokens={T} repeats={args.repeats} torch={torch.__version__}")
    print(f"{'G':>5} {'rows':>5} {'varbench tok/s':>15} {'generate tok/s':>15} {'ratio':>7}"
          f" {'varbench tok/cpu-s':>19} {'generate tok/cpu-s':>19} {'cpu ratio':>9}")

    def sync():
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()

    for G in args.G:
        B = args.prompts * G
        bi = ids.repeat_interleave(G, 0).to(args.device)
        bm = mask.repeat_interleave(G, 0).to(args.device)

        def ours(seed, G=G, B=B):
            b = sample(policy, task, prompts, G, seed=seed, max_new_tokens=T)
            assert b.T == T
            return B * T

        def theirs(seed, bi=bi, bm=bm, B=B):
            torch.manual_seed(seed)
            with torch.inference_mode():
                out = policy.model.generate(input_ids=bi, attention_mask=bm,
                                            generation_config=gcfg)
            assert out.shape[1] - bi.shape[1] == T
            return B * T

        ours(0), theirs(0)  # warm-up: allocator, kernels
        wall = {ours: [], theirs: []}
        cpu = {ours: [], theirs: []}
        for r in range(args.repeats):
            for fn in (ours, theirs):
                sync()
                t0, c0 = time.perf_counter(), time.process_time()
                n = fn(r + 1)
                sync()
                wall[fn].append(n / (time.perf_counter() - t0))
                cpu[fn].append(n / (time.process_time() - c0))
        # ratio: median over repeats of (ours / generate) within one back-to-back pair, so a
        # change of machine load between repeats hits both sides of a ratio alike
        def ratio(m):
            return statistics.median(x / y for x, y in zip(m[ours], m[theirs], strict=True))

        a, b = statistics.median(wall[ours]), statistics.median(wall[theirs])
        c, d = statistics.median(cpu[ours]), statistics.median(cpu[theirs])
        print(f"{G:>5} {B:>5} {a:>15.0f} {b:>15.0f} {ratio(wall):>7.2f}"
              f" {c:>19.0f} {d:>19.0f} {ratio(cpu):>9.2f}")


if __name__ == "__main__":
    main()
