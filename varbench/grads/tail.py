"""Tail-exact per-token norms from ONE ordinary backward (docs/science.md section 6).

Modules after the last token-mixing layer (the last block's MLP and its norm, the final norm,
an untied head) act position by position, so the cotangent that one backward of
``sum_t m_t log p_t`` leaves at a tail module's output position s is exactly the cotangent of
token s+1 alone. Per-token gradients are then per-position outer products:
``||d_s a_s^T||^2 = ||d_s||^2 ||a_s||^2`` for a Linear, and a per-position vjp for anything else
(norm weights). Prefix norms use the Gram form
``||sum_{j<=t} d_j a_j^T||^2 = sum_{i,j<=t} <d_i,d_j><a_i,a_j>``. For an untied head this gives
the identity ``head norm = w_t * ||h_t||^2`` (w_t the Logit-Gradient Proxy).

A tied head is NOT tail: its tensor is also the input embedding, which sits below attention.
Which modules form the tail is architecture knowledge (:func:`varbench.models.arch.tail_modules`);
whether they really act position by position after the last mixing is CHECKED on every call by
one extra backward of a single token (its cotangent must vanish at every other position), so a
wrong ``modules`` raises instead of giving wrong numbers. Norms are accumulated in float32 at
least (:func:`varbench.grads.ghost.acc_dtype`).
"""

from __future__ import annotations

import torch
from torch.func import functional_call, vjp, vmap
from transformers.pytorch_utils import Conv1D

from varbench._util.checks import UsageError
from varbench.grads._inputs import eval_mode, prepare
from varbench.grads.exact import TokenGradNorms, last_response_value
from varbench.grads.ghost import acc_dtype
from varbench.models.arch import check_finite_logits, tail_modules
from varbench.models.forward import forward_logits
from varbench.models.logits import token_logprobs, upcast


def default_tail_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Position-wise modules after the last attention (:func:`varbench.models.arch.tail_modules`):
    the last block's modules outside its attention, the final norm, an untied head."""
    return tail_modules(model)


def _by_position(x: torch.Tensor, B: int, L: int) -> torch.Tensor:
    """``[B, L, ...]`` view of a tail tensor, also when the module saw ``[B*L, ...]`` (OPT's
    MLP flattens its input row-major)."""
    return x if x.shape[:2] == (B, L) else x.reshape(B, L, *x.shape[1:])


