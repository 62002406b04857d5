"""Bring your own rollouts: responses sampled elsewhere (vLLM, verl, ...) from the policy's
checkpoint, read into the same :class:`RolloutBatch` :func:`~varbench.rollout.sample` returns.

    rollouts = read_rollouts("rollouts.jsonl", policy, task)
    batch = rollouts.batch(range(4), 0, 8)      # 4 prompts x their first 8 responses

The file (``.jsonl``, one JSON object a line, or ``.parquet``, needs the ``parquet`` extra:
``pip install 'varbench[parquet]'``) has one row per response. Columns (aliases in brackets,
the names vLLM's outputs and verl's dumps use):

- ``prompt`` [``input``]: the text the model was fed, chat template applied (a task's
  ``Prompt.text``); encoded as the sampler encodes prompts (the tokenizer's special tokens
  added). And/or ``prompt_ids`` [``prompt_token_ids``]: its token ids (they win; with both,
  the text must encode to them or be their decoding, with or without special tokens: verl
  dumps prompts decoded without them).
- ``response`` [``output``]: the response text, special tokens spelled out (vLLM's
  ``skip_special_tokens=False``: a stop token must be in it, ``<eos>``, or the response is
  taken as cut off); encoded without adding special tokens. And/or ``response_ids``
  [``token_ids``, ``output_ids``]: its token ids, the stop token included (they win; with
  both, they must decode to the text, with or without special tokens).
- ``reward`` [``score``]: the scalar reward (finite).
- optional ``logprobs`` [``rollout_log_probs``, ``old_log_probs``]: the behaviour
  log-probs, one per response token (log pi at temperature 1; environment tokens' values are
  ignored); checked against the checkpoint's (below).
- optional ``group`` [``uid``]: rows of one group (default: rows with equal prompt ids; two
  uids of one prompt are two groups, as verl draws them).
- optional ``env_mask``: 1 on environment (tool output) tokens of a multi-turn response, one
  per response token (``response_ids`` needed).

Rows are grouped by prompt in order of first appearance; a prompt's responses keep the file's
order. The returned batch is built as the sampler builds its own (left-padded prompts,
right-padded responses, ``T`` the longest response); ``logprobs``, ``sum_pi_sq`` and
``entropy`` are recomputed by the policy (one teacher-forced forward), never read from the file.

Checks (each a :class:`UsageError` naming the file, the row and the value): missing columns
(naming the valid ones); token ids outside the model's vocabulary; text that does not
round-trip through the policy's tokenizer (a mismatched tokenizer); behaviour log-probs whose
mean absolute difference from the checkpoint's over a response's policy tokens exceeds
``logprob_tol`` (a mismatched checkpoint; default :func:`default_logprob_tol` of the model's
dtype); a NaN or infinite reward; a response longer than the task's ``max_new_tokens`` (a
fixed-length task: not exactly that long); too few responses for what an analysis needs.
Rewards (the analyses read with ``"check"``): where
a file's prompt is one of ``known`` (the task's own prompts, which the task can score), each
response is re-scored with the task's reward and a disagreement beyond 1e-6 refuses
(``rescore="check"``), warns (``"warn"``) or is not looked at (``"off"``): the file's reward
is the one used either way; prompts the task does not know keep the file's rewards unchecked.
The log-probs are checked for the responses a batch uses, when it is built.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from varbench._util.checks import UsageError, UsageFileNotFoundError, check_choice
from varbench._util.io import check_path, file_sha256, jsonl_rows, parquet_rows
from varbench.models.logits import sequence_stats, stat_dtype
from varbench.models.presets import Policy
from varbench.rollout.batch import RolloutBatch
from varbench.rollout.sampler import sampling_prompts, stop_set, truncated_rows
from varbench.tasks.base import Prompt, Task
from varbench.tasks.verifiers import note_responses

# canonical column -> the names it is read from, first found wins
COLUMNS: dict[str, tuple[str, ...]] = {
    "prompt": ("prompt", "input"),
    "prompt_ids": ("prompt_ids", "prompt_token_ids"),
    "response": ("response", "output"),
    "response_ids": ("response_ids", "token_ids", "output_ids"),
    "reward": ("reward", "score"),
    "logprobs": ("logprobs", "rollout_log_probs", "old_log_probs"),
    "group": ("group", "uid"),
    "env_mask": ("env_mask",),
}
RESCORE = ("check", "warn", "off")
REWARD_ATOL = 1e-6  # a re-scored reward differing by more disagrees with the file's
# Default tolerance of the mean |behaviour - checkpoint| log-prob over a response's tokens, by
# the model's dtype. Measured on the CPU (presets tiny and small, arith and toolsum, 32
# responses each): the sampler's own log-probs against this module's recomputation differ by
# at most 2.7e-7 a token on average over a response in float32, 2.6e-4 in float16 and 1.8e-3
# in bfloat16; two engines' kernels (vLLM against a transformers forward) differ more, by an
# amount not measured here, so the half-precision defaults leave room for it. A checkpoint of
# other random weights differed by 0.037-0.078 (near-uniform policies: a trained checkpoint's
# peaked log-probs move more), so in half precision the default does not catch every other
# checkpoint; a nearby one (a small update) passes at any default: lower the tolerance then.
_DEFAULT_TOL = {torch.float64: 1e-6, torch.float32: 1e-3, torch.float16: 2e-2,
                torch.bfloat16: 5e-2}


def default_logprob_tol(dtype: torch.dtype) -> float:
    """The default ``logprob_tol`` of a model in ``dtype`` (module docstring)."""
    return _DEFAULT_TOL.get(dtype, 1e-3)


@dataclass
class _Row:
    line: int  # 1-based row of the file (JSONL: the n-th object, blank lines not counted)
    prompt_ids: tuple[int, ...]
    prompt_text: str | None
    response_ids: list[int]
    env: list[int]  # 1 on environment tokens
    reward: float
    logprobs: list[float] | None


@dataclass
class Rollouts:
    """A file's responses grouped by prompt, tokenized and checked for ``policy``."""

    path: Path
    policy: Policy
    task: Task
    prompts: list[Prompt]  # one per group, in order of first appearance
    rows: list[list[_Row]]  # each prompt's responses, in the file's order
    sha256: str
    reward: str
    logprob_tol: float
    tol_source: str  # "the default for <dtype>" or "given"
    known: list[bool] = field(default_factory=list)  # prompt p is one of the task's own

    def describe(self) -> str:
        """``path (sha256 ...)``: what results computed from this file depend on."""
        return f"{self.path} (sha256 {self.sha256[:16]})"

    def require(self, n_prompts: int, per_prompt: int, *, what: str) -> list[Prompt]:
        """The first ``n_prompts`` prompts, each with at least ``per_prompt`` responses;
        UsageError naming the file, the prompt, its count and ``what`` needs them."""
        if len(self.prompts) < n_prompts:
            raise UsageError(f"rollouts={str(self.path)!r} holds {len(self.prompts)} prompt(s); "
                             f"{what} needs n_prompts={n_prompts}: lower --prompts or add "
                             "prompts to the file")
        for p in range(n_prompts):
            if len(self.rows[p]) < per_prompt:
                raise UsageError(
                    f"rollouts={str(self.path)!r}: prompt {p} ({self.prompts[p].text[:60]!r}, "
                    f"first at row {self.rows[p][0].line}) has {len(self.rows[p])} responses; "
                    f"{what} needs {per_prompt} per prompt")
        return self.prompts[:n_prompts]

    def check_scorable(self, prompts: Iterable[int], *, what: str) -> None:
        """UsageError unless the task knows every prompt of ``prompts`` (its answer: needed
        to score responses the file does not hold, e.g. an enumerated reference)."""
        bad = [p for p in prompts if not self.known[p]]
        if bad:
            raise UsageError(
                f"rollouts={str(self.path)!r}: prompt {bad[0]} ({self.prompts[bad[0]].text[:60]!r}"
                f") is not one of task {self.task.name!r}'s prompts, so it cannot be scored; "
                f"{what} needs that: use reference='sampled'")

    def batch(self, prompts: Sequence[int], start: int, n: int) -> RolloutBatch:
        """``[len(prompts), n, T]`` batch of responses ``start .. start + n - 1`` of each
        prompt index of ``prompts``; the model's statistics recomputed, the behaviour log-probs
        checked (UsageError on a mismatch or too few responses)."""
        prompts = list(prompts)
        if not prompts or n < 1:
            raise UsageError(f"rollouts: a batch needs prompts and n >= 1, got {prompts}, {n}")
        for p in prompts:
            if not 0 <= p < len(self.rows):
                raise UsageError(f"rollouts={str(self.path)!r} holds {len(self.rows)} prompts; "
                                 f"prompt {p} was asked for")
            if len(self.rows[p]) < start + n:
                raise UsageError(
                    f"rollouts={str(self.path)!r}: prompt {p} ({self.prompts[p].text[:60]!r}) "
                    f"has {len(self.rows[p])} responses; responses {start}..{start + n - 1} "
                    "were asked for")
        return _build(self, prompts, [self.rows[p][start:start + n] for p in prompts])

    def pool(self, p: int, *, reserve: int = 0) -> _Pool:
        """Prompt ``p``'s responses as disjoint draws: :meth:`_Pool.draw` hands out the next
        ones from the front, :meth:`_Pool.reference` the last ``reserve`` (never both)."""
        return _Pool(self, p, reserve)


