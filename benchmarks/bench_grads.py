"""Benchmark of the gradient harness on the `small` preset (issue 4), side by side.

Run: .venv/bin/python benchmarks/bench_grads.py [--T 32 128 512] [--full] [--threads 1]

Contenders, each in its own subprocess (peak memory = the subprocess's peak RSS from
getrusage, which sees tensor memory; the 'delta' column subtracts the RSS after the model
and inputs are built):
  (a) forward            (b) forward + backward      (c) forward_stats (proxy, W, entropy)
  (d) token_grad_norms   (e) brute-force loop: one autograd.grad per token (retained graph),
  running prefix vector  (f) torch.func.jacrev of the per-token log-probs, then cumsum.
Batch: 4 sequences, prompt 8 tokens, response T tokens. Times are wall seconds (and process
CPU seconds: on a shared machine compare CPU). (d)-(f) get an untimed warm-up on a short
input first. Where a contender would take too long by default it runs on a subset and is
extrapolated, and the printout says so: (d) at T=512 one of the four equal-length sequences;
(e) a few tokens of one sequence, scaling only the per-token backward part (its forward is
timed whole per sequence); (f) one sequence (and at T=512 its last 128 rows). --full runs
everything whole.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

B, LP = 4, 8


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(name: str, T: int, full: bool, threads: int, chunk: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from varbench.grads import forward_stats, token_grad_norms, token_logprobs
    from varbench.models import build_policy
    from varbench.models.forward import forward_logits

    model = build_policy("small").model
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 30, (B, LP + T), generator=g)
    rm = torch.zeros(B, LP + T)
    rm[:, LP:] = 1
    am = torch.ones_like(ids)
    plist = [p for p in model.parameters() if p.requires_grad]
    note = ""
    scale = 1.0
    jac_chunk = None
    jac_rows = T
    nb = B  # sequences actually run

    def fwd():
        with torch.no_grad():
            forward_logits(model, ids, am)

    def fwd_bwd():
        lp = token_logprobs(forward_logits(model, ids, am).logits, ids)
        torch.autograd.grad((lp * rm).sum(), plist)

    def stats():
        forward_stats(model, ids, rm, am)

    def ours():
        token_grad_norms(model, ids[:nb], rm[:nb], am[:nb], chunk_size=chunk, progress=False)

    def brute(n_tok: int | None, sub: slice = slice(None)) -> tuple[float, float]:
        """One forward per sequence, then one retained-graph backward per token; returns the
        (wall, cpu) seconds of the per-token part alone so a token subset extrapolates it."""
        x, m = ids[:, sub], am[:, sub]
        n = x.shape[1]
        wall = cpu = 0.0
        for b in range(nb):
            row = x[b : b + 1]
            lp = token_logprobs(forward_logits(model, row, m[b : b + 1]).logits, row)[0]
            running = torch.zeros(sum(p.numel() for p in plist))
            cols = list(range(LP, n))
            if n_tok is not None:
                cols = cols[:: max(1, len(cols) // n_tok)][:n_tok]
            w0, c0 = time.perf_counter(), time.process_time()
            for t in cols:
                grads = torch.autograd.grad(lp[t], plist, retain_graph=True)
                gr = torch.cat([v.reshape(-1) for v in grads])
                _ = gr.dot(gr)
                running += gr
                _ = running.dot(running)
            wall, cpu = wall + time.perf_counter() - w0, cpu + time.process_time() - c0
        return wall, cpu

    def jac():
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

        def f(p):
            out = torch.func.functional_call(
                model,
                p,
                (),
                dict(
                    input_ids=ids[:nb],
                    attention_mask=am[:nb],
                    position_ids=(am[:nb].cumsum(-1) - 1).clamp(min=0),
                    use_cache=False,
                ),
            )
            return token_logprobs(out.logits, ids[:nb])[:, LP + T - jac_rows :]  # [nb, rows]

        J = torch.func.jacrev(f, chunk_size=jac_chunk)(params)
        flat = torch.cat([J[n].reshape(nb, jac_rows, -1) for n in names], -1)  # [nb, rows, P]
        flat.pow(2).sum(-1)
        flat.cumsum(1).pow(2).sum(-1)

    fns = {"a": fwd, "b": fwd_bwd, "c": stats}
    if name in fns:
        fns[name]()  # warm-up
        base = _rss_mb()
        best = float("inf"), float("inf")
        for _ in range(40):  # cheap contenders: best of 40 (the machine may be shared)
            w0, c0 = time.perf_counter(), time.process_time()
            fns[name]()
            best = min(best, (time.perf_counter() - w0, time.process_time() - c0))
        wall, cpu = best
        if name == "c":
            # Separate subprocesses differ by ~10% on their own (layout, frequency); the target
            # ratio is also measured here, in one process, over interleaved (a, c) pairs.
            ratios = []
            for _ in range(40):
                c0 = time.process_time()
                fwd()
                c1 = time.process_time()
                stats()
                ratios.append((time.process_time() - c1) / max(c1 - c0, 1e-9))
            note = f"paired in-process (c)/(a): median of 40 = {sorted(ratios)[20]:.3f}"
    else:
        base = _rss_mb()
        short = slice(0, LP + 4)  # warm-up input: one-time costs (allocator, dispatch) untimed
        per_token = None  # (e) on a token subset: (wall, cpu) of its per-token part
        if name == "d":
            token_grad_norms(model, ids[:1, short], rm[:1, short], am[:1, short], progress=False)
            if T >= 512 and not full:
                # every sequence has the same length, so one sequence costs a quarter of four
                nb, scale, note = 1, B, "1 of 4 sequences, x4"
            fn = ours
        elif name == "e":
            brute(None, short)
            n_tok = None if full else min(T, 16 if T <= 32 else 8)
            if n_tok is not None and n_tok < T:
                # each token's backward runs over the whole retained graph, so its cost does not
                # depend on the token: time n_tok of them, scale that part to all B x T tokens;
                # the one forward per sequence is timed whole
                nb = 1
                note = f"{n_tok} of {T} tokens of 1 sequence, per-token part x{B * T // n_tok}"
                per_token = n_tok
            fn = lambda: brute(n_tok)  # noqa: E731
        else:
            jac_rows_save = jac_rows
            jac_rows = 4
            nb = 1
            jac()  # warm-up on 4 rows of one sequence
            nb, jac_rows = B, jac_rows_save
            if T >= 512 and not full:
                # the whole T x P Jacobian of one sequence peaks near 19 GB here: take the
                # last 128 tokens' rows only (full-length forward; each row is one backward over
                # the whole graph, so rows cost alike); time x4 x4, memory is a lower bound
                nb, scale, jac_chunk, jac_rows = 1, B * T / 128, 32, 128
                note = "128 of 512 tokens of 1 sequence, x16; chunk_size=32 (memory: lower bound)"
            elif T >= 128 and not full:
                # unchunked jacrev over 4 x T rows needs tens of GB here: run 1 sequence with
                # 32 cotangents per vmap; its T x P output alone is T * P * 4 bytes
                nb, scale, jac_chunk = 1, B, 32
                note = "1 of 4 sequences, x4; jacrev chunk_size=32 (memory: of 1 sequence)"
            fn = jac
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall, cpu = (time.perf_counter() - w0) * scale, (time.process_time() - c0) * scale
        if per_token is not None:  # B x (forward part) + (B T / n_tok) x (per-token part)
            k = B * T / per_token
            wall = B * (wall - out[0]) + k * out[0]
            cpu = B * (cpu - out[1]) + k * out[1]
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return dict(name=name, T=T, wall=wall, cpu=cpu, peak_mb=peak, delta_mb=peak - base, note=note)


def _summary(T: int, res: dict) -> None:
    """Print the issue's target ratios, by wall time and by process CPU time."""

    def ratio(x: str, y: str, key: str, scale: float = 1.0) -> float:
        return res[x][key] / (scale * res[y][key])

    def both(x: str, y: str, scale: float = 1.0) -> str:
        return f"wall {ratio(x, y, 'wall', scale):.3f}, cpu {ratio(x, y, 'cpu', scale):.3f}"

    if {"a", "c"} <= res.keys():
        print(f"T={T:4d} (c)/(a) = {both('c', 'a')}  (target <= 1.05)")
    others = [k for k in "ef" if k in res]
    if "d" in res and others:
        for key in ("wall", "cpu"):
            best = min(res[k][key] for k in others)
            print(f"T={T:4d} min((e),(f))/(d) by {key} = {best / res['d'][key]:.2f}x (target >= 2)")
    if {"d", "f"} <= res.keys():
        d = res["d"]["delta_mb"] / res["f"]["delta_mb"]
        pk = res["d"]["peak_mb"] / res["f"]["peak_mb"]
        print(f"T={T:4d} memory (d)/(f): delta {d:.3f}, peak {pk:.3f}  (target <= 0.25 at T=512)")
    if {"d", "b"} <= res.keys():
        print(f"T={T:4d} (d)/(T x (b)) = {both('d', 'b', T)}  (target <= 0.75)")


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--T", type=int, nargs="+", default=[32, 128, 512])
    ap.add_argument("--full", action="store_true", help="no subsets or extrapolation (slow)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per subprocess")
    from varbench.grads.exact import DEFAULT_CHUNK

    ap.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="token_grad_norms chunk_size")
    ap.add_argument("--only", default="abcdef", help="contenders to run, e.g. 'abd'")
    ap.add_argument("--worker", nargs=2, metavar=("NAME", "T"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(
            json.dumps(
                worker(args.worker[0], int(args.worker[1]), args.full, args.threads, args.chunk)
            )
        )
        return 0
    env = dict(os.environ, TQDM_DISABLE="1")
    print(
        f"bench_grads: small preset, B={B}, prompt={LP}, threads={args.threads}, "
        f"chunk={args.chunk}; peak = subprocess peak RSS (getrusage), "
        "delta = peak - RSS after setup"
    )
    labels = dict(
        a="(a) forward",
        b="(b) fwd+bwd",
        c="(c) forward_stats",
        d="(d) token_grad_norms",
        e="(e) brute loop",
        f="(f) jacrev+cumsum",
    )
    for T in args.T:
        res = {}
        for name in args.only:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                name,
                str(T),
                "--threads",
                str(args.threads),
                "--chunk",
                str(args.chunk),
            ] + (["--full"] if args.full else [])
            p = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if p.returncode != 0:
                print(f"T={T} {labels[name]}: FAILED rc={p.returncode}: {p.stderr.strip()[-300:]}")
                continue
            r = json.loads(p.stdout.strip().splitlines()[-1])
            res[name] = r
            print(
                f"T={T:4d} {labels[name]:22s} wall {r['wall']:9.3f}s  cpu {r['cpu']:9.3f}s  "
                f"peak {r['peak_mb']:8.0f}MB  delta {r['delta_mb']:8.0f}MB  {r['note']}",
                flush=True,
            )
        _summary(T, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
