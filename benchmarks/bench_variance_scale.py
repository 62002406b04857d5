"""Variance cells at scale: per-token vectors + combine vs coefficient-first projected sketches.

    .venv/bin/python benchmarks/bench_variance_scale.py [--T 128 512] [--groups 3 [3]] [-G 2]
        [--hidden 256] [--layers 2] [--vocab 32768] [--sketch-dim 1024] [--k1 16 --k2 16]
        [--today-T 128] [--sweep 4 8 16 32 [--sweep-T 128] [--sweep-today-max 8]]
        [--rows N] [--sweep-only]

Side by side in one process on a Qwen2-shaped model (tied head, GQA; random weights, random
response tokens: timing and memory depend on shapes, not on what the tokens say), for two
coefficient sets per cell (a sequence-level centered advantage broadcast over tokens, and a
per-token OTB-shaped set: the same advantage times a positive per-token weight):

- today:  ``token_vectors`` (exact per-token gradients, count-sketched to ``--sketch-dim``)
          then ``combine`` for both sets (what varbench.analysis.variance does);
- new:    ``batch_sketches`` (varbench.grads.projected): one forward per row chunk and one
          weighted backward per set, Kronecker-projected (``k1 x k2`` per weight);
- exact:  ``group_gradients`` (one backward per group and set, flat: the truth the two
          sketched variances estimate).
``--paths`` picks the contenders; today's per-token path is the slow one at T = 512 (its cost
per response grows ~T^2: T cotangents, each over the whole sequence): ``--today-T`` names the T
at which it runs (default every T) and ``--groups`` takes one value per T (fewer responses at
the long T); a T without today's row says so in the table.

Reported per contender: wall and process-CPU seconds per response-use (responses x sets) in
units of one forward+backward of one response (measured here, same shapes, weight gradients
on), the peak resident memory above the start of the contender (VmHWM reset through
/proc/self/clear_refs), and each set's group-estimate variance (trace of the covariance over
the groups) with its sketch standard deviation (CountSketch: stats.intervals.sketch_sd; new:
grads.projected.projection_sd, the estimate that widens the intervals). Then a paper model of
the new path for a 4,096-response cell on Llama-3-8B at T = 1024 on one H200. Timings are
single runs (``--threads``, default 1).
"""

from __future__ import annotations

import argparse
import math
import resource
import time
import warnings
from types import SimpleNamespace

import torch
import transformers as tf

from varbench.analysis.variance_cells import (
    ProjectedContraction,
    VectorContraction,
    _from_batch,
    _from_sample,
    group_advantages,
    group_coefficients,
)
from varbench.grads.chunking import MEMORY_FRACTION
from varbench.grads.group import group_gradients
from varbench.grads.projected import batch_sketches, projection_sd
from varbench.grads.seqnorms import sequence_rows
from varbench.grads.vectors import combine, token_vectors
from varbench.models import memplan
from varbench.models.forward import forward_logits
from varbench.models.logits import token_logprobs
from varbench.rollout.batch import RolloutBatch
from varbench.stats.estimates import variance_stats
from varbench.stats.intervals import sketch_sd

SETS = ("centered (sequence)", "otb-shaped (per token)")


def qwen2(hidden: int, layers: int, vocab: int, seed: int = 0) -> torch.nn.Module:
    """A Qwen2-shaped random model (tied head, 4 heads / 2 kv heads, MLP 2.75 x hidden)."""
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.Qwen2Config(vocab_size=vocab, hidden_size=hidden,
                             intermediate_size=int(2.75 * hidden), num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=4096, tie_word_embeddings=True)
        cfg._attn_implementation = "sdpa"
        return tf.Qwen2ForCausalLM(cfg).eval()


