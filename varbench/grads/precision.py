"""A float64-throughout copy of a transformers causal LM, for exact validation.

Stock transformers modules do not keep float64: ``LlamaRMSNorm`` casts its input to float32
before normalising, and eager attention runs its softmax in float32. Gradients through those
casts are float32-rounded, which caps agreement between two exact methods near 1e-7 relative.
:func:`exact_float64` returns a copy in float64 whose RMS norms (``w * x_hat`` or Gemma's
``(1 + w) * x_hat``, told apart by :func:`varbench.models.arch.rms_norm_form`) and attention
(with Gemma2's logit soft-capping; registered with transformers' ``AttentionInterface`` under
:data:`ATTN_NAME`) keep the input dtype, MoE experts run transformers' eager loop (its grouped-mm
kernel refuses float64), and it is VERIFIED to compute the original's function (logits on a
probe batch, :func:`verify_copy`) or refused with the name of the first module that differs.
Exact gradient paths on the copy agree to ~1e-12. (Rotary cos/sin are still computed in float32
by transformers; they are constants, not functions of the parameters, so they do not limit
agreement.)
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from varbench._util.checks import UsageError, UsageTypeError
from varbench.models.arch import check_attention_kwargs, float64_experts, rms_norm_form
from varbench.models.forward import forward_logits

ATTN_NAME = "varbench_keep_dtype"


def keep_dtype_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager attention computed in float32 or better (``query.dtype`` promoted to at least
    float32: float64 stays float64, bf16/fp16 run in float32), output in ``query.dtype``; mask
    is sdpa's boolean (True = keep).

    Shapes: query ``[B, H, Lq, D]``, key/value ``[B, Hkv, Lk, D]`` -> ``([B, Lq, H, D], weights)``.
    A fully masked row (a left-pad query) gets the dtype's minimum instead of -inf, so it stays
    finite (uniform weights) and cannot put NaN into any gradient. ``softcap`` (Gemma2) applies
    ``softcap * tanh(scores / softcap)`` before the mask, as transformers does; attention sinks
    are refused. ``scaling`` None (GPT-2 in transformers before it passed one): the module's
    own rule (:func:`module_attention_scale`). Caveat: the ``[B, H, Lq, Lk]`` scores are
    materialised (in float32 for a half-precision model), unlike a fused kernel.
    """
    check_attention_kwargs(module, kwargs)
    if scaling is None:
        scaling = module_attention_scale(module, query.shape[-1])
    softcap = kwargs.get("softcap")
    out_dtype = query.dtype
    work = torch.promote_types(query.dtype, torch.float32)  # a bf16 softmax loses ~3 digits
    query, key, value = query.to(work), key.to(work), value.to(work)
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        key = key.repeat_interleave(n_rep, dim=1)
        value = value.repeat_interleave(n_rep, dim=1)
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is None:  # causal, queries aligned to the last keys
        lq, lk = scores.shape[-2:]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=scores.device).tril(lk - lq)
        scores = scores.masked_fill(~keep, torch.finfo(scores.dtype).min)
    else:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask.to(scores.dtype)
    weights = torch.softmax(scores, dim=-1)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous().to(out_dtype)
    return out, weights.to(out_dtype)


