"""What varbench knows about model architectures: the one home of that knowledge.

Everything the gradient harness, the float64 copy and the sampler need to know about how a
transformers causal LM is built lives here, recognised by what a module *computes* (checked by
recomputation on the actual call) rather than by its class name wherever possible:

- weight-carrying modules the ghost engines can factor (:func:`module_form`): ``nn.Linear``
  (weight ``[out, in]``), transformers' ``Conv1D`` (GPT-2, weight ``[in, out]``) and
  ``nn.Embedding`` including subclasses whose forward is a scaled lookup (Gemma's
  ``embed_scale``, measured from the output) or a lookup of derived positions (OPT's learned
  positional embedding, offset 2, positions from ``position_ids`` or the attention mask);
  anything else is reported with a reason so the caller routes it to an exact generic path;
- RMS norms (:func:`rms_norm_form`): ``w * x_hat`` (Llama, Qwen, Mistral, Olmo2, ...) or
  ``(1 + w) * x_hat`` (the Gemma family), told apart by evaluating the module;
- attention keyword arguments that change the math (:data:`ATTENTION_KWARGS_UNSUPPORTED`; Gemma2's
  logit soft-capping is supported by varbench's own attention, sinks are not);
- the MoE experts kernel (:func:`float64_experts`: transformers' default grouped-mm kernel
  refuses float64, its eager loop computes the same function);
- the position-wise tail after the last attention (:func:`tail_modules`), parameter naming for
  the default per-group breakdown (:data:`BLOCK_RE` and word lists), and the one decode step of
  the sampler (:func:`stepper`, including the non-finite-logits check: transformers' Gemma2
  returns NaN for left-padded rows in float64).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.pytorch_utils import Conv1D

from varbench._util.checks import UsageError, UsageTypeError

# ---------------------------------------------------------------------------------------------
# parameter naming (default groups of the per-group breakdown)

# "<prefix>.layers.3." (Llama family), ".h.3." (GPT-2), ".layer.3.", ".blocks.3."
BLOCK_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")
# names of a block's attention side (incl. its pre-attention norm) and MLP side; MLP words are
# tested first because Llama's pre-MLP norm is called "post_attention_layernorm"
ATTN_WORDS = ("attn", "attention", "input_layernorm", "ln_1")
MLP_WORDS = ("mlp", "feed_forward", "ffn", "post_attention_layernorm", "ln_2", "fc1", "fc2",
             "final_layer_norm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
             "block_sparse_moe")
# final norm names of the decoder stacks varbench knows
FINAL_NORM_NAMES = ("norm", "ln_f", "final_layer_norm", "final_layernorm")
# a block's token-mixing submodule and the norms that only feed it (not position-wise tail)
_MIXING_NAMES = ("self_attn", "attn", "attention", "input_layernorm", "ln_1",
                 "self_attn_layer_norm")


# ---------------------------------------------------------------------------------------------
# weight-carrying modules: what the ghost engines can factor


@dataclass(frozen=True)
class ModuleForm:
    """What one call of a module computes, in the factored form ``grad W = L^T R``.

    ``kind``: 'linear' (``y = x W^T + b``, W ``[out, in]``), 'conv1d' (``y = x W + b``, W
    ``[in, out]``), 'embedding' (``y = scale * W[idx]``) or None (not factorable; ``reason``
    says why). ``scale`` is the embedding's output scale (1 for a plain lookup).
    """

    kind: str | None
    scale: float = 1.0
    reason: str = ""


def _is_plain(module: torch.nn.Module, base: type) -> bool:
    return type(module).forward is base.forward


def _opt_positions(module, args, kwargs) -> torch.Tensor | None:
    """OPT's learned positional embedding: rows ``position_ids + offset`` (positions from the
    attention mask, OPT's own formula, when no position ids are passed)."""
    offset = getattr(module, "offset", None)
    if not isinstance(offset, int):
        return None
    pos = kwargs.get("position_ids", args[2] if len(args) > 2 else None)
    if pos is None:
        mask = kwargs.get("attention_mask", args[0] if args else None)
        if not isinstance(mask, torch.Tensor):
            return None
        past = kwargs.get("cache_length", kwargs.get("past_key_values_length",
                                                     args[1] if len(args) > 1 else 0))
        pos = (torch.cumsum(mask, dim=1) * mask - 1).long()[:, int(past):]
    return pos.long() + offset


# Embedding subclasses whose looked-up rows are not args[0]: class name -> rows(module, args,
# kwargs). Whatever a rule returns is verified against the module's output before it is used.
_EMBEDDING_ROWS: dict[str, Callable] = {"OPTLearnedPositionalEmbedding": _opt_positions}


