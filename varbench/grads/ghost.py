"""Ghost-norm engine for exact per-token and prefix norms (the default token_grad_norms path).

For a Linear layer (or an Embedding, a Linear on one-hot inputs) with inputs ``A [t, in]`` and
the cotangents ``D_c [t, out]`` that token c leaves at its outputs, token c's weight gradient is
``g_c = D_c^T A`` (a bias adds a column of ones to A). Two exact ways to its norms, chosen per
layer and chunk by cost (``t`` grows along the sequence, so a layer switches at most once):

- *ghost* (short prefixes, ``t`` below about ``in``): ``||g_c||^2 = <D_c, G D_c>`` with
  ``G = A A^T`` (Gram matrix over positions, "ghost norm", docs/science.md §6); the prefix gradient
  is ``(R + sum_{j<=c} D_j)^T A`` with R the cotangents of earlier chunks summed, so the
  running prefix lives in position space (one ``[L, out]`` matrix per layer, valid because
  causality makes A at positions <= t identical across truncations). One product ``G [D; R]``
  (about ``t^2 out`` per token) and the small Gram ``M_ij = <X_i, G X_j>`` over
  ``X = [D_1..D_C, R]`` give every token and prefix norm of the chunk (the prefix norm is the
  sum of M's entries over ``{1..c, R}``). G does not depend on the cotangents: it is built once
  per sequence, a few new rows per chunk.
- *weight* (long prefixes): ``g_c`` is formed for the chunk (``t in out`` per token, as cheap
  as the backward that produced D) and the running prefix is one ``[out, in]`` matrix per
  layer; at the switch the position-space prefix is converted once (``R = Dcum^T A``).

Which modules qualify is decided on an inspection forward by :func:`plan_modules`: a module is
factored only when :func:`varbench.models.arch.module_form` reproduces its output from the
factored form (a Linear, GPT-2's Conv1D, an Embedding or a scaled / position-deriving Embedding
subclass; the scale is folded into the cotangent, Conv1D's transposed weight changes nothing in
the norms, flattened ``[B*t, in]`` inputs are reshaped) AND the first-call self-check
(:func:`self_check`: the factored gradient of a random probe cotangent equals autograd's) passes.
A failed self-check raises an error naming the module class, never a wrong number. Parameters
outside such modules (norm weights, tied weights, modules called more than once, modules
varbench does not recognise) are materialised per token and streamed with a running vector,
in ``exact.py``; ``TokenGradNorms.methods`` records the route of every parameter.

Precision: inputs, cotangents, Gram matrices and running prefixes are kept in float32 at least
(:func:`acc_dtype`), whatever the parameter dtype.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from varbench._util.checks import UsageError
from varbench.models.arch import (
    ModuleForm,
    embedding_rows,
    is_factorable_type,
    linear_input,
    module_form,
    weight_in_features,
)
from varbench.models.logits import stat_dtype

# Switch to weight mode once the ghost cost exceeds WEIGHT_RATIO x the weight cost (see
# GhostModule.use_weight_mode); 1.0: both paths ran at about the same multiply-adds per second
# in a micro-benchmark on the small preset's shapes (CPU, float32, chunk 16).
WEIGHT_RATIO = 1.0


def cumsum_rows_(x: torch.Tensor) -> torch.Tensor:
    """In-place cumulative sum over dim 0 (on CPU several times faster than ``cumsum(0)``)."""
    for i in range(1, x.shape[0]):
        x[i] += x[i - 1]
    return x


def acc_dtype(dtype: torch.dtype, want: torch.dtype | None = None) -> torch.dtype:
    """Accumulation dtype of norms, Grams and prefixes: ``want`` if given (float32 or float64),
    else float64 for float64 parameters and float32 for every other dtype."""
    if want is not None:
        if want not in (torch.float32, torch.float64):
            raise UsageError(f"accumulate must be torch.float32 or torch.float64, got {want}")
        return want
    return stat_dtype(dtype)  # the statistics' rule: float64 stays, everything else float32


def factored_inputs(module: torch.nn.Module, form: ModuleForm, args: tuple, kwargs: dict):
    """The factored input of one call: rows ``[N]`` of an Embedding or ``[N, in]`` of a
    Linear/Conv1D, flattened over every leading axis (N = B*t, row-major like the output)."""
    if form.kind == "embedding":
        return embedding_rows(module, args, kwargs).reshape(-1)
    x = linear_input(module, args, kwargs)
    return x.reshape(-1, x.shape[-1])


def factored_grads(
    module: torch.nn.Module, form: ModuleForm, a: torch.Tensor, D: torch.Tensor
) -> list[torch.Tensor]:
    """Dense ``[weight grad, bias grad?]`` of one call from its factored inputs ``a`` and the
    output cotangent ``D [N, out]`` (the slow, explicit form the self-check compares with)."""
    w = module.weight
    if form.kind == "embedding":
        g = torch.zeros(w.shape, dtype=D.dtype, device=D.device).index_add_(0, a, D)
        if module.padding_idx is not None:  # torch gives the padding row no gradient
            g[module.padding_idx] = 0
        return [g * form.scale]
    a = a.to(D.dtype)
    g = D.T @ a if form.kind == "linear" else a.T @ D
    out = [g]
    if getattr(module, "bias", None) is not None:
        out.append(D.sum(0))
    return out


def _check_tol(dtype: torch.dtype) -> float:
    # relative tolerance between autograd's gradient (in the model's dtype) and the factored one
    return {torch.float64: 1e-9, torch.float32: 1e-4}.get(dtype, 5e-2)


# non-empty while the self-check re-runs a module: CallRecorder ignores those calls
_QUIET: list[bool] = []

# modules that passed the self-check: module -> (kind, scale, dtype); one check per module
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def self_check(module: torch.nn.Module, form: ModuleForm, args: tuple, kwargs: dict, out) -> None:
    """First-call check: the factored gradient of a seeded random probe cotangent equals
    autograd's gradient of the module's output (catches a custom backward or a layout the
    recomputation cannot see). Raises RuntimeError naming the module class on a mismatch."""
    key = (form.kind, form.scale, module.weight.dtype)
    if _CHECKED.get(module) == key:
        return
    params = [module.weight]
    if form.kind != "embedding" and getattr(module, "bias", None) is not None:
        params.append(module.bias)
    if not out.requires_grad:
        return  # nothing to check against (no graph); the caller's own backward has none either
    g = torch.Generator(device="cpu").manual_seed(1234)
    D = torch.randn(out.shape, generator=g, dtype=torch.float64,
                    device="cpu").to(out.device, out.dtype)

    def detach(x):
        return x.detach() if isinstance(x, torch.Tensor) else x

    # re-run the module's own forward on detached inputs: its output then depends on the weight
    # directly only (a tied weight also reaches the original output through the embedding)
    _QUIET.append(True)
    try:
        with torch.enable_grad():
            again = module(*[detach(x) for x in args], **{k: detach(v) for k, v in kwargs.items()})
            auto = [None if x is None else x.detach() for x in torch.autograd.grad(
                again, params, D, allow_unused=True)]
    finally:
        _QUIET.pop()
    a = factored_inputs(module, form, args, kwargs).detach()
    acc = acc_dtype(out.dtype)
    mine = factored_grads(module, form, a, D.reshape(-1, D.shape[-1]).to(acc))
    tol = _check_tol(out.dtype)
    for p, x, y in zip(params, auto, mine, strict=True):
        x = torch.zeros_like(p) if x is None else x
        err = float((x.to(acc) - y).norm() / x.to(acc).norm().clamp(min=1e-30))
        if not err <= tol:
            raise RuntimeError(
                f"ghost-norm self-check failed for {type(module).__name__} ({form.kind}, "
                f"scale {form.scale:g}): factored gradient differs from autograd's by {err:.2e} "
                f"relative (tolerance {tol:g}); use method='materialize' and report this module"
            )
    _CHECKED[module] = key


class GhostModule:
    """Bookkeeping for one Linear/Conv1D/Embedding handled by ghost norms within one sequence.

    ``form`` (default: a plain Linear/Embedding) says how the module computes (kind, embedding
    scale); ``acc`` is the dtype of inputs, Grams and prefixes (float32 at least).
    """

    def __init__(self, module: torch.nn.Module, group: int, L: int,
                 form: ModuleForm | None = None, acc: torch.dtype | None = None) -> None:
        self.module = module
        self.group = group
        self.L = L
        if form is None:
            form = ModuleForm("embedding" if isinstance(module, torch.nn.Embedding) else "linear")
        self.form = form
        self.acc = acc_dtype(module.weight.dtype, acc)
        self.is_embedding = form.kind == "embedding"
        self.has_bias = getattr(module, "bias", None) is not None and not self.is_embedding
        self.n_in = weight_in_features(module)
        # torch gives the padding_idx row of an Embedding no gradient: its positions count as 0
        self.pad = getattr(module, "padding_idx", None) if self.is_embedding else None
        self.inp: torch.Tensor | None = None
        self.out: torch.Tensor | None = None
        self.reset()

    def hook(self, mod, args, out, kwargs: dict | None = None) -> None:
        """Record one call: its factored inputs (rows or ``[t, in]``) and its output."""
        self.inp = factored_inputs(mod, self.form, args, kwargs or {}).detach()
        self.out = out

    def reset(self) -> None:
        """Start a new sequence: forget cached inputs, Gram matrix and running prefix."""
        # row_norms: one per-sequence state per row key, kept while that row continues
        self.rows: dict[int, GhostModule] = {}
        self.a: torch.Tensor | None = None  # [L, in(+1)] inputs (ids [L] for an Embedding)
        self.n_a = 0  # positions of self.a filled
        self.gram: torch.Tensor | None = None  # [L, L] A A^T (+1 with a bias)
        self.n_gram = 0
        self.n_prefix = 0  # positions covered by a position-space running prefix
        self.running: torch.Tensor | None = None  # ghost: [L, out]; weight: [out, in(+1)]
        self.weight_mode = False

    def row_norms(
        self, D: torch.Tensor, n_rows: int, t: int,
        segments: list[tuple[int, int, int, int, bool]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Norms of a forward over ``n_rows`` rows of ``t`` positions (one sequence or several).

        ``D [C, n_rows, t, out]`` (any shape of that size): the cotangents of the chunk's C
        tokens at this call's output (token c's is nonzero only in its own row);
        ``segments [(r, k0, k1, key, fresh)]``: tokens ``k0:k1`` belong to local row r, whose
        per-sequence state is ``key`` (started anew where ``fresh``: the row's first token).
        Each row's norms use only its own inputs, cotangent slice, Gram and running prefix;
        only the last segment's state is kept (the one row a later chunk can continue).
        Returns (token_sq [C], prefix_sq [C]) in the chunk's token order.
        """
        C = D.shape[0]
        x = self.inp
        if x.shape[0] != n_rows * t:
            raise RuntimeError(
                f"{type(self.module).__name__} saw {x.shape[0]} positions in a forward over "
                f"{n_rows} x {t}; its inputs are not one row per position "
                "(use method='materialize')")
        x = x.reshape(n_rows, t, *x.shape[1:])
        D = D.reshape(C, n_rows, t, -1)
        toks, pres = [], []
        state = self
        for r, k0, k1, key, fresh in segments:
            state = None if fresh else self.rows.get(key)
            if state is None:
                if not fresh:  # a bug in the caller's plan: never continue from nothing
                    raise RuntimeError(f"no running state for sequence {key} to continue")
                state = GhostModule(self.module, self.group, self.L, form=self.form,
                                    acc=self.acc)
                self.rows = {key: state}
            state.inp = x[r]
            tk, pr = state.norms(D[k0:k1, r])
            toks.append(tk)
            pres.append(pr)
            state.inp = None
        self.rows = {segments[-1][3]: state}
        if len(toks) == 1:
            return toks[0], pres[0]
        return torch.cat(toks), torch.cat(pres)

    def _cache_inputs(self, t: int) -> None:
        """Append this forward's inputs at positions [n_a, t) to the per-sequence cache."""
        x = self.inp
        if x.shape[0] != t:
            raise RuntimeError(
                f"{type(self.module).__name__} saw {x.shape[0]} positions in a forward over {t}; "
                "its inputs are not one row per position (use method='materialize')"
            )
        if self.a is None:
            if self.is_embedding:
                self.a = torch.zeros(self.L, dtype=x.dtype, device=x.device)
            else:
                n = x.shape[-1] + int(self.has_bias)
                self.a = torch.ones(self.L, n, dtype=self.acc, device=x.device)
        if t > self.n_a:
            if self.is_embedding:
                self.a[self.n_a : t] = x[self.n_a : t]
            else:
                self.a[self.n_a : t, : x.shape[-1]] = x[self.n_a : t]
            self.n_a = t

    def _inputs(self, t: int, dtype: torch.dtype) -> torch.Tensor:
        """``A [t, in(+1)]`` (one-hot rows for an Embedding)."""
        if self.is_embedding:
            ids = self.a[:t]
            a = torch.nn.functional.one_hot(ids, self.n_in).to(dtype)
            return a if self.pad is None else a * (ids != self.pad).to(dtype)[:, None]
        return self.a[:t]

    def _gram(self, t: int, dtype: torch.dtype) -> torch.Tensor:
        """``A A^T [t, t]``, extended by the rows/columns of the positions new since last call."""
        if self.gram is None:
            self.gram = torch.zeros(self.L, self.L, dtype=dtype, device=self.a.device)
        s = self.n_gram
        if t > s:
            if self.is_embedding:
                new = self.a[s:t, None] == self.a[None, :t]
                if self.pad is not None:
                    new &= self.a[None, :t] != self.pad
                    new &= self.a[s:t, None] != self.pad
                new = new.to(dtype)
            else:
                new = self.a[s:t] @ self.a[:t].T
            self.gram[s:t, :t] = new
            self.gram[:s, s:t] = new[:, :s].T
            self.n_gram = t
        return self.gram[:t, :t]

    def use_weight_mode(self, C: int, t: int) -> bool:
        """Cost model (multiply-adds, measured to hold within ~20% on CPU): the ghost products
        ``G [D; R]`` and their Gram cost ``(C+1) t (t+C+1) out``; forming ``g`` costs
        ``C t in out`` plus about four passes over ``[C, out, in]``."""
        n_in = self.n_in + int(self.has_bias)
        return (C + 1) * t * (t + C + 1) > WEIGHT_RATIO * C * (t + 4) * n_in

    def norms(self, D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``D [C, t, out]`` cotangents of this chunk -> (token_sq [C], prefix_sq [C])."""
        C, t, n_out = D.shape
        D = D.to(self.acc)
        if self.form.scale != 1.0:  # y = s W[rows]: the gradient is s times the plain lookup's
            D = D * self.form.scale
        self._cache_inputs(t)
        if not self.weight_mode and self.use_weight_mode(C, t):
            if self.running is not None:  # convert the position-space prefix once
                n = self.n_prefix
                self.running = self.running[:n].T @ self._inputs(n, D.dtype)
            self.weight_mode = True
        if self.weight_mode:
            return self._weight_norms(D)
        if self.running is None:
            self.running = torch.zeros(self.L, n_out, dtype=D.dtype, device=D.device)
        # M = <X_i, G X_j> over X = [D_1..D_C, R]: one product with G serves token and prefix
        # norms alike (the prefix norm expands ||R + sum_{j<=c} D_j||_G^2 in M's entries)
        gram_a = self._gram(t, D.dtype)
        R = self.running[:t]
        GD = torch.matmul(gram_a, D).reshape(C, -1)
        GR = (gram_a @ R).reshape(-1)
        flat = D.reshape(C, -1)
        m_dd = flat @ GD.T
        m_dr = flat @ GR
        tok = m_dd.diagonal()
        pre = m_dd.cumsum(0).cumsum(1).diagonal() + 2 * m_dr.cumsum(0) + R.reshape(-1) @ GR
        self.running[:t] += D.sum(0)
        self.n_prefix = t
        return tok, pre

    def _weight_norms(self, D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        C, t, _ = D.shape
        g = torch.matmul(D.transpose(1, 2), self._inputs(t, D.dtype))  # [C, out, in(+1)]
        flat = g.reshape(C, -1)
        tok = torch.linalg.vecdot(flat, flat)
        if self.running is not None:
            flat[0] += self.running.reshape(-1)
        cumsum_rows_(flat)
        pre = torch.linalg.vecdot(flat, flat)
        self.running = flat[-1].reshape(g.shape[1:]).clone()
        return tok, pre


@dataclass
class ModulePlan:
    """Routes of the chosen parameters: ``ghost [(module, weight name, form)]`` factored by the
    ghost engine, ``rest [(name, param)]`` materialised, ``methods`` name -> route (with the
    reason for every parameter of a factorable-looking module that was not factored)."""

    ghost: list[tuple[torch.nn.Module, str, ModuleForm]] = field(default_factory=list)
    rest: list[tuple[str, torch.nn.Parameter]] = field(default_factory=list)
    methods: dict[str, str] = field(default_factory=dict)


def _candidates(model, chosen):
    """Factorable-looking modules whose weight (and bias) are chosen and owned once."""
    chosen_ids = {id(p): n for n, p in chosen}
    owners: dict[int, int] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    out, why = [], {}
    for m in model.modules():
        if not is_factorable_type(m) or id(m.weight) not in chosen_ids:
            continue
        b = getattr(m, "bias", None)
        name = chosen_ids[id(m.weight)]
        if owners.get(id(m.weight), 0) != 1:
            why[name] = "materialize: weight shared with another module (tied)"
            continue
        if b is not None and id(b) not in chosen_ids:
            why[name] = "materialize: bias not selected"
            continue
        out.append((m, name))
    return out, why


class CallRecorder:
    """Forward hooks recording every call ``(args, kwargs, out)`` of the given modules."""

    def __init__(self, modules) -> None:
        self.calls: dict[int, list] = {id(m): [] for m in modules}
        self.handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in modules]

    def _hook(self, mod, args, kwargs, out) -> None:
        if not _QUIET:
            self.calls[id(mod)].append((args, kwargs, out))

    def clear(self) -> None:
        for v in self.calls.values():
            v.clear()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def checked_form(module, call, n_rows: int, form: ModuleForm | None = None) -> ModuleForm:
    """:func:`module_form` of one recorded call (or the given ``form``: the decision taken
    elsewhere), its rows-per-position check (``n_rows`` factored rows expected: B*t), and the
    first-call :func:`self_check`."""
    args, kwargs, out = call
    if form is None:
        form = module_form(module, args, kwargs, out)
    if form.kind is None:
        return form
    a = factored_inputs(module, form, args, kwargs)
    if a.shape[0] != n_rows:
        return ModuleForm(None, reason=f"{type(module).__name__}: {a.shape[0]} input rows for "
                                       f"{n_rows} positions (inputs are not [..., t, in])")
    self_check(module, form, args, kwargs, out)
    return form


def plan_modules(
    model: torch.nn.Module,
    chosen: list[tuple[str, torch.nn.Parameter]],
    probe: Callable[[], tuple[int, torch.Tensor]],
) -> ModulePlan:
    """Decide every chosen parameter's route on one inspection forward ``probe()`` (which runs
    the model with autograd on and returns the number of positions it ran over).

    A module is factored when it is called exactly once per forward, its form is recognised by
    recomputation and the self-check passes; every other parameter is materialised.
    """
    cands, why = _candidates(model, chosen)
    rec = CallRecorder([m for m, _ in cands])
    try:
        with torch.enable_grad():
            n_rows, _ = probe()
        plan = ModulePlan()
        taken = set()
        for m, name in cands:
            calls = rec.calls[id(m)]
            if len(calls) != 1:
                why[name] = f"materialize: {type(m).__name__} called {len(calls)} times per forward"
                continue
            form = checked_form(m, calls[0], n_rows)
            if form.kind is None:
                why[name] = f"materialize: {form.reason}"
                continue
            plan.ghost.append((m, name, form))
            taken.add(id(m.weight))
            b = getattr(m, "bias", None)
            if b is not None and form.kind != "embedding":
                taken.add(id(b))
    finally:
        rec.remove()
    ghost_names = {}
    for _m, name, form in plan.ghost:
        ghost_names[name] = f"ghost ({form.kind}" + (
            f", scale {form.scale:g})" if form.scale != 1.0 else ")")
    chosen_names = {id(p): n for n, p in chosen}
    for m, name, _ in plan.ghost:
        b = getattr(m, "bias", None)
        if b is not None and id(b) in chosen_names:
            ghost_names[chosen_names[id(b)]] = ghost_names[name]
    plan.rest = [(n, p) for n, p in chosen if id(p) not in taken]
    for n, _ in chosen:
        plan.methods[n] = ghost_names.get(n) or why.get(n, "materialize")
    return plan
