"""Exact per-token, prefix and diagonal-prefix gradient norms of a causal LM (docs/science.md §6).

For every response token t of sequence b, ``g_t = grad_theta log pi(y_t | y_<t)``. Method:
reverse mode, one cotangent per token, batched ``chunk_size`` at a time through
``torch.autograd.grad(..., is_grads_batched=True)`` (a vmap over the backward). Causality is
used twice: a chunk whose last token sits at column t1 runs its forward on ``input_ids[:, :t1+1]``
only (later positions cannot influence it), and tokens with ``response_mask == 0`` (prompt,
environment, padding) cost nothing. Prefix norms ``||sum_{j<=t} g_j||^2`` stream with one
running vector per parameter (O(P) memory); only a ``chunk_size x P`` block of per-token
gradients ever exists, never ``T x P``. The chunks are planned from one host read of the
mask (no host sync per chunk); :func:`iter_token_grads` can pack several short sequences into
one forward (the default on CUDA, where a forward's launch cost dominates a short sequence).

Models: any causal LM that ``varbench.models.forward.forward_logits`` can run and whose ops
have vmap batching rules for their backward (transformers' eager and sdpa attention do).
Flash-attention kernels and models with in-place buffer updates in forward are not functional
in this sense; use ``attn_implementation='eager'`` or ``'sdpa'`` for them.
"""

from __future__ import annotations

import bisect
import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from varbench._util.checks import check_choice, check_positive_int
from varbench._util.progress import show_progress
from varbench.grads._inputs import eval_mode, prepare
from varbench.grads.chunking import (
    DEFAULT_CHUNK,
    MEMORY_FRACTION,
    free_device_bytes,
    token_plan,
)
from varbench.grads.ghost import GhostModule, ModulePlan, acc_dtype, cumsum_rows_, plan_modules
from varbench.grads.params import GroupSpec, ParamFilter, group_index, select_params
from varbench.grads.precision import batched_backward_attention
from varbench.models.arch import check_finite_logits
from varbench.models.forward import forward_logits
from varbench.models.logits import token_logprobs, upcast

__all__ = ["DEFAULT_CHUNK", "TokenGradNorms", "iter_token_grads", "last_response_value",
           "packed_chunk", "token_chunks", "token_grad_norms"]


@dataclass
class TokenGradNorms:
    """Exact squared gradient norms, each ``[B, L]`` (0 where ``response_mask`` is 0).

    ``token_sq = ||g_t||^2``; ``prefix_sq = ||sum_{j<=t, m_j=1} g_j||^2`` (cross terms
    included); ``diag_prefix_sq = sum_{j<=t, m_j=1} ||g_j||^2``. With ``groups``, the
    ``group_*`` fields are ``[B, L, n_groups]`` over ``group_names`` and sum to the totals
    over the last axis (the prefix breakdown is per group's own prefix vector). ``methods``
    maps every parameter name to the route that computed it (ghost kind, or materialize and
    why). Values are in float32 at least (float64 for a float64 model or on request).
    """

    token_sq: torch.Tensor
    prefix_sq: torch.Tensor
    diag_prefix_sq: torch.Tensor
    sequence_sq: torch.Tensor | None = None  # [B] ||sum_t g_t||^2, = prefix_sq at the last token
    group_names: list[str] | None = None
    group_token_sq: torch.Tensor | None = None
    group_prefix_sq: torch.Tensor | None = None
    group_diag_prefix_sq: torch.Tensor | None = None
    # parameter name -> route: "ghost (linear)", "ghost (embedding, scale 4)", "materialize: <why>"
    methods: dict[str, str] | None = None


