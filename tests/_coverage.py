"""Coverage harness (issue 30 point 3): intervals as shipped against an UNSKETCHED truth.

Setups: a warm ``micro`` or ``tiny`` policy on ``sort`` (n = 2, max_value = 2: 900 responses of
2 tokens per prompt, enumerable), converted to float64, its per-token gradients taken FLAT
(``response_table(sketch_dim=None)``: K = D, no sketch). The truth of every statistic is read
in an isometric embedding of those flat vectors: the Gram matrix of the N * T token vectors is
factored ``V V^T = U L U^T`` and each token vector replaced by its row of ``U L^(1/2)``, which
has exactly the same inner products (variance, MSE, projection and their ratios are functions
of inner products only), in dimension N * T instead of D. Reward-only schemes then get closed
forms (``table_cells(exact=True)`` on the embedded table, ``exact`` cells), the others a large
Monte Carlo in the embedding (relative SE printed with the truth).

A replicate draws a FRESH CountSketch of the flat vectors (K buckets, the CLI's default 1024)
and M groups of G, and computes the cells exactly as ``estimator_variance`` does
(``table_cells(sketch_k=K)``: bootstrap-t intervals widened by the sketch's own SD); pooled
intervals average ``n_prompts`` prompts through the shipping ``_pool``; adaptive M is the
shipping two-stage rule (a pilot sets M, fresh groups are reported). Every size is a parameter:
the default-run test uses a few replicates (it runs), the slow one produces the table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pandas as pd
import torch

STATS = ("variance", "mse", "projection")


@dataclass
class Setup:
    """One prompt's flat float64 table and its isometric embedding."""

    name: str
    flat: object  # ResponseTable, vec [N, T, D] float64
    embedded: object  # ResponseTable, vec [N, T, r] float64: same inner products

    def kurtosis(self) -> float:
        """E||s||^4 / (E||s||^2)^2 of the sequence gradients s = sum_t v_t (the tail weight)."""
        s2 = (self.embedded.vec.sum(1) ** 2).sum(-1)
        p = self.embedded.probs.double()
        return float((p * s2**2).sum() / (p * s2).sum() ** 2)


def build_setups(preset: str, n_prompts: int = 1) -> list[Setup]:
    """Warm ``preset`` on sort (n = 2, max_value = 2), float64, flat tables of ``n_prompts``."""
    from varbench.analysis.oracle import enumerate_distribution, response_table
    from varbench.grads.precision import exact_float64
    from varbench.models.presets import Policy
    from varbench.tasks import get_task
    from varbench.train.policies import build_policy

    task = get_task("sort", n=2, max_value=2)
    warm = build_policy(preset, task=task, warm=True, progress=False)
    pol = Policy(model=exact_float64(warm.model), tokenizer=warm.tokenizer, name=preset)
    out = []
    for p, prompt in enumerate(task.prompts(n_prompts, seed=0)):
        dist = enumerate_distribution(pol, task, prompt)
        flat = response_table(pol, dist, sketch_dim=None)
        flat = replace(flat, vec=flat.vec.double())
        N, T, D = flat.vec.shape
        v = flat.vec.reshape(N * T, D)
        lam, U = torch.linalg.eigh(v @ v.T)
        keep = lam > lam.max() * 1e-13  # the rest is rounding of a rank-deficient Gram
        emb = (U[:, keep] * lam[keep].sqrt()).reshape(N, T, -1)
        out.append(Setup(f"{preset}/p{p}", flat, replace(flat, vec=emb)))
    return out


def truth(setup: Setup, G: int, schemes: list[str], *, mc_groups: int = 400_000,
          seed: int = 12_345) -> dict[tuple[str, str], float]:
    """``{(scheme, stat): value}``: closed forms where the scheme reads rewards only, else a
    flat Monte Carlo of ``mc_groups`` groups (in the embedding: the flat inner products)."""
    from varbench.analysis.variance_cells import table_cells

    out: dict[tuple[str, str], float] = {}
    ex, _ = table_cells(setup.embedded, G, 8, schemes=schemes, exact=True)
    mc = []
    for r in ex.itertuples():
        if r.method == "exact":
            out.update({(r.scheme, k): getattr(r, k) for k in STATS})
        else:
            mc.append(r.scheme)
    if mc:
        out.update(mc_truth(setup.embedded, G, mc, mc_groups, seed=seed))
    return out