class _Pool:
    """One prompt's responses, handed out in disjoint slices (see :meth:`Rollouts.pool`)."""

    def __init__(self, rollouts: Rollouts, p: int, reserve: int) -> None:
        self.rollouts, self.p, self.reserve, self.used = rollouts, p, reserve, 0

    def draw(self, n: int) -> RolloutBatch:
        """The next ``n`` responses from the front (``[1, n, T]``); UsageError when they would
        reach the ``reserve`` kept for the reference."""
        r = self.rollouts
        have = len(r.rows[self.p]) - self.reserve
        if self.used + n > have:
            raise UsageError(
                f"rollouts={str(r.path)!r}: prompt {self.p} ({r.prompts[self.p].text[:60]!r}) "
                f"has {len(r.rows[self.p])} responses; its groups need {self.used + n} plus "
                f"{self.reserve} for the reference")
        b = r.batch([self.p], self.used, n)
        self.used += n
        return b

    def reference(self, n: int) -> RolloutBatch:
        """The last ``n`` responses (``[1, n, T]``), kept apart from the groups' draws."""
        r = self.rollouts
        if n > self.reserve:
            raise UsageError(f"rollouts: reference of {n} responses, {self.reserve} reserved")
        return r.batch([self.p], len(r.rows[self.p]) - n, n)


