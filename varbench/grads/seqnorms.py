"""Exact per-sequence squared gradient norms from ONE batched backward (docs/science.md §6).

For sequence b with coefficients ``c_{b,t}`` (default: 1 on response tokens) the quantity is
``||G_b||^2`` with ``G_b = sum_t c_{b,t} grad_theta log pi(y_{b,t} | y_{b,<t})``. Sequences
of a batch do not interact in a causal LM forward, so one backward of
``sum_{b,t} c_{b,t} log p_{b,t}`` leaves at every module output the cotangents ``D_b`` of
sequence b's own loss. Per parameter, ``G_b`` is then recovered per module call from what that
call saw, without one backward per sequence:

- factored modules (Linear, Conv1D, Embedding and the scaled / position-deriving Embeddings of
  :func:`varbench.models.arch.module_form`): ``G_b = L_b^T R_b`` (a Linear: ``L = D [t, out]``,
  ``R = A [t, in]``; an Embedding: ``L`` the one-hot rows, ``R = scale * D``). The norm is
  ``sum_{s,u} (L L^T)_{su} (R R^T)_{su}`` ("ghost norm", cost ``t^2 (out + in)``) or, when
  cheaper, ``||L^T R||^2`` formed (cost ``t out in``). A weight used by several calls (a tied
  embedding and head) sums its contributions; the cross terms use the same Gram form;
- generic position-separable modules (norm weights, ...): per-sequence gradients by a vmapped
  vjp of the module's own forward on its recorded input (cost ~ the module's forward);
- anything else (MoE experts, routers, unrecognised modules): one backward per sequence for
  those parameters only (the slow exact route), recorded in ``methods``.

Only cotangents at module outputs are requested from autograd, so the backward skips every
weight gradient. Accumulation in float32 at least (float64 for a float64 model or on request).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.func import functional_call, vjp, vmap

from varbench._util.checks import UsageError, check_choice, check_positive_int, check_shape
from varbench.grads._inputs import eval_mode, prepare
from varbench.grads.ghost import (
    _QUIET,
    CallRecorder,
    acc_dtype,
    checked_form,
    factored_grads,
    factored_inputs,
)
from varbench.grads.params import ParamFilter, select_params
from varbench.models import memplan
from varbench.models.arch import (
    ModuleForm,
    check_finite_logits,
    is_factorable_type,
    rms_norm_form,
)
from varbench.models.forward import forward_logits
from varbench.models.logits import token_logprobs, upcast


@dataclass
class _Factor:
    """One call's factored contribution ``G_b = L_b^T R_b`` in the weight's orientation:
    ``L [B, N, rows]`` dense, or ``rows_ids [B, N]`` (one-hot L, with ``keep`` masking the
    padding row); ``R [B, N, cols]``."""

    R: torch.Tensor
    L: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    keep: torch.Tensor | None = None


@dataclass
class _ParamWork:
    factors: list[_Factor] = field(default_factory=list)
    dense: list[torch.Tensor] = field(default_factory=list)  # [B, numel] per-sequence grads


ROUTE_KINDS = ("factor", "rms", "copies", "vjp", "slow")


@dataclass(frozen=True)
class SequenceRoute:
    """How :func:`sequence_grad_norms` computes one module's chosen parameters: ``kind``
    'factor' (``forms``: the :class:`ModuleForm` of each of its calls), 'rms' (``rms``: its
    :func:`varbench.models.arch.rms_norm_form`), 'copies' (one backward over per-sequence
    parameter copies), 'vjp' (a vmapped vjp of its forward) or 'slow' (one backward per
    sequence; ``reason`` says why). Decided from the values of a forward
    (:func:`sequence_routes`); a given route skips those value checks."""

    kind: str
    forms: tuple[ModuleForm, ...] = ()
    rms: tuple[str, float] | None = None
    reason: str = ""


def _l_gram(f: _Factor, g: _Factor) -> torch.Tensor:
    """``[B, N_f, N_g]`` ``L_f L_g^T`` (one-hot sides by gather / equality)."""
    if f.ids is not None and g.ids is not None:
        m = (f.ids[:, :, None] == g.ids[:, None, :]).to(g.R.dtype)
    elif f.ids is not None:  # (L_f L_g^T)[s, u] = L_g[u, ids_f[s]]
        N_f = f.ids.shape[1]
        m = g.L.gather(2, f.ids[:, None, :].expand(-1, g.L.shape[1], N_f)).transpose(1, 2)
    elif g.ids is not None:
        return _l_gram(g, f).transpose(1, 2)
    else:
        return f.L @ g.L.transpose(1, 2)
    if f.keep is not None:
        m = m * f.keep[:, :, None]
    if g.keep is not None:
        m = m * g.keep[:, None, :]
    return m


def _pair(f: _Factor, g: _Factor) -> torch.Tensor:
    """``[B]`` per-sequence ``<L_f^T R_f, L_g^T R_g>`` by the Gram (ghost) form."""
    return (_l_gram(f, g) * (f.R @ g.R.transpose(1, 2))).sum((1, 2))


def _self_norm(f: _Factor) -> torch.Tensor:
    """``[B]`` ``||L^T R||^2``: ghost form, or the gradient formed when that is cheaper."""
    B, N, cols = f.R.shape
    if f.ids is not None:
        return _pair(f, f)
    rows = f.L.shape[2]
    if N * (rows + cols) <= rows * cols:
        return _pair(f, f)
    out = torch.empty(B, dtype=f.R.dtype, device=f.R.device)
    step = max(1, int(2**24 // max(1, rows * cols)))  # bound the formed [b, rows, cols] block
    for s in range(0, B, step):
        g = f.L[s : s + step].transpose(1, 2) @ f.R[s : s + step]
        out[s : s + step] = g.pow(2).sum((1, 2))
    return out


def _factor(module, form: ModuleForm, call, B: int, D: torch.Tensor, acc) -> list[_Factor]:
    """Factored contributions (weight, then bias as a dense grad) of one recorded call."""
    args, kwargs, _ = call
    a = factored_inputs(module, form, args, kwargs).detach()
    D = D.reshape(B, -1, D.shape[-1]).to(acc)
    if form.kind == "embedding":
        ids = a.reshape(B, -1)
        pad = module.padding_idx
        keep = None if pad is None else (ids != pad).to(acc)
        return [_Factor(R=D * form.scale if form.scale != 1.0 else D, ids=ids, keep=keep)]
    A = a.reshape(B, -1, a.shape[-1]).to(acc)
    return [_Factor(R=A, L=D) if form.kind == "linear" else _Factor(R=D, L=A)]


def _generic_ok(module: torch.nn.Module, call, B: int) -> bool:
    """A module whose per-sequence gradient a vmapped vjp of its own forward gives: one tensor
    argument and one tensor output, both with the batch as leading axis, no tensor kwargs."""
    args, kwargs, out = call
    return (len(args) == 1 and isinstance(args[0], torch.Tensor) and args[0].dim() >= 2
            and args[0].shape[0] == B and isinstance(out, torch.Tensor) and out.dim() >= 2
            and out.shape[0] == B
            and not any(isinstance(v, torch.Tensor) for v in kwargs.values()))


def _generic_grads(module, call, D: torch.Tensor, names: list[str]) -> list[torch.Tensor]:
    """``[B, numel]`` per-sequence gradients of ``module``'s own params ``names``."""
    x = call[0][0].detach()
    own = {n: p.detach() for n, p in module.named_parameters(recurse=False)}

    def one(xb, db):
        def f(p):
            return functional_call(module, {**own, **p}, (xb[None],))[0]

        _, pull = vjp(f, {n: own[n] for n in names})
        (g,) = pull(db)
        return [g[n].reshape(-1) for n in names]

    return list(vmap(one)(x, D.to(x.dtype)))


