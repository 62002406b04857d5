"""Sketched (unbiased) per-token and prefix norms from k forward-mode probes (docs/science.md §6).

For a random direction v over the parameters, one forward-mode JVP gives ``u_t = g_t . v`` for
every token at once, and ``cumsum(u)_t = G_t . v`` for every prefix. With ``v ~ N(0, I)``,
``E[u_t^2] = ||g_t||^2`` and ``E[(G_t . v)^2] = ||G_t||^2``: averaging over k probes is unbiased,
with ``Var = 2 ||g||^4 / k`` (relative std ``sqrt(2/k)``) per entry. Cost: k JVPs (each about
2-3 forwards), independent of T: the route for models too large for the exact path.
The directions are independent Gaussian probes (:class:`GaussianProbes`), not varbench's count
sketch: the estimator's chi-square law and its error bar need iid probes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.func import functional_call, jvp, vmap

from varbench._util.checks import UsageError, UsageTypeError, check_positive_int
from varbench.grads._inputs import check_inputs, eval_mode, prepare_model
from varbench.grads.params import ParamFilter, select_params
from varbench.grads.precision import functional_attention
from varbench.models.forward import forward_logits
from varbench.models.logits import token_logprobs


@dataclass(frozen=True)
class GaussianProbes:
    """k seeded iid ``N(0, I)`` probe directions over the parameters, for forward-mode JVPs only.

    Why Gaussian (and not the CountSketch): :func:`varbench.grads.sketch.sketched_token_norms`
    averages ``u_j^2 = (g . v_j)^2`` over k INDEPENDENT, identically distributed probes, so that
    (a) ``k * estimate / ||g||^2 ~ chi2_k`` exactly, ``Var = 2 ||g||^4 / k`` per entry, and (b)
    the sample std of the k per-probe values over sqrt(k) is a valid error bar. The k buckets of
    a CountSketch are neither independent nor identically scaled probes, so neither holds for
    them. Direction j is generated from ``seed * 1_000_003 + j`` alone, by a generator on the
    device it is used on (float64 normals on the CPU; on an accelerator normals in the model's
    dtype, float32 at least), never stored whole and never copied from the host. CPU and CUDA
    generators draw different directions for one seed (both iid N(0, I)).
    """

    k: int
    seed: int = 0

    def __post_init__(self) -> None:
        check_positive_int("k", self.k)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise UsageTypeError(f"seed must be an int, got {type(self.seed).__name__}")

    def direction(self, j: int, n: int, dtype: torch.dtype, device) -> torch.Tensor:
        """Probe j: ``[n]`` iid N(0, 1), a function of (seed, j, n) only."""
        device = torch.device(device)
        if device.type == "meta":  # no values to draw
            return torch.empty(n, dtype=dtype, device=device)
        g = torch.Generator(device=device).manual_seed(self.seed * 1_000_003 + j)
        # CPU: float64 draws (the historical directions); elsewhere the working dtype, so an
        # accelerator never generates (or holds) P float64 numbers per probe
        draw = (torch.float64 if device.type == "cpu"
                else torch.promote_types(dtype, torch.float32))
        v = torch.randn(n, generator=g, dtype=draw, device=device)
        return v if v.dtype == dtype else v.to(dtype)


class _LogProbs(torch.nn.Module):
    """Wrapper so ``functional_call`` can swap parameters under ``forward_logits``."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.m = model

    def forward(self, ids: torch.Tensor, am: torch.Tensor) -> torch.Tensor:
        return token_logprobs(forward_logits(self.m, ids, am).logits, ids)