def embedding_rows(module: torch.nn.Embedding, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The integer rows an Embedding call looked up (``[...]``), or None if varbench cannot
    tell. Plain and scaled embeddings look up ``args[0]``; known subclasses use their rule."""
    rule = _EMBEDDING_ROWS.get(type(module).__name__)
    if rule is not None:
        return rule(module, args, kwargs)
    x = args[0] if args else kwargs.get("input", kwargs.get("input_ids"))
    if isinstance(x, torch.Tensor) and not x.dtype.is_floating_point and x.dtype != torch.bool:
        return x
    return None


def linear_input(module: torch.nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The input ``[..., in]`` of a Linear/Conv1D call (None if it is not a tensor)."""
    x = args[0] if args else kwargs.get("input", kwargs.get("x"))
    return x if isinstance(x, torch.Tensor) else None


def weight_in_features(module: torch.nn.Module) -> int:
    """Input width of a factorable module: ``in`` of a Linear/Conv1D, V of an Embedding."""
    if isinstance(module, Conv1D):
        return module.weight.shape[0]
    return module.weight.shape[1] if isinstance(module, torch.nn.Linear) else module.weight.shape[0]


def is_factorable_type(module: torch.nn.Module) -> bool:
    """A module type the ghost engines may factor (subject to :func:`module_form` per call)."""
    return isinstance(module, (torch.nn.Linear, torch.nn.Embedding, Conv1D))


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    # tolerance of the computation's own dtype: the module and the recomputation round alike
    eps = torch.finfo(a.dtype).eps if a.dtype.is_floating_point else 0.0
    scale = b.abs().max().clamp(min=1e-30)
    return bool(a.shape == b.shape and ((a - b).abs().max() <= 64 * eps * scale))


@torch.no_grad()
def module_form(module: torch.nn.Module, args: tuple, kwargs: dict, out) -> ModuleForm:
    """Recognise one call of ``module`` by recomputing its output from the factored form.

    Returns kind 'linear' / 'conv1d' / 'embedding' when the recomputation reproduces ``out``
    (to the dtype's rounding), else kind None with the reason (the caller then uses an exact
    generic path for this module's parameters).
    """
    name = type(module).__name__
    if not isinstance(out, torch.Tensor):
        return ModuleForm(None, reason=f"{name} returns {type(out).__name__}, not a tensor")
    w = module.weight
    if isinstance(module, torch.nn.Embedding):
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            return ModuleForm(None, reason=f"{name} uses max_norm/scale_grad_by_freq/sparse")
        rows = embedding_rows(module, args, kwargs)
        if rows is None:
            return ModuleForm(None, reason=f"{name}: Embedding subclass with a forward varbench "
                                           "does not know (not a lookup of its first argument)")
        if rows.numel() == 0 or rows.min() < 0 or rows.max() >= w.shape[0]:
            return ModuleForm(None, reason=f"{name}: looked-up rows out of range")
        looked = torch.nn.functional.embedding(rows, w)
        if looked.shape != out.shape:
            return ModuleForm(None, reason=f"{name}: output is not a lookup of its rows")
        if torch.equal(looked, out):
            return ModuleForm("embedding", 1.0)
        # a scaled lookup y = s * W[rows]: measure s, then require it to reproduce y
        den = (looked.double() ** 2).sum()
        s = float((looked.double() * out.double()).sum() / den) if den > 0 else 1.0
        if _close(out, looked * torch.tensor(s, dtype=w.dtype)):
            return ModuleForm("embedding", s)
        return ModuleForm(None, reason=f"{name}: output is not a (scaled) lookup of its rows")
    x = linear_input(module, args, kwargs)
    if x is None or x.shape[-1:] != (weight_in_features(module),):
        return ModuleForm(None, reason=f"{name}: first input is not [..., in]")
    if isinstance(module, Conv1D):
        ref = torch.addmm(module.bias, x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], -1)
        kind = "conv1d"
    elif isinstance(module, torch.nn.Linear):
        if _is_plain(module, torch.nn.Linear):
            return ModuleForm("linear")
        ref = torch.nn.functional.linear(x, w, module.bias)
        kind = "linear"
    else:
        return ModuleForm(None, reason=f"{name} is not a Linear, Conv1D or Embedding")
    if _close(out, ref):
        return ModuleForm(kind)
    return ModuleForm(None, reason=f"{name}: output is not x W^T + b of its first input")


# ---------------------------------------------------------------------------------------------
# norms and attention (what the float64 copy must reproduce)


def rms_norm_form(module: torch.nn.Module) -> tuple[str, float] | None:
    """``('w' | '1+w', eps)`` for an RMS norm computing ``w * x_hat`` or ``(1 + w) * x_hat``
    (``x_hat = x / sqrt(mean(x^2) + eps)``), told apart by evaluating the module on a probe;
    None when ``module`` is not an RMS norm of either form (e.g. a LayerNorm)."""
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or not type(module).__name__.endswith(
        "RMSNorm"
    ):
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if not isinstance(eps, (int, float)):
        return None
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(3, w.shape[0], generator=g, dtype=torch.float32).to(w.device, w.dtype)
    with torch.no_grad():
        y = module(x).double()
        xd = x.double()
        x_hat = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
        # modules may compute internally in float32 (Llama casts): float32-level tolerance; the
        # two forms differ by x_hat itself, O(1)
        low = w.dtype in (torch.float64, torch.float32)
        tol = (1e-5 if low else 5e-2) * (1 + x_hat.abs().max() * (1 + w.double().abs().max()))
        for kind, scale in (("w", w.double()), ("1+w", 1 + w.double())):
            if (y - scale * x_hat).abs().max() <= tol:
                return kind, float(eps)
    return None