def _per_sequence_params(module, call, local: list[str], B: int, *, check: bool = True):
    """Re-run ``module`` on its detached input with each parameter in ``local`` replaced by a
    per-sequence copy ``[B, 1.., *shape]`` (broadcast over positions). Returns (output, copies)
    when that reproduces the recorded output (an elementwise-affine module: RMS norms), else
    None (the module needs the vmapped vjp). ``check=False`` (a given route): the shapes are
    checked, the values are not."""
    x = call[0][0].detach()
    out = call[2]
    own = {n: p.detach() for n, p in module.named_parameters(recurse=False)}
    copies = {}
    for n in local:
        p = own[n]
        lead = x.dim() - 1 - p.dim()
        if lead < 0:
            return None
        copies[n] = p.reshape(1, *([1] * lead), *p.shape).repeat(B, *([1] * (lead + p.dim())))
        copies[n].requires_grad_(True)
    _QUIET.append(True)
    try:
        with torch.enable_grad():
            y = functional_call(module, {**own, **copies}, (x,))
    except (RuntimeError, ValueError, TypeError):
        return None
    finally:
        _QUIET.pop()
    if not isinstance(y, torch.Tensor) or y.shape != out.shape:
        return None
    if not check:
        return y, [copies[n] for n in local]
    tol = 1e-6 if y.dtype in (torch.float32, torch.float64) else 1e-2
    if not bool(((y.detach() - out.detach()).abs() <= tol * (1 + out.detach().abs())).all()):
        return None
    return y, [copies[n] for n in local]


