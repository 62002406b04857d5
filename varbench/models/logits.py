"""The statistics of pi: the one home of these formulas, computed a chunk of positions at a time.

Token log-probs, entropy, ``sum_v pi(v)^2``, the Logit-Gradient Proxy
``w = 1 - 2 pi(y) + sum_v pi(v)^2`` (docs/science.md section 2.3) and optionally the max-prob
and the top-k log-probs. The sampler, the forward statistics, the trainer, warm start and the
analyses all call these functions, so every recorded statistic of pi means the same thing
everywhere.

One kernel, two entries: from given logits (:func:`pi_stats`) or from a model's final hidden
states and output head (:func:`sequence_stats`, :func:`sequence_logprobs`; the head is read by
``varbench.models.head``). Either way the logits exist only ``chunk`` positions at a time: peak
extra memory is ``O(chunk x V)``, never ``O(B x L x V)``. :func:`sequence_logprobs` is
differentiable and recomputes each chunk's logits in backward instead of storing them (as fused
linear cross-entropy does). A model whose head cannot be read falls back to the plain path (the
model's full logits) with a warning naming the reason.

Precision: statistics are computed in float32 whatever the model dtype (float64 for float64
logits, or when ``dtype=torch.float64`` is asked for); the head's matmul runs in the model's
dtype, as the model's own head does.

Alignment for ``[B, L]`` batches: the statistic of token ``input_ids[:, t]`` comes from the logits
at position ``t - 1``; :func:`token_logprobs` puts it at column t (column 0 predicts nothing and
is 0), :func:`sequence_stats` / :func:`sequence_logprobs` return the columns ``t >= start``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from varbench._util.checks import UsageError, UsageTypeError, check_positive_int
from varbench.models import memplan
from varbench.models.forward import forward_logits
from varbench.models.head import OutputHead, final_hidden, read_head

# Positions per head matmul when no chunk is given: at least CHUNK_ROWS (each chunk reads the
# whole [V, H] head from memory: with fewer rows the matmul slows down, 1.09x at 256 and 1.2x at
# 128 rows for V = 151936, H = 256 on CPU), more for small vocabularies (up to CHUNK_ELEMENTS
# logits). Extra memory is then O(CHUNK_ROWS x V): 311 MB in float32 at V = 151936. The
# differentiable path uses GRAD_CHUNK_ROWS: its backward holds a few chunk-sized buffers on top
# of the body's activations (training-step peak at V = 32768, T = 1024: 372 MB with 512 rows,
# 308 MB with 256, against 1250 MB for the full logits; benchmarks/bench_logits.py).
CHUNK_ROWS = 512
GRAD_CHUNK_ROWS = 256
CHUNK_ELEMENTS = 1 << 22
# Logits per statistics block on the CPU: the ~8 passes of the statistics run over blocks this
# size (2 MiB in float32), which stay in the L2 cache instead of streaming from memory each pass.
# On an accelerator a block is the whole chunk: there every op is a kernel launch, and at
# V = 151936 a 2 MiB block is 3 rows (~11 launches per 3 positions); one block per chunk makes
# the launches per position ~11 / chunk.
_BLOCK_ELEMENTS = 1 << 19


def block_rows(V: int, chunk_rows: int, device: torch.device | str) -> int:
    """Rows per statistics block for ``chunk_rows``-row chunks of ``V`` logits on ``device``.

    CPU: ``_BLOCK_ELEMENTS // V`` rows (cache blocking, at least 1); any other device: the
    whole chunk.
    """
    if torch.device(device).type != "cpu":
        return max(chunk_rows, 1)
    return min(max(chunk_rows, 1), max(1, _BLOCK_ELEMENTS // max(V, 1)))


def stat_dtype(dtype: torch.dtype, want: torch.dtype | None = None) -> torch.dtype:
    """The dtype statistics of logits of ``dtype`` are computed in (float32 at least).

    ``want`` (float32 or float64) overrides it: ``dtype=torch.float64`` asks for float64
    statistics of a float32 or bfloat16 model.
    """
    if want is not None:
        if want not in (torch.float32, torch.float64):
            raise UsageTypeError(f"dtype={want} is not valid for statistics; expected "
                                 "torch.float32 or torch.float64")
        return want
    return torch.float64 if dtype == torch.float64 else torch.float32


def upcast(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` in :func:`stat_dtype` (a no-op for float32 and float64)."""
    want = stat_dtype(logits.dtype)
    return logits if logits.dtype == want else logits.to(want)


