"""Batched on-policy sampling with a KV cache into the [P, G, T] RolloutBatch layout.

    batch = sample(policy, task, task.prompts(4, seed=0), G=8, seed=0)

All B = P * G rows advance in lock step, one token per model call after a prefill of the
left-padded prompts. A row stops at EOS (variable-length tasks), after exactly
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
"""

from __future__ import annotations

import inspect
import sys
from collections import deque
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from varbench._checks import check_positive_int
from varbench.grads.stats import sum_pi_sq
from varbench.models.forward import position_ids_from_mask
from varbench.models.presets import Policy
from varbench.models.tokenizer import check_tokenizer_covers
from varbench.rollout.batch import RolloutBatch
from varbench.tasks.base import Prompt, Task


def _check_args(policy, task, prompts, G, temperature, top_k, top_p) -> None:
    if not isinstance(policy, Policy):
        raise TypeError(f"policy must be a varbench Policy, got {type(policy).__name__}")
    if not isinstance(task, Task):
        raise TypeError(f"task must be a varbench Task, got {type(task).__name__}")
    check_positive_int("G", G)
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts must be a non-empty list of Prompt, got {prompts!r}")
    bad = [p for p in prompts if not isinstance(p, Prompt)]
    if bad:
        raise TypeError(f"prompts must hold varbench Prompt objects, got {type(bad[0]).__name__}")
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"temperature={temperature!r} is not valid; expected a number > 0")
    if top_k is not None:
        check_positive_int("top_k", top_k)
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p={top_p!r} is not valid; expected a number in (0, 1]")


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


