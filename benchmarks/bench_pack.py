"""The exact harness with one sequence per forward against several sequences per forward.

Run: .venv/bin/python benchmarks/bench_pack.py [--preset tiny] [--B 16] [--T 4 16] [--chunk 8 16]
     [--harness vectors norms] [--method ghost]

Contenders IN ONE PROCESS, interleaved (each round runs both once; median over rounds), on
``varbench.grads.token_vectors`` (count sketch K = 64; ``--harness vectors``) and on
``varbench.grads.token_grad_norms`` (exact per-token / prefix norms, ``--method`` ghost or
materialize; ``--harness norms``) of a batch of B sequences with an 8-token prompt and T
response tokens:
  (1) ``pack=False``: a chunk never leaves its sequence (one forward per sequence and chunk;
      the CPU default),
  (2) ``pack=True``: a chunk takes the next ``chunk`` response tokens whatever their sequence
      (one forward per chunk over the packed rows; the CUDA default).
Packing saves forwards and autograd calls (launch-bound on a GPU) but each cotangent's
backward then spans the packed rows (more arithmetic), so on a CPU it pays only where the
per-call overhead dominates. Prints wall and process-CPU seconds per call, their ratio
(packed / one sequence) and the largest difference of the results (rounding only; for the
norms relative to the largest prefix norm).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from varbench.grads.exact import token_grad_norms
from varbench.grads.vectors import token_vectors
from varbench.models import build_preset
from varbench.rollout.batch import RolloutBatch


def make_batch(B: int, T: int, V: int, seed: int = 0) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    P, Lp = 1, 8
    z = torch.zeros(P, B, T)
    return RolloutBatch(
        prompt_ids=torch.randint(3, V, (P, Lp), generator=g),
        prompt_mask=torch.ones(P, Lp, dtype=torch.long),
        tokens=torch.randint(3, V, (P, B, T), generator=g), mask=torch.ones(P, B, T),
        env_mask=z, logprobs=z, sum_pi_sq=z, entropy=z, rewards=torch.zeros(P, B),
        lengths=torch.full((P, B), T))


def timed(fn):
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--B", type=int, default=16)
    ap.add_argument("--T", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--chunk", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--harness", nargs="+", choices=["vectors", "norms"],
                    default=["vectors", "norms"])
    ap.add_argument("--method", default="ghost", choices=["ghost", "materialize"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    pol = build_preset(args.preset, seed=0)
    V = int(pol.model.get_output_embeddings().weight.shape[0])
    print(f"preset {args.preset}, B = {args.B}, prompt 8, threads {args.threads}, "
          f"median of {args.rounds} interleaved rounds (seconds per call)")
    print(f"{'harness':>7} {'T':>4} {'chunk':>5} | {'one-seq wall':>12} {'cpu':>7} | "
          f"{'packed wall':>11} {'cpu':>7} | {'wall ratio':>10} {'cpu ratio':>9} | "
          f"{'max |diff|':>10}")
    for harness in args.harness:
        for T in args.T:
            batch = make_batch(args.B, T, V)
            flat = batch.flat()
            for chunk in args.chunk:
                if harness == "vectors":
                    def run(pack, chunk=chunk, batch=batch):
                        return token_vectors(pol.model, batch, sketch_dim=64, chunk_size=chunk,
                                             pack=pack).vec
                else:
                    def run(pack, chunk=chunk, f=flat):
                        return token_grad_norms(
                            pol.model, f.input_ids, f.response_mask, f.attention_mask,
                            chunk_size=chunk, method=args.method, pack=pack,
                            progress=False).prefix_sq
                run(False), run(True)  # warm-up
                res = {False: [], True: []}
                outs = {}
                for _ in range(args.rounds):
                    for pack in (False, True):
                        outs[pack], w, c = timed(lambda pack=pack, run=run: run(pack))
                        res[pack].append((w, c))
                med = {k: (statistics.median(w for w, _ in v),
                           statistics.median(c for _, c in v)) for k, v in res.items()}
                diff = float((outs[False] - outs[True]).abs().max())
                if harness == "norms":
                    diff /= float(outs[False].abs().max())
                (w1, c1), (w2, c2) = med[False], med[True]
                name = harness if harness == "vectors" else f"{args.method[:5]}"
                print(f"{name:>7} {T:>4} {chunk:>5} | {w1:>12.4f} {c1:>7.4f} | {w2:>11.4f} "
                      f"{c2:>7.4f} | {w2 / w1:>10.2f} {c2 / c1:>9.2f} | {diff:>10.2e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