class PiStats(NamedTuple):
    """Statistics of pi at each position, each of the positions' shape (``[...]``).

    ``max_prob``, ``topk_logp`` / ``topk_ids`` (``[..., k]``, largest first) and ``hidden_sq``
    (``||h||^2`` of the head's input) are None unless asked for.
    """

    logp: torch.Tensor  # log pi(y) of the given token
    entropy: torch.Tensor  # -sum_v pi(v) log pi(v)
    sum_pi_sq: torch.Tensor  # sum_v pi(v)^2
    proxy: torch.Tensor  # 1 - 2 pi(y) + sum_v pi(v)^2
    max_prob: torch.Tensor | None = None
    topk_logp: torch.Tensor | None = None
    topk_ids: torch.Tensor | None = None
    hidden_sq: torch.Tensor | None = None


def _chunk_rows(V: int, chunk: int | None, like: torch.Tensor, H: int, *,
                grad: bool = False) -> int:
    """Positions per head matmul: ``chunk`` when given, else the memory plan's
    (:func:`varbench.models.memplan.logit_rows`) for ``like``'s device and dtype, whose
    unmeasured (CPU) default is the cache-tuned size."""
    if chunk is not None:
        return check_positive_int("chunk", chunk)
    default = GRAD_CHUNK_ROWS if grad else max(CHUNK_ROWS, CHUNK_ELEMENTS // max(V, 1))
    return memplan.logit_rows(V, H, like.element_size(), like.device, default, grad=grad)


def _block_stats(z: torch.Tensor, y: torch.Tensor, top_k: int):
    """Statistics of ``[r, V]`` logits ``z`` (overwritten) for tokens ``y`` ``[r]``.

    Returns ``(logp, entropy, sum_pi_sq, max_prob, logsumexp, topk values, topk ids)``. With
    ``p = softmax(z)`` (torch's fused kernel), ``m = max z`` and ``log s = -log max p``
    (``s = sum exp(z - m) >= 1``): ``log pi(y) = (z_y - m) - log s``,
    entropy ``= log s - sum p (z - m)`` (no cancellation of the max), ``sum pi^2 = sum p^2``
    with ``p <= 1``: stable for any logit scale.
    """
    p = torch.softmax(z, -1)
    m = z.amax(-1, keepdim=True)  # amax, not max: max with indices is ~50x slower on CPU
    pmax = p.amax(-1, keepdim=True)  # exp(0) / s = 1 / s
    log_s = pmax.log().neg_().squeeze(-1)
    lse = m.squeeze(-1) + log_s
    logp = z.gather(-1, y[:, None]).squeeze(-1) - lse
    topv = topi = None
    if top_k:
        topv, topi = z.topk(top_k, dim=-1)
        topv = topv - lse[:, None]
    # a -inf logit (masked entry) has p = 0; clamp so that p * (z - m) is 0, not 0 * -inf = NaN
    d = z.sub_(m).clamp_(min=torch.finfo(z.dtype).min)
    entropy = log_s - d.mul_(p).sum(-1)
    spsq = p.square_().sum(-1)
    return logp, entropy, spsq, pmax.squeeze(-1), lse, topv, topi


def _chunked_stats(n: int, V: int, chunk_logits: Callable[[int, int], torch.Tensor],
                   tokens: torch.Tensor, sd: torch.dtype, chunk: int, top_k: int = 0,
                   max_prob: bool = False) -> tuple[PiStats, torch.Tensor]:
    """``(PiStats, logsumexp)`` of ``n`` positions whose logits ``chunk_logits(i, j)`` gives
    (``[j - i, V]`` in ``sd``, the caller's to overwrite) for tokens ``tokens`` ``[n]``,
    ``chunk`` (:func:`_chunk_rows`) positions at a time."""
    dev = tokens.device
    c = min(chunk, max(n, 1))
    r = block_rows(V, c, dev)
    out = [torch.empty(n, dtype=sd, device=dev) for _ in range(5)]
    k = min(top_k, V)
    tv = torch.empty(n, k, dtype=sd, device=dev) if k else None
    ti = torch.empty(n, k, dtype=torch.long, device=dev) if k else None
    for i in range(0, n, c):
        j = min(i + c, n)
        z = chunk_logits(i, j)
        for a in range(0, j - i, r):
            b = min(a + r, j - i)
            got = _block_stats(z[a:b], tokens[i + a:i + b], k)
            for o, x in zip(out, got[:5], strict=True):
                o[i + a:i + b] = x
            if k:
                tv[i + a:i + b], ti[i + a:i + b] = got[5], got[6]
        del z  # before the next chunk is made: one chunk of logits alive at a time
    logp, ent, spsq, mp, lse = out
    return PiStats(logp, ent, spsq, proxy_from_logprobs(logp, spsq),
                   mp if max_prob else None, tv, ti), lse


def _reshape(s: PiStats, shape: torch.Size) -> PiStats:
    def rs(x, extra=()):
        return None if x is None else x.reshape(*shape, *extra)

    k = () if s.topk_logp is None else (s.topk_logp.shape[-1],)
    return PiStats(rs(s.logp), rs(s.entropy), rs(s.sum_pi_sq), rs(s.proxy), rs(s.max_prob),
                   rs(s.topk_logp, k), rs(s.topk_ids, k), rs(s.hidden_sq))


def pi_stats(logits: torch.Tensor, tokens: torch.Tensor, *, dtype: torch.dtype | None = None,
             chunk: int | None = None, top_k: int = 0, max_prob: bool = False) -> PiStats:
    """``[..., V], [...] -> PiStats`` of ``softmax(logits)``, ``chunk`` positions at a time.

    Not differentiable (see :func:`logit_proxy`, :func:`token_logprobs`). Stable for any logit
    scale; a ``-inf`` logit (a masked vocabulary entry) contributes exactly 0 to the entropy and
    to ``sum_pi_sq``, never NaN. Extra memory: ``O(chunk x V)`` in the statistics' dtype.
    """
    if tokens.shape != logits.shape[:-1]:
        raise UsageError(
            f"tokens has shape {list(tokens.shape)}, expected {list(logits.shape[:-1])} "
            "(logits without the vocabulary axis)"
        )
    sd = stat_dtype(logits.dtype, dtype)
    V = logits.shape[-1]
    z = logits.detach().reshape(-1, V)
    y = tokens.reshape(-1).long()
    chunk = _chunk_rows(V, chunk, z, 0)  # no head matmul here: no weight copy
    c = min(chunk, max(z.shape[0], 1))
    buf = torch.empty(c, V, dtype=sd, device=z.device)

    def chunk_logits(i: int, j: int) -> torch.Tensor:
        return buf[: j - i].copy_(z[i:j])

    with torch.no_grad():
        s, _ = _chunked_stats(z.shape[0], V, chunk_logits, y, sd, chunk, top_k, max_prob)
    return _reshape(s, tokens.shape)


def head_stats(hidden: torch.Tensor, head: OutputHead, tokens: torch.Tensor, *,
               dtype: torch.dtype | None = None, chunk: int | None = None, top_k: int = 0,
               max_prob: bool = False) -> PiStats:
    """``[..., H], OutputHead, [...] -> PiStats`` of ``softmax(head(hidden))`` without ever
    holding more than ``chunk`` positions' logits (``O(chunk x V)`` extra memory).

    Not differentiable (:func:`head_logprobs` is). ``hidden_sq`` is ``||hidden||^2``.
    """
    if tokens.shape != hidden.shape[:-1]:
        raise UsageError(f"tokens has shape {list(tokens.shape)}, expected "
                         f"{list(hidden.shape[:-1])} (hidden states without the hidden axis)")
    sd = stat_dtype(hidden.dtype, dtype)
    h = hidden.detach().reshape(-1, hidden.shape[-1])
    y = tokens.reshape(-1).long()
    chunk = _chunk_rows(head.vocab_size, chunk, h, h.shape[-1])
    with torch.no_grad():
        s, _ = _chunked_stats(h.shape[0], head.vocab_size,
                              lambda i, j: head.logits(h[i:j], sd), y, sd, chunk, top_k, max_prob)
        s = s._replace(hidden_sq=h.to(sd).square().sum(-1))
    return _reshape(s, tokens.shape)


class _HeadLogprobs(torch.autograd.Function):
    """log pi(y) (and the entropy) of ``softmax(head(h))``; backward recomputes the logits."""

    @staticmethod
    def forward(ctx, h, weight, bias, tokens, head, sd, chunk, with_entropy):
        ctx.set_materialize_grads(False)
        chunk = _chunk_rows(head.vocab_size, chunk, h, h.shape[-1], grad=True)
        hd = OutputHead(weight, bias, head.scale, head.softcap)
        s, lse = _chunked_stats(h.shape[0], hd.vocab_size, lambda i, j: hd.logits(h[i:j], sd),
                                tokens, sd, chunk)
        ctx.save_for_backward(h, weight, bias, tokens, lse, s.entropy)
        ctx.head = head
        ctx.chunk = min(chunk, max(h.shape[0], 1))
        if with_entropy:
            return s.logp, s.entropy
        ctx.mark_non_differentiable(s.entropy)
        return s.logp, s.entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_logp, g_ent):
        h, weight, bias, tokens, lse, ent = ctx.saved_tensors
        hd = OutputHead(weight, bias, ctx.head.scale, ctx.head.softcap)
        sd, c, n = lse.dtype, ctx.chunk, h.shape[0]
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        acc = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        gh = torch.empty_like(h) if need_h else None
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        gb = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        if g_logp is None and g_ent is None:
            return None, None, None, None, None, None, None, None
        with torch.no_grad():
            for i in range(0, n, c):
                j = min(i + c, n)
                z = hd.logits(h[i:j], sd)
                # log pi, in place unless the cap's derivative still needs the logits z
                lp = z - lse[i:j, None] if hd.softcap is not None else z.sub_(lse[i:j, None])
                # d log pi(y) / dz = e_y - pi;  d H / dz = -pi (log pi + H)
                if g_ent is not None:
                    p = lp.exp()
                    g = lp.add_(ent[i:j, None]).mul_(g_ent[i:j, None].to(sd))
                    if g_logp is not None:
                        g.add_(g_logp[i:j, None].to(sd))
                    gz = p.mul_(g).neg_()
                    del g, lp, p
                else:
                    gz = lp.exp_().mul_(g_logp[i:j, None].to(sd)).neg_()
                    del lp
                if g_logp is not None:
                    gz.scatter_add_(1, tokens[i:j, None], g_logp[i:j, None].to(sd))
                gu = hd.grad_linear(z, gz)
                del z
                if need_h:
                    gh[i:j] = gu.to(weight.dtype) @ weight
                if need_w:
                    gw.addmm_(gu.to(acc).t(), h[i:j].to(acc))
                if need_b:
                    gb.add_(gu.sum(0).to(acc))
                del gu, gz  # before the next chunk is made: one chunk's buffers at a time
        return (gh, None if gw is None else gw.to(weight.dtype),
                None if gb is None else gb.to(bias.dtype), None, None, None, None, None)