def read_rollouts(path: str | Path, policy: Policy, task: Task, *,
                  known: Sequence[Prompt] = (), reward: str | None = None,
                  logprob_tol: float | str = "auto", rescore: str = "check") -> Rollouts:
    """Read and check a rollouts file for ``policy`` and ``task`` (module docstring).

    ``known``: prompts the task can score (e.g. ``task.prompts(n, seed=s)``); a file prompt
    with the same text is re-scored (``rescore``). ``logprob_tol``: ``"auto"`` (the model
    dtype's :func:`default_logprob_tol`) or a positive number.
    """
    p = check_path("rollouts", path)
    check_choice("rescore", rescore, RESCORE)
    reward = task.check_reward(reward)
    dtype = next(policy.model.parameters()).dtype
    source = "given"
    if logprob_tol == "auto":
        tol = default_logprob_tol(dtype)
        source = f"the default for {str(dtype).removeprefix('torch.')}"
    elif isinstance(logprob_tol, (int, float)) and not isinstance(logprob_tol, bool) and (
            math.isfinite(logprob_tol) and logprob_tol > 0):
        tol = float(logprob_tol)
    else:
        raise UsageError(f"logprob_tol={logprob_tol!r} is not valid; give 'auto' or a positive "
                         "number")
    raw = _read_file(p)
    cols = _columns(p, raw)
    if task.multi_turn and "env_mask" not in cols:
        raise UsageError(
            f"rollouts={str(p)!r}: task {task.name!r} is multi-turn; give response_ids and "
            "env_mask (1 on tool output tokens): without it no token is the environment's")
    rows = [_parse(p, i, r, cols, policy) for i, r in enumerate(raw, 1)]
    T = task.max_new_tokens
    for r in rows:
        n = len(r.response_ids)
        if n > T or (task.fixed_length and n != T):
            raise UsageError(
                f"rollouts={str(p)!r} row {r.line}: a response of {n} tokens; task "
                f"{task.name!r} has {'exactly' if task.fixed_length else 'at most'} "
                f"max_new_tokens={T} (its length knob)")
    groups: dict[Any, list[_Row]] = {}
    keys: dict[Any, tuple[int, ...]] = {}
    for r, x in zip(rows, raw, strict=True):
        key = x.get(cols["group"]) if "group" in cols else None
        key = r.prompt_ids if key is None else ("group", json.dumps(key, sort_keys=True))
        if key in keys and keys[key] != r.prompt_ids:
            raise UsageError(f"rollouts={str(p)!r} row {r.line}: group {key[1]} has another "
                             f"prompt than its first row {groups[key][0].line}")
        keys[key] = r.prompt_ids
        groups.setdefault(key, []).append(r)
    by_text = {q.text: q for q in known}
    tok = policy.tokenizer
    prompts, is_known = [], []
    for rs in groups.values():
        text = rs[0].prompt_text
        if text is None:
            text = tok.decode(list(rs[0].prompt_ids), skip_special_tokens=True)
        q = by_text.get(text)
        if q is not None and tuple(tok(q.text, add_special_tokens=True)["input_ids"]) != (
                rs[0].prompt_ids):
            q = None  # the same text, other ids: not the task's prompt as the sampler feeds it
        prompts.append(q if q is not None else Prompt(text, ""))
        is_known.append(q is not None)
    out = Rollouts(path=p, policy=policy, task=task, prompts=prompts, rows=list(groups.values()),
                   sha256=file_sha256(p), reward=reward, logprob_tol=tol, tol_source=source,
                   known=is_known)
    if rescore != "off":
        _rescore(out, rescore)
    return out