# module -> its RMS norm form (or None), from models.arch.rms_norm_form (a probe per module)
_RMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _rms_form(module: torch.nn.Module):
    if module not in _RMS:
        _RMS[module] = rms_norm_form(module)
    return _RMS[module]


def _generic_all(generic, B: int, hows: dict[int, SequenceRoute] | None = None,
                 decided: dict[int, SequenceRoute] | None = None):
    """Per-sequence gradients ``[B, numel]`` of every generic module call: ONE small backward
    over per-sequence parameter copies for elementwise-affine modules, a vmapped vjp of the
    module's own forward for the others. Yields ``(module, names, grads)``. ``hows``: module
    id -> its given route (kind 'rms', 'copies' or 'vjp'; the value probes are skipped);
    ``decided``: filled with the route each module took."""
    fast, ys, cots, leaves = [], [], [], []
    for m, call, D, local in generic:
        given = None if hows is None else hows.get(id(m))
        if given is None:
            form = _rms_form(m)
        else:
            form = given.rms if given.kind == "rms" else None
            if given.kind == "rms" and (form is None or local != ["weight"]):
                raise UsageError(f"route 'rms' given for {type(m).__name__} without its form "
                                 f"or for parameters {local} (it covers a lone weight)")
        if form is not None and local == ["weight"]:
            if decided is not None:
                decided[id(m)] = SequenceRoute("rms", rms=form)
            # y = (w or 1 + w) * x_hat: the weight's per-sequence gradient is sum_t D * x_hat
            x = call[0][0].detach()
            acc = acc_dtype(D.dtype)
            xa = x.to(acc)
            x_hat = xa * torch.rsqrt(xa.pow(2).mean(-1, keepdim=True) + form[1])
            g = (D.to(acc) * x_hat).reshape(B, -1, x.shape[-1]).sum(1)
            yield m, local, [g]
            continue
        got = None
        if given is None or given.kind == "copies":
            got = _per_sequence_params(m, call, local, B, check=given is None)
            if got is None and given is not None:
                raise UsageError(f"route 'copies' given for {type(m).__name__}, whose forward "
                                 "does not take per-sequence parameter copies")
        if decided is not None:
            decided[id(m)] = SequenceRoute("vjp" if got is None else "copies")
        if got is None:
            yield m, local, _generic_grads(m, call, D, local)
            continue
        y, copies = got
        fast.append((m, local, len(leaves), len(copies)))
        ys.append(y)
        cots.append(D.to(y.dtype))
        leaves += copies
    if not fast:
        return
    grads = torch.autograd.grad(ys, leaves, cots, allow_unused=True)
    for m, local, i0, n in fast:
        gs = [torch.zeros_like(leaves[i]) if grads[i] is None else grads[i]
              for i in range(i0, i0 + n)]
        yield m, local, [g.reshape(B, -1) for g in gs]


