"""Coefficient-first per-response sketches: ONE weighted backward per response chunk and
coefficient set, each Linear/Embedding gradient projected without being formed (issue 26).

For response b and coefficients ``c_{b,t}`` the quantity is the per-response gradient
``G_b = sum_t c_{b,t} grad_theta log pi(y_{b,t} | y_{b,<t})``. One backward of
``sum_{b,t} c_{b,t} log p_{b,t}`` over a chunk of responses leaves at each module output the
cotangents of every response's own loss (causal LM rows do not interact), so per weight
``G_b = L_b^T R_b`` from one call's factors (:mod:`varbench.grads.seqnorms`: a Linear's
``L = D [t, out]``, ``R = A [t, in]``; Conv1D transposed; an Embedding's one-hot ids and its
scaled cotangent). Instead of forming ``G_b`` (``out x in``), each factor is projected on its
own side (a Kronecker-structured random projection, as LoGra / LogIX do):

    S(G_b) = P_1^T G_b P_2 = (L_b P_1)^T (R_b P_2)      [k1, k2], flattened,

with ``P_1 [rows, k1]``, ``P_2 [cols, k2]`` iid N(0, 1/k) entries, drawn per parameter from a
generator seeded with ``seed`` on the model's device (an Embedding's ``L_b P_1`` is a row
gather). A side with ``k >= its dimension`` is kept exact (identity: no variance, no saving).
Cost per call: ``t (rows k1 + cols k2 + k1 k2)`` multiply-adds per response, never
``rows x cols``. A weight used by several calls (a tied embedding and head) sums its calls'
sketches under the same projection (S is linear). Small parameters (biases, norm weights and
other position-separable modules' parameters) get their exact per-response gradients by the
rules of :mod:`varbench.grads.seqnorms` (a cotangent sum, the RMS-norm formula or a vmapped
vjp), kept flat (``k_dense=None``) or count-sketched (:class:`varbench.grads.vectors.CountSketch`
with ``k_dense`` buckets). Modules with no exact per-response rule (MoE experts called on a
token subset, unrecognised modules) raise an error naming them: exclude them with ``params``.

Unbiasedness and variance (docs/science.md, "Coefficient-first projected sketches"): per block
``E<S a, S b> = <a, b>`` and, for Gaussian sides,
``Var = (tr(Z^2) + ||W||^2)/k1 + (tr(Z^2) + ||Z||^2)/k2 + (||Z||^2 + ||W||^2 + <a,b>^2 +
||a||^2 ||b||^2)/(k1 k2)`` with ``Z = a^T b`` and ``W = a b^T`` (:func:`block_pair_variance`);
blocks are drawn independently so their variances add. :func:`projection_sd` is the error that
goes into intervals (as :func:`varbench.stats.intervals.sketch_sd` is for the CountSketch):
each block's variance estimated without bias from the Gram of its sketch rows and columns
(:func:`kron_pair_var`), turned into a symmetric sd evaluated at the truth (:func:`score_sd`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy import special, stats

from varbench._util.checks import UsageError, check_positive_int, check_shape
from varbench.grads._inputs import check_inputs, eval_mode, prepare_model
from varbench.grads.ghost import _QUIET, CallRecorder, acc_dtype, checked_form
from varbench.grads.params import ParamFilter, select_params
from varbench.grads.seqnorms import (
    _check_rows,
    _Factor,
    _factor,
    _generic_all,
    _generic_ok,
    sequence_rows,
)
from varbench.grads.vectors import CountSketch
from varbench.models.arch import check_finite_logits, is_factorable_type
from varbench.models.forward import forward_logits
from varbench.models.logits import token_logprobs, upcast

PROJECTIONS = ("gaussian", "identity")

# the dense block's CountSketch seed is a fixed map of ``seed`` that never equals it, so its
# hash is not drawn from the same stream as the Gaussian projections of the same seed
_DENSE_SEED_MUL = 1_000_003
_DENSE_SEED_ADD = 0x5EED


@dataclass(frozen=True)
class Block:
    """One slot ``[start, stop)`` of a sketch row: a factored weight projected to
    ``k1 x k2`` (``kind='kron'``; ``k1 == rows`` / ``k2 == cols`` mark an exact side), a
    parameter kept flat (``kind='exact'``) or the CountSketch of every dense parameter
    (``kind='countsketch'``, ``k1 = K``, ``names`` all of them)."""

    kind: str
    names: tuple[str, ...]
    start: int
    stop: int
    k1: int
    k2: int
    rows: int = 0
    cols: int = 0

    def inv_k(self) -> tuple[float, float]:
        """``(1/k1, 1/k2)`` of a Kronecker block, 0 for an exact side."""
        return (0.0 if self.k1 >= self.rows else 1.0 / self.k1,
                0.0 if self.k2 >= self.cols else 1.0 / self.k2)

    def norm_var_factor(self) -> float:
        """``c`` with ``Var<S a, S b> <= c ||a||^2 ||b||^2`` for this block (0: exact)."""
        if self.kind == "exact":
            return 0.0
        if self.kind == "countsketch":
            return 2.0 / self.k1  # CountSketch: (||a||^2||b||^2 + <a,b>^2) / K at most
        u, v = self.inv_k()
        return 2 * u + 2 * v + 4 * u * v


@dataclass
class ResponseSketches:
    """``vec [S, B, K]`` (``[B, K]`` when one coefficient set was given): row b of set s is
    ``S(G_{s,b})``; ``blocks`` the layout of K, ``methods`` parameter name -> route,
    ``description`` e.g. "kron(gaussian, k1=16, k2=16, seed=0) + countsketch(K=1024)"."""

    vec: torch.Tensor
    blocks: list[Block]
    methods: dict[str, str]
    description: str

    @property
    def dim(self) -> int:
        """K: numbers per response."""
        return self.blocks[-1].stop if self.blocks else 0


class _Plan:
    """The seeded projections of one call: per factored weight ``(P_1 | None, P_2 | None)``
    (None: exact side), the slots, and the dense CountSketch (or None: dense kept flat)."""

    def __init__(self, model, chosen, factored: dict[int, tuple[int, int]], k1: int, k2: int,
                 seed: int, projection: str, k_dense: int | None, acc, dev) -> None:
        g = None if dev.type == "meta" else torch.Generator(device=dev).manual_seed(seed)
        self.proj: dict[int, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        self.slot: dict[int, tuple[int, int]] = {}
        self.blocks: list[Block] = []
        dense = [(n, p) for n, p in chosen if id(p) not in factored]
        n_dense = sum(p.numel() for _, p in dense)
        sketch_dense = (projection != "identity" and k_dense is not None and dense
                        and k_dense < n_dense)
        pos = 0
        for name, p in chosen:
            if id(p) in factored:
                rows, cols = factored[id(p)]
                a = rows if projection == "identity" or k1 >= rows else k1
                b = cols if projection == "identity" or k2 >= cols else k2
                # drawn in select_params order, rows side then cols side: the same P for the
                # same (model, seed, k1, k2) on one device type
                p1 = None if a == rows else torch.randn(
                    rows, a, generator=g, device=dev, dtype=acc) / math.sqrt(a)
                p2 = None if b == cols else torch.randn(
                    cols, b, generator=g, device=dev, dtype=acc) / math.sqrt(b)
                self.proj[id(p)] = (p1, p2)
                self.blocks.append(Block("kron", (name,), pos, pos + a * b, a, b, rows, cols))
            elif sketch_dense:
                continue
            else:
                self.blocks.append(Block("exact", (name,), pos, pos + p.numel(), p.numel(), 1,
                                         p.numel(), 1))
            self.slot[id(p)] = (pos, self.blocks[-1].stop)
            pos = self.blocks[-1].stop
        self.dense_ids = [id(p) for _, p in dense]
        self.sketch: CountSketch | None = None
        if sketch_dense:
            self.sketch = CountSketch([p.numel() for _, p in dense], int(k_dense),
                                      seed * _DENSE_SEED_MUL + _DENSE_SEED_ADD, device=dev)
            self.blocks.append(Block("countsketch", tuple(n for n, _ in dense), pos,
                                     pos + int(k_dense), int(k_dense), 1, n_dense, 1))
        self.K = self.blocks[-1].stop if self.blocks else 0


def _project(f: _Factor, p1: torch.Tensor | None, p2: torch.Tensor | None,
             rows: int) -> torch.Tensor:
    """``[B, a*b]`` flattened ``(L_b P_1)^T (R_b P_2)`` of one call's factors (row-major like
    the weight when both sides are exact)."""
    if f.ids is not None:  # one-hot L: L P_1 is a row gather (or the one-hot rows themselves)
        if p1 is None:
            left = torch.nn.functional.one_hot(f.ids, rows).to(f.R.dtype)
        else:
            left = p1[f.ids]
        if f.keep is not None:
            left = left * f.keep[..., None]
    else:
        left = f.L if p1 is None else f.L @ p1
    right = f.R if p2 is None else f.R @ p2
    return torch.einsum("bna,bnc->bac", left, right).reshape(left.shape[0], -1)


def _rows_view(m: torch.nn.Module, call, B: int):
    """A call on flattened ``[B*t, h]`` rows (OPT's MLP norms) as the call on ``[B, t, h]``
    when re-running the module on that view reproduces the recorded output (a row-wise module),
    else None."""
    args, kwargs, out = call
    if (len(args) != 1 or not isinstance(args[0], torch.Tensor) or args[0].dim() != 2
            or not isinstance(out, torch.Tensor) or out.dim() != 2
            or args[0].shape[0] % B or out.shape[0] != args[0].shape[0]
            or any(isinstance(v, torch.Tensor) for v in kwargs.values())):
        return None
    x = args[0].detach().reshape(B, -1, args[0].shape[-1])
    _QUIET.append(True)
    try:
        with torch.no_grad():
            y = m(x, **kwargs)
    finally:
        _QUIET.pop()
    want = out.detach().reshape(B, -1, out.shape[-1])
    if not isinstance(y, torch.Tensor) or y.shape != want.shape or not torch.equal(y, want):
        return None
    # the call as seen per response; the cotangent is still taken at the recorded output
    return ((x,), kwargs, want)


def _route(model, rec, owners, chosen_name, B, L) -> tuple[list, dict[int, str]]:
    """Every chosen parameter's exact per-response rule from the recorded calls: plan entries
    ``(module, call, form | "generic", names, recorded output)`` and the routes. Raises on a
    module without one."""
    plan, route = [], {}
    for m in owners:
        calls = rec.calls[id(m)]
        own = [n for n, p in m.named_parameters(recurse=False) if id(p) in chosen_name]
        if not calls:
            continue
        if is_factorable_type(m):
            forms = [checked_form(m, call, B * L) for call in calls]
            if all(f.kind is not None for f in forms):
                for f, call in zip(forms, calls, strict=True):
                    _check_rows(m, f, call, B, B * L)
                    plan.append((m, call, f, own, call[2]))
                for n in own:
                    p = getattr(m, n)
                    route.setdefault(id(p), "projected" if n == "weight" else "exact (bias)")
                continue
            reason = next(f.reason for f in forms if f.kind is None)
        elif all(_generic_ok(m, call, B) or _rows_view(m, call, B) for call in calls):
            for call in calls:
                view = call if _generic_ok(m, call, B) else _rows_view(m, call, B)
                plan.append((m, view, "generic", own, call[2]))
            for n in own:
                route.setdefault(id(getattr(m, n)), "exact (per-module vjp)")
            continue
        else:
            reason = f"{type(m).__name__} is not a recognised or position-separable module"
        names = [chosen_name[id(getattr(m, n))] for n in own]
        raise UsageError(
            f"response_sketches has no exact per-response rule for {type(m).__name__} "
            f"({reason}; parameters {names}): exclude them with params=..."
        )
    kinds: dict[int, set] = {}
    for m, _, f, own, _ in plan:
        for n in own:
            kinds.setdefault(id(getattr(m, n)), set()).add("g" if f == "generic" else "f")
    for pid, k in kinds.items():
        if len(k) > 1:
            raise UsageError(f"parameter {chosen_name[pid]} is reached by factored and generic "
                             "module calls; exclude it with params=...")
    return plan, route


def _block_sketches(model, ids, am, c, chosen, state: dict, acc, args) -> torch.Tensor:
    """``[S, b, K]`` sketches of one chunk of responses: one forward, S weighted backwards."""
    dev = ids.device
    B, L = ids.shape
    S = c.shape[0]
    chosen_name = {id(p): n for n, p in chosen}
    owners = [m for m in model.modules()
              if any(id(p) in chosen_name for p in m.parameters(recurse=False))]
    rec = CallRecorder(owners)
    try:
        with eval_mode(model), torch.enable_grad():
            logits = forward_logits(model, ids, am).logits
            check_finite_logits(model, logits, "response_sketches' forward")
            lp = token_logprobs(upcast(logits), ids)
            plan, route = _route(model, rec, owners, chosen_name, B, L)
            if "plan" not in state:  # projections drawn once per call, for every chunk
                factored = {}
                for m, _, f, _own, _ in plan:
                    # G = L^T R in the weight's own layout (Conv1D's [in, out] included)
                    if f != "generic" and id(m.weight) in chosen_name:
                        factored[id(m.weight)] = tuple(m.weight.shape)
                state["plan"] = _Plan(model, chosen, factored, *args, acc=acc, dev=dev)
                state["route"] = route
            pl: _Plan = state["plan"]
            out = torch.zeros(S, B, pl.K, dtype=acc, device=dev)
            outs, index = [], {}
            for *_, o in plan:
                if id(o) not in index and o.requires_grad:
                    index[id(o)] = len(outs)
                    outs.append(o)
            for s in range(S):
                loss = (lp * c[s].to(lp.dtype)).sum()
                # cotangents at module outputs only: autograd skips every weight gradient
                cots = torch.autograd.grad(loss, outs, allow_unused=True,
                                           retain_graph=s < S - 1) if outs else []
                dense: dict[int, list[torch.Tensor]] = {}
                generic = []
                for m, call, f, own, o in plan:
                    D = cots[index[id(o)]] if id(o) in index else None
                    if D is None:
                        D = torch.zeros_like(o)
                    if f == "generic":  # per-response layout [B, t, ...] (a rows view too)
                        generic.append((m, call, D.reshape(call[2].shape), own))
                        continue
                    w, b = m.weight, getattr(m, "bias", None)
                    if id(w) in chosen_name:
                        (fac,) = _factor(m, f, call, B, D, acc)
                        p1, p2 = pl.proj[id(w)]
                        lo, hi = pl.slot[id(w)]
                        out[s, :, lo:hi] += _project(fac, p1, p2, w.shape[0])
                        del fac  # the head's [b, t, V] factor: not alive into the next call
                    if b is not None and f.kind != "embedding" and id(b) in chosen_name:
                        db = D.reshape(B, -1, D.shape[-1]).to(acc).sum(1)
                        dense.setdefault(id(b), []).append(db)
                for m, local, grads in _generic_all(generic, B):
                    for k, g in zip(local, grads, strict=True):
                        dense.setdefault(id(getattr(m, k)), []).append(g.to(acc))
                _put_dense(out[s], dense, chosen, pl)
                # this set's cotangents die before the next set's backward makes its own
                cots = dense = generic = D = None
    finally:
        rec.remove()
    return out


def _put_dense(out: torch.Tensor, dense: dict[int, list[torch.Tensor]], chosen,
               pl: _Plan) -> None:
    """Write the dense parameters' exact ``[b, numel]`` gradients (0 where a parameter got
    none) flat into their slots, or their CountSketch into the trailing block."""
    B = out.shape[0]
    grads = []
    for pid, p in ((id(p), p) for _, p in chosen if id(p) in set(pl.dense_ids)):
        parts = dense.get(pid)
        g = (torch.stack(parts).sum(0) if parts else
             torch.zeros(B, p.numel(), dtype=out.dtype, device=out.device))
        if pl.sketch is None:
            lo, hi = pl.slot[pid]
            out[:, lo:hi] += g
        else:
            grads.append(g)
    if pl.sketch is not None and grads:
        blk = pl.blocks[-1]
        out[:, blk.start:blk.stop] += pl.sketch(grads)


def response_sketches(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    coefficients: torch.Tensor,
    k1: int = 16,
    k2: int = 16,
    seed: int = 0,
    projection: str = "gaussian",
    k_dense: int | None = 1024,
    params: ParamFilter = None,
    rows: int | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    accumulate: torch.dtype | None = None,
    out_device: str | torch.device | None = None,
    groups: int | None = None,
) -> ResponseSketches:
    """Per-response sketches ``S(sum_t c_{s,b,t} grad log p_{b,t})``: ``[S, B, K]`` from one
    forward per chunk of ``rows`` responses and ONE weighted backward per chunk and set.

    Shapes: ``input_ids``, ``response_mask``, ``attention_mask`` ``[B, L]``;
    ``coefficients`` ``[B, L]`` (one set; ``vec`` is then ``[B, K]``) or ``[S, B, L]``,
    aligned with the inputs (or ``[S?, B, T]``, T <= L: the last T positions, the responses)
    (a sequence-level Delta broadcast over the response positions, or
    per-token OTB coefficients); only response positions count. ``k1``/``k2``: the Kronecker
    projection's sides (a side at least as large as its dimension stays exact);
    ``projection="identity"`` keeps every block exact (the rows ARE the flat gradients in
    :func:`select_params` order: a test mode, ``rows x cols`` per weight). ``k_dense``: buckets
    of the CountSketch of biases / norm weights (None: exact). ``rows``: responses per chunk
    (default :func:`varbench.grads.seqnorms.sequence_rows`, from the free device memory on
    CUDA or a byte budget on the CPU); chunks change nothing but rounding.
    Caveat: inner products of rows are unbiased for the exact ones over the random projection
    (per fixed ``seed`` they carry its error: :func:`projection_sd`); accumulation in float32
    at least (float64 for a float64 model or ``accumulate``), on the model's device, each
    chunk's rows moved to ``out_device`` (default: stay there). ``groups``: sum each run of
    ``groups`` consecutive responses into one row as the chunks stream (``vec [S, B/groups,
    K]``: group estimates, memory O(chunk) on the device and O(B/groups) on ``out_device``).
    Inputs and coefficients stay where they are and go to the device one chunk at a time.
    """
    if projection not in PROJECTIONS:
        raise UsageError(f"projection must be one of {PROJECTIONS}, got {projection!r}")
    check_positive_int("k1", k1)
    check_positive_int("k2", k2)
    if k_dense is not None:
        check_positive_int("k_dense", k_dense)
    input_ids, response_mask, attention_mask = check_inputs(
        input_ids, response_mask, attention_mask)
    model = prepare_model(model, dtype, device)
    dev = next(model.parameters()).device
    B, L = input_ids.shape
    if groups is not None:
        check_positive_int("groups", groups)
    if groups is not None and B % groups:
        raise UsageError(f"groups={groups} does not divide the {B} responses")
    acc = acc_dtype(next(model.parameters()).dtype, accumulate)
    single = coefficients.dim() == 2
    c = coefficients[None] if single else coefficients
    check_shape("coefficients", c, [None, B, None])
    if c.shape[-1] > L:
        raise UsageError(f"coefficients has {c.shape[-1]} positions, more than the inputs' {L}")
    if not bool(torch.isfinite(c).all()):
        raise UsageError("coefficients contains NaN or inf")
    chosen = select_params(model, params)
    out_device = dev if out_device is None else torch.device(out_device)
    n = sequence_rows(model, B, L, dev, rows)
    state: dict = {}
    parts = []
    vec = None
    for s in range(0, B, n):
        m = response_mask[s:s + n].to(dev)
        # a chunk's coefficients at full length on the device (right-aligned when shorter)
        cs = torch.zeros(c.shape[0], m.shape[0], L, dtype=acc, device=dev)
        cs[..., L - c.shape[-1]:] = c[:, s:s + n].to(dev, acc)
        cs = cs * m.to(acc)
        part = _block_sketches(model, input_ids[s:s + n].to(dev),
                               attention_mask[s:s + n].to(dev), cs, chosen, state,
                               acc, (k1, k2, seed, projection, k_dense)).to(out_device)
        if groups is None:
            parts.append(part)
            continue
        if vec is None:  # group sums accumulate online: a chunk may split a group
            vec = torch.zeros(c.shape[0], B // groups, part.shape[-1], dtype=part.dtype,
                              device=out_device)
        idx = torch.arange(s, s + part.shape[1], device=out_device) // groups
        vec.index_add_(1, idx, part)
    pl: _Plan = state["plan"]
    if groups is None:
        vec = torch.cat(parts, 1)
    methods = {}
    for name, p in chosen:
        r = state["route"].get(id(p), "unused")
        if id(p) in pl.proj:
            p1, p2 = pl.proj[id(p)]
            blk = next(b for b in pl.blocks if b.names == (name,))
            r = f"projected ({blk.k1}x{blk.k2}" + (
                ", exact" if p1 is None and p2 is None else "") + ")"
        elif pl.sketch is not None and id(p) in set(pl.dense_ids):
            r += f", countsketch(K={pl.sketch.dim})"
        methods[name] = r
    desc = f"kron({projection}, k1={k1}, k2={k2}, seed={seed})" + (
        f" + countsketch(K={pl.sketch.dim})" if pl.sketch is not None else "")
    return ResponseSketches(vec=vec[0] if single else vec, blocks=pl.blocks, methods=methods,
                            description=desc)


def batch_sketches(model: torch.nn.Module, batch, coeffs: torch.Tensor,
                   **kw) -> ResponseSketches:
    """:func:`response_sketches` of a RolloutBatch with ``[P, G, T]`` or ``[S, P, G, T]``
    coefficients (the variance analysis' layout): ``vec [S?, P, G, K]``; ``vec.sum(-2)`` is the
    sketch of the group estimate ``sum_{i,t} c_{p,i,t} g_{p,i,t}`` (what ``combine`` gives on
    per-token vectors), unbiased for its inner products."""
    flat = batch.flat()
    P, G, T = batch.tokens.shape
    single = coeffs.dim() == 3
    c = coeffs[None] if single else coeffs
    check_shape("coeffs", c, [None, P, G, T])
    full = torch.zeros(c.shape[0], P * G, flat.input_ids.shape[1], dtype=torch.float64,
                       device=c.device)
    full[..., flat.prompt_len:] = c.reshape(c.shape[0], P * G, T).double()
    r = response_sketches(model, flat.input_ids, flat.response_mask, flat.attention_mask,
                          coefficients=full, **kw)
    v = r.vec.reshape(c.shape[0], P, G, -1)
    r.vec = v[0] if single else v
    return r


def block_pair_variance(a: torch.Tensor, b: torch.Tensor, k1: float, k2: float) -> torch.Tensor:
    """Exact ``Var<S a, S b>`` over Gaussian Kronecker projections of ``[rows, cols]`` matrices
    a, b (``1/k = 0`` for an exact side: pass ``math.inf``); the formula of the module doc."""
    u = 0.0 if math.isinf(k1) else 1.0 / k1
    v = 0.0 if math.isinf(k2) else 1.0 / k2
    Z = a.T @ b  # [cols, cols]
    W = a @ b.T  # [rows, rows]
    trZ2 = (Z * Z.T).sum()
    z2, w2 = Z.pow(2).sum(), W.pow(2).sum()
    s = (a * b).sum()
    return ((trZ2 + w2) * u + (trZ2 + z2) * v
            + (z2 + w2 + s * s + a.pow(2).sum() * b.pow(2).sum()) * u * v)


def _gram_offdiag(H: torch.Tensor) -> float:
    """``sum_{i != j} (H_ij^2 + H_ij H_ji) / (k - 1)`` of a ``[k, k]`` Gram of sketch rows."""
    d = float(H.diagonal().pow(2).sum())
    return (float(H.pow(2).sum()) - d + float((H * H.T).sum()) - d) / (H.shape[0] - 1)


def _pure_pairs(N: torch.Tensor) -> float:
    """Unbiased ``tr(B^2) + ||B||^2`` from ``N [ka, kb, kb]`` (``N_i = sum_m w X^a_m[i]^T
    X^b_m[i]`` per sketch row i): the products over distinct rows and distinct columns."""
    ka, kb = N.shape[0], N.shape[1]
    S = N.sum(0)
    pairs = S * S - (N * N).sum(0) + S * S.T - (N * N.transpose(1, 2)).sum(0)
    off = 1 - torch.eye(kb, dtype=N.dtype, device=N.device)
    return float((pairs * off).sum()) * ka * kb / ((ka - 1) * (kb - 1))


def kron_pair_var(xa: torch.Tensor, xb: torch.Tensor, w: float, blk: Block) -> float:
    """Unbiased estimate, over the Gaussian projection, of ``Var Q`` for ``Q = w sum_m
    <xa_m, xb_m>``, ``xa, xb [M, k1, k2]`` the sketches ``P_1^T a_m P_2``, ``P_1^T b_m P_2`` of
    one Kronecker block (docs/science.md, "Coefficient-first projected sketches").

    Given ``P_2``, ``Q = sum_i p_i^T C p_i`` over the iid ``N(0, I/k1)`` columns of ``P_1``
    (``C = w sum_m a_m P_2 P_2^T b_m^T``), so ``Var(Q | P_2) = (tr C^2 + ||C||^2) / k1``, which
    the off-diagonal entries of the rows' Gram ``H = P_1^T C P_1`` estimate (``k1 (k1 - 1)``
    pairs, :func:`_gram_offdiag`). ``Var E(Q | P_2) = (tr B^2 + ||B||^2) / k2`` for ``B = w
    sum_m a_m^T b_m``, estimated from products over distinct rows and columns
    (:func:`_pure_pairs`). The same with the sides swapped is a second unbiased estimate; the
    two are averaged. An exact side (identity) is not random: its term is 0. Clamped at 0; a
    random side of one column (no pair) falls back to the block's Cauchy-Schwarz bound."""
    k1, k2 = blk.k1, blk.k2
    xa = xa.reshape(-1, k1, k2).to(torch.float64)
    xb = xb.reshape(-1, k1, k2).to(torch.float64)
    rows_random, cols_random = blk.k1 < blk.rows, blk.k2 < blk.cols
    if (rows_random and k1 < 2) or (cols_random and k2 < 2):
        return blk.norm_var_factor() * w * w * float(xa.pow(2).sum()) * float(xb.pow(2).sum())
    v = 0.0
    if rows_random and cols_random:
        v = (_gram_offdiag(w * torch.einsum("mij,mkj->ik", xa, xb))
             + _pure_pairs(w * torch.einsum("mij,mik->ijk", xa, xb)) / k2
             + _gram_offdiag(w * torch.einsum("mji,mjk->ik", xa, xb))
             + _pure_pairs(w * torch.einsum("mji,mki->ijk", xa, xb)) / k1) / 2
    elif rows_random:
        v = _gram_offdiag(w * torch.einsum("mij,mkj->ik", xa, xb))
    elif cols_random:
        v = _gram_offdiag(w * torch.einsum("mji,mjk->ik", xa, xb))
    return max(0.0, v)


