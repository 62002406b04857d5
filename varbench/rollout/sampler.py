"""Batched on-policy sampling with a KV cache into the [P, G, T] RolloutBatch layout.

    batch = sample(policy, task, task.prompts(4, seed=0), G=8, seed=0)

All B = P * G rows advance in lock step, one token per model call after a prefill of the
left-padded prompts. A row stops at a stop token or stop string (variable-length tasks; the
stop set, :func:`stop_set`, is the union of the tokenizer's eos, the checkpoint's
``generation_config.eos_token_id`` and the task's ``stop`` strings), after exactly
``max_new_tokens`` tokens (fixed-length tasks: EOS is then an ordinary token), or when a
multi-turn environment ends the episode. In multi-turn tasks, when the policy emits the task's
``turn_end`` symbol, ``task.env_step`` returns tool output whose tokens are fed to the model one
per step as context (``mask`` 0, ``env_mask`` 1); ``max_new_tokens`` budgets policy and
environment tokens together. A stopped row is fed padding with attention 0, so position ids (from
the attention mask, as in ``forward_logits``) match a teacher-forced forward over
``batch.flat()``.

Recorded ``logprobs``, ``sum_pi_sq`` and ``entropy`` describe pi itself, i.e. the model's
softmax at temperature 1 without filtering, whatever ``temperature``/``top_k``/``top_p``/
``greedy`` select tokens with; with non-default settings the samples are not from pi
(``meta["on_policy"]`` is then False).

Speed (``benchmarks/bench_sampling.py``): the model runs under ``inference_mode`` while the
returned tensors are allocated outside it (ordinary tensors, usable in autograd); the KV cache
of plain full-attention decoders is preallocated and written in place (``kvcache.py``) instead
of concatenated every step; for single-turn tasks the statistics of pi are computed in one pass
over the stored [B, T, V] logits after the loop. None of this changes a drawn token or a
recorded number (tests compare against transformers' DynamicCache and the per-step path).

``differentiable=True`` runs the same calls with autograd on, on transformers' differentiable
``DynamicLayer`` cache: the returned ``logprobs`` carry the graph to the parameters, so a loss
on them backpropagates through the sampler's own forward (the gradient of a teacher-forced
forward over the same tokens, up to float64 rounding; tested), and the update needs no forward
of its own. ``sum_pi_sq`` and ``entropy`` stay detached. Every decode step's graph is kept
until that backward: memory grows with T (and the saved keys and values as T^2).
"""

from __future__ import annotations

import warnings
import weakref
from collections import deque
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm
from transformers.cache_utils import Cache

from varbench._util.bounds import check_knob, check_memory
from varbench._util.checks import UsageError, UsageTypeError, check_positive_int
from varbench._util.progress import show_progress
from varbench.models import memplan
from varbench.models.arch import stepper
from varbench.models.forward import position_ids_from_mask
from varbench.models.logits import chosen_logprobs, pi_stats, stat_dtype
from varbench.models.presets import Policy
from varbench.models.tokenizer import check_tokenizer_covers
from varbench.rollout.batch import RolloutBatch
from varbench.rollout.kvcache import autograd_cache
from varbench.rollout.kvcache import grow_cache as _grow_cache
from varbench.tasks.base import Prompt, Task
from varbench.tasks.verifiers import note_responses


def _check_args(policy, task, prompts, G, seed, temperature, top_k, top_p) -> None:
    if not isinstance(policy, Policy):
        raise UsageTypeError(f"policy must be a varbench Policy, got {type(policy).__name__}")
    if not isinstance(task, Task):
        raise UsageTypeError(f"task must be a varbench Task, got {type(task).__name__}")
    check_knob("G", G)
    check_knob("generator_seed", seed, arg="seed")
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise UsageError(f"prompts must be a non-empty list of Prompt, got {prompts!r}")
    bad = [p for p in prompts if not isinstance(p, Prompt)]
    if bad:
        raise UsageTypeError(
            f"prompts must hold varbench Prompt objects, got {type(bad[0]).__name__}")
    check_knob("temperature", temperature)
    if top_k is not None:
        check_knob("top_k", top_k)
    if top_p is not None:
        check_knob("top_p", top_p)