def _read_file(p: Path) -> list[dict[str, Any]]:
    """The file's rows as dicts (JSONL or Parquet)."""
    if not p.exists():
        raise UsageFileNotFoundError(f"rollouts={str(p)!r}: no such file")
    ext = p.suffix.lower()
    if ext == ".jsonl":
        rows = jsonl_rows(p, p.read_text(encoding="utf-8"), what="rollouts")
    elif ext == ".parquet":
        rows = parquet_rows(p, what="rollouts", extra="parquet")
    else:
        raise UsageError(f"rollouts={str(p)!r}: unknown extension {p.suffix!r}; choose one of "
                         "['.jsonl', '.parquet']")
    if not rows:
        raise UsageError(f"rollouts={str(p)!r} holds no rows")
    return rows


_NEED = (("prompt", "prompt_ids"), ("response", "response_ids"), ("reward",))  # one of each


def _spelled(alts: Sequence[str]) -> str:
    """``'reward (or score)'``, ``'prompt (or input) or prompt_ids (or prompt_token_ids)'``."""
    return " or ".join(f"{a} (or {'/'.join(COLUMNS[a][1:])})" if len(COLUMNS[a]) > 1 else a
                       for a in alts)


def check_columns(path: str | Path) -> None:
    """UsageError, before any model is built, when the rollouts file at ``path`` is missing,
    of an unknown kind, or lacks a needed column (read from a Parquet file's schema or a
    JSONL file's first row; every row is checked when the file is read)."""
    p = check_path("rollouts", path)
    if not p.exists():
        raise UsageFileNotFoundError(f"rollouts={str(p)!r}: no such file")
    if p.suffix.lower() == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UsageError(f"rollouts={str(p)!r}: reading .parquet needs pyarrow; pip install "
                             "'varbench[parquet]'") from None
        try:
            names = pq.read_schema(p).names
        except Exception as err:  # noqa: BLE001 - a corrupt file: name it
            raise UsageError(f"rollouts={str(p)!r}: cannot read parquet file ({err})") from None
        _columns(p, [dict.fromkeys(names, 0)], rows=False)
        return
    if p.suffix.lower() != ".jsonl":
        _read_file(p)  # the extension's error
    with p.open(encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), None)
    if first is None:
        raise UsageError(f"rollouts={str(p)!r} holds no rows")
    try:
        row = json.loads(first)
    except json.JSONDecodeError as err:
        raise UsageError(f"rollouts={str(p)!r}: its first row is not valid JSON ({err})"
                         ) from None
    if not isinstance(row, dict):
        raise UsageError(f"rollouts={str(p)!r}: its first row is not a JSON object")
    _columns(p, [row], rows=False)