def score_sd(q: list[float], v: list[float], z: float = 2.0) -> float:
    """The symmetric standard deviation of a positive sketched statistic ``sum_b q_b`` whose
    independent random blocks b carry estimated variances ``v_b``, each ``~ theta_b^2``.

    The error's variance is that at the truth, not at the estimate: with the blocks of a
    deviation ``d`` of the total moving in proportion to their variances (the most likely split
    of ``d`` for independent Gaussian blocks), ``V(d) = sum_b v_b (1 + d v_b / (V q_b))^2``,
    ``V = sum_b v_b``. The half-width h is the one whose two one-sided misses
    ``Phi(-h / sqrt V(h)) + Phi(-h / sqrt V(-h))`` add up to ``2 Phi(-z)``; at most every block
    at its own one-sided chi-square bound ``q_b nu_b / chi2_{nu_b}(Phi(-z))``, ``nu_b = 2
    q_b^2 / v_b`` (V(h) grows like h^2, so the equation may have no root). Returns ``h / z``
    (``sqrt V`` when the blocks' shapes are Gaussian, i.e. every ``nu_b`` large)."""
    qa, va = np.asarray(q, dtype=np.float64), np.asarray(v, dtype=np.float64)
    keep = (va > 0) & (qa > 0)
    qa, va = qa[keep], va[keep]
    V = float(va.sum())
    if V <= 0:
        return 0.0
    tail = float(special.ndtr(-z))
    nu = 2 * qa * qa / va
    with np.errstate(all="ignore"):
        ratio = nu / stats.chi2.ppf(tail, nu)
    # a near-Gaussian block (huge nu): the normal approximation of the same quantile
    big = ~np.isfinite(ratio) | (nu > 1e7)
    ratio[big] = 1 / np.clip(1 - z * np.sqrt(2 / nu[big]), 1e-12, None)
    cap = float((qa * (ratio - 1)).sum())

    def miss(h: float) -> float:
        up = float((va * (1 + h * va / (V * qa)) ** 2).sum())
        lo = float((va * np.clip(1 - h * va / (V * qa), 0, None) ** 2).sum())
        return float(special.ndtr(-h / up ** 0.5)) + (
            float(special.ndtr(-h / lo ** 0.5)) if lo > 0 else 0.0)

    if miss(cap) > 2 * tail:
        return cap / z
    a, b = 0.0, cap
    for _ in range(60):
        m = (a + b) / 2
        a, b = (m, b) if miss(m) > 2 * tail else (a, m)
    return b / z