def _encode_prompts(tokenizer, prompts: Sequence[Prompt]) -> tuple[torch.Tensor, torch.Tensor]:
    """[P, Lp] left-padded prompt ids and their mask."""
    ids = [tokenizer(p.text, add_special_tokens=True)["input_ids"] for p in prompts]
    Lp = max(len(x) for x in ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = torch.full((len(ids), Lp), pad, dtype=torch.long)
    mask = torch.zeros((len(ids), Lp), dtype=torch.long)
    for r, x in enumerate(ids):
        if x:
            out[r, Lp - len(x):] = torch.tensor(x)
            mask[r, Lp - len(x):] = 1
    return out, mask


@torch.no_grad()  # not inference_mode: callers use the outputs in autograd graphs
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
    progress: bool = False,
) -> RolloutBatch:
    """Sample ``G`` responses to each prompt; return the scored ``[P, G, T]`` RolloutBatch.

    ``generator`` (on the model's device) overrides ``seed``. ``max_new_tokens`` defaults to
    ``task.max_new_tokens``; T of the result is the longest response actually produced
    (exactly ``max_new_tokens`` for fixed-length tasks). ``device`` is where the returned
    tensors live (default: the model's device). Raises ValueError before any model call on bad
    arguments, prompts longer than the context, or a tokenizer missing a symbol of the task.
    """
    _check_args(policy, task, prompts, G, temperature, top_k, top_p)
    reward = task.check_reward(reward)
    T = task.max_new_tokens if max_new_tokens is None else check_positive_int(
        "max_new_tokens", max_new_tokens)
    tok, model = policy.tokenizer, policy.model
    check_tokenizer_covers(tok, task.alphabet, what=f"task {task.name!r}")
    prompt_ids, prompt_mask = _encode_prompts(tok, prompts)
    longest = int(prompt_mask.sum(-1).max())
    if longest + T > policy.context_length:
        raise ValueError(
            f"prompt of {longest} tokens + max_new_tokens={T} exceeds the context of "
            f"{policy.context_length} tokens of policy {policy.name!r}"
        )
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    turn_ids = (tok(task.turn_end, add_special_tokens=False)["input_ids"]
                if task.multi_turn else [])
    dev = policy.device
    gen = generator
    if gen is None and not greedy:
        gen = torch.Generator(device=dev).manual_seed(int(seed))

    P = len(prompts)
    B = P * G  # row b = p * G + i
    step = _stepper(model)
    pids, pmask = prompt_ids.to(dev), prompt_mask.to(dev)
    if G > 1 and _can_repeat(model):
        # Prefill each prompt once and copy its cache G times: identical rows, 1/G the work.
        cache, logits = step(pids, pmask, position_ids_from_mask(pmask), None)
        cache.batch_repeat_interleave(G)
        logits = logits.repeat_interleave(G, 0)
    else:
        ids = pids.repeat_interleave(G, 0)
        m = pmask.repeat_interleave(G, 0)
        cache, logits = step(ids, m, position_ids_from_mask(m), None)
    attn = pmask.repeat_interleave(G, 0)  # [A, Lp + t] mask of the active rows
    next_pos = attn.sum(-1)  # [A] position id of each active row's next token

    stat_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    tokens = torch.full((B, T), pad, dtype=torch.long, device=dev)
    mask = torch.zeros((B, T), dtype=torch.float32, device=dev)
    env = torch.zeros((B, T), dtype=torch.float32, device=dev)
    lp_out, spsq_out, ent_out = (torch.zeros((B, T), dtype=stat_dtype, device=dev)
                                 for _ in range(3))
    # Finished rows leave the batch (their cache rows too), so later steps cost only what is
    # still running; act maps active slots to rows of the [B, T] outputs.
    act = torch.arange(B, device=dev)
    whole = True  # every row still active: act is arange(B)
    plain = temperature == 1.0 and top_k is None and top_p in (None, 1.0)
    queues: list[deque[int]] = [deque() for _ in range(B)]
    pending: set[int] = set()
    steps = tqdm(range(T), desc=f"sample {task.name}", leave=False,
                 disable=not (progress and sys.stderr.isatty()))
    used = 0
    for t in steps:
        z = logits.to(stat_dtype)
        logp = torch.log_softmax(z, dim=-1)  # [A, V] of pi (temperature 1, unfiltered)
        pi = logp.exp()
        if greedy:
            cur = z.argmax(-1)
        else:
            probs = pi if plain else torch.softmax(_filtered(z, temperature, top_k, top_p), -1)
            cur = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
        is_env = torch.zeros_like(cur, dtype=torch.bool)
        if pending:  # rows with queued tool output take it instead of their draw
            slot = {int(b): s for s, b in enumerate(act.tolist()) if int(b) in pending}
            rows = sorted(slot)
            idx = torch.tensor([slot[b] for b in rows], device=dev)
            cur[idx] = torch.tensor([queues[b].popleft() for b in rows], device=dev)
            is_env[idx] = True
            pending.difference_update(b for b in rows if not queues[b])
        is_pol = ~is_env
        rows = slice(None) if whole else act  # plain slicing is cheaper while nobody stopped
        pol = is_pol.to(stat_dtype)
        tokens[rows, t] = cur
        mask[rows, t] = is_pol.float()
        env[rows, t] = is_env.float()
        lp_out[rows, t] = logp.gather(-1, cur[:, None]).squeeze(-1) * pol
        spsq_out[rows, t] = sum_pi_sq(z) * pol
        # clamp: a -inf logit (masked vocabulary) must give 0 * finite, not 0 * -inf = NaN
        ent_out[rows, t] = -(pi * logp.clamp(min=torch.finfo(logp.dtype).min)).sum(-1) * pol
        used = t + 1
        if t == T - 1:
            break
        if not task.fixed_length or task.multi_turn:
            finished = torch.zeros_like(is_pol)
            if not task.fixed_length and eos is not None:
                finished |= is_pol & (cur == eos)
            if task.multi_turn:
                finished |= _env_turn(task, prompts, G, tok, tokens, mask, env, t, act,
                                      is_pol & ~finished, queues, pending, turn_ids, T)
            if bool(finished.all()):
                break
            if bool(finished.any()):
                keep = (~finished).nonzero().flatten()
                act, cur, attn, next_pos = act[keep], cur[keep], attn[keep], next_pos[keep]
                cache.batch_select_indices(keep)
                whole = False
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=-1)
        cache, logits = step(cur[:, None], attn, next_pos[:, None], cache)
        next_pos = next_pos + 1
    sl = slice(0, used)
    res = [x[:, sl] for x in (tokens, mask, env, lp_out, spsq_out, ent_out)]
    texts = [_decode(tok, res[0][b], res[1][b] + res[2][b]) for b in range(B)]
    scores = [task.score(prompts[b // G], texts[b], reward) for b in range(B)]
    rewards = torch.tensor(scores, dtype=torch.float32).reshape(P, G)
    out_dev = torch.device(device) if device is not None else dev
    shape = (P, G, used)
    return RolloutBatch(
        prompt_ids=prompt_ids.to(out_dev),
        prompt_mask=prompt_mask.to(out_dev),
        tokens=res[0].reshape(shape).to(out_dev),
        mask=res[1].reshape(shape).to(out_dev),
        env_mask=res[2].reshape(shape).to(out_dev),
        logprobs=res[3].reshape(shape).to(out_dev),
        sum_pi_sq=res[4].reshape(shape).to(out_dev),
        entropy=res[5].reshape(shape).to(out_dev),
        rewards=rewards.to(out_dev),
        lengths=res[1].sum(-1).long().reshape(P, G).to(out_dev),
        prompts=[p.text for p in prompts],
        texts=[texts[p * G:(p + 1) * G] for p in range(P)],
        meta={
            "task": task.name, "knobs": dict(task.knobs), "reward": reward,
            "policy": policy.name, "seed": None if generator is not None else int(seed),
            "max_new_tokens": T, "temperature": float(temperature), "top_k": top_k,
            "top_p": top_p, "greedy": bool(greedy),
            "on_policy": plain and not greedy,
            "prompt_objects": list(prompts),
        },
    )


def _stepper(model):
    """``step(ids, attn, pos, cache) -> (cache, last logits [B, V])`` for this transformers."""
    params = inspect.signature(model.forward).parameters
    # transformers >= 5.2x renamed past_key_values to cache; older 5.x only knows the old name.
    key = "cache" if "cache" in params else "past_key_values"
    keep = {"logits_to_keep": 1} if "logits_to_keep" in params else {}

    def step(ids, attn, pos, cache):
        kw = {key: cache} if cache is not None else {}
        out = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True,
                    **keep, **kw)
        new = getattr(out, "cache", None)
        if new is None:
            new = out.past_key_values
        return new, out.logits[:, -1]

    return step


def _decode(tok, ids: torch.Tensor, real: torch.Tensor) -> str:
    return tok.decode(ids[real > 0].tolist(), skip_special_tokens=True)


def _can_repeat(model) -> bool:
    """Whether this model's cache class can copy batch rows (transformers' Cache can)."""
    from transformers.cache_utils import Cache

    return hasattr(Cache, "batch_repeat_interleave") and hasattr(Cache, "batch_select_indices")


def _env_turn(task, prompts, G, tok, tokens, mask, env, t, act, cand, queues, pending,
              turn_ids, T) -> torch.Tensor:
    """Run the environment for active rows whose policy just ended a turn at step t.

    ``cand`` [A] marks active slots that emitted a policy token; returns [A] bool of slots
    whose episode the environment ended. Replies are queued (truncated to the budget).
    """
    ended = torch.zeros_like(cand)
    if len(turn_ids) == 1:
        cand = cand & (tokens[act, t] == turn_ids[0])
    for s in cand.nonzero().flatten().tolist():
        b = int(act[s])
        text = _decode(tok, tokens[b, : t + 1], mask[b, : t + 1] + env[b, : t + 1])
        if len(turn_ids) != 1 and not text.endswith(task.turn_end):
            continue
        reply = task.env_step(prompts[b // G], text)
        if reply is None:
            ended[s] = True
            continue
        ids = tok(reply, add_special_tokens=False)["input_ids"][: max(0, T - t - 1)]
        queues[b].extend(ids)
        if ids:
            pending.add(b)
    return ended