def _columns(p: Path, raw: list[dict[str, Any]], *, rows: bool = True) -> dict[str, str]:
    """Canonical column -> the file's name for it; UsageError naming the missing ones."""
    names = set().union(*(r.keys() for r in raw))
    cols = {c: next(a for a in al if a in names) for c, al in COLUMNS.items()
            if any(a in names for a in al)}
    valid = ", ".join(_spelled([c]) for c in COLUMNS)
    for alts in _NEED:
        if not any(a in cols for a in alts):
            raise UsageError(f"rollouts={str(p)!r}: no column {_spelled(alts)}; its columns "
                             f"are {sorted(names)}; valid columns: {valid}")
    for i, r in enumerate(raw if rows else (), 1):
        for alts in _NEED:
            if all(r.get(cols[a]) is None for a in alts if a in cols):
                raise UsageError(f"rollouts={str(p)!r} row {i}: {_spelled(alts)} missing")
    return cols


def _ids(p: Path, line: int, name: str, value: Any, V: int) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in value):
        raise UsageError(f"rollouts={str(p)!r} row {line}: {name}={str(value)[:80]} is not a "
                         "list of token ids")
    bad = [x for x in value if not 0 <= x < V]
    if bad:
        raise UsageError(f"rollouts={str(p)!r} row {line}: {name} holds id {bad[0]} outside the "
                         f"model's vocabulary [0, {V}) (a mismatched tokenizer or checkpoint?)")
    return list(value)


def _text_ids(p: Path, line: int, x: dict[str, Any], cols: dict[str, str], name: str,
              V: int) -> tuple[str | None, list[int] | None]:
    """The row's ``name`` (prompt / response) text and ``<name>_ids``, either None if absent."""
    text = x.get(cols[name]) if name in cols else None
    if text is not None and not isinstance(text, str):
        raise UsageError(f"rollouts={str(p)!r} row {line}: {name}={text!r} is not text")
    ids = x.get(cols[f"{name}_ids"]) if f"{name}_ids" in cols else None
    return text, None if ids is None else _ids(p, line, f"{name}_ids", ids, V)


def _parse(p: Path, line: int, x: dict[str, Any], cols: dict[str, str], policy: Policy) -> _Row:
    """One row tokenized and checked (module docstring)."""
    tok = policy.tokenizer
    V = int(policy.model.get_output_embeddings().weight.shape[0])
    where = f"rollouts={str(p)!r} row {line}"
    ptext, pids = _text_ids(p, line, x, cols, "prompt", V)
    if ptext is not None:
        enc = tok(ptext, add_special_tokens=True)["input_ids"]
        if pids is None:
            _round_trip(where, "prompt", ptext, tok, enc, special=True)
            pids = enc
        elif enc != pids and ptext not in (tok.decode(pids, skip_special_tokens=True),
                                           tok.decode(pids, skip_special_tokens=False)):
            # verl dumps the prompt decoded without special tokens: either spelling agrees
            raise UsageError(f"{where}: prompt {ptext[:60]!r} encodes to {enc[:12]}..., not the "
                             f"row's prompt_ids {pids[:12]}... (a mismatched tokenizer or chat "
                             "template)")
    if not pids:
        raise UsageError(f"{where}: empty prompt")
    rtext, rids = _text_ids(p, line, x, cols, "response", V)
    if rids is not None:
        if rtext is not None and rtext not in (tok.decode(rids, skip_special_tokens=False),
                                               tok.decode(rids, skip_special_tokens=True)):
            raise UsageError(f"{where}: response_ids decode to "
                             f"{tok.decode(rids, skip_special_tokens=False)[:60]!r}, not the "
                             f"row's response {rtext[:60]!r} (a mismatched tokenizer)")
    else:
        rids = tok(rtext, add_special_tokens=False)["input_ids"]
        _round_trip(where, "response", rtext, tok, rids, special=False)
    if not rids:
        raise UsageError(f"{where}: empty response (the sampler's hold at least one token)")
    env = [0] * len(rids)
    if "env_mask" in cols and x.get(cols["env_mask"]) is not None:
        env = x[cols["env_mask"]]
        if not isinstance(env, (list, tuple)) or len(env) != len(rids) or any(
                e not in (0, 1) for e in env):
            raise UsageError(f"{where}: env_mask={str(env)[:80]} is not a 0/1 list of "
                             f"{len(rids)} values (one per response token)")
        env = [int(e) for e in env]
    r = x.get(cols["reward"])
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
        raise UsageError(f"{where}: reward={r!r} is not a finite number")
    lp = x.get(cols["logprobs"]) if "logprobs" in cols else None
    if lp is not None:
        if not isinstance(lp, (list, tuple)) or any(
                isinstance(v, bool) or not isinstance(v, (int, float)) for v in lp):
            raise UsageError(f"{where}: logprobs={str(lp)[:80]} is not a list of numbers")
        if len(lp) != len(rids):
            raise UsageError(f"{where}: {len(lp)} logprobs for a response of {len(rids)} tokens "
                             "(one per response token; a mismatched tokenizer?)")
        lp = [float(v) for v in lp]
    return _Row(line, tuple(pids), ptext, rids, env, float(r), lp)