def _check_rows(module, form, call, B, n_rows) -> None:
    """Flattened ``[B*t, in]`` inputs (OPT's MLP): check that rows map to sequences in
    row-major order (sequence 0's probe gradient alone equals autograd's), else raise."""
    args, kwargs, out = call
    if form.kind == "embedding" or out.shape[0] == B or not out.requires_grad:
        return
    g = torch.Generator(device="cpu").manual_seed(99)
    D = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype)
    D = D.reshape(B, -1, D.shape[-1])
    D[1:] = 0
    D = D.reshape(out.shape)
    with torch.enable_grad():
        auto = torch.autograd.grad(out, module.weight, D, retain_graph=True)[0].detach()
    a = factored_inputs(module, form, args, kwargs).detach()
    acc = acc_dtype(out.dtype)
    mine = factored_grads(module, form, a, D.reshape(-1, D.shape[-1]).to(acc))[0]
    err = float((auto.to(acc) - mine).norm() / auto.to(acc).norm().clamp(min=1e-30))
    if not err <= (1e-4 if out.dtype in (torch.float32, torch.float64) else 5e-2):
        raise RuntimeError(
            f"{type(module).__name__} flattens its input to [B*t, in] in an order varbench "
            f"cannot attribute to sequences (probe error {err:.2e})"
        )


def sequence_grad_norms(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    coefficients: torch.Tensor | None = None,
    params: ParamFilter = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    accumulate: torch.dtype | None = None,
    with_methods: bool = False,
    rows: int | None = None,
    routes: dict[str, SequenceRoute] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, dict[str, str]]:
    """Exact ``||sum_t c_{b,t} grad log p_{b,t}||^2`` per sequence: ``[B]``, one backward per
    chunk of ``rows`` sequences.

    Shapes: ``input_ids``, ``response_mask``, ``attention_mask``, ``coefficients`` ``[B, L]``
    (``coefficients`` e.g. from :func:`varbench.token_coefficients`, aligned like the inputs;
    only response positions count; default 1 there). ``params`` filters parameters as in
    :func:`varbench.grads.select_params`; ``dtype``/``device`` run on a copy; ``accumulate``:
    float32 (default; float64 for a float64 model) or float64. ``with_methods=True`` also
    returns ``{parameter name: route}`` (ghost / formed / per-module vjp / per-sequence).
    Equals ``sequence_grads(...).pow(2).sum(-1)`` (c = mask) to rounding. Cost: one forward,
    one activation-only backward, the Gram products per chunk; memory: the cotangent of every
    module output of a chunk at once plus ``rows t^2`` per Gram. ``rows`` (default
    :func:`sequence_rows`: from the free device memory on CUDA, a fixed byte budget on the CPU)
    bounds the sequences per forward+backward; the norms are per sequence, so chunks change
    nothing but rounding. ``routes`` (module name -> :class:`SequenceRoute`, from
    :func:`sequence_routes` of this model or its architecture): take these routes instead of
    deciding them on each chunk's values (skips the form self-checks: for tracing memory on
    tensors without values, benchmarks/plan_scale.py); default: decided and checked.
    """
    model, input_ids, response_mask, attention_mask = prepare(
        model, input_ids, response_mask, attention_mask, dtype, device
    )
    dev = input_ids.device
    B, L = input_ids.shape
    acc = acc_dtype(next(model.parameters()).dtype, accumulate)
    if coefficients is None:
        c = response_mask.to(acc)
    else:
        check_shape("coefficients", coefficients, [B, L])
        c = coefficients.to(dev, acc)
        if not bool(torch.isfinite(c).all()):
            raise UsageError("coefficients contains NaN or inf")
        c = c * response_mask.to(acc)
    chosen = select_params(model, params)
    n = sequence_rows(model, B, L, dev, rows)
    totals, methods = [], {}
    for s in range(0, B, n):
        mask = None if attention_mask is None else attention_mask[s:s + n]
        total, route = _norms_block(model, input_ids[s:s + n], mask, c[s:s + n], chosen, acc,
                                    routes)
        totals.append(total)
        for name, how in route.items():  # a slower route in any chunk is the route
            if methods.get(name, "").startswith("per-sequence"):
                continue
            methods[name] = how
    total = torch.cat(totals) if totals else torch.zeros(0, dtype=acc, device=dev)
    if with_methods:
        return total, methods
    return total