def mc_truth(tab, G: int, schemes: list[str], n_groups: int, *, chunk: int = 4_000,
             seed: int = 12_345) -> dict[tuple[str, str], float]:
    """Monte Carlo ``{(scheme, stat): value}`` over ``n_groups`` groups of ``tab`` (chunked
    sums: no Gram matrix), for the schemes without a closed form (they read token weights)."""
    from varbench.analysis.variance import group_advantages, group_estimates

    ref = tab.reference()
    T = tab.mask.shape[1]
    gen = torch.Generator().manual_seed(seed)
    acc = {s: [torch.zeros_like(ref), 0.0, 0.0] for s in schemes}
    for _ in range(n_groups // chunk):
        d = tab.sample(chunk * G, gen)
        grp = {k: v[0].reshape(chunk, G, *v.shape[2:]) for k, v in d.items()}
        mask = grp["mask"] != 0
        for s in schemes:
            adv = group_advantages(s, grp["rewards"].to(grp["logprobs"].dtype), mask,
                                   grp["logprobs"], grp["sum_pi_sq"], grp["token_sq"])
            x = group_estimates(grp["vec"], adv, mask.to(grp["logprobs"].dtype),
                                grp["logprobs"], "seq-mean-token-sum", max_len=T).double()
            a = acc[s]
            a[0] += x.sum(0)
            a[1] += float((x * x).sum())
            a[2] += float(((x - ref) ** 2).sum())
    n = (n_groups // chunk) * chunk
    out = {}
    for s, (sm, sq, se2) in acc.items():
        mean = sm / n
        out[s, "variance"] = (sq - n * float(mean @ mean)) / (n - 1)
        out[s, "mse"] = se2 / n
        out[s, "projection"] = float(mean @ ref) / float(ref @ ref)
    return out


def add_ratios(t: dict, pairs: list[tuple[str, str]]) -> dict:
    """Truth of the paired variance and MSE ratios ``a / b``."""
    for a, b in pairs:
        for k in ("variance", "mse"):
            t[f"{a}/{b}", k] = t[a, k] / t[b, k]
    return t


def two_reward_levels(setups: list[Setup]) -> bool:
    """Whether every setup's responses take exactly two reward values."""
    return all(len(set(s.flat.rewards.tolist())) == 2 for s in setups)


def exact_identities(G: int, schemes: list[str], setups: list[Setup]) -> list[tuple[str, str]]:
    """Paired ratios that are a constant on every sample (no sketch or sampling error: the cells
    report a zero-width interval, tested exactly in test_coverage.py, not an interval to cover):
    rloo / centered's variance, ``(G/(G-1))^2``; at G = 2 with two reward levels, normalized /
    centered's variance too (every mixed group has the same spread, so normalized is a fixed
    multiple of centered on every group, and tied groups are 0 under both)."""
    out = []
    if "rloo" in schemes and "centered" in schemes:
        out.append(("rloo/centered", "variance"))
    if (G == 2 and "normalized" in schemes and "centered" in schemes
            and two_reward_levels(setups)):
        out.append(("normalized/centered", "variance"))
    return out


def _sketched(setup: Setup, K: int | None, seed: int):
    """The flat table under a fresh CountSketch (K buckets; None: flat)."""
    from varbench.grads.vectors import CountSketch

    if K is None:
        return setup.flat
    S = CountSketch([setup.flat.vec.shape[-1]], K, seed=seed)
    return replace(setup.flat, vec=S.apply(setup.flat.vec), sketch=S.description)


def _tables(setups, K, rep):
    """One replicate's sketch draw of every prompt's table: prompt p seeded as
    ``estimator_variance`` seeds it (``SKETCH_PROMPT_STRIDE`` apart), from ``10_000 + rep``."""
    from varbench.analysis.variance import SKETCH_PROMPT_STRIDE

    return [_sketched(s, K, seed=10_000 + rep + SKETCH_PROMPT_STRIDE * p)
            for p, s in enumerate(setups)]


def _pilot_rel_se(tabs, G, pilot, schemes, rep) -> float:
    """The largest relative SE of the headline figures (the shipping ``_headline_rel_se``) on
    a pilot of ``pilot`` groups per prompt, drawn apart from the reported ones (seed offset
    ``PILOT_SEED``), on the replicate's sketch draw; the worst prompt's."""
    from varbench.analysis.variance import PILOT_SEED, _headline_rel_se

    worst = 0.0
    for p, tab in enumerate(tabs):
        T = tab.mask.shape[1]
        gen = torch.Generator().manual_seed(1000 + rep + 7919 * p + PILOT_SEED)
        d = tab.sample(pilot * G, gen)
        r, _ = _headline_rel_se(d, [G], pilot, schemes, ["seq-mean-token-sum"], tab.reference(),
                                topk_k=1, max_len=T, mean_len=float(T))
        worst = max(worst, r)
    return worst


def _cells(tabs, G, M, schemes, rep, n_boot, exact):
    """One replicate's (cells, paired) of every prompt's (sketched) table."""
    from varbench.analysis.variance_cells import table_cells

    cells, paired = [], []
    for p, tab in enumerate(tabs):
        c, pr = table_cells(tab, G, M, schemes=schemes, seed=1000 + rep + 7919 * p,
                            n_boot=n_boot, exact=exact, sketch_k=tab.sketch_k)
        cells.append(c.assign(prompt=p))
        paired.append(pr.assign(prompt=p))
    return pd.concat(cells), pd.concat(paired)


def coverage(setups: list[Setup], G: int, M: int, reps: int, truths: list[dict],
             schemes: list[str], *, K: int | None = 1024, n_boot: int = 1000,
             exact: bool = False, adaptive: tuple[float, int, int] | None = None,
             start: int = 0, records: list | None = None, per_prompt: bool = False,
             ) -> dict[tuple[str, str], tuple[int, int, float]]:
    """``{(quantity, stat): (hits, replicates, mean M)}`` of the intervals over ``reps``.

    One setup: per-prompt intervals; several: the intervals pooled over them (``_pool``, as
    ``estimator_variance`` reports them) against the mean truth. ``exact``: the reward-only
    schemes' cells are ``exact-sketched`` (closed form on the sketch, the sketch's SD as SE).
    ``adaptive = (target, cap, pilot)``: the shipping two-stage rule (``planned_groups``): a
    pilot of ``pilot`` groups, drawn apart, gives the headline figures' largest relative SE
    (``_headline_rel_se``), which sets M in steps of ``M`` within [M, cap]; the reported
    cells rest on fresh groups. Replicates are seeded ``start .. start + reps - 1`` (a long
    study runs in chunks). ``records``: a list that gets one dict per (replicate, quantity,
    stat) with the value, the interval and the truth, so a miss can be read by side and size.
    ``per_prompt`` (several setups): each prompt's own intervals, before pooling, against its
    own truth, as well (quantity ``p{p}:{quantity}``): one prompt alone on the same replicates,
    its cells exactly those of a one-prompt run with that prompt's seeds.
    """
    from varbench.analysis.variance import _pool
    from varbench.stats.intervals import planned_groups

    keys = list(truths[0])
    want = {k: sum(t[k] for t in truths) / len(truths) for k in keys}
    per_prompt = per_prompt and len(setups) > 1
    if per_prompt:
        want |= {(f"p{p}:{q}", st): t[q, st] for p, t in enumerate(truths) for q, st in t}
        keys = list(want)
    hits = {k: 0 for k in keys}
    n = {k: 0 for k in keys}
    Ms = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # [M, M] and [n_boot, M] tensors: threads only add overhead
    try:
        for rep in range(start, start + reps):
            tabs = _tables(setups, K, rep)
            m = M
            if adaptive is not None:
                target, cap, pilot = adaptive
                m = planned_groups(_pilot_rel_se(tabs, G, pilot, schemes, rep), pilot=pilot,
                                   step=M, floor=M, cap=cap, target=target)
            Ms.append(m)
            cells, paired = _cells(tabs, G, m, schemes, rep, n_boot, exact)
            found = []
            if per_prompt:
                for p in range(len(setups)):
                    found += _found(cells[cells.prompt == p], paired[paired.prompt == p], want,
                                    f"p{p}:")
            if len(setups) > 1:
                cells = _pool(cells, ["scheme", "G", "mode"])
                paired = _pool(paired, ["scheme", "baseline", "G", "mode", "stat"])
            found += _found(cells, paired, want)
            for key, value, lo, hi in found:
                hits[key] += lo <= want[key] <= hi
                n[key] += 1
                if records is not None:
                    records.append({"rep": rep, "quantity": key[0], "stat": key[1],
                                    "value": value, "ci_low": lo, "ci_high": hi,
                                    "truth": want[key], "groups": m})
    finally:
        torch.set_num_threads(threads)
    mean_m = sum(Ms) / len(Ms)
    return {k: (hits[k], n[k], mean_m) for k in keys if n[k]}


def _found(cells, paired, want, prefix: str = "") -> list[tuple]:
    """``(key, value, ci_low, ci_high)`` of every wanted quantity in one replicate's frames;
    ``prefix`` names a prompt's own quantities (``p{p}:``)."""
    out = [((prefix + r.scheme, k), getattr(r, k), getattr(r, f"{k}_ci_low"),
            getattr(r, f"{k}_ci_high"))
           for r in cells.itertuples() for k in STATS if (prefix + r.scheme, k) in want]
    if "ratio_ci_low" in paired:
        out += [((f"{prefix}{r.scheme}/{r.baseline}", r.stat), r.ratio, r.ratio_ci_low,
                 r.ratio_ci_high) for r in paired.itertuples()
                if (f"{prefix}{r.scheme}/{r.baseline}", r.stat) in want]
    return out


def table_rows(setup: str, G: int, M: int, cov: dict, *, variant: str,
               level: float = 0.95) -> list[dict]:
    """Rows of the coverage table: coverage, its Monte Carlo SE, the replicates."""
    rows = []
    for (q, stat), (h, n, mean_m) in sorted(cov.items()):
        c = h / n
        rows.append({"setup": setup, "variant": variant, "G": G, "groups": M,
                     "mean_groups": mean_m, "quantity": q, "stat": stat, "reps": n,
                     "coverage": c, "mc_se": (c * (1 - c) / n) ** 0.5,
                     "within_2pt": abs(c - level) <= 0.02})
    return rows


def main(argv: list[str] | None = None) -> None:
    """Command line for the slow table: ``python tests/_coverage.py --preset tiny -G 8 ...``
    appends one CSV row per (quantity, stat) to ``--out``."""
    import argparse
    import os
    import time

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--preset", default="tiny", choices=("micro", "tiny"))
    ap.add_argument("-G", type=int, default=8)
    ap.add_argument("--groups", type=int, default=512, help="groups per prompt at this G")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--variant", default="mc", choices=("mc", "exact", "pooled", "adaptive"))
    ap.add_argument("--schemes", default="centered,otb,otb_exact")
    ap.add_argument("-K", type=int, default=1024)
    ap.add_argument("--n-boot", type=int, default=1000)
    ap.add_argument("--target", type=float, default=0.05, help="adaptive: relative SE")
    ap.add_argument("--cap", type=int, default=4096, help="adaptive: largest groups")
    ap.add_argument("--pilot", type=int, default=64, help="adaptive: pilot groups")
    ap.add_argument("--mc-groups", type=int, default=400_000)
    ap.add_argument("--chunk", type=int, default=20, help="replicates between CSV writes")
    ap.add_argument("--start", type=int, default=0,
                    help="first replicate seed (a study extended with new seeds)")
    ap.add_argument("--out", required=True, help="CSV of this run (rewritten per chunk)")
    ap.add_argument("--records", help="CSV of every replicate's intervals (rewritten per chunk)")
    a = ap.parse_args(argv)
    t0 = time.time()
    schemes = a.schemes.split(",")
    setups = build_setups(a.preset, 2 if a.variant == "pooled" else 1)
    base = "centered" if "centered" in schemes else schemes[0]
    pairs = [(s, base) for s in schemes if s != base]
    if "otb" in schemes and "otb_exact" in schemes:
        pairs.append(("otb", "otb_exact"))
    truths = [add_ratios(truth(s, a.G, schemes, mc_groups=a.mc_groups), pairs) for s in setups]
    for t in truths:
        for k in exact_identities(a.G, schemes, setups):
            t.pop(k, None)
    if a.variant == "exact" and two_reward_levels(setups):
        # two reward levels: E g_hat of a reward-only scheme is along g* on every sketch, its
        # exact-sketched projection has no sketch error (SE 0, tested exactly in
        # test_coverage.py), not an interval to cover
        for t in truths:
            for sch in schemes:
                if sch in ("centered", "rloo", "normalized", "topk"):
                    t.pop((sch, "projection"), None)
    kurt = sum(s.kurtosis() for s in setups) / len(setups)
    total: dict = {}
    records: list = []
    for first in range(0, a.reps, a.chunk):  # the CSV is rewritten after every chunk
        part = coverage(setups, a.G, a.groups, min(a.chunk, a.reps - first), truths, schemes,
                        K=a.K, n_boot=a.n_boot, exact=a.variant == "exact",
                        start=a.start + first, records=records,
                        per_prompt=a.variant == "pooled",
                        adaptive=((a.target, a.cap, a.pilot) if a.variant == "adaptive"
                                  else None))
        for k, (h, n, m) in part.items():
            h0, n0, m0 = total.get(k, (0, 0, 0.0))
            total[k] = (h0 + h, n0 + n, (m0 * n0 + m * n) / (n0 + n))
        rows = pd.DataFrame(table_rows(a.preset, a.G, a.groups, total, variant=a.variant))
        rows = rows.assign(K=a.K, kurtosis=kurt, seconds=time.time() - t0)
        rows.to_csv(a.out + ".tmp", index=False)
        os.replace(a.out + ".tmp", a.out)
        if a.records:
            pd.DataFrame(records).to_csv(a.records + ".tmp", index=False)
            os.replace(a.records + ".tmp", a.records)
    print(rows.to_string(index=False))


if __name__ == "__main__":
    main()