def projection_blocks(estimates: torch.Tensor, reference: torch.Tensor,
                      blocks: list[Block]) -> dict[str, tuple[list[float], list[float]]]:
    """Per random block, ``(q_b, v_b)`` of the variance (``tr`` of the covariance of
    ``estimates [M, K]``), the MSE about ``reference [K]`` and the unnormalised projection
    ``<g_bar, g*>``: the block's share of the statistic and its variance over the projection
    (:func:`kron_pair_var`; the CountSketch block its plug-in bound ``(2/K) q_b^2``, the
    projection's ``(2/K) ||g_bar||^2 ||g*||^2``). Exact blocks carry no error and are left out.
    The reference is taken as fixed, as :func:`varbench.stats.intervals.sketch_sd` does."""
    x = estimates.detach().to(torch.float64)
    ref = reference.detach().to(torch.float64).reshape(-1)
    M = x.shape[0]
    parts = {"variance": (x - x.mean(0), None, 1.0 / (M - 1)), "mse": (x - ref, None, 1.0 / M),
             "projection": (x.mean(0)[None], ref[None], 1.0)}
    out: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in parts}
    for blk in blocks:
        sl = slice(blk.start, blk.stop)
        if blk.kind == "exact" or (blk.kind == "kron" and blk.k1 >= blk.rows
                                   and blk.k2 >= blk.cols):
            continue
        for k, (a, b, w) in parts.items():
            xa = a[:, sl]
            xb = xa if b is None else b[:, sl]
            q = w * float((xa * xb).sum())
            if blk.kind == "kron":
                v = kron_pair_var(xa, xb, w, blk)
            else:
                v = blk.norm_var_factor() * w * w * float(xa.pow(2).sum()) * float(
                    xb.pow(2).sum())
            out[k][0].append(q)
            out[k][1].append(v)
    return out