def _round_trip(where: str, name: str, text: str, tok, ids: list[int], *, special: bool) -> None:
    """UsageError unless ``ids`` (``text`` encoded) decode back to ``text``: a tokenizer that
    cannot spell the text (unknown characters) is not the one that wrote it."""
    back = tok.decode(ids, skip_special_tokens=special)
    if back != text:
        at = next((i for i, (a, b) in enumerate(zip(back, text, strict=False)) if a != b),
                  min(len(back), len(text)))
        raise UsageError(f"{where}: {name} {text[:60]!r} does not round-trip through the "
                         f"policy's tokenizer (decodes to {back[:60]!r}, first difference at "
                         f"character {at}): a mismatched tokenizer")


def _decode(tok, r: _Row) -> str:
    """The response's text as the sampler decodes it (real tokens, special tokens skipped)."""
    return tok.decode(r.response_ids, skip_special_tokens=True)


def _rescore(ro: Rollouts, how: str) -> None:
    """Re-score the responses of prompts the task knows; refuse or warn on disagreement."""
    tok, bad = ro.policy.tokenizer, []
    for q, known, rs in zip(ro.prompts, ro.known, ro.rows, strict=True):
        if not known:
            continue
        for r in rs:
            s = float(ro.task.score(q, _decode(tok, r), ro.reward))
            if abs(s - r.reward) > REWARD_ATOL:
                bad.append((r.line, r.reward, s))
    if not bad:
        return
    line, got, want = bad[0]
    msg = (f"rollouts={str(ro.path)!r} row {line}: reward {got!r} but task {ro.task.name!r} "
           f"scores the response {want!r} (reward {ro.reward!r}); {len(bad)} row(s) disagree")
    if how == "check":
        raise UsageError(msg + "; fix the rewards or the task/reward the analysis uses")
    warnings.warn(msg + "; the file's rewards are used", UserWarning, stacklevel=3)