def check_rollout_memory(policy: Policy, P: int, G: int, T: int, *, arg: str = "G",
                         device: str | torch.device | None = None) -> None:
    """UsageError, before any model call, when sampling ``G`` responses of up to ``T`` tokens
    to each of ``P`` prompts cannot fit the memory of ``device`` (default: the model's):
    :func:`varbench._util.bounds.check_memory` of the memory plan's least need (path
    ``sampling``: the ``[P*G, T]`` outputs and, since rows are sampled a chunk at a time,
    one group's KV cache and step logits). The model comes on top, so a size this refuses can
    never run; one it admits still may not."""
    shape = memplan.ModelShape.from_model(policy.model)
    p = memplan.plan(shape, "sampling", P * G, T, None, response=T)
    need = p.fixed_bytes + G * p.unit_bytes
    check_memory(arg, G, need, policy.device if device is None else device,
                 what=f"P={P} prompts x G={G} responses: the outputs of T={T} tokens and one "
                      f"group's keys, values and logits over V={shape.vocab} tokens")


def _filtered(z: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None):
    """Logits of the distribution tokens are drawn from (default: z itself)."""
    if temperature != 1.0:
        z = z / temperature
    if top_k is not None and top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        srt, idx = torch.sort(z, dim=-1, descending=True)
        cum = torch.softmax(srt, -1).cumsum(-1)
        drop = cum - torch.softmax(srt, -1) >= top_p  # keep the smallest prefix reaching top_p
        z = z.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return z


# tokenizer -> {(vocabulary size, alphabet)} already checked: the check encodes and decodes every
# symbol (~3 ms, ~1% of a small sampling call) and its answer only changes with the vocabulary
_COVERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_covers(tok, task: Task) -> None:
    key = (len(tok), tuple(task.alphabet))
    try:
        seen = _COVERED.setdefault(tok, set())
    except TypeError:  # not weak-referenceable: check every time
        seen = set()
    if key not in seen:
        check_tokenizer_covers(tok, task.alphabet, what=f"task {task.name!r}")
        seen.add(key)