def last_response_value(x: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """``[B, L, ...] -> [B, ...]``: x at each row's last response column (0 for an empty row)."""
    B, L = response_mask.shape
    cols = torch.arange(L, device=x.device).expand(B, L)
    last = torch.where(response_mask != 0, cols, torch.zeros_like(cols)).max(-1).values
    return x[torch.arange(B, device=x.device), last]



@contextlib.contextmanager
def batched_eval(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """Eval mode, with attention on a kernel that has a batched (vmap) backward while inside.

    The batched-cotangent backward (``is_grads_batched=True``) of CUDA's fused SDPA kernels has
    no batching rule (one backward per cotangent: correct, slow); the switch to math SDPA is
    announced once per call with a warning (the application layer also puts it in the result).
    """
    with eval_mode(model), batched_backward_attention(model, device) as note:
        if note is not None:
            warnings.warn(note, stacklevel=3)
        yield

def token_chunks(response_mask: torch.Tensor, chunk_size: int, *,
                 pack: bool = False) -> list[tuple[int, int, int, int, int]]:
    """The harness's chunks ``(start, stop, row_lo, row_hi, end)`` over the response tokens.

    Tokens are listed row-major (``torch.nonzero(response_mask)``); a chunk is the slice
    ``start:stop`` of that list (at most ``chunk_size`` tokens), from rows ``row_lo..row_hi``,
    whose forward runs on columns ``:end`` (causality: later columns cannot matter). Without
    ``pack`` a chunk never leaves its row (one sequence per forward); with ``pack`` it takes
    the next ``chunk_size`` tokens whatever their rows (several short sequences per forward).
    One host read of the mask per call (the plan), none per chunk.
    """
    nz = torch.nonzero(response_mask, as_tuple=False).tolist()  # the one host sync
    chunks = []
    i, n = 0, len(nz)
    while i < n:
        j = min(i + chunk_size, n)
        if not pack:  # stop at the row's end
            b = nz[i][0]
            j = i + 1
            while j < n and j - i < chunk_size and nz[j][0] == b:
                j += 1
        end = max(c for _, c in nz[i:j]) + 1
        chunks.append((i, j, nz[i][0], nz[j - 1][0], end))
        i = j
    return chunks


def iter_token_grads(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor,
    params: list[torch.nn.Parameter],
    chunk_size: int,
    *,
    progress: bool | None = None,
    pack: bool | None = None,
) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]]:
    """Yield ``(rows [C], cols [C], grads)`` with ``grads[i]`` the ``[C, numel_i]`` per-token
    gradients of ``params[i]`` for the response tokens ``(rows[c], cols[c])``, row-major.

    ``rows``/``cols`` are long tensors on the parameters' device, where the inputs are moved.
    ``pack``: several sequences per forward (a chunk takes the next ``chunk_size`` tokens
    whatever their rows; :func:`token_chunks`); default on CUDA only, where a forward's launch
    cost dominates a short sequence (each cotangent's backward then spans the packed rows).
    Inputs are assumed checked (:func:`check_inputs`); the model is put in eval mode.
    """
    dev = params[0].device
    input_ids, response_mask, attention_mask = (
        x.to(dev) for x in (input_ids, response_mask, attention_mask))
    pack = dev.type == "cuda" if pack is None else bool(pack)
    nz = torch.nonzero(response_mask, as_tuple=False)  # [N, 2] on the device
    plan = token_chunks(response_mask, chunk_size, pack=pack)
    bar = tqdm(total=nz.shape[0], desc="per-token grads", disable=not show_progress(progress),
               leave=False)
    with batched_eval(model, dev):
        for start, stop, lo, hi, end in plan:
            rows, cols = nz[start:stop, 0], nz[start:stop, 1]
            C = stop - start
            ids = input_ids[lo : hi + 1, :end]
            am = attention_mask[lo : hi + 1, :end]
            with torch.enable_grad():
                logits = forward_logits(model, ids, am).logits
                lp = token_logprobs(upcast(logits), ids)[rows - lo, cols]  # [C]
                eye = torch.eye(C, dtype=lp.dtype, device=dev)
                grads = torch.autograd.grad(
                    lp, params, grad_outputs=eye, is_grads_batched=True, allow_unused=True
                )
            flat = [
                torch.zeros(C, p.numel(), dtype=lp.dtype, device=dev)
                if g is None
                else g.reshape(C, -1)
                for g, p in zip(grads, params, strict=True)
            ]
            yield rows, cols, flat
            bar.update(C)
    bar.close()