def _build(ro: Rollouts, prompts: list[int], rows: list[list[_Row]]) -> RolloutBatch:
    """The RolloutBatch of ``rows[k]`` (responses of prompt ``prompts[k]``), as the sampler
    lays it out; the policy's statistics from one teacher-forced forward per chunk."""
    policy, task, tok = ro.policy, ro.task, ro.policy.tokenizer
    dev = policy.device
    P, G = len(rows), len(rows[0])
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    pids = [rs[0].prompt_ids for rs in rows]
    Lp = max(len(x) for x in pids)
    T = max(len(r.response_ids) for rs in rows for r in rs)
    if Lp + T > policy.context_length:
        raise UsageError(f"rollouts={str(ro.path)!r}: a prompt of {Lp} tokens + a response of "
                         f"{T} exceeds the context of {policy.context_length} tokens of policy "
                         f"{policy.name!r}")
    prompt_ids = torch.tensor([[pad] * (Lp - len(x)) + list(x) for x in pids], dtype=torch.long,
                              device=dev)
    prompt_mask = torch.tensor([[0] * (Lp - len(x)) + [1] * len(x) for x in pids],
                               dtype=torch.long, device=dev)
    flat = [r for rs in rows for r in rs]
    tokens = torch.tensor([r.response_ids + [pad] * (T - len(r.response_ids)) for r in flat],
                          dtype=torch.long, device=dev).reshape(P, G, T)
    env = torch.tensor([r.env + [0] * (T - len(r.env)) for r in flat], dtype=torch.float32,
                       device=dev).reshape(P, G, T)
    real = torch.tensor([[1] * len(r.response_ids) + [0] * (T - len(r.response_ids))
                         for r in flat], dtype=torch.float32, device=dev).reshape(P, G, T)
    mask = real - env
    rewards = torch.tensor([r.reward for r in flat], dtype=torch.float32, device=dev)
    zeros = torch.zeros((P, G, T), device=dev)
    batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, tokens=tokens,
                         mask=mask, env_mask=env, logprobs=zeros, sum_pi_sq=zeros,
                         entropy=zeros, rewards=rewards.reshape(P, G),
                         lengths=mask.sum(-1).long())
    lp, spsq, ent = _model_stats(policy, batch)
    batch.logprobs, batch.sum_pi_sq, batch.entropy = lp, spsq, ent
    _check_logprobs(ro, flat, lp.reshape(P * G, T), mask.reshape(P * G, T))
    texts = [_decode(tok, r) for r in flat]
    stop_ids, stop_texts = stop_set(policy, task)
    n_cut = 0  # as the sampler counts: cut at max_new_tokens without a stop token
    if not task.fixed_length and T == task.max_new_tokens:
        n_cut = int(truncated_rows(tokens.reshape(P * G, T), real.reshape(P * G, T).sum(-1).long(),
                                   T, stop_ids).sum())
    note_responses(task, n=P * G, n_zero=sum(1 for r in flat if r.reward == 0),
                   n_truncated=n_cut, max_new_tokens=task.max_new_tokens)
    batch.prompts = [ro.prompts[p].text for p in prompts]
    batch.texts = [texts[k * G:(k + 1) * G] for k in range(P)]
    batch.meta = {
        "task": task.name, "knobs": dict(task.knobs), "reward": ro.reward,
        "policy": policy.name, "seed": None, "max_new_tokens": task.max_new_tokens,
        "on_policy": True, "prompt_objects": [ro.prompts[p] for p in prompts],
        "stop_ids": list(stop_ids), "stop_strings": list(stop_texts), "truncated": n_cut,
        "rollouts": ro.describe(), "rows": [[r.line for r in rs] for rs in rows],
    }
    return batch


@torch.no_grad()
def _model_stats(policy: Policy, batch: RolloutBatch):
    """``[P, G, T]`` log pi, sum pi^2 and entropy of the batch's tokens under the policy (0 off
    ``mask``), a chunk of prompts at a time (the sampler's memory plan)."""
    P, G, T = batch.tokens.shape
    flat = batch.flat()
    Lp = flat.prompt_len
    per = sampling_prompts(policy, P, G, Lp + T)
    sdt = stat_dtype(next(policy.model.parameters()).dtype)  # the sampler's statistics' dtype
    parts = []
    for p0 in range(0, P, per):
        r = slice(p0 * G, min(P, p0 + per) * G)
        m = batch.mask.reshape(P * G, T)[r]
        st = sequence_stats(policy.model, flat.input_ids[r], flat.attention_mask[r], start=Lp,
                            mask=m, dtype=sdt)
        parts.append([x * m.to(x.dtype) for x in (st.logp, st.sum_pi_sq, st.entropy)])
    return tuple(torch.cat([pt[i] for pt in parts]).reshape(P, G, T) for i in range(3))