def head_logprobs(hidden: torch.Tensor, head: OutputHead, tokens: torch.Tensor, *,
                  entropy: bool = False, dtype: torch.dtype | None = None,
                  chunk: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``[..., H], OutputHead, [...] -> [...]`` log pi(y), differentiable in ``hidden``, the
    head's weight and bias; with ``entropy=True`` also the (differentiable) entropy.

    Backward recomputes each chunk's logits (``O(chunk x V)`` memory, one more head matmul per
    chunk; default ``GRAD_CHUNK_ROWS`` positions); saved for backward: ``hidden`` and two numbers
    per position. The weight gradient is accumulated over chunks in float32 (float64 for a
    float64 head).
    """
    if tokens.shape != hidden.shape[:-1]:
        raise UsageError(f"tokens has shape {list(tokens.shape)}, expected "
                         f"{list(hidden.shape[:-1])} (hidden states without the hidden axis)")
    sd = stat_dtype(hidden.dtype, dtype)
    h = hidden.reshape(-1, hidden.shape[-1])
    y = tokens.reshape(-1).long()
    lp, ent = _HeadLogprobs.apply(h, head.weight, head.bias, y, head, sd, chunk, entropy)
    lp = lp.reshape(tokens.shape)
    return (lp, ent.reshape(tokens.shape)) if entropy else lp


_WARNED: set[str] = set()


def _readable_head(model: torch.nn.Module) -> OutputHead | None:
    """The model's head, or None after warning (once per reason) that the plain path is used."""
    head, reason = read_head(model)
    if head is None and reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"varbench statistics fall back to the full [B, L, V] logits: {reason}",
                      stacklevel=3)
    return head