def packed_chunk(offsets: list[int], budget: int) -> int:
    """Largest packed chunk size ``c <= budget`` whose chunks keep ``C x rows <= budget``.

    ``offsets [B+1]``: row b's response tokens are ``offsets[b]:offsets[b+1]`` of the
    row-major token list. A packed chunk of C tokens over rows lo..hi holds C cotangents of
    ``hi - lo + 1`` rows each, so a budget measured in one-row cotangents (``token_plan``)
    bounds ``C x rows``, not C. Host arithmetic only (no device read).
    """
    n = offsets[-1]
    for c in range(max(1, budget), 1, -1):
        worst = 0
        for i in range(0, n, c):
            j = min(i + c, n)
            rows = bisect.bisect_right(offsets, j - 1) - bisect.bisect_right(offsets, i) + 1
            worst = max(worst, (j - i) * rows)
            if worst > budget:
                break
        if worst <= budget:
            return c
    return 1


def token_grad_norms(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    params: ParamFilter = None,
    groups: GroupSpec = False,
    chunk_size: int | None = None,
    method: str = "ghost",
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    accumulate: torch.dtype | None = None,
    progress: bool | None = None,
    memory_fraction: float = MEMORY_FRACTION,
    pack: bool | None = None,
) -> TokenGradNorms:
    """Exact ``token_sq``, ``prefix_sq``, ``diag_prefix_sq`` (each ``[B, L]``) of a causal LM.

    ``params``: parameter filter (see :func:`varbench.grads.params.select_params`);
    ``groups``: True (embeddings / each block's attention and MLP / final norm / head) or a
    callable name -> group, adding ``[B, L, n_groups]`` breakdowns; ``chunk_size``: tokens per
    batched backward (default: ``DEFAULT_CHUNK`` on the CPU, on CUDA from ``memory_fraction``
    of the free device memory, :func:`varbench.grads.chunking.token_plan`); ``method``:
    'ghost' (default: Linear/Embedding weights by Gram-matrix ghost norms, see
    :mod:`varbench.grads.ghost`; memory ~ chunk_size x activations) or 'materialize' (every
    per-token gradient formed, memory ~ chunk_size x P); ``dtype``/``device``:
    run on a copy of the model (float64 for validation: :func:`varbench.grads.exact_float64`
    gives a model that is float64 throughout); ``accumulate``: dtype of norms, Grams and
    prefix sums (default float32, float64 for a float64 model; pass torch.float64 to ask for
    it with a lower-precision model). Log-probs are taken from float32-upcast logits. Cost:
    about one activation backward per response token over its own prefix (causality halves
    the total), plus the weight-gradient norms at about the same cost or less (ghost Gram
    products on short prefixes), plus one forward per chunk (4-11% of the total at chunk
    8-16, measured on the small preset) and one inspection forward per call.

    ``pack``: several sequences per forward (a chunk takes the next ``chunk_size`` tokens
    whatever their rows, :func:`token_chunks`; one forward over those rows and one batched
    backward); default on CUDA only, so CPU results are those of one sequence per forward.
    Token c's cotangent is nonzero only in its own row, so its norms are taken from that
    row's slice alone, with per-row ghost state and running prefixes (a row's state carries
    over to the next chunk while the row continues). Each cotangent's backward then spans the
    chunk's rows: with the automatic CUDA chunk size, packed chunks are shrunk until tokens x
    rows fits the memory budget (:func:`packed_chunk`); an explicit ``chunk_size`` is kept.
    """
    if chunk_size is not None:
        check_positive_int("chunk_size", chunk_size)
    check_choice("method", method, ["ghost", "materialize"])
    model, input_ids, response_mask, attention_mask = prepare(
        model, input_ids, response_mask, attention_mask, dtype, device
    )
    dev = input_ids.device
    pack = dev.type == "cuda" if pack is None else bool(pack)
    chosen = select_params(model, params)
    names = [n for n, _ in chosen]
    if groups is False:
        group_names, gidx = ["all"], [0] * len(chosen)
    else:
        group_names, gidx = group_index(model, names, groups)
    group_of = dict(zip(names, gidx, strict=True))
    n_groups = len(group_names)
    B, L = input_ids.shape
    acc = acc_dtype(next(model.parameters()).dtype, accumulate)
    tok = torch.zeros(B, L, n_groups, dtype=acc, device=dev)
    pre = torch.zeros(B, L, n_groups, dtype=acc, device=dev)
    n_mat = 0 if method == "ghost" else sum(p.numel() for _, p in chosen)
    measured = chunk_size is None and free_device_bytes(dev) is not None
    # the memory plan: a tied head's per-token gradient [C, V h] counts (ghost cannot factor it)
    chunk_size = token_plan(model, B, L, dev, chunk_size=chunk_size, n_grad=n_mat,
                            memory_fraction=memory_fraction).chunk
    # the index of every row's first response token in the row-major token list
    if pack:  # one more host read per call: the rows' token counts
        offs = [0]
        for n in response_mask.count_nonzero(1).tolist():
            offs.append(offs[-1] + n)
        first = {b: offs[b] for b in range(B) if offs[b + 1] > offs[b]}
        stops = {b: offs[b + 1] for b in first}
        if measured:  # each cotangent's backward spans the chunk's rows: C x rows in budget
            chunk_size = packed_chunk(offs, chunk_size)
    # the plan of every chunk, read from the mask once (no host sync per chunk)
    nz = torch.nonzero(response_mask, as_tuple=False)  # [N, 2] on the device
    plan = token_chunks(response_mask, chunk_size, pack=pack)
    if not pack:
        first, stops = {}, {}
        for start, stop, b, _, _ in plan:
            first.setdefault(b, start)
            stops[b] = stop

    def segments(start: int, stop: int, lo: int, hi: int) -> list[tuple[int, int, int, int, bool]]:
        # (local row, k0, k1, row, fresh): the chunk's tokens start:stop split by row
        out = []
        for b in range(lo, hi + 1):
            if b not in first:
                continue  # a row without response tokens inside a packed forward
            k0, k1 = max(start, first[b]), min(stop, stops[b])
            if k1 > k0:
                out.append((b - lo, k0 - start, k1 - start, b, k0 == first[b]))
        return out

    def probe() -> tuple[int, torch.Tensor]:
        # the inspection forward: the first sequence with a response, up to its last token
        b = plan[0][2] if plan else 0
        end = max((e for _, _, r, _, e in plan if r == b), default=L)
        with eval_mode(model):
            logits = forward_logits(model, input_ids[b : b + 1, :end],
                                    attention_mask[b : b + 1, :end]).logits
        check_finite_logits(model, logits, "the gradient harness's forward")
        return end, logits

    if method == "ghost":
        plan_m = plan_modules(model, chosen, probe)
    else:
        probe()
        plan_m = ModulePlan(rest=list(chosen), methods={n: "materialize" for n in names})
    ghost_plan, rest = [(m, n, f) for m, n, f in plan_m.ghost], plan_m.rest
    ghosts = [GhostModule(m, group_of[n], L, form=f, acc=acc) for m, n, f in ghost_plan]
    calls = {id(g): 0 for g in ghosts}

    def make_hook(gm):
        def fn(mod, args, kwargs, out):
            calls[id(gm)] += 1
            gm.hook(mod, args, out, kwargs)

        return fn

    handles = [gm.module.register_forward_hook(make_hook(gm), with_kwargs=True)
               for gm in ghosts]
    rest_p = [p for _, p in rest]
    rest_g = [group_of[n] for n, _ in rest]
    bar = tqdm(total=nz.shape[0], desc="per-token grads", disable=not show_progress(progress),
               leave=False)
    nan_lp = torch.zeros((), dtype=torch.bool, device=dev)  # read once, after the loop
    running: list[torch.Tensor] = []  # the rest's prefix sums of the chunk's last row
    try:
        with batched_eval(model, dev):
            for start, stop, lo, hi, end in plan:
                segs = segments(start, stop, lo, hi)
                if segs[0][4]:  # the chunk opens a new sequence: its prefix sums start at 0
                    running = [torch.zeros(p.numel(), dtype=acc, device=dev) for p in rest_p]
                rows, cols = nz[start:stop, 0], nz[start:stop, 1]
                C = stop - start
                ids = input_ids[lo : hi + 1, :end]
                for gm in ghosts:
                    calls[id(gm)] = 0
                with torch.enable_grad():
                    logits = forward_logits(model, ids, attention_mask[lo : hi + 1, :end]).logits
                    lp = token_logprobs(upcast(logits), ids)[rows - lo, cols]  # [C]
                    nan_lp |= torch.isnan(lp).any()
                    if any(c != 1 for c in calls.values()):
                        raise RuntimeError(
                            "a Linear/Embedding ran more or less than once per forward; "
                            "use method='materialize'"
                        )
                    targets = [gm.out for gm in ghosts] + rest_p
                    eye = torch.eye(C, dtype=lp.dtype, device=dev)
                    grads = torch.autograd.grad(
                        lp, targets, grad_outputs=eye, is_grads_batched=True, allow_unused=True
                    )
                for gm, d in zip(ghosts, grads[: len(ghosts)], strict=True):
                    if d is None:
                        continue
                    t_sq, p_sq = gm.row_norms(d, hi - lo + 1, end, segs)
                    tok[rows, cols, gm.group] += t_sq
                    pre[rows, cols, gm.group] += p_sq
                for i, g in enumerate(grads[len(ghosts) :]):
                    if g is None:
                        g = torch.zeros(C, rest_p[i].numel(), dtype=acc, device=dev)
                    g = g.reshape(C, -1).to(acc)
                    tok[rows, cols, rest_g[i]] += torch.einsum("cn,cn->c", g, g)
                    cum = g.clone()
                    for _, k0, k1, _, fresh in segs:  # each row's own running prefix
                        if not fresh:
                            cum[k0] += running[i]
                        cumsum_rows_(cum[k0:k1])
                    pre[rows, cols, rest_g[i]] += torch.einsum("cn,cn->c", cum, cum)
                    running[i] = cum[-1].clone()
                bar.update(C)
        if bool(nan_lp):  # one sync per call: name the model on NaN log-probs
            for _, _, lo, hi, end in plan:
                with eval_mode(model), torch.no_grad():
                    logits = forward_logits(model, input_ids[lo : hi + 1, :end],
                                            attention_mask[lo : hi + 1, :end]).logits
                check_finite_logits(model, logits, "the gradient harness's forward")
    finally:
        for h in handles:
            h.remove()
        for gm in ghosts:
            gm.inp = gm.out = gm.running = None
            gm.rows = {}
        bar.close()
    m = response_mask.to(acc).unsqueeze(-1)
    diag = tok.cumsum(1) * m
    out = TokenGradNorms(
        token_sq=tok.sum(-1),
        prefix_sq=pre.sum(-1),
        diag_prefix_sq=diag.sum(-1),
        sequence_sq=last_response_value(pre.sum(-1), response_mask),
    )
    out.methods = plan_m.methods
    if groups is not False:
        out.group_names = group_names
        out.group_token_sq, out.group_prefix_sq, out.group_diag_prefix_sq = tok, pre, diag
    return out