def _check_logprobs(ro: Rollouts, flat: list[_Row], lp: torch.Tensor, mask: torch.Tensor) -> None:
    """UsageError naming the first row whose behaviour log-probs' mean absolute difference
    from the checkpoint's ``lp`` exceeds the tolerance (a mismatched checkpoint)."""
    have = [b for b, r in enumerate(flat) if r.logprobs is not None]
    if not have:
        return
    T = lp.shape[1]
    beh = torch.tensor([flat[b].logprobs + [0.0] * (T - len(flat[b].logprobs)) for b in have],
                       dtype=torch.float64, device=lp.device)
    m = mask[have].double()
    diff = (beh - lp[have].double()).abs() * m
    mean = diff.sum(-1) / m.sum(-1).clamp(min=1)
    over = (mean > ro.logprob_tol).nonzero().flatten().tolist()
    if not over:
        return
    k = over[0]
    r, t = flat[have[k]], int(diff[k].argmax())
    raise UsageError(
        f"rollouts={str(ro.path)!r} row {r.line}: behaviour log-probs differ from policy "
        f"{ro.policy.name!r}'s by {float(mean[k]):.3g} nats a token on average (token {t}: "
        f"{r.logprobs[t]:.6g} in the file, {float(lp[have[k], t]):.6g} recomputed), above "
        f"logprob_tol={ro.logprob_tol:g} ({ro.tol_source}): the responses were sampled from "
        f"another checkpoint ({len(over)} of {len(have)} rows differ); raise --logprob-tol "
        "only if they come from this one")


def rollouts_key(path: str | Path | None, logprob_tol: float | str) -> dict[str, Any]:
    """An analysis config's entries for a rollouts file (its cache key and provenance: the
    path, its content hash, the tolerance); ``{}`` without one, so the keys of sampling runs
    stay what they were."""
    if path is None:
        return {}
    p = check_path("rollouts", path)
    if not p.exists():
        raise UsageFileNotFoundError(f"rollouts={str(p)!r}: no such file")
    return {"rollouts": f"{p} (sha256 {file_sha256(p)[:16]})", "logprob_tol": logprob_tol}


def rollouts_note(path: str | Path | None) -> tuple[str, ...]:
    """The cost notice's clause for a rollouts file (``()`` without one): its responses are
    read, not sampled."""
    return () if path is None else (f"responses read from rollouts={str(path)!r}, not sampled",)


def variance_rollouts(path: str | Path, policy: Policy, task: Task, prompts: Sequence[Prompt],
                      *, reward: str, logprob_tol: float | str, groups: int, G: int,
                      reserve: int, exact_reference: bool) -> tuple[list[Prompt], Rollouts]:
    """``(prompts, rollouts)`` of the variance analysis on a file: its first ``len(prompts)``
    prompts (``prompts``, the task's own for the run's seed, are the known ones), each holding
    ``groups`` groups of ``G`` and ``reserve`` more for the sampled reference (else a
    UsageError naming how many); an exact reference needs prompts the task can score."""
    ro = read_rollouts(path, policy, task, known=prompts, reward=reward,
                       logprob_tol=logprob_tol)
    ref = f" + n_ref={reserve}" if reserve else ""
    out = ro.require(len(prompts), groups * G + reserve,
                     what=f"variance ({groups} groups of G={G}{ref})")
    if exact_reference:
        ro.check_scorable(range(len(prompts)), what="reference='exact'")
    return out, ro


def rollout_batch(path: str | Path, policy: Policy, task: Task, n_prompts: int, G: int, *,
                  seed: int = 0, reward: str | None = None, logprob_tol: float | str = "auto",
                  what: str = "this analysis") -> RolloutBatch:
    """What ``sample(policy, task, task.prompts(n_prompts, seed=seed), G)`` returns, read from
    a rollouts file instead: its first ``n_prompts`` prompts x the first ``G`` responses of
    each (fewer is a UsageError naming ``what``). The task's own prompts of that call are the
    ``known`` ones (re-scored, :func:`read_rollouts`)."""
    ro = read_rollouts(path, policy, task, known=task.prompts(n_prompts, seed=seed),
                       reward=reward, logprob_tol=logprob_tol)
    ro.require(n_prompts, G, what=f"{what} (G={G})")
    return ro.batch(range(n_prompts), 0, G)