def projection_sd(estimates: torch.Tensor, reference: torch.Tensor,
                  blocks: list[Block], *, z: float = 2.0) -> dict[str, float]:
    """The projection's standard deviation of the variance (``tr`` of the covariance of
    ``estimates [M, K]``), the MSE about ``reference [K]`` and the projection
    ``<g_bar, g*> / ||g*||^2`` (the analogue of :func:`varbench.stats.intervals.sketch_sd` for
    these sketches), estimated from the sketches themselves.

    Per random block the statistic's variance over the projection is estimated without bias
    from the Gram of the sketch's rows and columns (:func:`projection_blocks`). Variance and
    MSE are positive quadratic forms whose error sd grows with their true value, and the
    estimate falls with the statistic (plugging it in undercovers where the sketch came out
    low), so their sd is :func:`score_sd` (``value -/+ z sd`` covers at ``2 Phi(z) - 1``); the
    projection (a bilinear form) keeps ``sqrt(sum v_b) / ||g*||^2``."""
    parts = projection_blocks(estimates, reference, blocks)
    ref = reference.detach().to(torch.float64).reshape(-1)
    gg = float(ref @ ref)
    proj = sum(parts["projection"][1]) ** 0.5
    return {"variance": score_sd(*parts["variance"], z=z), "mse": score_sd(*parts["mse"], z=z),
            "projection": proj / gg if gg > 0 else float("nan")}
