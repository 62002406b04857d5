"""A causal LM's output head, read so the logits can be made a chunk of positions at a time.

``logits = softcap(scale * (h @ W^T + b))`` with ``h`` the body's final hidden states (after the
final norm), ``W`` the output embedding ``[V, H]`` (the input embedding when tied), ``b`` its
bias or none, ``scale`` a constant (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``)
and ``softcap(x) = c * tanh(x / c)`` (Gemma2/3's ``final_logit_softcapping``), or no cap.

What a causal LM's forward does after its head is not in the module tree: it is read from a table
of known architectures (``config.model_type``). A model is used this way only when its type is
in the table, its body is reachable as ``model.base_model`` and ``get_output_embeddings()`` is a
linear layer, and once per model instance a probe (8 positions through both paths) finds the
head's logits equal to the model's own; otherwise :func:`read_head` answers None and a reason,
and callers use the plain full-logits path (``varbench.models.logits`` says so with a warning).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from varbench.models.forward import forward_logits, position_ids_from_mask

# model_type -> what the CausalLM's forward applies to ``lm_head(h)``: "plain", "softcap"
# (config.final_logit_softcapping, may be None), "mul_logit_scale" (model.logit_scale),
# "div_logits_scaling" / "mul_logits_scaling" (config.logits_scaling after the head),
# "pre_div_logits_scaling" (h / config.logits_scaling before a bias-free head).
_POST: dict[str, str] = {
    **dict.fromkeys(
        ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mistral", "mixtral", "phi3",
         "olmo", "olmo2", "gemma", "smollm3", "gpt_neox", "gpt2", "gptj", "starcoder2"),
        "plain"),
    **dict.fromkeys(("gemma2", "gemma3_text", "vaultgemma"), "softcap"),
    **dict.fromkeys(("cohere", "cohere2"), "mul_logit_scale"),
    **dict.fromkeys(("granite", "granitemoe", "granitemoeshared"), "div_logits_scaling"),
    "minicpm3": "pre_div_logits_scaling",
}


@dataclass(frozen=True)
class OutputHead:
    """The output head of a causal LM: ``logits = softcap(scale * (h @ weight^T + bias))``.

    Shapes: ``weight [V, H]``, ``bias [V]`` or None. ``scale`` is a constant, ``softcap`` the cap
    ``c`` of ``c * tanh(x / c)`` or None. The tensors are the model's own parameters (not copies).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None = None
    scale: float = 1.0
    softcap: float | None = None

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    def logits(self, hidden: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[n, H] -> [n, V]`` logits in ``dtype``, not differentiable (in place after the matmul).

        The matmul runs in the model's dtype, as the model's own head does; scale and cap run in
        ``dtype`` (float32 at least: no rounding to bfloat16 of the capped logits).
        """
        with torch.no_grad():
            z = torch.nn.functional.linear(hidden, self.weight, self.bias)
            z = z if z.dtype == dtype else z.to(dtype)
            if self.scale != 1.0:
                z.mul_(self.scale)
            if self.softcap is not None:
                z.div_(self.softcap).tanh_().mul_(self.softcap)
        return z

    def grad_linear(self, z: torch.Tensor, grad_z: torch.Tensor) -> torch.Tensor:
        """``d loss / d (h W^T + b)`` from ``d loss / d logits`` at logits ``z`` (both ``[n, V]``).

        ``d softcap(x) / dx = 1 - (softcap(x) / c)^2``; overwrites ``grad_z`` and ``z``.
        """
        if self.softcap is not None:
            grad_z.mul_(z.div_(self.softcap).square_().neg_().add_(1))
        if self.scale != 1.0:
            grad_z.mul_(self.scale)
        return grad_z


@dataclass(frozen=True)
class _Resolved:
    body: torch.nn.Module
    head: torch.nn.Module  # the output embedding module (its parameters are read at each call)
    post: str
    scale: float
    softcap: float | None


# model -> _Resolved, or the reason it cannot be read (str): probed once per model instance
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def read_head(model: torch.nn.Module) -> tuple[OutputHead | None, str]:
    """``(OutputHead, "")`` of ``model``, or ``(None, reason)`` when it cannot be read safely.

    The first call on a model instance runs the probe of this module's docstring (a forward of
    ``[1, 8]`` tokens through the model and through body + head, without gradient).
    """
    try:
        got = _CACHE.get(model)
    except TypeError:  # not weak-referenceable: resolve every time
        got = None
    if got is None:
        got = _resolve(model)
        if isinstance(got, _Resolved):
            got = _probe(model, got)
        try:
            _CACHE[model] = got
        except TypeError:
            pass
    if isinstance(got, str):
        return None, got
    return _head_of(got), ""


def final_hidden(model: torch.nn.Module, input_ids: torch.Tensor,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[B, L] -> [B, L, H]``: the hidden states the output head reads (after the final norm).

    Runs ``model.base_model`` with the positions ``forward_logits`` uses (from the attention
    mask); differentiable when grad mode is on. Only for models :func:`read_head` accepts.
    """
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    out = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                           position_ids=position_ids_from_mask(attention_mask),
                           use_cache=False)
    return out.last_hidden_state