# keyword arguments transformers passes to attention functions that change what attention
# computes and that varbench's own attention does not implement
ATTENTION_KWARGS_UNSUPPORTED = ("s_aux", "sinks")


def check_attention_kwargs(module: torch.nn.Module, kwargs: dict) -> None:
    """Raise (naming the module class) if the call asks for attention math varbench lacks."""
    bad = [k for k in ATTENTION_KWARGS_UNSUPPORTED if kwargs.get(k) is not None]
    if bad:
        raise UsageError(
            f"{type(module).__name__} passes {bad} to its attention (attention sinks); "
            "varbench's float64 / functional attention does not implement them"
        )


def float64_experts(model: torch.nn.Module) -> bool:
    """Switch a MoE model to transformers' eager experts loop (the default grouped-mm kernel
    refuses float64; the loop computes the same function). Returns whether it was a MoE model."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_experts_implementation", None)
    if impl is None:
        return False
    if impl != "eager":
        model.set_experts_implementation("eager")
    return True


# ---------------------------------------------------------------------------------------------
# position-wise tail


def decoder_layers(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.ModuleList]:
    """``(decoder, its list of blocks)`` of a transformers causal LM."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else None
    for holder in (base, getattr(base, "decoder", None)):
        for attr in ("layers", "h"):
            blocks = getattr(holder, attr, None)
            if isinstance(blocks, torch.nn.ModuleList) and len(blocks) > 0:
                return holder, blocks
    raise UsageTypeError(
        f"cannot find the tail (the decoder blocks) of {type(model).__name__}; "
        "pass modules={name: module}"
    )


def _is_moe(module: torch.nn.Module) -> bool:
    return type(module).__name__.endswith(("Router", "Experts", "SparseMoeBlock"))


def tail_modules(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Position-wise modules after the last token mixing: the last block's parameter-carrying
    modules outside its attention (and the norm feeding it), the final norm, an untied head.

    MoE blocks (routers and experts) are left out: a router returns a tuple and experts take
    routing tensors, which the tail's per-position gradients do not model. Whether the modules
    really are position-wise is checked by :func:`varbench.grads.tail_token_norms` itself.
    """
    base, blocks = decoder_layers(model)
    last = blocks[-1]
    names = {id(m): n for n, m in model.named_modules()}
    moe = {id(x) for m in last.modules() if _is_moe(m) for x in m.modules()}
    mods: list[torch.nn.Module] = []
    for child_name, child in last.named_children():
        if child_name in _MIXING_NAMES:
            continue
        mods += [m for m in child.modules()
                 if id(m) not in moe and any(True for _ in m.parameters(recurse=False))]
    for nm in FINAL_NORM_NAMES:
        norm = getattr(base, nm, None)
        if isinstance(norm, torch.nn.Module):
            mods.append(norm)
            break
    proj = getattr(base, "project_out", None)  # OPT with word_embed_proj_dim != hidden
    if isinstance(proj, torch.nn.Module):
        mods.append(proj)
    head = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    if head is not None and head.weight is not emb.weight:
        mods.append(head)
    return {names[id(m)]: m for m in mods}


# ---------------------------------------------------------------------------------------------
# the sampler's decode step


def check_finite_logits(model: torch.nn.Module, logits: torch.Tensor, what: str) -> None:
    """Raise a UsageError naming the model and dtype when ``logits`` hold NaN (a ``-inf`` logit
    is a legitimately masked vocabulary entry)."""
    if bool(torch.isnan(logits).any()):
        raise UsageError(
            f"{type(model).__name__} in {logits.dtype} returned NaN logits ({what}). "
            "transformers' Gemma2 does so in float64 for left-padded rows; run it in float32, "
            "or use varbench.grads.exact_float64(model), whose attention keeps padded rows finite"
        )


def stepper(model: torch.nn.Module):
    """``step(ids, attn, pos, cache) -> (cache, last logits [B, V])`` for this transformers.

    The first call (the prefill) checks that the logits hold no NaN, so a model that returns NaN
    fails with its name instead of inside ``torch.multinomial``.
    """
    params = inspect.signature(model.forward).parameters
    # transformers >= 5.2x renamed past_key_values to cache; older 5.x only knows the old name.
    key = "cache" if "cache" in params else "past_key_values"
    keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
    checked = []

    def step(ids, attn, pos, cache):
        kw = {key: cache} if cache is not None else {}
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                    **keep, **kw)
        new = getattr(out, "cache", None)
        if new is None:
            new = out.past_key_values
        logits = out.logits[:, -1]
        if not checked:
            check_finite_logits(model, logits, "prefill of the prompts")
            checked.append(True)
        return new, logits

    return step