def _check_start(input_ids: torch.Tensor, start: int) -> int:
    L = input_ids.shape[-1]
    if not (isinstance(start, int) and 1 <= start <= L):
        raise UsageError(f"start={start!r} is not valid for input_ids of length L={L}; "
                         "expected an int in [1, L] (column 0 predicts nothing)")
    return start


def _selection(mask: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor | None:
    """``[B, L - start]`` bool of the positions to compute (None: all)."""
    if mask is None:
        return None
    if tuple(mask.shape) != tuple(shape):
        raise UsageError(f"mask has shape {list(mask.shape)}, expected {list(shape)} "
                         "([B, L - start], the tokens input_ids[:, start:])")
    return mask != 0


def _scatter(x: torch.Tensor | None, sel: torch.Tensor | None) -> torch.Tensor | None:
    """Values ``x`` ``[n, ...]`` of the selected positions -> ``[B, T, ...]``, 0 elsewhere
    (differentiable in ``x``)."""
    if x is None or sel is None:
        return x
    out = x.new_zeros((*sel.shape, *x.shape[1:]))
    return out.index_put((sel,), x)


class _Run(NamedTuple):
    tokens: torch.Tensor  # the tokens of the selected positions
    sel: torch.Tensor | None  # [B, L - start] bool, None: all positions
    head: OutputHead | None  # None: the head cannot be read (fallback)
    x: torch.Tensor  # the selected positions' hidden states [.., H], or (fallback) logits [.., V]
    hidden: torch.Tensor | None  # fallback with want_hidden: the head's input [.., H]


def _run(model, input_ids, attention_mask, start, mask, want_hidden=False) -> _Run:
    """One forward of ``model``: the inputs of the statistics of tokens ``input_ids[:, start:]``."""
    start = _check_start(input_ids, start)
    y = input_ids[:, start:]
    sel = _selection(mask, tuple(y.shape))

    def pick(t: torch.Tensor) -> torch.Tensor:  # position t - 1 predicts token t
        t = t[:, start - 1:-1]
        return t if sel is None else t[sel]

    ys = y if sel is None else y[sel]
    head = _readable_head(model)
    if head is not None:
        return _Run(ys, sel, head, pick(final_hidden(model, input_ids, attention_mask)), None)
    captured: list[torch.Tensor] = []
    handle = None
    if want_hidden:
        out_emb = model.get_output_embeddings()
        if out_emb is None:
            raise UsageError("hidden_sq=True needs model.get_output_embeddings(); got None")
        handle = out_emb.register_forward_hook(lambda m, args, out: captured.append(args[0]))
    try:
        logits = forward_logits(model, input_ids, attention_mask).logits
    finally:
        if handle is not None:
            handle.remove()
    return _Run(ys, sel, None, pick(logits), pick(captured[-1]) if want_hidden else None)


@torch.no_grad()
def sequence_stats(model: torch.nn.Module, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor | None = None, *, start: int = 1,
                   mask: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                   chunk: int | None = None, top_k: int = 0, max_prob: bool = False,
                   hidden_sq: bool = False) -> PiStats:
    """One forward -> :class:`PiStats` of tokens ``input_ids[:, start:]``, each ``[B, L - start]``.

    The statistic of token t comes from the logits at position t - 1, made from the final hidden
    states by the output head a chunk at a time (or, when the head cannot be read, from the
    model's full logits, with a warning). ``mask`` (``[B, L - start]``) limits the work to the
    positions where it is nonzero; every statistic is 0 elsewhere. ``hidden_sq`` adds
    ``||h_{t-1}||^2``.
    """
    r = _run(model, input_ids, attention_mask, start, mask, want_hidden=hidden_sq)
    opts = dict(dtype=dtype, chunk=chunk, top_k=top_k, max_prob=max_prob)
    if r.head is not None:
        s = head_stats(r.x, r.head, r.tokens, **opts)
        s = s if hidden_sq else s._replace(hidden_sq=None)
    else:
        s = pi_stats(r.x, r.tokens, **opts)
        if hidden_sq:
            s = s._replace(hidden_sq=r.hidden.to(s.logp.dtype).square().sum(-1))
    return PiStats(*(_scatter(x, r.sel) for x in s))


def sequence_logprobs(model: torch.nn.Module, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor | None = None, *, start: int = 1,
                      mask: torch.Tensor | None = None, entropy: bool = False,
                      dtype: torch.dtype | None = None, chunk: int | None = None,
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``[B, L] -> [B, L - start]`` log pi of tokens ``input_ids[:, start:]``, differentiable
    when grad mode is on (with ``entropy=True`` also their entropies).

    Computed in float32 at least (``dtype`` may ask for float64) by :func:`head_logprobs` from the
    final hidden states, or from the model's full logits when the head cannot be read.
    ``mask`` (``[B, L - start]``) limits the work to the positions where it is nonzero; the
    values (and their gradients) are 0 elsewhere.
    """
    r = _run(model, input_ids, attention_mask, start, mask)
    sel = r.sel
    if r.head is not None:
        got = head_logprobs(r.x, r.head, r.tokens, entropy=entropy, dtype=dtype, chunk=chunk)
    else:
        z = r.x.to(stat_dtype(r.x.dtype, dtype))
        got = _plain_logprobs(z, r.tokens)
        if entropy:
            lsm = torch.log_softmax(z, -1)
            got = (got, -(lsm.exp() * lsm.clamp(min=torch.finfo(z.dtype).min)).sum(-1))
    if entropy:
        return _scatter(got[0], sel), _scatter(got[1], sel)
    return _scatter(got, sel)


def _plain_logprobs(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # z_y - logsumexp(z) rather than log_softmax: its backward (softmax * cotangent) has vmap
    # batching rules, log_softmax's backward falls back to a slow per-cotangent loop
    return z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)


def sum_pi_sq(logits: torch.Tensor) -> torch.Tensor:
    """``sum_v softmax(logits)_v ** 2`` over the last axis, stable for any logit scale.

    Shapes: ``[..., V] -> [...]``, in float32 at least; logits of magnitude 1e4 give a value
    in ``(0, 1]``, never inf or NaN. Not differentiable.
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() < 1 or logits.shape[-1] < 1:
        got = list(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise UsageError(f"logits has shape {got}, expected [..., V] with V >= 1")
    _check_logits(logits)
    zeros = torch.zeros(logits.shape[:-1], dtype=torch.long, device=logits.device)
    return pi_stats(logits, zeros).sum_pi_sq


def proxy_from_logprobs(logprobs: torch.Tensor, sum_pi_sq: torch.Tensor) -> torch.Tensor:
    """Logit-Gradient Proxy from stored statistics: ``w = 1 - 2 exp(logprobs) + sum_pi_sq``.

    Shapes: any, equal. Range ``[0, 2)``: the exact squared norm of ``d log pi(y) / d z``.
    It ignores everything below the logits (for an untied head, the head's own gradient of the
    token has squared norm ``w * ||h||^2``).
    """
    for name, t in (("logprobs", logprobs), ("sum_pi_sq", sum_pi_sq)):
        if not isinstance(t, torch.Tensor):
            raise UsageTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if logprobs.shape != sum_pi_sq.shape:  # host metadata only: no sync on the hot path
        raise UsageError(f"sum_pi_sq has shape {list(sum_pi_sq.shape)}, expected logprobs' "
                         f"{list(logprobs.shape)}")
    w = torch.exp(logprobs)
    if torch.is_grad_enabled() and (logprobs.requires_grad or sum_pi_sq.requires_grad):
        return 1 - 2 * w + sum_pi_sq  # differentiable (e.g. logit_proxy under autograd)
    return torch.add(sum_pi_sq, w, alpha=-2, out=w).add_(1)  # in place: one allocation


def _check_logits(logits: torch.Tensor) -> None:
    """UsageError for NaN or +inf logits (public entry points only: one host read); -inf is a
    token ruled out (top-k, a banned id), which the statistics handle."""
    if isinstance(logits, torch.Tensor) and logits.is_floating_point() and logits.numel():
        z = logits.detach()
        if bool(torch.isnan(z).any() | torch.isposinf(z).any()):
            raise UsageError("logits contain NaN or +inf; pass finite logits (-inf rules a "
                             "token out)")


def logit_proxy(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Logit-Gradient Proxy ``w = ||e_y - softmax(z)||^2 = 1 - 2 p(y) + sum_pi_sq``, in [0, 2).

    Shapes: ``logits [..., V]``, ``tokens [...]`` (integer ids) ``-> [...]``. Differentiable
    when ``logits`` requires grad (then through the full ``[..., V]`` softmax). UsageError for
    NaN or +inf logits and for ids outside ``[0, V)``.
    """
    _check_logits(logits)
    if tokens.numel() and logits.dim() and not tokens.is_floating_point():
        lo, hi = (int(v) for v in torch.aminmax(tokens))  # one read
        if lo < 0 or hi >= logits.shape[-1]:
            raise UsageError(f"tokens holds ids in [{lo}, {hi}], outside the vocabulary "
                             f"[0, {logits.shape[-1]}) of logits")
    if not (torch.is_grad_enabled() and logits.requires_grad):
        return pi_stats(logits, tokens).proxy
    if tokens.shape != logits.shape[:-1]:
        raise UsageError(f"tokens has shape {list(tokens.shape)}, expected "
                         f"{list(logits.shape[:-1])} (logits without the vocabulary axis)")
    p = torch.softmax(upcast(logits), -1)
    return proxy_from_logprobs(p.gather(-1, tokens.long()[..., None]).squeeze(-1).log(),
                               p.square().sum(-1))


def chosen_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``[..., V], [...] -> [...]`` log softmax(logits) at ``tokens`` (no shift: position t's
    logits score position t's token). Differentiable; in the logits' dtype."""
    return _plain_logprobs(logits, tokens)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """``[B, L, V], [B, L] -> [B, L]`` log-prob of ``input_ids[:, t]`` from ``logits[:, t-1]``.

    The plain full-logits path: column 0 is 0 (nothing predicts the first token).
    Differentiable, with vmap rules: the exact gradient paths differentiate this function.
    Computed in the logits' dtype (the gradient paths choose their precision by the model's);
    :func:`sequence_logprobs` is the chunked, float32-at-least path of the trainer.
    """
    lp = chosen_logprobs(logits[:, :-1], input_ids[:, 1:])
    return torch.nn.functional.pad(lp, (1, 0))