def sequence_routes(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    params: ParamFilter = None,
) -> dict[str, SequenceRoute]:
    """The route of every module owning a chosen parameter (module name -> route), as
    :func:`sequence_grad_norms` decides and checks it on the values of the first sequence's
    forward (the routes are structural: the same on any model of the architecture)."""
    model, input_ids, response_mask, attention_mask = prepare(
        model, input_ids[:1], response_mask[:1],
        None if attention_mask is None else attention_mask[:1], None, None)
    acc = acc_dtype(next(model.parameters()).dtype)
    decided: dict[str, SequenceRoute] = {}
    _norms_block(model, input_ids, attention_mask, response_mask.to(acc),
                 select_params(model, params), acc, None, decided)
    return decided


SEQUENCE_CPU_BYTES = 1 << 30
"""CPU: activation memory one :func:`sequence_grad_norms` chunk may hold (1 GiB)."""


def sequence_plan(shape: memplan.ModelShape, B: int, L: int,
                  free: int | None) -> memplan.Plan:
    """The memory plan :func:`sequence_rows` chunks ``B`` sequences of ``L`` positions by
    (path ``sequence_norms``): ``free`` bytes free on the device with the model loaded give
    the budget ``MEMORY_FRACTION * free``; None (the CPU) :data:`SEQUENCE_CPU_BYTES`."""
    from varbench.grads.chunking import MEMORY_FRACTION

    budget = SEQUENCE_CPU_BYTES if free is None else int(MEMORY_FRACTION * free)
    return memplan.plan(shape, "sequence_norms", max(B, 1), L, budget)


def sequence_rows(model: torch.nn.Module, B: int, L: int, device: torch.device | str,
                  rows: int | None = None) -> int:
    """Sequences per forward+backward of :func:`sequence_grad_norms`: ``rows`` when given,
    else the memory plan's (:func:`sequence_plan`) inside the budget (CUDA:
    ``MEMORY_FRACTION`` of the free memory; CPU: :data:`SEQUENCE_CPU_BYTES`), at least 1 and
    at most ``B``; UsageError when one row cannot fit a measured budget."""
    from varbench.grads.chunking import free_device_bytes

    if rows is not None:
        return min(check_positive_int("rows", rows), max(B, 1))
    free = free_device_bytes(device)
    p = sequence_plan(memplan.ModelShape.from_model(model), B, L, free)
    if free is not None:
        memplan.check_plan(p, f"a {L}-position sequence of {type(model).__name__}")
    return p.chunk