def jvp_token_probes(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None,
    probes: GaussianProbes,
    *,
    params: ParamFilter = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    probe_chunk: int = 32,
) -> torch.Tensor:
    """``[k, B, L]`` probes ``u_j[b, t] = g_{b,t} . v_j`` (v_j = probe direction j; 0 off mask).

    ``probe_chunk`` probes run as one vmapped JVP (memory ~ probe_chunk x activations)."""
    check_positive_int("probe_chunk", probe_chunk)
    input_ids, response_mask, attention_mask = check_inputs(
        input_ids, response_mask, attention_mask
    )
    model = prepare_model(model, dtype, device)
    p0 = next(model.parameters())
    dev, dt = p0.device, p0.dtype
    chosen = select_params(model, params)
    primals = {"m." + n: p.detach() for n, p in chosen}
    sizes = [p.numel() for _, p in chosen]
    wrapper = _LogProbs(model)
    pad_rows = _padding_rows(model, chosen, input_ids, attention_mask)
    ids, am = input_ids.to(dev), attention_mask.to(dev)
    m = response_mask.to(dev, dt)

    def f(p):
        return functional_call(wrapper, p, (ids, am))

    def probe(tangents):
        return jvp(f, (primals,), (tangents,))[1]

    out = []
    with eval_mode(model), functional_attention(model), torch.no_grad():
        for j0 in range(0, probes.k, probe_chunk):
            js = range(j0, min(j0 + probe_chunk, probes.k))
            v = torch.stack([probes.direction(j, sum(sizes), dt, dev) for j in js])  # [c, n]
            tangents = {
                k: t.reshape(len(js), *primals[k].shape)
                for k, t in zip(primals, torch.split(v, sizes, dim=1), strict=True)
            }
            for k, row in pad_rows.items():
                # torch's embedding gives its padding row no gradient, but its forward-mode
                # derivative would move it: zero that row of the tangent so u_j = g . v_j
                tangents[k] = tangents[k].clone()
                tangents[k][:, row] = 0
            # vmap over probes: one batched dual forward per chunk instead of c forwards
            out.append(vmap(probe)(tangents) * m)
    return torch.cat(out)


def _padding_rows(model, chosen, input_ids, attention_mask) -> dict[str, int]:
    """``{"m." + name: padding row}`` of chosen untied Embedding weights with a padding_idx.

    torch gives an Embedding's padding row no gradient, but its forward-mode derivative moves
    it: zeroing that row of the tangent keeps ``u_j = g . v_j``. A TIED weight's padding row
    does get a gradient (from the head), so it cannot be zeroed: when its padding id occurs at
    an attended position the probes would not be ``g . v_j``, and a UsageError says so.
    """
    uses: dict[int, int] = {}
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            uses[id(p)] = uses.get(id(p), 0) + 1
    by_id = {id(p): "m." + n for n, p in chosen}
    rows = {}
    for mod in model.modules():
        if not (isinstance(mod, torch.nn.Embedding) and mod.padding_idx is not None
                and id(mod.weight) in by_id):
            continue
        if uses[id(mod.weight)] == 1:
            rows[by_id[id(mod.weight)]] = mod.padding_idx
        elif bool(((input_ids == mod.padding_idx) & (attention_mask != 0)).any()):
            raise UsageError(
                f"token id {mod.padding_idx} (the padding_idx of the tied "
                f"{type(mod).__name__}) occurs at an attended position: forward-mode probes "
                "cannot match its gradient convention there; mask those positions"
            )
    return rows


@dataclass
class SketchedNorms:
    """Unbiased estimates ``[B, L]`` (0 off the mask) and their estimated std ``[B, L]``
    (sample std of the k per-probe values / sqrt(k)); ``probes [k, B, L]`` for custom stats."""

    token_sq: torch.Tensor
    prefix_sq: torch.Tensor
    diag_prefix_sq: torch.Tensor
    token_sq_std: torch.Tensor
    prefix_sq_std: torch.Tensor
    probes: torch.Tensor


def sketched_token_norms(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    k: int = 16,
    seed: int = 0,
    params: ParamFilter = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> SketchedNorms:
    """Estimate ``token_sq``, ``prefix_sq``, ``diag_prefix_sq`` from k Gaussian JVP probes.

    Unbiased for every entry; relative std ``sqrt(2/k)`` per entry (Gaussian probes). Same
    ``seed`` -> same numbers. Shapes as :func:`varbench.grads.token_grad_norms`.
    """
    check_positive_int("k", k)
    u = jvp_token_probes(
        model,
        input_ids,
        response_mask,
        attention_mask,
        GaussianProbes(k, seed),
        params=params,
        dtype=dtype,
        device=device,
    )  # [k, B, L]
    m = response_mask.to(u.device, u.dtype)
    tok_s = u.pow(2)
    pre_s = u.cumsum(-1).pow(2) * m
    sd = (lambda x: x.std(0) / k**0.5) if k > 1 else (lambda x: torch.full_like(x[0], float("nan")))
    tok = tok_s.mean(0)
    return SketchedNorms(
        token_sq=tok,
        prefix_sq=pre_s.mean(0),
        diag_prefix_sq=tok.cumsum(-1) * m,
        token_sq_std=sd(tok_s),
        prefix_sq_std=sd(pre_s),
        probes=u,
    )
