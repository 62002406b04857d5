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
"""

from __future__ import annotations

import torch
from torch.func import functional_call, vjp, vmap

from varbench._util.checks import UsageTypeError
from varbench.grads._inputs import eval_mode, prepare
from varbench.grads.exact import TokenGradNorms, last_response_value
from varbench.models.forward import forward_logits
from varbench.models.logits import token_logprobs


def default_tail_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Position-wise modules after the last attention of a Llama/Qwen/Mistral-style model:
    last block's ``post_attention_layernorm`` and MLP linears, final ``norm``, untied head."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    if base is None or not hasattr(base, "layers") or not hasattr(base, "norm"):
        raise UsageTypeError(
            f"cannot find the tail of {type(model).__name__}; pass modules={{name: module}}"
        )
    last = base.layers[-1]
    names = {id(m): n for n, m in model.named_modules()}
    mods = [last.post_attention_layernorm]
    mods += [m for m in last.mlp.modules() if isinstance(m, torch.nn.Linear)]
    mods.append(base.norm)
    head = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    if head is not None and head.weight is not emb.weight:
        mods.append(head)
    return {names[id(m)]: m for m in mods}


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
    position-wise and after the last token-mixing layer (not checked: a mixing module gives
    wrong numbers); default :func:`default_tail_modules`. Memory O(B L^2) for the Grams.
    """
    model, input_ids, response_mask, attention_mask = prepare(
        model, input_ids, response_mask, attention_mask, dtype, device
    )
    dev = input_ids.device
    if modules is None:
        modules = default_tail_modules(model)
    acts: dict[str, torch.Tensor] = {}
    outs: dict[str, torch.Tensor] = {}

    def hook(name):
        def fn(mod, args, out):
            acts[name] = args[0].detach()
            outs[name] = out

        return fn

    handles = [m.register_forward_hook(hook(n)) for n, m in modules.items()]
    try:
        with eval_mode(model), torch.enable_grad():
            logits = forward_logits(model, input_ids, attention_mask).logits
            lp = token_logprobs(logits, input_ids)
            loss = (lp * response_mask.to(lp.dtype)).sum()
            # cotangents of the tail outputs only: no parameter .grad is touched
            grads = torch.autograd.grad(loss, [outs[n] for n in modules])
    finally:
        for h in handles:
            h.remove()
    cots = {n: g.detach() for n, g in zip(modules, grads, strict=True)}
    logits = logits.detach()
    B, L = input_ids.shape
    # position s predicts token s + 1: shift the token mask onto positions
    pos_mask = torch.nn.functional.pad(response_mask[:, 1:], (0, 1)).to(logits.dtype)
    tok = torch.zeros(B, L, len(modules), dtype=logits.dtype, device=dev)
    pre = torch.zeros_like(tok)
    for k, (name, mod) in enumerate(modules.items()):
        a, d = acts[name], cots[name] * pos_mask.unsqueeze(-1)
        if isinstance(mod, torch.nn.Linear):
            a_gram = a @ a.transpose(1, 2) + (1.0 if mod.bias is not None else 0.0)
            gram = (d @ d.transpose(1, 2)) * a_gram  # [B, L, L]
        else:
            gp = _per_position_grads(mod, a, d)  # [B, L, n]
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