def _head_of(r: _Resolved) -> OutputHead:
    bias = getattr(r.head, "bias", None)
    return OutputHead(weight=r.head.weight, bias=bias, scale=r.scale, softcap=r.softcap)


def _resolve(model: torch.nn.Module) -> _Resolved | str:
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    post = _POST.get(mtype) if isinstance(mtype, str) else None
    name = type(model).__name__
    if post is None:
        return (f"{name} (model_type {mtype!r}) is not an architecture whose logits varbench "
                f"knows how to build from the head; known: {sorted(_POST)}")
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, torch.nn.Linear):
        return f"{name}.get_output_embeddings() is {type(head).__name__}, not a torch.nn.Linear"
    body = getattr(model, "base_model", None)
    if not isinstance(body, torch.nn.Module) or body is model:
        return f"{name} has no base_model (the body that makes the final hidden states)"
    scale, softcap = 1.0, None
    if post == "softcap":
        softcap = getattr(cfg, "final_logit_softcapping", None)
        softcap = None if softcap is None else float(softcap)
    elif post == "mul_logit_scale":
        scale = float(getattr(model, "logit_scale", getattr(cfg, "logit_scale", 1.0)))
    elif post in ("div_logits_scaling", "pre_div_logits_scaling"):
        scale = 1.0 / float(cfg.logits_scaling)
        if post == "pre_div_logits_scaling" and head.bias is not None:
            return f"{name} scales h before a head with a bias: not a constant times the logits"
    elif post == "mul_logits_scaling":
        scale = float(cfg.logits_scaling)
    return _Resolved(body=body, head=head, post=post, scale=scale, softcap=softcap)


def _probe(model: torch.nn.Module, r: _Resolved) -> _Resolved | str:
    """``r`` if body + head give the model's own logits on 8 positions, else the reason."""
    head = _head_of(r)
    dev = head.weight.device
    V = head.vocab_size
    ids = (torch.arange(8, device=dev) * 7 + 1).remainder(V)[None]
    was_training = model.training
    try:
        model.eval()  # dropout would make the two forwards differ
        with torch.no_grad():
            want = forward_logits(model, ids).logits[0]
            out = r.body(input_ids=ids, attention_mask=torch.ones_like(ids),
                         position_ids=position_ids_from_mask(torch.ones_like(ids)),
                         use_cache=False)
            got = head.logits(out.last_hidden_state[0], want.dtype if want.dtype ==
                              torch.float64 else torch.float32)
    except Exception as err:  # any failure means: do not use this path for this model
        return f"running {type(model).__name__}.base_model failed ({type(err).__name__}: {err})"
    finally:
        model.train(was_training)
    want = want.to(got.dtype)
    tol = {torch.float64: 1e-10, torch.float32: 1e-4}.get(head.weight.dtype, 3e-2)
    err = float((got - want).abs().max()) if got.shape == want.shape else float("inf")
    if not err <= tol * (1.0 + float(want.abs().max())):
        return (f"{type(model).__name__}: logits built from base_model + head differ from the "
                f"model's own (max abs difference {err:.3g})")
    return r