def _route_calls(owners, rec, chosen_name, names, B: int, L: int,
                 routes: dict[str, SequenceRoute] | None, decided: dict[int, SequenceRoute]):
    """Every owner module's route from its recorded calls: ``(plan, route, hows)`` with
    ``plan`` the ``(module, call, form | "generic", own params)`` entries, ``route`` each
    parameter's method string and ``hows`` the given routes of generic modules. Without
    ``routes`` the forms are checked on the calls' values (:func:`checked_form`,
    :func:`_check_rows`) and ``decided`` is filled; given ``routes`` (module name -> route)
    the recognition of the forms (:func:`module_form`, reading values) is skipped; the
    guards run (module type, number of calls, rows count, the forms' self-checks)."""
    route: dict[int, str] = {}
    plan = []
    hows: dict[int, SequenceRoute] = {}
    for m in owners:
        calls = rec.calls[id(m)]
        own = [(n, p) for n, p in m.named_parameters(recurse=False) if id(p) in chosen_name]
        if not calls:
            continue
        given = None
        if routes is not None:
            given = routes.get(names[id(m)])
            if given is None:
                raise UsageError(f"routes has no entry for module {names[id(m)]!r} "
                                 f"({type(m).__name__}); pass sequence_routes(...) of this model")
            check_choice("route kind", given.kind, list(ROUTE_KINDS))
        if given is not None and given.kind == "slow":
            for _, p in own:
                route[id(p)] = f"per-sequence backward: {given.reason}"
            continue
        if is_factorable_type(m):
            if given is not None and (given.kind != "factor" or len(given.forms) != len(calls)):
                raise UsageError(f"route {given.kind!r} with {len(given.forms)} forms given for "
                                 f"{names[id(m)]!r}, a {type(m).__name__} called "
                                 f"{len(calls)} times: expected 'factor' with one form a call")
            # a given form skips the recognition (which reads values) but not the guards: the
            # rows count, the first-call self-check and the rows-order check still run
            forms = [checked_form(m, call, B * L, None if given is None else given.forms[i])
                     for i, call in enumerate(calls)]
            if all(f.kind is not None for f in forms):
                for f, call in zip(forms, calls, strict=True):
                    _check_rows(m, f, call, B, B * L)
                    plan.append((m, call, f, own))
                for _, p in own:
                    route.setdefault(id(p), f"ghost ({forms[0].kind})")
                decided[id(m)] = SequenceRoute("factor", forms=tuple(forms))
                continue
            reason = next(f.reason for f in forms if f.kind is None)
            for _, p in own:
                route[id(p)] = f"per-sequence backward: {reason}"
            decided[id(m)] = SequenceRoute("slow", reason=reason)
            continue
        if given is not None and given.kind == "factor":
            raise UsageError(f"route 'factor' given for {names[id(m)]!r}, a "
                             f"{type(m).__name__} (not a Linear, Conv1D or Embedding)")
        if all(_generic_ok(m, call, B) for call in calls):
            for call in calls:
                plan.append((m, call, "generic", own))
            for _, p in own:
                route.setdefault(id(p), "per-module vjp")
            if given is not None:
                hows[id(m)] = given
            continue
        if given is not None:
            raise UsageError(f"route {given.kind!r} given for {names[id(m)]!r}, whose calls "
                             "are not position-separable (one tensor in, one out, batch first)")
        reason = (f"{type(m).__name__} is not a recognised or position-separable module")
        for _, p in own:
            route[id(p)] = f"per-sequence backward: {reason}"
        decided[id(m)] = SequenceRoute("slow", reason=reason)
    return plan, route, hows