def rollouts(P: int, G: int, T: int, vocab: int, seed: int = 0) -> RolloutBatch:
    """P groups of G random length-T responses after an 8-token prompt, random rewards."""
    g = torch.Generator().manual_seed(seed)
    Lp = 8
    z = torch.zeros(P, G, T)
    return RolloutBatch(
        prompt_ids=torch.randint(3, vocab, (P, Lp), generator=g),
        prompt_mask=torch.ones(P, Lp, dtype=torch.long),
        tokens=torch.randint(3, vocab, (P, G, T), generator=g), mask=torch.ones(P, G, T),
        env_mask=z.clone(), logprobs=z.clone(), sum_pi_sq=z.clone(), entropy=z.clone(),
        rewards=torch.rand(P, G, generator=g), lengths=torch.full((P, G), T))


def coefficient_sets(batch: RolloutBatch, seed: int = 1) -> torch.Tensor:
    """``[2, P, G, T]``: centered advantage / G on every token; the same times a positive
    per-token weight (mean 1), the shape of OTB's per-token coefficients."""
    adv = batch.rewards - batch.rewards.mean(1, keepdim=True)
    seq = (adv / batch.G)[..., None].expand(-1, -1, batch.T) * batch.mask
    w = torch.rand(batch.tokens.shape, generator=torch.Generator().manual_seed(seed)) * 2
    return torch.stack([seq, seq * w]).double()