# the attention implementation a model ran before keep_dtype_attention replaced it, on its
# config: a module that passes no scaling is scaled as that implementation would have scaled it
SOURCE_ATTN = "_varbench_source_attn"
_DEFAULT_SCALE_IMPLS = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def module_attention_scale(module: torch.nn.Module, head_dim: int) -> float:
    """The score scale of an attention module that passes no ``scaling`` to its attention
    function (GPT-2 in transformers 5.0), as the implementation it replaced would have used:
    the module's ``scaling`` attribute; else, after sdpa / flash / flex attention (which then
    fall back to their default), ``head_dim ** -0.5``; after eager attention, GPT-2's rule
    (``head_dim ** -0.5`` when ``scale_attn_weights``, divided by ``layer_idx + 1`` when
    ``scale_attn_by_inverse_layer_idx``). Anything else is an error naming the module."""
    own = getattr(module, "scaling", None)
    if isinstance(own, (int, float)):
        return float(own)
    source = getattr(getattr(module, "config", None), SOURCE_ATTN, None)
    if source in _DEFAULT_SCALE_IMPLS:
        return head_dim ** -0.5
    if source == "eager" and hasattr(module, "scale_attn_weights"):
        scale = head_dim ** -0.5 if module.scale_attn_weights else 1.0
        if getattr(module, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(module.layer_idx + 1)
        return scale
    raise UsageError(
        f"{type(module).__name__} calls its attention function without a scaling, and varbench "
        f"knows no scale rule for it after attention implementation {source!r}: its float64 "
        f"attention cannot know the score scale")


def _always_mask(*args, **kwargs):
    # sdpa_mask returns None for an unpadded batch (sdpa then relies on is_causal); this
    # attention function needs the explicit causal mask every time
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(ATTN_NAME, keep_dtype_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, _always_mask)


class KeepDtypeRMSNorm(torch.nn.Module):
    """RMSNorm ``w * x / sqrt(mean(x^2) + eps)`` (``offset=True``: ``(1 + w) * ...``, Gemma)
    computed in the input's dtype (no float32 cast).

    Shares the replaced module's weight Parameter (same tensor, same name in the parent).
    """

    def __init__(self, weight: torch.nn.Parameter, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = weight
        self.variance_epsilon = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = 1 + self.weight if self.offset else self.weight
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def exact_float64(model: torch.nn.Module, *, verify: bool = True) -> torch.nn.Module:
    """Deep copy of ``model`` in float64 with dtype-keeping RMS norms and attention, verified.

    Works for transformers causal LMs whose attention dispatches through
    ``config._attn_implementation`` (Llama, Qwen2/3, Mistral, Gemma 1-3, Phi3, GPT-2, GPT-NeoX,
    OPT, Olmo2, Mixtral, ...). ``verify`` (default): :func:`verify_copy` checks the copy's
    logits against the original's on a probe batch and raises a UsageError naming the first
    module whose output differs. The original is untouched.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise UsageTypeError(
            f"exact_float64 needs a transformers model with .config, got {type(model).__name__}"
        )
    new = copy.deepcopy(model).to(torch.float64)
    for parent in list(new.modules()):
        for child_name, child in list(parent.named_children()):
            form = rms_norm_form(child)
            if form is not None:
                setattr(parent, child_name,
                        KeepDtypeRMSNorm(child.weight, form[1], offset=form[0] == "1+w"))
            elif type(child).__name__.endswith("RMSNorm"):
                raise UsageError(
                    f"exact_float64: {type(child).__name__} at {child_name!r} is neither "
                    "w * x_hat nor (1 + w) * x_hat; varbench cannot make it float64-exact"
                )
    float64_experts(new)
    if getattr(new.config, "_attn_implementation", None) != ATTN_NAME:
        setattr(new.config, SOURCE_ATTN, getattr(new.config, "_attn_implementation", None))
    if hasattr(new, "set_attn_implementation"):
        new.set_attn_implementation(ATTN_NAME)
    else:
        new.config._attn_implementation = ATTN_NAME
    if verify:
        verify_copy(model, new)
    return new


def _probe_batch(vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, vocab, (2, 8), generator=g)
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, :3] = 0  # a left-padded row
    return ids.to(device), am.to(device)


def _outputs(model, ids, am) -> dict[str, torch.Tensor]:
    """Every named module's (first) tensor output, in call order."""
    names = {id(m): n for n, m in model.named_modules()}
    seen: dict[str, torch.Tensor] = {}

    def hook(mod, args, out):
        t = out[0] if isinstance(out, (tuple, list)) and out else out
        n = names.get(id(mod))
        if isinstance(t, torch.Tensor) and t.dtype.is_floating_point and n and n not in seen:
            seen[n] = t.detach()

    hs = [m.register_forward_hook(hook) for m in model.modules()]
    try:
        with torch.no_grad():
            forward_logits(model, ids, am)
    finally:
        for h in hs:
            h.remove()
    return seen


def _differs(a: torch.Tensor, b: torch.Tensor, keep: torch.Tensor) -> bool:
    """Whether two module outputs differ beyond float32 tolerance at attended positions (a
    padded query's output is arbitrary: attention over no key)."""
    if a.shape != b.shape:
        return False
    a = a.to(b.dtype)
    if a.shape[:2] == keep.shape:
        a, b = a[keep], b[keep]
    if torch.isnan(a).any() or a.numel() == 0:
        return False
    return float((a - b).abs().max()) > 1e-4 * (1 + float(a.abs().max()))


@torch.no_grad()
def verify_copy(original: torch.nn.Module, copy64: torch.nn.Module) -> float:
    """Check that ``copy64`` computes ``original``'s function: logits on a seeded probe batch
    (one row left-padded; padded positions ignored) agree within float32 tolerance
    (``|dz| <= 1e-4 (1 + max|z|)``; a bf16/fp16 original is compared through its float32 copy,
    the same weights). Returns the max deviation; raises a UsageError naming the first module
    (in call order) whose output differs, and says so when the original returns NaN."""
    ref = original if next(original.parameters()).dtype in (torch.float32, torch.float64) else (
        copy.deepcopy(original).float())
    p = next(copy64.parameters())
    vocab = copy64.get_output_embeddings().weight.shape[0]
    ids, am = _probe_batch(vocab, p.device)
    was = ref.training, copy64.training
    ref.eval()
    copy64.eval()
    try:
        z0 = forward_logits(ref, ids.to(next(ref.parameters()).device),
                            am.to(next(ref.parameters()).device)).logits.to(p.device, p.dtype)
        z1 = forward_logits(copy64, ids, am).logits
        keep = am.bool()
        if torch.isnan(z0[keep]).any():
            raise UsageError(
                f"{type(original).__name__} returns NaN logits on a probe batch with a left-padded"
                " row; its float64 copy cannot be verified against it"
            )
        dev = float((z1[keep] - z0[keep]).abs().max())
        tol = 1e-4 * (1 + float(z0[keep].abs().max()))
        if not dev <= tol:
            o0, o1 = _outputs(ref, ids, am), _outputs(copy64, ids, am)
            first = next((n for n in o1 if n in o0 and _differs(o0[n], o1[n], keep)), None)
            mod = type(copy64.get_submodule(first)).__name__ if first else "unknown module"
            raise UsageError(
                f"exact_float64: the float64 copy of {type(original).__name__} does not compute "
                f"the original's function (logits differ by {dev:.3g} > {tol:.3g}); first "
                f"differing module: {first!r} ({mod})"
            )
    finally:
        ref.train(was[0])
        copy64.train(was[1])
    return dev


@contextlib.contextmanager
def functional_attention(model: torch.nn.Module) -> Iterator[None]:
    """Temporarily route a transformers model's attention through :func:`keep_dtype_attention`
    (plain matmul/softmax in float32 or better: supports forward-mode AD and vmap, unlike the
    fused sdpa kernel on CPU). Same math as the model's attention up to rounding; restored on
    exit. No-op for
    models without ``config._attn_implementation``."""
    config = getattr(model, "config", None)
    old = getattr(config, "_attn_implementation", None)
    if old is None or old == ATTN_NAME:
        yield
        return
    setattr(config, SOURCE_ATTN, old)
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(old)
        delattr(config, SOURCE_ATTN)


# Attention implementations whose backward has no vmap (batched-cotangent) rule: transformers'
# names for the flash-attention packages and flex attention (a compiled kernel).
_UNBATCHED_IMPLS = ("flash_attention_2", "flash_attention_3", "flex_attention")


def fused_attention_kernel(model: torch.nn.Module,
                           device: torch.device | str | None = None) -> str | None:
    """The fused attention kernel ``model`` would run whose backward has no batched (vmap)
    rule, in words, or None (eager, math SDPA, CPU SDPA, this module's attention).

    On CUDA, ``sdpa`` dispatches to the flash / memory-efficient / cuDNN kernels when they are
    enabled (``torch.backends.cuda.*_sdp_enabled()``); their backward ops have no batching
    rule, so a batched-cotangent backward (``is_grads_batched=True``) falls back to one
    backward per cotangent (correct, slow). ``device``: the model's parameters' by default.
    """
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is None:
        return None
    if impl in _UNBATCHED_IMPLS or "flash" in str(impl):
        return str(impl)
    if impl != "sdpa":
        return None
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    if dev.type != "cuda":
        return None
    cuda = torch.backends.cuda
    fused = [name for name, on in (("flash", cuda.flash_sdp_enabled()),
                                   ("memory-efficient", cuda.mem_efficient_sdp_enabled()),
                                   ("cudnn", cuda.cudnn_sdp_enabled())) if on]
    return f"sdpa ({' / '.join(fused)} CUDA kernels)" if fused else None


@contextlib.contextmanager
def batched_backward_attention(model: torch.nn.Module,
                               device: torch.device | str | None = None) -> Iterator[str | None]:
    """Run ``model``'s attention through a kernel whose backward has a batched (vmap) rule while
    inside; yields the note saying what was switched (None: nothing was needed).

    ``sdpa`` on CUDA with fused kernels enabled: restricted to the math backend
    (``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``, same function, composite ops). A
    flash-attention or flex implementation: the model runs ``sdpa`` on the math backend, and
    its own implementation is restored on exit. Numbers agree with the fused kernels up to
    rounding (float64: identical to eager). Caveat: the math backend materialises the
    ``[B, H, L, L]`` scores.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kernel = fused_attention_kernel(model, device)
    if kernel is None:
        yield None
        return
    impl = model.config._attn_implementation
    note = (f"attention: {kernel} has no batched (vmap) backward; the batched-cotangent "
            "gradients ran it as math SDPA (same function, one batched backward)")
    with sdpa_kernel(SDPBackend.MATH):
        if impl == "sdpa":
            yield note
            return
        model.set_attn_implementation("sdpa")
        try:
            yield note
        finally:
            model.set_attn_implementation(impl)