def _norms_block(model, input_ids, attention_mask, c, chosen, acc,
                 routes: dict[str, SequenceRoute] | None = None,
                 decided: dict[str, SequenceRoute] | None = None
                 ) -> tuple[torch.Tensor, dict[str, str]]:
    """``[b]`` norms of one chunk of sequences and each chosen parameter's route: decided on
    the chunk's forward (``decided``, when given, gets each module's) or taken from
    ``routes`` (module name -> route, :func:`_route_calls`)."""
    dev = input_ids.device
    B, L = input_ids.shape
    chosen_name = {id(p): n for n, p in chosen}
    names = {id(m): n for n, m in model.named_modules()}
    owners = [m for m in model.modules()
              if any(id(p) in chosen_name for p in m.parameters(recurse=False))]
    rec = CallRecorder(owners)
    took: dict[int, SequenceRoute] = {}
    try:
        with eval_mode(model), torch.enable_grad():
            logits = forward_logits(model, input_ids, attention_mask).logits
            check_finite_logits(model, logits, "sequence_grad_norms' forward")
            lp = token_logprobs(upcast(logits), input_ids)
            # route every chosen parameter from what its modules' calls computed
            plan, route, hows = _route_calls(owners, rec, chosen_name, names, B, L, routes, took)
            # a parameter reached through both factored and generic calls: slow route
            kinds: dict[int, set] = {}
            for _, _, f, own in plan:
                for _, p in own:
                    kinds.setdefault(id(p), set()).add("g" if f == "generic" else "f")
            for pid, k in kinds.items():
                if len(k) > 1:
                    route[pid] = "per-sequence backward: mixed module kinds"
            slow = [p for _, p in chosen if route.get(id(p), "").startswith("per-sequence")]
            fast_plan = [e for e in plan
                         if not any(route[id(p)].startswith("per-sequence") for _, p in e[3])]
            outs = []
            index: dict[int, int] = {}
            for _, call, _, _ in fast_plan:
                o = call[2]
                if id(o) not in index and o.requires_grad:
                    index[id(o)] = len(outs)
                    outs.append(o)
            loss = (lp * c.to(lp.dtype)).sum()
            cots = torch.autograd.grad(loss, outs, allow_unused=True,
                                       retain_graph=bool(slow)) if outs else []
            work: dict[int, _ParamWork] = {}
            generic = []
            for m, call, f, _own in fast_plan:
                o = call[2]
                D = cots[index[id(o)]] if id(o) in index else None
                if D is None:
                    D = torch.zeros_like(o)
                if f == "generic":
                    local = [k for k, _ in m.named_parameters(recurse=False)
                             if id(getattr(m, k)) in chosen_name]
                    generic.append((m, call, D, local))
                    continue
                w, b = m.weight, getattr(m, "bias", None)
                if id(w) in chosen_name:
                    work.setdefault(id(w), _ParamWork()).factors += _factor(m, f, call, B, D, acc)
                if b is not None and f.kind != "embedding" and id(b) in chosen_name:
                    db = D.reshape(B, -1, D.shape[-1]).to(acc).sum(1)
                    work.setdefault(id(b), _ParamWork()).dense.append(db)
            for m, local, grads in _generic_all(generic, B, hows if routes else None, took):
                for k, g in zip(local, grads, strict=True):
                    work.setdefault(id(getattr(m, k)), _ParamWork()).dense.append(g.to(acc))
            total = torch.zeros(B, dtype=acc, device=dev)
            for wk in work.values():
                total += _param_norm(wk)
            if slow:
                total += _slow_norms(lp, c, slow, acc)
    finally:
        rec.remove()
    if decided is not None:
        decided.update({names[i]: r for i, r in took.items()})
    return total, {n: route.get(id(p), "unused") for n, p in chosen}


def _param_norm(wk: _ParamWork) -> torch.Tensor:
    """``[B]`` squared norm of one parameter's per-sequence gradient from its contributions."""
    if wk.factors and wk.dense:  # cannot happen for one parameter (routes are exclusive)
        raise RuntimeError("a parameter with both factored and dense contributions")
    if wk.dense:
        g = torch.stack(wk.dense).sum(0)
        return g.pow(2).sum(-1)
    f = wk.factors
    out = sum(_self_norm(x) for x in f)
    for i in range(len(f)):
        for j in range(i + 1, len(f)):
            out = out + 2 * _pair(f[i], f[j])
    return out


def _slow_norms(lp, c, params, acc) -> torch.Tensor:
    """``[B]`` squared norms over ``params`` by one backward per sequence (exact, slow)."""
    B = lp.shape[0]
    out = torch.zeros(B, dtype=acc, device=lp.device)
    for b in range(B):
        loss = (lp[b] * c[b].to(lp.dtype)).sum()
        gs = torch.autograd.grad(loss, params, retain_graph=True, allow_unused=True)
        out[b] = sum(g.to(acc).pow(2).sum() for g in gs if g is not None)
    return out