def encode_prompts(tokenizer, prompts: Sequence[Prompt], *,
                   device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """[P, Lp] left-padded prompt ids and their mask, made on ``device`` from the host lists."""
    ids = tokenizer([p.text for p in prompts], add_special_tokens=True)["input_ids"]
    Lp = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = [[pad] * (Lp - len(x)) + list(x) for x in ids]
    real = [[0] * (Lp - len(x)) + [1] * len(x) for x in ids]
    return (torch.tensor(rows, dtype=torch.long, device=device),
            torch.tensor(real, dtype=torch.long, device=device))


def stop_set(policy: Policy, task: Task) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(token ids, text strings)`` that end a response of a variable-length task.

    The ids are the union of the tokenizer's ``eos_token_id``, the checkpoint's
    ``generation_config.eos_token_id`` (an int or a list: a Llama-3-Instruct checkpoint ends
    its turns with ``<|eot_id|>``, not the tokenizer's ``<|end_of_text|>``) and each of the
    task's ``stop_strings`` that is one token of the vocabulary; the other stop strings are
    matched in the decoded text. Fixed-length tasks ignore the set (EOS is an ordinary token).
    """
    tok = policy.tokenizer
    ids: list[int] = []
    if tok.eos_token_id is not None:
        ids.append(int(tok.eos_token_id))
    gen = getattr(policy.model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None)
    for x in (extra if isinstance(extra, (list, tuple)) else [extra]):
        if isinstance(x, int) and not isinstance(x, bool):
            ids.append(int(x))
    texts: list[str] = []
    vocab = tok.get_vocab()
    for s in task.stop_strings:
        if s in vocab:
            ids.append(int(vocab[s]))
        else:
            texts.append(s)
    return tuple(dict.fromkeys(ids)), tuple(dict.fromkeys(texts))


def truncated_rows(tokens: torch.Tensor, stop: torch.Tensor, T: int,
                   stop_ids: Sequence[int]) -> torch.Tensor:
    """[B] bool: rows that took all ``T`` steps without ending on a stop token (cut off at
    ``max_new_tokens``); ``tokens`` [B, >=T], ``stop`` [B] steps each row took."""
    ran = stop >= T
    if T == 0 or not bool(ran.any()):
        return ran
    if stop_ids:
        last = tokens[:, T - 1]
        ran = ran & ~torch.isin(last, torch.tensor(list(stop_ids), dtype=last.dtype,
                                                   device=last.device))
    return ran


@torch.no_grad()  # model calls run in inference_mode inside; the outputs stay ordinary tensors
def sample(
    policy: Policy,
    task: Task,
    prompts: Sequence[Prompt],
    G: int,
    *,
    seed: int = 0,
    generator: torch.Generator | None = None,
    max_new_tokens: int | None = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    greedy: bool = False,
    reward: str | None = None,
    device: str | torch.device | None = None,
    progress: bool | None = False,
    differentiable: bool = False,
    rows: int | None = None,
) -> RolloutBatch:
    """Sample ``G`` responses to each prompt; return the scored ``[P, G, T]`` RolloutBatch.

    ``generator`` (on the model's device) overrides ``seed``. ``max_new_tokens`` defaults to
    ``task.max_new_tokens``; T of the result is the longest response actually produced
    (exactly ``max_new_tokens`` for fixed-length tasks). ``device`` is where the returned
    tensors live (default: the model's device). ``differentiable``: ``logprobs`` carry the
    graph of the model calls (module docstring; needs a model whose every layer is plain full
    attention, :func:`can_sample_differentiably`). Raises ValueError before any model call on
    bad arguments, prompts longer than the context, or a tokenizer missing a symbol of the task.

    ``rows``: responses per KV cache (whole groups; default: the memory plan's,
    :func:`sampling_prompts`; all rows on the CPU). Each chunk of prompts is prefilled and
    decoded on its own, drawing from the one generator in turn: greedy decoding is identical
    for every ``rows``, sampled draws are a valid sample whose stream depends on the chunks
    (one multinomial call per step over the active rows), so a seed reproduces a batch for a
    given ``rows`` and device budget.
    """
    _check_args(policy, task, prompts, G, seed, temperature, top_k, top_p)
    reward = task.check_reward(reward)
    T = task.max_new_tokens if max_new_tokens is None else check_positive_int(
        "max_new_tokens", max_new_tokens)
    check_rollout_memory(policy, len(prompts), G, T)  # before encoding the prompts
    tok, model = policy.tokenizer, policy.model
    _check_covers(tok, task)
    if differentiable:
        check_differentiable(policy, "differentiable=True", "sample without it and run a "
                             "teacher-forced forward (varbench.rollout.response_logprobs)")
    dev = policy.device
    prompt_ids, prompt_mask = encode_prompts(tok, prompts, device=dev)
    longest = prompt_ids.shape[1]  # Lp is the longest prompt's length: no host sync
    if longest + T > policy.context_length:
        raise UsageError(
            f"prompt of {longest} tokens + max_new_tokens={T} exceeds the context of "
            f"{policy.context_length} tokens of policy {policy.name!r}"
        )
    stop_ids, stop_texts = stop_set(policy, task)
    if not task.fixed_length and not stop_ids and not stop_texts:
        warnings.warn(
            f"policy {policy.name!r} has no stop token (no tokenizer eos, no "
            f"generation_config.eos_token_id) and task {task.name!r} no stop strings: every "
            f"response runs to max_new_tokens={T}; set the task's stop knob (e.g. --knob "
            "stop='<|im_end|>')", UserWarning, stacklevel=2)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    turn_ids = (tok(task.turn_end, add_special_tokens=False)["input_ids"]
                if task.multi_turn else [])
    gen = generator
    if gen is None and not greedy:
        gen = torch.Generator(device=dev).manual_seed(int(seed))

    P = len(prompts)
    B = P * G  # row b = p * G + i
    step = _stepper(model)
    pids, pmask = prompt_ids.to(dev), prompt_mask.to(dev)
    Lp = pids.shape[1]
    # inference_mode, not just no_grad: no version counters or autograd metadata on the many
    # small tensors of each model call (several % of a decode step for a small model).
    calls = torch.enable_grad if differentiable else torch.inference_mode
    sdt = stat_dtype(next(model.parameters()).dtype)
    # Outputs are allocated outside inference mode and only written in place inside it, so the
    # returned tensors stay ordinary tensors that autograd may save.
    tokens = torch.full((B, T), pad, dtype=torch.long, device=dev)
    mask = torch.zeros((B, T), dtype=torch.float32, device=dev)
    env = torch.zeros((B, T), dtype=torch.float32, device=dev)
    lp_out, spsq_out, ent_out = (torch.zeros((B, T), dtype=sdt, device=dev)
                                 for _ in range(3))
    stop = torch.full((B,), T, dtype=torch.long, device=dev)  # steps each row took part in
    per = sampling_prompts(policy, P, G, Lp + T, rows, response=T)  # per KV cache (the plan)
    used = 0
    for p0 in range(0, P, per):
        p1 = min(P, p0 + per)
        r0, r1 = p0 * G, p1 * G  # the chunk's rows: views of the outputs, written in place
        with calls():  # views made in the mode they are written in (autograd's rule)
            out = tuple(x[r0:r1] for x in (tokens, mask, env, lp_out, spsq_out, ent_out, stop))
        used = max(used, _sample_rows(
            model, step, calls, pids[p0:p1], pmask[p0:p1], prompts[p0:p1], G, T, out,
            task=task, tok=tok, stop_ids=stop_ids, stop_texts=stop_texts, turn_ids=turn_ids,
            gen=gen, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
            differentiable=differentiable, progress=progress))
    if not task.multi_turn:  # mask was not needed during the loop: every kept step is policy
        mask.copy_(torch.arange(T, device=dev) < stop[:, None])
    sl = slice(0, used)
    res = [x[:, sl] for x in (tokens, mask, env, spsq_out, ent_out)]
    out_dev = torch.device(device) if device is not None else dev
    with calls():  # the log-probs' slice and reshape stay on the graph when differentiable
        logprobs = lp_out[:, sl].reshape(P, G, used).to(out_dev)
    # decoded once, at the end, in one tokenizer call
    real = (res[1] + res[2]).tolist()
    texts = tok.batch_decode([[x for x, r in zip(row, keep, strict=True) if r > 0]
                              for row, keep in zip(res[0].tolist(), real, strict=True)],
                             skip_special_tokens=True)
    scores = [task.score(prompts[b // G], texts[b], reward) for b in range(B)]
    rewards = torch.tensor(scores, dtype=torch.float32, device=dev).reshape(P, G)
    n_cut = (0 if task.fixed_length or used < T else
             int(truncated_rows(res[0], stop, T, stop_ids).sum()))
    note_responses(task, n=B, n_zero=sum(1 for x in scores if x == 0), n_truncated=n_cut,
                   max_new_tokens=T)
    shape = (P, G, used)
    return RolloutBatch(
        prompt_ids=prompt_ids.to(out_dev),
        prompt_mask=prompt_mask.to(out_dev),
        tokens=res[0].reshape(shape).to(out_dev),
        mask=res[1].reshape(shape).to(out_dev),
        env_mask=res[2].reshape(shape).to(out_dev),
        logprobs=logprobs,
        sum_pi_sq=res[3].reshape(shape).to(out_dev),
        entropy=res[4].reshape(shape).to(out_dev),
        rewards=rewards.to(out_dev),
        lengths=res[1].sum(-1).long().reshape(P, G).to(out_dev),
        prompts=[p.text for p in prompts],
        texts=[texts[p * G:(p + 1) * G] for p in range(P)],
        meta={
            "task": task.name, "knobs": dict(task.knobs), "reward": reward,
            "policy": policy.name, "seed": None if generator is not None else int(seed),
            "max_new_tokens": T, "temperature": float(temperature), "top_k": top_k,
            "top_p": top_p, "greedy": bool(greedy),
            "on_policy": _plain(temperature, top_k, top_p) and not greedy,
            "prompt_objects": list(prompts),
            "stop_ids": list(stop_ids), "stop_strings": list(stop_texts),
            "truncated": n_cut,
        },
    )


def sampling_prompts(policy: Policy, P: int, G: int, L: int, rows: int | None = None, *,
                     response: int | None = None) -> int:
    """Prompts per KV cache of :func:`sample`: ``rows`` (rounded down to whole groups, at
    least one) when given, else the memory plan's rows (path ``sampling``: every layer's keys
    and values over ``L`` positions, the larger of a step's logits and the prefill's
    activations per row; ``response`` of the L positions are sampled) inside the device's
    budget; all ``P`` without a measured budget (the CPU)."""
    if rows is not None:
        return max(1, min(P, check_positive_int("rows", rows) // G))
    budget = memplan.device_budget(policy.device)
    if budget is None:
        return P
    p = memplan.plan(memplan.ModelShape.from_model(policy.model), "sampling", P * G, L, budget,
                     response=response)
    return max(1, min(P, p.chunk // G))


def _sample_rows(model, step, calls, pids, pmask, prompts, G, T, out, *, task, tok, stop_ids,
                 stop_texts, turn_ids, gen, greedy, temperature, top_k, top_p, differentiable,
                 progress) -> int:
    """Prefill and decode the ``[p, Lp]`` prompts ``pids`` G times each into ``out`` (row
    views of sample's outputs); returns the steps run. One KV cache for these rows only."""
    Lp = pids.shape[1]
    B = pids.shape[0] * G
    dev = pids.device
    with calls():
        cache = autograd_cache(model) if differentiable else _grow_cache(model, Lp + T)
        if G > 1 and _can_repeat(model):
            # Prefill each prompt once and copy its cache G times: identical rows, 1/G the work.
            cache, logits = step(pids, pmask, position_ids_from_mask(pmask), cache)
            cache.batch_repeat_interleave(G)
            logits = logits.repeat_interleave(G, 0)
        else:
            ids = pids.repeat_interleave(G, 0)
            m = pmask.repeat_interleave(G, 0)
            cache, logits = step(ids, m, position_ids_from_mask(m), cache)
        # Attention mask and position ids of every step, preallocated: step t reads a view
        # instead of concatenating. Active rows never hold a stopped token (stopped rows leave
        # the batch), so the response part of the mask is all ones.
        attn_all = torch.ones((B, Lp + T), dtype=pmask.dtype, device=dev)
        attn_all[:, :Lp] = pmask.repeat_interleave(G, 0)
        pos_all = attn_all[:, :Lp].sum(-1, keepdim=True) + torch.arange(T, device=dev)
        loop = _Loop(task=task, prompts=prompts, G=G, tok=tok, T=T, eos=stop_ids,
                     stop_texts=stop_texts, turn_ids=turn_ids,
                     gen=gen, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
                     stat_dtype=stat_dtype(logits.dtype), differentiable=differentiable,
                     out=out)
        used = loop.run(step, cache, logits, attn_all, pos_all, progress)
        loop.finish(used)
    return used


_DEFER_MAX = memplan.DEFER_ELEMENTS  # elements of the [B, T, V] logits kept for deferred
# statistics (the memory plan counts this buffer)


def _plain(temperature: float, top_k: int | None, top_p: float | None) -> bool:
    """Whether draws come from pi itself (temperature 1, no filtering)."""
    return temperature == 1.0 and top_k is None and top_p in (None, 1.0)


class _Loop:
    """The decode loop of ``sample``; writes step t of active rows into the [B, T] outputs.

    Per step: one model call on the active rows and the statistics of pi. Written so a step
    costs few small tensor ops and no host sync for tasks that cannot stop early, one (the
    count of stopped rows) for EOS-stopped tasks, and one (the step's tokens, ``[A]``) for
    multi-turn tasks, whose turn bookkeeping and environment calls then run on the host:
    never one per row, per turn or per token.
    """

    def __init__(self, *, task, prompts, G, tok, T, eos, turn_ids, gen, greedy, temperature,
                 top_k, top_p, stat_dtype, out, differentiable=False, stop_texts=()):
        self.task, self.prompts, self.G, self.tok, self.T = task, prompts, G, tok, T
        # eos: the stop token ids (a tuple, see stop_set); stop_texts: strings matched in text
        self.eos, self.turn_ids, self.gen, self.greedy = tuple(eos), turn_ids, gen, greedy
        self.eos_set = frozenset(self.eos)
        self.stop_texts = tuple(stop_texts)
        # decoded tail long enough to hold any stop string (in tokens), plus a margin
        self.tail = max((len(tok(x, add_special_tokens=False)["input_ids"])
                         for x in self.stop_texts), default=0) + 2
        dev = out[0].device
        self.eos_ids = (torch.tensor(self.eos, dtype=torch.long, device=dev) if self.eos
                        else None)
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p
        self.plain = _plain(temperature, top_k, top_p)
        self.stat_dtype = stat_dtype
        self.differentiable = differentiable
        self.tokens, self.mask, self.env, self.lp, self.spsq, self.ent, self.stop = out
        B = self.tokens.shape[0]
        self.queues: list[deque[int]] = [deque() for _ in range(B)]
        self.pending: set[int] = set()
        # Multi-turn bookkeeping lives on the host: the output row of each active slot, the
        # tokens each row has so far (policy and environment), and the slots that took an
        # environment token this step. One transfer of the step's tokens feeds it all.
        self.act_host: list[int] = list(range(B))
        self.history: list[list[int]] = [[] for _ in range(B)]
        self.env_slots: set[int] = set()
        self.zbuf: torch.Tensor | None = None  # [B, T, V] logits when statistics are deferred

    def run(self, step, cache, logits, attn_all, pos_all, progress: bool | None) -> int:
        """Decode until every row stopped or T steps ran; returns the number of steps run."""
        task, T = self.task, self.T
        dev = logits.device
        Lp = attn_all.shape[1] - T
        act = torch.arange(self.tokens.shape[0], device=dev)  # active slot -> output row
        whole = True  # every row still active: act is arange(B), plain slicing is cheaper
        can_stop = not task.fixed_length or task.multi_turn
        B, V = self.tokens.shape[0], logits.shape[-1]
        if not task.multi_turn and B * T * V <= _DEFER_MAX:
            # Statistics of pi in one pass after the loop instead of ~30 small ops per step;
            # row-wise log_softmax / logsumexp / sum give the same bits for a row whether it
            # is computed alone or inside the [B, T, V] block (tested against the per-step path).
            self.zbuf = torch.zeros((B, T, V), dtype=self.stat_dtype, device=dev)
        steps = range(T)  # a disabled tqdm still costs ~1 ms to build: only make a live one
        if show_progress(progress):
            steps = tqdm(steps, desc=f"sample {task.name}", leave=False)
        for t in steps:
            cur, is_pol = self._record(logits, t, slice(None) if whole else act, act)
            if t == T - 1:
                return T
            if can_stop:
                if task.multi_turn:
                    finished, keep_host = self._finished_host(cur, t)
                    n_done = finished.numel() - len(keep_host)
                else:
                    finished = self._finished(cur, is_pol)
                    n_done = int(finished.sum())  # the one host sync of a step
                if n_done == finished.numel():
                    self.stop[act] = t + 1
                    return t + 1
                if n_done:
                    self.stop[act[finished]] = t + 1
                    if task.multi_turn:
                        keep = torch.tensor(keep_host, dtype=torch.long, device=dev)
                        self.act_host = [self.act_host[s] for s in keep_host]
                    else:
                        keep = (~finished).nonzero().flatten()
                        if self.stop_texts:
                            self.act_host = [self.act_host[s] for s in keep.tolist()]
                    act, cur = act[keep], cur[keep]
                    attn_all, pos_all = attn_all[keep], pos_all[keep]
                    cache.batch_select_indices(keep)
                    whole = False
            attn, pos = attn_all[:, : Lp + t + 1], pos_all[:, t : t + 1]  # views, no copies
            cache, logits = step(cur[:, None], attn, pos, cache)
        return T

    def _record(self, logits, t, rows, act):
        """Draw step t's tokens from ``logits`` [A, V] and record them and pi's statistics."""
        z = logits.to(self.stat_dtype)
        with torch.no_grad():  # draws are not differentiated (nor recorded on a graph)
            cur = self._draw(z)
        if self.zbuf is not None:
            self.tokens[rows, t] = cur
            self.zbuf[rows, t] = z
            return cur, None
        lp, ent, spsq = pi_stats(z, cur)[:3]  # of pi itself (temperature 1, unfiltered)
        lp = self._on_graph(lp, z, cur)
        is_pol = None
        if self.task.multi_turn:  # env tokens replace draws and get mask 0 / statistics 0
            is_env = torch.zeros_like(cur, dtype=torch.bool)
            if self.pending:  # rows with queued tool output take it instead of their draw
                self._take_env_tokens(cur, is_env, act)
            is_pol = ~is_env
            pol = is_pol.to(self.stat_dtype)
            lp, spsq, ent = lp * pol, spsq * pol, ent * pol
            self.mask[rows, t] = is_pol.float()
            self.env[rows, t] = is_env.float()
        self.tokens[rows, t] = cur
        self.lp[rows, t] = lp
        self.spsq[rows, t] = spsq.detach()
        self.ent[rows, t] = ent.detach()
        return cur, is_pol

    def _on_graph(self, lp: torch.Tensor, z: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``lp`` (pi_stats' values, the same bits as plain sampling) with the gradient of
        log softmax(z) at ``tokens`` when differentiable: ``g - g.detach()`` is exactly 0."""
        if not self.differentiable:
            return lp
        g = chosen_logprobs(z, tokens.clone())  # a step's tokens take env tokens in place later
        return lp + (g - g.detach())

    def _draw(self, z: torch.Tensor) -> torch.Tensor:
        """[A] tokens drawn from ``z`` [A, V] (argmax when greedy)."""
        if self.greedy:
            return z.argmax(-1)
        probs = (torch.log_softmax(z, dim=-1).exp() if self.plain else torch.softmax(
            _filtered(z, self.temperature, self.top_k, self.top_p), -1))
        return torch.multinomial(probs, 1, generator=self.gen).squeeze(-1)

    def finish(self, used: int) -> None:
        """Write the deferred statistics of the first ``used`` steps (no-op if not deferred)."""
        if self.zbuf is None:
            return
        # the whole contiguous block, a chunk of rows at a time: the same row-wise kernels as
        # the per-step [A, V] rows
        lp, ent, spsq = pi_stats(self.zbuf, self.tokens)[:3]
        lp = self._on_graph(lp, self.zbuf, self.tokens)
        z = self.zbuf
        T = self.T
        valid = torch.arange(T, device=z.device) < self.stop[:, None]  # steps a row took
        zero = torch.zeros((), dtype=self.stat_dtype, device=z.device)
        for out, x in ((self.lp, lp), (self.spsq, spsq.detach()), (self.ent, ent.detach())):
            out[:, :used] = torch.where(valid, x, zero)[:, :used]

    def _take_env_tokens(self, cur, is_env, act) -> None:
        """Rows with queued tool output take its next token instead of their draw (in place)."""
        queues, pending = self.queues, self.pending
        slots = [s for s, b in enumerate(self.act_host) if b in pending]
        rows = [self.act_host[s] for s in slots]
        idx = torch.tensor(slots, dtype=torch.long, device=cur.device)
        cur[idx] = torch.tensor([queues[b].popleft() for b in rows], dtype=cur.dtype,
                                device=cur.device)
        is_env[idx] = True
        self.env_slots = set(slots)
        pending.difference_update(b for b in rows if not queues[b])

    def _finished(self, cur, is_pol) -> torch.Tensor:
        """[A] bool, single-turn: rows that stop after this step (a stop token or, with stop
        strings, a decoded tail holding one; variable-length tasks only)."""
        pol = is_pol if is_pol is not None else torch.ones_like(cur, dtype=torch.bool)
        finished = torch.zeros_like(pol)
        if self.task.fixed_length:
            return finished
        if self.eos_ids is not None:
            finished |= pol & (torch.isin(cur, self.eos_ids) if len(self.eos) > 1
                               else cur == self.eos[0])
        if self.stop_texts:  # one host transfer of the step's tokens
            hit = []
            for b, y in zip(self.act_host, cur.tolist(), strict=True):
                self.history[b].append(y)
                tail = self.tok.decode(self.history[b][-self.tail:], skip_special_tokens=False)
                hit.append(any(x in tail for x in self.stop_texts))
            finished |= torch.tensor(hit, dtype=torch.bool, device=cur.device)
        return finished

    def _finished_host(self, cur, t) -> tuple[torch.Tensor, list[int]]:
        """Multi-turn: ``([A] bool of slots that stop after step t, host list of the others)``.

        A slot stops at a policy EOS (variable-length tasks) or when the environment ends its
        episode; a policy ``turn_end`` runs the environment, whose reply is queued (truncated
        to the budget). The step's tokens come to the host once (``cur.tolist()``), whatever
        the number of rows or of turns ending.
        """
        task, tok, T = self.task, self.tok, self.T
        toks = cur.tolist()  # the one host sync of a multi-turn step
        env_slots, self.env_slots = self.env_slots, set()
        eos = self.eos_set if not task.fixed_length else frozenset()
        one_id = self.turn_ids[0] if len(self.turn_ids) == 1 else None
        done = [False] * len(toks)
        for s, (b, y) in enumerate(zip(self.act_host, toks, strict=True)):
            self.history[b].append(y)
            if s in env_slots:  # an environment token: neither EOS nor a turn end
                continue
            if y in eos:
                done[s] = True
                continue
            if one_id is not None and y != one_id:
                continue
            text = tok.decode(self.history[b], skip_special_tokens=True)
            if one_id is None and not text.endswith(task.turn_end):
                continue
            reply = task.env_step(self.prompts[b // self.G], text)
            if reply is None:
                done[s] = True
                continue
            ids = tok(reply, add_special_tokens=False)["input_ids"][: max(0, T - t - 1)]
            self.queues[b].extend(ids)
            if ids:
                self.pending.add(b)
        finished = torch.tensor(done, dtype=torch.bool, device=cur.device)
        return finished, [s for s, d in enumerate(done) if not d]


def _stepper(model):
    """``step(ids, attn, pos, cache) -> (cache, last logits [B, V])`` (models/arch.py)."""
    return stepper(model)


def can_sample_differentiably(model) -> bool:
    """Whether ``sample(..., differentiable=True)`` can run ``model``: every layer plain full
    attention (transformers' differentiable ``DynamicLayer`` cache; the rule of
    ``kvcache.autograd_cache``)."""
    return autograd_cache(model) is not None


def check_differentiable(policy: Policy, what: str, way_out: str) -> None:
    """Raise a UsageError naming ``what`` asked for differentiable sampling, the policy and
    ``way_out`` when :func:`can_sample_differentiably` is False for its model."""
    if not can_sample_differentiably(policy.model):
        raise UsageError(
            f"{what} needs a model whose every layer is plain full attention (a "
            f"differentiable KV cache); policy {policy.name!r} ({type(policy.model).__name__}) "
            f"has other layers: {way_out}")


def _can_repeat(model) -> bool:
    """Whether this model's cache class can copy batch rows (transformers' Cache can)."""
    return hasattr(Cache, "batch_repeat_interleave") and hasattr(Cache, "batch_select_indices")