def _check_position_wise(lp, response_mask, outs, modules) -> None:
    """One backward of a single response token: a tail module's output cotangent must vanish
    at every other position and row (exactly: no path links them), else raise naming it."""
    hit = torch.nonzero(response_mask)
    if hit.shape[0] == 0:
        return
    b, t = (int(x) for x in hit[hit.shape[0] // 2])
    grads = torch.autograd.grad(lp[b, t], [outs[n] for n in modules], retain_graph=True,
                                allow_unused=True)
    for name, g in zip(modules, grads, strict=True):
        if g is None:
            continue
        g = _by_position(g, *response_mask.shape).clone()
        g[b, t - 1] = 0
        if bool(g.ne(0).any()):
            raise UsageError(
                f"tail module {name!r} ({type(modules[name]).__name__}) is not position-wise "
                "after the last token mixing: a token's gradient reaches its other positions"
            )


def _prefix_from_gram(gram: torch.Tensor) -> torch.Tensor:
    """``[B, L, L]`` Gram of per-position gradients (masked) -> ``[B, L]`` prefix norms."""
    return gram.cumsum(1).cumsum(2).diagonal(dim1=1, dim2=2)


def tail_token_norms(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    modules: dict[str, torch.nn.Module] | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> TokenGradNorms:
    """Exact per-token norms restricted to the tail parameters, from one backward.

    Shapes: inputs ``[B, L]``; ``token_sq``, ``prefix_sq``, ``diag_prefix_sq`` ``[B, L]``;
    ``group_*`` ``[B, L, n_modules]`` with ``group_names`` the module names. ``modules`` must be
    position-wise and after the last token-mixing layer, each called once per forward (both
    checked: a UsageError names a module that is not); default :func:`default_tail_modules`.
    Linear and Conv1D modules use the Gram form, others a per-position vjp of their own
    forward. Memory O(B L^2) for the Grams.
    """
    model, input_ids, response_mask, attention_mask = prepare(
        model, input_ids, response_mask, attention_mask, dtype, device
    )
    dev = input_ids.device
    if modules is None:
        modules = default_tail_modules(model)
    acts: dict[str, torch.Tensor] = {}
    outs: dict[str, torch.Tensor] = {}
    n_calls = dict.fromkeys(modules, 0)

    def hook(name):
        def fn(mod, args, out):
            acts[name] = args[0].detach()
            outs[name] = out
            n_calls[name] += 1

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in modules.items()]
    try:
        with eval_mode(model), torch.enable_grad():
            logits = forward_logits(model, input_ids, attention_mask).logits
            check_finite_logits(model, logits, "tail_token_norms' forward")
            bad = [n for n, c in n_calls.items() if c != 1]
            if bad:
                raise UsageError(f"tail modules {bad} ran {[n_calls[n] for n in bad]} times in "
                                 "one forward; each must run exactly once")
            lp = token_logprobs(upcast(logits), input_ids)
            _check_position_wise(lp, response_mask, outs, modules)
            loss = (lp * response_mask.to(lp.dtype)).sum()
            # cotangents of the tail outputs only: no parameter .grad is touched
            grads = torch.autograd.grad(loss, [outs[n] for n in modules])
    finally:
        for h in handles:
            h.remove()
    B, L = input_ids.shape
    cots = {n: _by_position(g.detach(), B, L) for n, g in zip(modules, grads, strict=True)}
    acts = {n: _by_position(a, B, L) for n, a in acts.items()}
    acc = acc_dtype(next(model.parameters()).dtype)
    # position s predicts token s + 1: shift the token mask onto positions
    pos_mask = torch.nn.functional.pad(response_mask[:, 1:], (0, 1)).to(acc)
    tok = torch.zeros(B, L, len(modules), dtype=acc, device=dev)
    pre = torch.zeros_like(tok)
    for k, (name, mod) in enumerate(modules.items()):
        if isinstance(mod, (torch.nn.Linear, Conv1D)):
            a, d = acts[name].to(acc), cots[name].to(acc) * pos_mask.unsqueeze(-1)
            a_gram = a @ a.transpose(1, 2) + (1.0 if mod.bias is not None else 0.0)
            gram = (d @ d.transpose(1, 2)) * a_gram  # [B, L, L]
        else:
            d = cots[name] * pos_mask.unsqueeze(-1).to(cots[name].dtype)
            gp = _per_position_grads(mod, acts[name], d).to(acc)  # [B, L, n]
            gram = gp @ gp.transpose(1, 2)
        t_pos = gram.diagonal(dim1=1, dim2=2)
        p_pos = _prefix_from_gram(gram)
        tok[:, 1:, k] = t_pos[:, :-1]
        pre[:, 1:, k] = p_pos[:, :-1]
    m = response_mask.to(tok.dtype).unsqueeze(-1)
    tok, pre = tok * m, pre * m
    diag = tok.cumsum(1) * m
    return TokenGradNorms(
        token_sq=tok.sum(-1),
        prefix_sq=pre.sum(-1),
        diag_prefix_sq=diag.sum(-1),
        sequence_sq=last_response_value(pre.sum(-1), response_mask),
        group_names=list(modules),
        group_token_sq=tok,
        group_prefix_sq=pre,
        group_diag_prefix_sq=diag,
    )


def _per_position_grads(mod: torch.nn.Module, a: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``[B, L, n]`` gradients of the module's own parameters at each position (vjp per row)."""
    params = {n: p.detach() for n, p in mod.named_parameters(recurse=False)}

    def one(x, cot):
        _, pull = vjp(lambda p: functional_call(mod, p, (x[None],))[0], params)
        (g,) = pull(cot)
        return torch.cat([v.reshape(-1) for v in g.values()])

    B, L = a.shape[:2]
    flat = vmap(one)(a.reshape(B * L, -1), d.reshape(B * L, -1))
    return flat.reshape(B, L, -1)