def reset_peak() -> int:
    """Reset VmHWM to the current RSS; return the RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")
    return _status("VmRSS:")


def peak_since(base: int) -> int:
    """Bytes of the resident peak above ``base``."""
    return _status("VmHWM:") - base


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def measured(fn):
    """(result, wall s, CPU s, peak bytes above the start) of ``fn()``."""
    base = reset_peak()
    w0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w0, time.process_time() - c0, peak_since(base)


def fwd_bwd_unit(model, batch: RolloutBatch, repeat: int = 3) -> tuple[float, float]:
    """Median (wall, CPU) seconds of one forward+backward of one response (weight grads on)."""
    flat = batch.flat()
    ids, am = flat.input_ids[:1], flat.attention_mask[:1]
    walls, cpus = [], []
    for _ in range(repeat):
        model.zero_grad(set_to_none=True)
        w0, c0 = time.perf_counter(), time.process_time()
        lp = token_logprobs(forward_logits(model, ids, am).logits, ids)
        (lp * flat.response_mask[:1]).sum().backward()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    model.zero_grad(set_to_none=True)
    return sorted(walls)[repeat // 2], sorted(cpus)[repeat // 2]


def cell(model, T: int, groups: int, args) -> list[dict]:
    """Both paths (and the exact one) on one cell of ``groups x args.G`` responses."""
    batch = rollouts(groups, args.G, T, args.vocab, seed=T)
    coeffs = coefficient_sets(batch)
    S, B = coeffs.shape[0], batch.P * batch.G
    unit_w, unit_c = fwd_bwd_unit(model, batch)

    def today():
        tv = token_vectors(model, batch, sketch_dim=args.sketch_dim, sketch_seed=0)
        return combine(tv, coeffs).double()  # [S, P, K]

    def new():
        r = batch_sketches(model, batch, coeffs, k1=args.k1, k2=args.k2, seed=0,
                           k_dense=args.k_dense)
        return r.vec.sum(-2).double(), r.blocks  # [S, P, K']

    rows = []
    if "today" in args.paths and (args.today_T is None or T in args.today_T):
        est, w, c, peak = measured(today)
        rows.append(dict(path="today", wall=w, cpu=c, peak=peak, est=est,
                         sd=[sketch_sd(est[s], est[s].mean(0), args.sketch_dim)["variance"]
                             for s in range(S)]))
    (est, blocks), w, c, peak = measured(new)
    rows.append(dict(path="new", wall=w, cpu=c, peak=peak, est=est,
                     sd=[projection_sd(est[s], est[s].mean(0), blocks)["variance"]
                         for s in range(S)]))
    if "exact" in args.paths:
        est, w, c, peak = measured(lambda: torch.stack(
            [group_gradients(model, batch, coeffs[s].float()).double() for s in range(S)]))
        rows.append(dict(path="exact", wall=w, cpu=c, peak=peak, est=est, sd=[0.0] * S))
    for r in rows:
        r.update(T=T, B=B, S=S, unit_w=unit_w, unit_c=unit_c,
                 var=[variance_stats(r["est"][s])["variance"] for s in range(S)])
    return rows


def analysis_cells(model, T: int, args) -> None:
    """The variance analysis' own cell code (varbench.analysis.variance_cells) on one prompt of
    ``groups x G`` responses, schemes centered and otb (proxy weights), both contractions:
    today's gradients="vectors" and the new default gradients="projected"; agreement of the
    variance within the combined sketch/projection SDs (z)."""
    b = rollouts(1, args.groups[T] * args.G, T, args.vocab, seed=T + 1)
    g = torch.Generator().manual_seed(3)
    b.logprobs = -torch.rand(b.tokens.shape, generator=g) * 3
    b.sum_pi_sq = torch.rand(b.tokens.shape, generator=g)
    M, G = args.groups[T], args.G
    unit_w, unit_c = fwd_bwd_unit(model, b)

    def sets(data):
        mask = data["mask"][0].reshape(M, G, T) != 0
        out = []
        for label in ("centered", "otb"):
            adv = group_advantages(label, data["rewards"][0].reshape(M, G).float(), mask,
                                   data["logprobs"][0].reshape(M, G, T),
                                   data["sum_pi_sq"][0].reshape(M, G, T), None)
            out.append(((label, G), group_coefficients(adv, mask.float(), data["logprobs"][0]
                                                       .reshape(M, G, T),
                                                       "seq-mean-token-sum", max_len=T)))
        return out

    def today():
        tv = token_vectors(model, b, sketch_dim=args.sketch_dim, sketch_seed=0)
        data = _from_sample(b, tv)
        con = VectorContraction(args.sketch_dim)
        return con, con.estimates(data, sets(data))

    def new():
        data = _from_batch(b, None)
        con = ProjectedContraction(model, k1=args.k1, k2=args.k2, k_dense=args.k_dense, seed=0)
        return con, con.estimates(data, sets(data))

    res = {}
    for name, fn in (("vectors", today), ("projected", new)):
        (con, est), w, c, peak = measured(fn)
        var = [variance_stats(e)["variance"][0] for e in est]
        sd = [con.error_sd(e, e.mean(0))["variance"] for e in est]
        res[name] = (var, sd)
        uses = M * G * len(est)
        print(f"  analysis T={T} {name:<9} wall/use {w / uses / unit_w:6.2f} fb, cpu/use "
              f"{c / uses / unit_c:6.2f} fb, wall {w:.1f}s cpu {c:.1f}s, peak "
              f"{peak / 2**20:.0f} MiB, var centered {var[0]:.4e} ± {sd[0]:.2e}, otb "
              f"{var[1]:.4e} ± {sd[1]:.2e}")
    (vt, st), (vn, sn) = res["vectors"], res["projected"]
    zs = [(a - b_) / math.hypot(x, y) if math.hypot(x, y) else float("nan")
          for a, b_, x, y in zip(vt, vn, st, sn, strict=True)]
    ok = "within" if all(abs(z) <= 1.96 for z in zs) else "OUTSIDE"
    print(f"  analysis T={T} agreement (vectors - projected) / combined sd: centered "
          f"{zs[0]:+.2f}, otb {zs[1]:+.2f} ({ok} 1.96)")


def print_table(rows: list[dict]) -> None:
    print(f"{'T':>5} {'path':<6} {'resp':>5} {'sets':>4} {'fb s':>7} {'wall s':>8} "
          f"{'cpu s':>8} {'wall/use':>9} {'cpu/use':>8} {'peak MiB':>9}  " + "  ".join(
              f"{'var ' + s.split()[0]:>24}" for s in SETS))
    for r in rows:
        uses = r["B"] * r["S"]
        cols = "  ".join(f"{v[0]:>11.4e} ± {sd:>9.2e}" for v, sd in zip(r["var"], r["sd"],
                                                                       strict=True))
        print(f"{r['T']:>5} {r['path']:<6} {r['B']:>5} {r['S']:>4} {r['unit_c']:>7.3f} "
              f"{r['wall']:>8.1f} {r['cpu']:>8.1f} {r['wall'] / uses / r['unit_w']:>9.2f} "
              f"{r['cpu'] / uses / r['unit_c']:>8.2f} "
              f"{r['peak'] / 2**20:>9.1f}  {cols}")
    print("(wall s, cpu s: the contender's whole call; wall/use, cpu/use: seconds per "
          "response x coefficient set in units of one "
          "forward+backward 'fb s' (CPU s of one response); var: trace of the covariance over "
          "the groups, ± the sketch's stated sd (z below: (sketched - exact) / that sd); "
          "targets: new <= 2 (sequence) / <= 3 (OTB) fb per use)")
    by = {(r["T"], r["path"]): r for r in rows}
    for T in sorted({r["T"] for r in rows}):
        t, n = by.get((T, "today")), by[(T, "new")]
        line = f"T={T}"
        if t is None:
            line += ": today's path not run at this T (--today-T / --paths)"
        else:
            line += (f": today/new wall {t['wall'] / n['wall']:.1f}x, cpu "
                     f"{t['cpu'] / n['cpu']:.1f}x, peak {t['peak'] / max(n['peak'], 1):.1f}x")
        if (T, "exact") in by:
            e = by[(T, "exact")]
            for s, name in enumerate(SETS):
                ve = e["var"][s][0]
                for r in (x for x in (t, n) if x is not None):
                    # same responses: the sketch is the only difference, so z in its sd
                    z = (r["var"][s][0] - ve) / r["sd"][s] if r["sd"][s] else float("nan")
                    line += f"; {r['path']} {name.split()[0]} var/exact {r['var'][s][0] / ve:.3f}"
                    line += f" (z {z:+.2f})"
        print(line)


def sweep(model, args) -> None:
    """Peak memory (and wall / CPU per response-use) of one cell against the number of
    responses at one T: the new path at every count (chunks of ``--rows`` rows, default the
    memory plan's), today's where the count is at most ``--sweep-today-max``; then the ratio of
    the largest count's peak to the smallest's (target: flat, i.e. ~1)."""
    T = args.sweep_T
    print(f"\nsweep over responses at T = {T} (groups of G = {args.G}, 2 sets; new path rows "
          f"per chunk: {args.rows or 'memory plan'}):")
    print(f"{'resp':>5} {'path':<6} {'chunk':>5} {'wall s':>8} {'cpu s':>8} {'wall/use':>9} "
          f"{'cpu/use':>8} {'peak MiB':>9}")
    peaks: dict[str, dict[int, int]] = {"new": {}, "today": {}}
    chunks: dict[int, int] = {}
    for n in sorted(args.sweep):
        batch = rollouts(n // args.G, args.G, T, args.vocab, seed=T + n)
        coeffs = coefficient_sets(batch)
        S = coeffs.shape[0]
        unit_w, unit_c = fwd_bwd_unit(model, batch)
        fns = {"new": lambda b=batch, c=coeffs: batch_sketches(
            model, b, c, k1=args.k1, k2=args.k2, seed=0, k_dense=args.k_dense, rows=args.rows)}
        if "today" in args.paths and n <= args.sweep_today_max:
            fns["today"] = lambda b=batch, c=coeffs: combine(
                token_vectors(model, b, sketch_dim=args.sketch_dim, sketch_seed=0), c)
        flat = batch.flat()
        chunk = sequence_rows(model, n, flat.input_ids.shape[1], "cpu", args.rows)
        chunks[n] = chunk
        for path, fn in fns.items():
            _, w, c, peak = measured(fn)
            peaks[path][n] = peak
            uses = n * S
            print(f"{n:>5} {path:<6} {chunk if path == 'new' else '-':>5} {w:>8.2f} {c:>8.2f} "
                  f"{w / uses / unit_w:>9.2f} "
                  f"{c / uses / unit_c:>8.2f} {peak / 2**20:>9.1f}")
    for path, pk in peaks.items():
        if len(pk) >= 2:
            lo, hi = min(pk), max(pk)
            print(f"  {path}: peak at {hi} responses / peak at {lo} = "
                  f"{pk[hi] / max(pk[lo], 1):.2f} ({hi // lo}x the responses)")
        elif pk:
            print(f"  {path}: one count only ({', '.join(map(str, pk))}; --sweep-today-max)")
    # the new path holds one chunk: below the plan's chunk the chunk is every response, so
    # the flat claim is read among the counts that share the largest chunk
    same = sorted(n for n in peaks["new"] if chunks[n] == max(chunks.values()))
    if len(same) >= 2:
        pk = peaks["new"]
        print(f"  new at the same chunk ({chunks[same[0]]} rows): peak at {same[-1]} / peak at "
              f"{same[0]} = {pk[same[-1]] / max(pk[same[0]], 1):.2f} "
              f"({same[-1] // same[0]}x the responses)")


# --- paper model --------------------------------------------------------------------------

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)


def paper_model(args) -> None:
    """Memory + FLOP model of the new path for a 4,096-response cell on Llama-3-8B, T = 1024."""
    c = LLAMA3_8B
    h, i, n, V = (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"],
                  c["vocab_size"])
    kv = h * c["num_key_value_heads"] // c["num_attention_heads"]
    T, R, S, k1, k2 = 1024, 4096, args.paper_sets, args.k1, args.k2
    linears = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]  # (out, in) per layer
    N = n * sum(o * j for o, j in linears) + V * h * 2 + (2 * n + 1) * h  # untied embed + head
    attn = 2 * 2 * n * T * T * h / 2  # QK^T and PV, causal half, per forward
    fwd = 2 * N * T + attn
    bwd_act = 2 * N * T + 2 * attn  # activation gradients only (weight gradients skipped)
    # projections: L P_1 (out k1) and R P_2 (in k2) and their [k1, k2] product, per token
    proj = 2 * T * (n * sum(o * k1 + j * k2 + k1 * k2 for o, j in linears)
                    + V * k1 + h * k2 + k1 * k2 + h * k2 + k1 * k2)  # head + embed
    per_resp = fwd + S * (bwd_act + proj)
    total = R * per_resp
    rate = args.peak_tflops * 1e12 * args.efficiency
    minutes = total / rate / 60
    K = (n * len(linears) + 2) * k1 * k2 + args.k_dense
    # memory: bf16 weights, float32 projections, per-row activations (three cotangents of a
    # sequence as grads.seqnorms.sequence_rows budgets them) in bf16 (half the float32 model)
    # the memory plan's per-row bytes of the sequence path (what response_sketches' chunks ask)
    per_row = memplan.unit_bytes(memplan.ModelShape.from_config(SimpleNamespace(**c),
                                                                torch.bfloat16),
                                 "sequence_norms", T)
    weights = 2 * N
    projs = 4 * (n * sum(o * k1 + j * k2 for o, j in linears) + V * k1 + h * k2 + V * k1
                 + h * k2)
    free = 141e9 - weights - projs
    rows = max(1, int(MEMORY_FRACTION * free // per_row))
    today = R * 0.3 * T * (fwd + 2 * N * T + 2 * attn + 2 * N * T)  # per-token vectors, full fb
    print(f"\npaper model: Llama-3-8B (N = {N / 1e9:.2f}B), {R} responses x T = {T}, "
          f"{S} coefficient set(s), k1 = {k1}, k2 = {k2}, one H200")
    print(f"  FLOP/response: forward {fwd:.3e} + {S} x (activation backward {bwd_act:.3e} + "
          f"projections {proj:.3e}) = {per_resp:.3e}")
    print(f"  rate assumed: {args.peak_tflops:g} TFLOP/s bf16 dense x efficiency "
          f"{args.efficiency:g} = {rate / 1e12:.0f} TFLOP/s")
    print(f"  time: {total:.3e} FLOP -> {minutes:.1f} min (target <= 15 min: "
          f"{'met' if minutes <= 15 else 'NOT met'})")
    print(f"  memory: weights {weights / 2**30:.1f} GiB bf16, projections {projs / 2**30:.2f} "
          f"GiB fp32, {per_row / 2**30:.2f} GiB activations per response row -> {rows} rows "
          f"per chunk at fraction {MEMORY_FRACTION}; sketches {K} floats/response = "
          f"{R * K * 4 * S / 2**30:.2f} GiB for the cell (host, streamed out per chunk)")
    print(f"  today's path (~0.3 T forward+backward per response): {today:.3e} FLOP -> "
          f"{today / rate / 3600:.1f} h at the same rate")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--groups", type=int, nargs="+", default=[3],
                    help="groups (prompts) per cell: one value, or one per --T")
    ap.add_argument("-G", type=int, default=2, help="responses per group")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--sketch-dim", type=int, default=1024, help="today's CountSketch K")
    ap.add_argument("--k1", type=int, default=16)
    ap.add_argument("--k2", type=int, default=16)
    ap.add_argument("--k-dense", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--paths", nargs="+", default=["today", "new", "exact"],
                    choices=["today", "new", "exact"], help="contenders ('new' always runs)")
    ap.add_argument("--today-T", type=int, nargs="+", default=None,
                    help="the T at which today's path runs (default: every T)")
    ap.add_argument("--paper-only", action="store_true")
    ap.add_argument("--sweep", type=int, nargs="+", default=None,
                    help="also sweep the number of responses (e.g. 4 8 16 32) at --sweep-T")
    ap.add_argument("--sweep-T", type=int, default=128)
    ap.add_argument("--sweep-today-max", type=int, default=8,
                    help="today's path in the sweep only up to this many responses")
    ap.add_argument("--sweep-only", action="store_true",
                    help="skip the side-by-side cells (the sweep and the paper model only)")
    ap.add_argument("--rows", type=int, default=None,
                    help="new path: responses per chunk (default: the memory plan's)")
    ap.add_argument("--analysis", action="store_true",
                    help="also run both paths through the analysis' cell code")
    ap.add_argument("--paper-sets", type=int, default=2, help="coefficient sets in the model")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="H200 bf16 dense")
    ap.add_argument("--efficiency", type=float, default=0.35,
                    help="achieved fraction of peak (HF model, eager kernels)")
    args = ap.parse_args()
    if len(args.groups) not in (1, len(args.T)):
        ap.error(f"--groups takes one value or one per --T ({len(args.T)}), got {args.groups}")
    groups = dict(zip(args.T, args.groups * len(args.T) if len(args.groups) == 1
                      else args.groups, strict=True))
    if any(g < 2 for g in groups.values()):
        ap.error(f"--groups must be at least 2 (a variance over groups), got {args.groups}")
    args.groups = groups
    torch.set_num_threads(args.threads)
    if not args.paper_only:
        model = qwen2(args.hidden, args.layers, args.vocab)
        D = sum(p.numel() for p in model.parameters())
        print(f"Qwen2-shaped: hidden {args.hidden}, {args.layers} layers, V = {args.vocab}, "
              f"D = {D / 1e6:.1f}M, threads {args.threads}, today K = {args.sketch_dim}, new "
              f"k1 x k2 = {args.k1} x {args.k2} (+ dense K = {args.k_dense}); "
              f"groups per T {groups} x {args.G} responses, sets: {', '.join(SETS)}")
        if not args.sweep_only:
            rows = []
            for T in args.T:
                rows += cell(model, T, groups[T], args)
            print_table(rows)
        if args.sweep:
            if any(n < args.G or n % args.G for n in args.sweep):
                ap.error(f"--sweep counts must be multiples of -G {args.G}, got {args.sweep}")
            sweep(model, args)
        if args.analysis:
            print("\nthrough the analysis' cells (varbench.analysis.variance_cells):")
            for T in args.T:
                analysis_cells(model, T, args)
        print(f"(max RSS of the process: "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB)")
    paper_model(args)


if __name__ == "__main__":
    main()
