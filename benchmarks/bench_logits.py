"""Benchmark of the statistics of pi at LLM vocabulary sizes (issue 15): today's full-logits path
against the chunked one, side by side.

Run: .venv/bin/python benchmarks/bench_logits.py [--V 30 32768 151936] [--T 128 1024]
     [--reps 3] [--threads 1] [--hidden 256] [--layers 4] [--B 2]

Model: a Qwen2-shaped causal LM (hidden 256, 4 layers, 4 heads / 2 kv heads, MLP 1024, untied
head), random weights, float32, B = 2 rows of a 16-token prompt + T response tokens.
Contenders:
  fwd        a plain forward of the model (``forward_logits``: the [B, L, V] logits, nothing else)
  stats_old  the forward statistics as before the change: full logits, then log_softmax, exp,
             products over [B, L, V] (a copy of the old code, kept here only)
  stats_new  ``varbench.grads.forward_stats`` (chunked: never the full logits)
  train_old  one training step's log-probs, forward + backward, as before: ``token_logprobs`` of
             the full logits (a copy of the old code), loss = sum(c * logp) over the response
  train_new  the same with ``varbench.models.logits.sequence_logprobs`` (chunked, logits
             recomputed in backward)
The parameters' ``.grad`` tensors exist before a training call (made by the warm-up, zeroed in
place after each call), so its peak is the log-prob computation's own memory.
Times: wall and process CPU seconds, median of ``--reps`` interleaved repetitions in ONE process
(after one untimed warm-up each on a short input; on a shared machine compare CPU seconds).
Peak memory: each contender once more in the same process under torch's profiler with
``profile_memory=True``, which records every CPU tensor allocation and free (tracemalloc does not
see them): the peak of the running sum of live tensor bytes during the call, i.e. the call's
own extra tensor memory above what existed before it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

LP = 16
CONTENDERS = ["fwd", "stats_old", "stats_new", "train_old", "train_new"]


def _build(V: int, T: int, B: int, hidden: int, layers: int):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=V, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max(2048, LP + T), tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=min(1, V - 1), pad_token_id=0)
    model = Qwen2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, LP + T), generator=g)
    am = torch.ones_like(ids)
    rm = torch.zeros(B, LP + T)
    rm[:, LP:] = 1
    coef = torch.randn(B, T, generator=g)
    return model, ids, am, rm, coef


def _old_pi_stats(logits, tokens):
    """The statistics of pi as varbench computed them before issue 15 (full [.., V] tensors)."""
    import torch

    z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    logp_all = torch.log_softmax(z, dim=-1)
    p = logp_all.exp()
    logp = logp_all.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    entropy = -(p * logp_all.clamp(min=torch.finfo(z.dtype).min)).sum(-1)
    return logp, entropy, p.square().sum(-1)


def _old_token_logprobs(logits, input_ids):
    import torch

    z = logits[:, :-1]
    lp = z.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return torch.nn.functional.pad(lp, (1, 0))


def _calls(model, ids, am, rm, coef):
    import torch

    from varbench.grads import forward_stats
    from varbench.models.forward import forward_logits
    from varbench.models.logits import proxy_from_logprobs, sequence_logprobs

    def fwd():
        with torch.no_grad():
            forward_logits(model, ids, am)

    def stats_old():
        with torch.no_grad():
            logits = forward_logits(model, ids, am).logits
            logp, ent, spsq = _old_pi_stats(logits[:, :-1], ids[:, 1:])
            proxy = proxy_from_logprobs(logp, spsq)
            m = rm.to(logp.dtype)
            w = torch.nn.functional.pad(proxy, (1, 0)) * m
            return w.cumsum(-1), ent

    def stats_new():
        forward_stats(model, ids, rm, am)

    def train_old():
        lp = _old_token_logprobs(forward_logits(model, ids, am).logits, ids)[:, LP:]
        (lp * coef).sum().backward()
        model.zero_grad(set_to_none=False)

    def train_new():
        lp = sequence_logprobs(model, ids, am, start=LP)
        (lp * coef).sum().backward()
        model.zero_grad(set_to_none=False)

    return {"fwd": fwd, "stats_old": stats_old, "stats_new": stats_new,
            "train_old": train_old, "train_new": train_new}


def timing(args, V: int, T: int) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    model, ids, am, rm, coef = _build(V, T, args.B, args.hidden, args.layers)
    calls = _calls(model, ids, am, rm, coef)
    short = _build(V, 16, args.B, args.hidden, args.layers)
    for f in _calls(model, *short[1:]).values():  # untimed warm-up on a short input
        f()
    res: dict[str, dict[str, list[float]]] = {c: {"wall": [], "cpu": []} for c in CONTENDERS}
    for _ in range(args.reps):
        for c in CONTENDERS:
            t0, c0 = time.perf_counter(), time.process_time()
            calls[c]()
            res[c]["wall"].append(time.perf_counter() - t0)
            res[c]["cpu"].append(time.process_time() - c0)
    return {c: {k: statistics.median(v) for k, v in d.items()} for c, d in res.items()}


def memory(args, V: int, T: int) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(args.threads)
    model, ids, am, rm, coef = _build(V, T, args.B, args.hidden, args.layers)
    short = _build(V, 16, args.B, args.hidden, args.layers)
    for f in _calls(model, *short[1:]).values():  # warm-up (the head probe, the .grad tensors)
        f()
    out = {}
    for name, f in _calls(model, ids, am, rm, coef).items():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            f()
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        live = peak = 0
        for e in sorted(events, key=lambda e: e.start_ns()):
            live += e.nbytes()
            peak = max(peak, live)
        out[name] = {"peak_mb": peak / 2**20}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--V", type=int, nargs="+", default=[30, 32768, 151936])
    ap.add_argument("--T", type=int, nargs="+", default=[128, 1024])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--B", type=int, default=2)
    ap.add_argument("--no-memory", action="store_true")
    args = ap.parse_args()
    print(f"Qwen2 shape: hidden {args.hidden}, {args.layers} layers, B={args.B}, prompt {LP}, "
          f"threads {args.threads}, reps {args.reps}; load {os.getloadavg()}")
    hdr = f"{'V':>7} {'T':>5} {'contender':>10} {'wall s':>8} {'cpu s':>8} {'peak MB':>9}"
    print(hdr)
    rows = []
    for V in args.V:
        for T in args.T:
            t = timing(args, V, T)
            mem = ({c: {"peak_mb": float("nan")} for c in CONTENDERS} if args.no_memory
                   else memory(args, V, T))
            for c in CONTENDERS:
                print(f"{V:>7} {T:>5} {c:>10} {t[c]['wall']:>8.3f} {t[c]['cpu']:>8.3f} "
                      f"{mem[c]['peak_mb']:>9.1f}", flush=True)
            rows.append((V, T, t, mem))
    print("\nratios (targets: stats_new/fwd <= 1.05 at every V; at V = 32768 "
          "train_new/train_old peak memory <= 0.25 and time <= 1.00)")
    print(f"{'V':>7} {'T':>5} {'stats_new/fwd wall':>19} {'cpu':>6} {'stats_old/fwd':>14} "
          f"{'train new/old wall':>19} {'cpu':>6} {'peak mem':>9} {'stats mem new/old':>18}")
    for V, T, t, mem in rows:
        def r(a, b, k, d=t):
            return d[a][k] / d[b][k]

        print(f"{V:>7} {T:>5} {r('stats_new', 'fwd', 'wall'):>19.3f} "
              f"{r('stats_new', 'fwd', 'cpu'):>6.3f} {r('stats_old', 'fwd', 'wall'):>14.3f} "
              f"{r('train_new', 'train_old', 'wall'):>19.3f} "
              f"{r('train_new', 'train_old', 'cpu'):>6.3f} "
              f"{r('train_new', 'train_old', 'peak_mb', mem):>9.3f} "
              f"{r('stats_new', 'stats_old', 'peak_mb', mem):>18.3f}")
    print(f"load at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
