"""The one memory plan: peak bytes per chunk of every path and the chunk sizes that fit.

Every path that scales with tokens, responses or batch asks :func:`plan` (or
:func:`plan_from_config`, before any model is loaded) instead of guessing: the per-token
gradient harness (``token_norms``: cotangents per batched backward), the per-sequence norms
(``sequence_norms``: rows per forward+backward), the per-token vectors (``vectors``:
cotangents, the gradient block aside), the logit statistics (``logits``: positions per head
matmul), sampling (``sampling``: rows per KV cache) and the training step's log-probs
(``train_logprobs``: rows per forward+backward). A plan is ``fixed + chunk * unit`` bytes
beyond the parameters; ``chunk`` is the largest that keeps it inside the budget (``fraction``
of the free device memory; no budget, i.e. the CPU: the path's default). A model whose one-unit
chunk does not fit is refused by :func:`check_plan`, naming the bytes it needs.

The terms (e: the model's bytes per element, a: the accumulation's, 4 or 8; L: the prefix of a
unit, h/i/V: hidden, intermediate, vocabulary; per layer and position ``width`` module outputs)
were traced with :class:`LiveBytes`: on the CPU at small scale (tests/test_memplan.py,
tests/test_memplan_budget.py) and on fake full-size models, the real functions where they can
run there (benchmarks/plan_scale.py: planned within 15% of traced for Qwen2-0.5B, Qwen2.5-1.5B,
Gemma-2-2B and Llama-3-8B). The per-token harness's peak is the largest of its phases
(:func:`_token_phases`): a plan holds ``(fixed, unit)`` per phase and its chunk fits all;
- the batched vocabulary backward costs ``3a`` bytes per ``L V`` element and cotangent, beside
  the previous chunk's cotangents (still referenced while the next backward runs);
- a tied head's per-token gradient ``[C, V h]``: autograd's sum of the embedding's and the
  head's parts (``3e``), then its float32 copy and prefix sum;
- the kept activations of a training forward are ``9h e + 4[e < 4] h + 4 i e`` bytes per
  layer and position (RMS norms keep a float32 copy of their input in low precision).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from varbench._util.checks import UsageError, check_choice

PATHS = ("token_norms", "sequence_norms", "vectors", "logits", "sampling", "train_logprobs")
UNITS = {"token_norms": "cotangents", "sequence_norms": "rows", "vectors": "cotangents",
         "logits": "positions", "sampling": "rows", "train_logprobs": "rows"}
MEMORY_FRACTION = 0.5  # share of the free device memory a chunk may take (the rest: the
# allocator's fragmentation, other processes and what the estimate misses)
MAX_COTANGENTS = 512  # cotangents per batched backward at most (the vmap's batch)
DEFER_ELEMENTS = 1 << 24  # the sampler defers a step's statistics into one [rows, T, V]
# float32 buffer when it holds at most this many elements (varbench.rollout.sampler)
HEADROOM = 0.95  # a chunk is planned into this share of the budget: traced peaks of the
# terms' coefficients run up to ~2% above them (a bfloat16 tied head: 10.13, not 10, bytes)


@dataclass(frozen=True)
class ModelShape:
    """What the plan reads of a model: sizes of a decoder, its head, its dtype's bytes."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    elsize: int  # bytes per parameter element
    n_params: int
    norms: int = 2  # RMS norms per layer (4: Gemma-2/3's sandwich norms)
    softcap: bool = False  # the logits are soft-capped (Gemma-2: tanh(z / c) c, kept)

    @property
    def kv_dim(self) -> int:
        """Width of one layer's keys (= values): ``kv_heads * head_dim``."""
        return self.kv_heads * self.head_dim

    @property
    def acc(self) -> int:
        """Bytes of the statistics' dtype: float32 at least, float64 for a float64 model."""
        return 8 if self.elsize == 8 else 4

    @property
    def q_dim(self) -> int:
        """Width of one layer's queries: ``heads * head_dim`` (not always ``hidden``: Gemma-2)."""
        return self.heads * self.head_dim

    @property
    def width(self) -> int:
        """Module outputs per layer and position: q (q_dim), o, down (h), k, v (kv), gate,
        up (i)."""
        return self.q_dim + 2 * self.hidden + 2 * self.kv_dim + 2 * self.intermediate

    def linears(self) -> list[tuple[int, int]]:
        """``(in + 1, out)`` of each Linear of one layer (the ghost engine's input cache
        holds a column of ones for a bias)."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return [(h + 1, q), (h + 1, kv), (h + 1, kv), (q + 1, h), (h + 1, i), (h + 1, i),
                (i + 1, h)]

    @property
    def model_bytes(self) -> int:
        """Bytes of the parameters."""
        return self.n_params * self.elsize

    @classmethod
    def from_config(cls, config: Any, dtype: torch.dtype | str) -> ModelShape:
        """The shape of a transformers ``config`` (text config of a multimodal one) in ``dtype``."""
        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        h = int(cfg.hidden_size)
        heads = int(getattr(cfg, "num_attention_heads", 1) or 1)
        kvh = int(getattr(cfg, "num_key_value_heads", None) or heads)
        hd = int(getattr(cfg, "head_dim", None) or h // heads)
        inter = int(getattr(cfg, "intermediate_size", None) or 4 * h)
        layers = int(cfg.num_hidden_layers)
        V = int(cfg.vocab_size)
        tied = bool(getattr(config, "tie_word_embeddings", getattr(cfg, "tie_word_embeddings",
                                                                   False)))
        norms = 4 if str(getattr(cfg, "model_type", "")).startswith(("gemma2", "gemma3")) else 2
        per_layer = (h * heads * hd * 2 + h * kvh * hd * 2 + 3 * h * inter + norms * h)
        n = V * h * (1 if tied else 2) + layers * per_layer + h
        return cls(h, layers, heads, kvh, hd, inter, V, tied,
                   torch.empty((), dtype=dtype, device="meta").element_size(), n, norms,
                   bool(getattr(cfg, "final_logit_softcapping", None)))

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> ModelShape:
        """The shape of a loaded model: its config's sizes, its parameters' dtype and count,
        tied when the input embedding and the output head share one tensor."""
        p = next(model.parameters())
        n = sum(q.numel() for q in model.parameters())
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(cfg, "hidden_size"):
            # not a transformers decoder: every activation as large as the parameters
            return cls(0, 0, 1, 1, 0, 0, 0, False, p.element_size(), n)
        got = cls.from_config(cfg, p.dtype)
        tied = _tied(model)
        return cls(got.hidden, got.layers, got.heads, got.kv_heads, got.head_dim,
                   got.intermediate, got.vocab, got.tied if tied is None else tied,
                   got.elsize, n, got.norms, got.softcap)


def _tied(model: torch.nn.Module) -> bool | None:
    """Whether the input embedding and the output head share their weight (None: unknown)."""
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if get_in is None or get_out is None:
        return None
    try:
        e, o = get_in(), get_out()
    except (AttributeError, NotImplementedError):  # a wrapper without the accessors' modules
        return None
    we, wo = getattr(e, "weight", None), getattr(o, "weight", None)
    if we is None or wo is None:
        return None
    return we is wo


def _ghost_state(a: int, L: int, n_in: int, out: int) -> int:
    """Bytes the ghost engine keeps for one module over a row of ``L`` positions: its cached
    inputs ``[L, in]`` and Gram ``[L, L]`` and its running prefix, ``[L, out]`` in position
    mode or ``[out, in]`` in weight mode (chosen when ``in`` is below about ``2 L``: the
    larger of the two is counted there)."""
    run = L if n_in >= 2 * L else max(L, n_in)
    return a * (L * n_in + L * L + out * run)


def _token_phases(shape: ModelShape, path: str, L: int, materialised: int
                  ) -> list[tuple[int, int]]:
    """``(fixed, unit)`` bytes of each phase of one chunk of the per-token harness over a
    prefix of ``L`` (traced with the real ``token_grad_norms`` on fake full-size models,
    benchmarks/plan_scale.py, two chunks so the second holds what the first left):

    - every phase: the chunk forward's logits ``[L, V]`` (and their float32 copy), its kept
      activations, the ghost engine's per-module state (:func:`_ghost_state`), a tied head's
      running prefix ``[V h]`` (``a``; its next value beside it while it is replaced), and the
      previous chunk's
      cotangents (still referenced while the next backward runs): every module output
      (``n L width e`` per cotangent), a tied head's ``[V h]`` or an untied head's ``[L, V]``;
    - the vocabulary's backward: the batched gather backward's ``[C, L, V]`` gradient, its
      stack and its product in the log-probs' dtype (``3a`` per element and cotangent);
    - the backward's end: every cotangent of the chunk beside the previous chunk's (traced
      as the peak of an untied Llama-3-8B in float32);
    - an untied head's ghost norms: its cotangent cast to the statistics' dtype and its Gram
      product (``a + a [e != a]``), its running prefix product and sum (``2a L V`` fixed);
    - a tied head: autograd's sum of the embedding's and the head's per-token parts (``3e``
      beside the previous chunk's ``e``) and the materialised copy and prefix sum
      (``a [e != a] + a``);
    - ``materialised`` parameter elements (method 'materialize'): the same as a tied head's.
    """
    e, a, V, h, n = shape.elsize, shape.acc, shape.vocab, shape.hidden, shape.layers
    low = 4 if e < 4 else 0  # the float32 copy a low-precision tensor gets
    cast = a if e != a else 0  # a cast to the statistics' dtype (none when they agree)
    mods = n * L * shape.width * e  # one cotangent at every module output
    logits = L * V * e  # kept by the loop until the next chunk's forward
    # freed with the graph once the chunk's backward is done: the float32 logits, the kept
    # activations
    graph = L * V * low + L * n * (h * (9 * e + low) + 4 * e * shape.intermediate)
    state = n * sum(_ghost_state(a, L, i, o) for i, o in shape.linears())
    if path == "vectors":  # the harness of token_vectors: no ghost state, no tied term; the
        # previous chunk's block of ``materialised`` elements per cotangent (its flat result
        # and its cast) is alive while the next chunk's backward runs
        return [(logits + graph, 3 * a * L * V + mods + (e + cast) * materialised)]
    if shape.tied:
        state += a * V * h  # its running prefix (and its next value while it is replaced)
        head_prev = V * h * e
    else:
        state += _ghost_state(a, L, L, h) + _ghost_state(a, L, h + 1, V)  # embedding, head
        head_prev = L * V * e
    prev = mods + head_prev + e * materialised
    fixed = logits + state
    phases = [(fixed + graph, 3 * a * L * V + prev)]
    if shape.tied:
        phases.append((fixed + graph, 3 * e * V * h + prev + mods))
        phases.append((fixed + a * V * h, (e + cast + a) * V * h + mods))
    else:
        # the backward's end: its cotangents beside the previous chunk's, the graph alive
        phases.append((fixed + graph, prev + mods + L * V * e))
        phases.append((fixed + 2 * a * L * V, (e + cast + a) * L * V + mods))
    if materialised:
        phases.append((fixed + graph, 3 * e * materialised + prev + mods))
        phases.append((fixed, (e + cast + a) * materialised + mods))
    return phases


FORMED_ELEMENTS = 1 << 24  # seqnorms._self_norm forms [rows, out, in] per-sequence
# gradients of at most this many elements at once (one row's, when one is larger)


def _sequence_phases(shape: ModelShape, B: int, L: int) -> list[tuple[int, int]]:
    """``(fixed, unit)`` bytes of each phase of one chunk of ``sequence_grad_norms`` (a unit:
    one row of ``L`` positions; traced with the real function on fake full-size models,
    benchmarks/plan_scale.py):

    - the forward's log-probs: the graph, the logits, their float32 copy and the
      log-sum-exp's three float32 transients ``[L, V]`` (traced on the CPU at small scale:
      an op that fake tensors run as one, so the full-size trace cannot see them);
    - the first chunk's form checks (once per module; the head's is the largest): the
      forward's graph, the logits, the head's recomputed output and its probe cotangent
      (``3e + 4 [e < 4]`` per ``L V`` element; soft-capped logits keep ``2e`` more), and the
      head weight's gradient by autograd, factored and their difference (``e + 2a``, and the
      cast to the statistics' dtype, per ``V h`` element);
    - the norms: what the recorded calls keep of the forward (every Linear's input and
      output, the residual stream, the attention's output) and the cotangents at every module
      output (per layer and position ``e ((7 + 2 r) h + 2 q + 4 kv + 5 i)`` with r norms a
      layer), their factors' casts to the statistics' dtype in low precision
      (``a ((3 + 2 r) h + 2 q + 2 kv + 3 i)``), the logits
      and their cotangent (``2e + cast`` per ``L V``), and the largest per-sequence gradient
      the formed branch builds (and its square: ``2a`` per element; a module is formed where
      ``L (out + in) > out in``), beside the ``[B]`` outputs.
    """
    e, a, V, h, n = shape.elsize, shape.acc, shape.vocab, shape.hidden, shape.layers
    i, q, kv = shape.intermediate, shape.q_dim, shape.kv_dim
    low = 4 if e < 4 else 0
    cast = a if e != a else 0
    out = 2 * B * L * a
    r = shape.norms
    cap = 2 * e if shape.softcap else 0  # the capped logits and their tanh, kept
    # the forward's graph per layer and position (traced: Qwen2 / Llama, two norms a layer,
    # and Gemma-2, four): every Linear's output, the norms' products, the rotated q and k
    graph = n * (e * ((4 + 2 * r) * h + 3 * q + 3 * kv + 4 * i) + low * r * h)
    logprobs = (out, L * (V * (e + low + 3 * a + cap) + graph))
    check = (out + V * h * (e + 2 * a + cast), L * (V * (3 * e + low + cap) + graph))
    kept = n * (e * ((7 + 2 * r) * h + 2 * q + 4 * kv + 5 * i)
                + cast * ((3 + 2 * r) * h + 2 * q + 2 * kv + 3 * i))
    formed = 0
    for o, k in [(oo, kk - 1) for kk, oo in shape.linears()] + [(V, h)]:
        if L * (o + k) > o * k:  # seqnorms._self_norm forms the gradient, rows at a time
            formed = max(formed, max(1, min(B, FORMED_ELEMENTS // (o * k))) * o * k)
    norms = (out + 2 * a * formed, L * (kept + V * (2 * e + cast + cap // 2)))
    return [logprobs, check, norms]


def vector_block_bytes(shape: ModelShape, L: int, C: int, numel: int, tied: int = 0) -> int:
    """Peak bytes of one harness pass of ``token_vectors`` once its block of per-token
    gradients exists (traced on fake full-size models, benchmarks/plan_scale.py): ``C``
    cotangents of ``numel`` parameter elements, autograd's batched result and its flat copy
    (``2e`` per element) and their cast to the statistics' dtype (``a [e != a]``), the
    ``tied`` elements of a tied weight its two parts before their sum (``2e`` more), beside
    the chunk's logits ``[L, V]``. (The vocabulary's backward before it is the path's chunk
    phase, :func:`unit_bytes`; the peak of a pass is the larger of the two.)"""
    e, a = shape.elsize, shape.acc
    cast = a if e != a else 0
    return C * (numel * (2 * e + cast) + tied * 2 * e) + L * shape.vocab * e


def unit_bytes(shape: ModelShape, path: str, L: int, *, materialised: int = 0) -> int:
    """Bytes one unit of ``path`` adds to a chunk over a prefix of ``L`` positions.

    ``materialised``: parameter elements whose per-token gradient the harness forms (the
    'materialize' method; a tied head's is counted here already). The per-token paths take
    the largest of their phases' units (:func:`_token_phases`).
    """
    check_choice("path", path, list(PATHS))
    e, V, h, n = shape.elsize, shape.vocab, shape.hidden, shape.layers
    if shape.hidden == 0:  # not a decoder: the parameters' size per unit
        return 4 * (shape.n_params + materialised)
    low = 4 if e < 4 else 0  # the float32 copy a low-precision tensor gets
    if path in ("token_norms", "vectors"):
        return max(u for _, u in _token_phases(shape, path, L, materialised))
    if path == "sequence_norms":  # the largest phase's (_sequence_phases)
        return max(u for _, u in _sequence_phases(shape, 1, L))
    if path == "train_logprobs":
        return L * n * (h * (9 * e + low) + 4 * e * shape.intermediate + 2 * e * shape.kv_dim)
    if path == "sampling":
        # keys and values of every layer over L positions (the cache's capacity), the larger
        # of a step's logits (in float32, their softmax) and the prefill's live activations
        # at one layer (traced: up, gate and their product [L, i]; residual, input, norm
        # [L, h]; the causal mask [L, L] of one byte, one per attention kind)
        prefill = L * (3 * shape.intermediate + 4 * h) * e + 2 * L * L
        return 2 * n * shape.kv_dim * L * e + max(V * (e + 3 * 4), prefill)
    return logits_unit(V, e)


def fixed_bytes(shape: ModelShape, path: str, B: int, L: int, *,
                response: int | None = None) -> int:
    """Bytes a ``path`` holds whatever its chunk: the forward's kept activations of the chunk's
    one row (token paths), the ``[B, L]`` outputs, per-module running state. ``response``
    (sampling): the response length T of the L positions, when known."""
    check_choice("path", path, list(PATHS))
    e, a, V, h = shape.elsize, shape.acc, shape.vocab, shape.hidden
    if shape.hidden == 0:
        return 0
    if path in ("token_norms", "vectors"):  # the largest phase's (_token_phases)
        return max(f for f, _ in _token_phases(shape, path, L, 0)) + 2 * B * L * a
    if path == "sequence_norms":  # the largest phase's (_sequence_phases)
        return max(f for f, _ in _sequence_phases(shape, B, L))
    if path == "train_logprobs":
        # the head's chunked log-probs (256 positions of logits and their gradients at a time,
        # its weight's gradient accumulator), the parameters' gradients
        return (256 * logits_unit(V, e, grad=True) + logits_fixed(V, h, e, grad=True)
                + 2 * B * L * a + shape.n_params * e)
    if path == "sampling":
        # the [B, T] outputs (tokens, masks, statistics); the sampler's deferred statistics
        # buffer [rows, T, V] (float32) where rows * T * V <= DEFER_ELEMENTS: none when one
        # row's exceeds it, at most DEFER_ELEMENTS elements (T unknown: taken as L, which
        # bounds it)
        T = L if response is None else min(L, response)
        defer = 0 if T * V > DEFER_ELEMENTS else 4 * min(B * T * V, DEFER_ELEMENTS)
        if response is None:
            defer = 4 * min(B * L * V, DEFER_ELEMENTS)
        return B * T * (8 + 4 + 4 + 3 * 4) + defer
    return logits_fixed(V, h, e) + 2 * B * L * a


def logits_unit(vocab: int, elsize: int, *, grad: bool = False) -> int:
    """Bytes one position adds to a chunk of the logit statistics: its logits and their
    softmax in the statistics' dtype (``2a V``; traced with the whole chunk as one block, as on
    CUDA; the CPU's cache blocking keeps the softmax per block, so this bounds it there); on
    the differentiable path (``grad``) the backward's recomputed logits and their float32 copy
    (``(e + 4 [e < 4]) V``, traced: 6.0 V in bfloat16, 4.0 V in float32)."""
    a = 8 if elsize == 8 else 4
    low = 4 if elsize < 4 else 0
    return vocab * (elsize + low if grad else 2 * a)


def logits_fixed(vocab: int, hidden: int, elsize: int, *, grad: bool = False) -> int:
    """Bytes the logit statistics hold whatever the chunk: nothing on the forward path (the
    head matmul reads the ``[V, h]`` weight in place); on the differentiable path (``grad``)
    the weight's gradient accumulator (``a``) and its cast to a low-precision weight's dtype
    (``e``; traced: 4.06 and 4.13 bytes per weight element in bfloat16 and float32 during the
    chunks, the cast comes after them)."""
    a = 8 if elsize == 8 else 4
    return vocab * hidden * (a + (elsize if elsize != a else 0)) if grad else 0


def logit_rows(vocab: int, hidden: int, elsize: int, device: torch.device | str, default: int,
               *, grad: bool = False, fraction: float = MEMORY_FRACTION) -> int:
    """Positions per head matmul of the logit statistics on ``device``: ``default`` without a
    measured budget (the CPU: its cache-tuned size), else the most whose planned peak fits
    :data:`HEADROOM` of ``fraction`` of the free memory; the differentiable path at most
    ``default`` (the training step's plan counts that many). Refused (UsageError) when one
    position cannot fit."""
    budget = device_budget(device, fraction)
    if budget is None:
        return default
    unit = logits_unit(vocab, elsize, grad=grad)
    fixed = logits_fixed(vocab, hidden, elsize, grad=grad)
    if fixed + unit > budget:
        raise UsageError(f"the logit statistics do not fit: one position of a {vocab}-token "
                         f"vocabulary needs {gib(fixed + unit)}, the budget is {gib(budget)}; "
                         "use a device with more memory or a smaller model")
    rows = max(1, (int(HEADROOM * budget) - fixed) // unit)
    return min(default, rows) if grad else rows


def probe_bytes(shape: ModelShape, path: str, L: int) -> int:
    """Bytes of a path's phase before its chunks (0 where none): the gradient harness's
    inspection forward of one row, with an untied head's form check (``(e + 4a) V h``). (The
    sequence norms' form checks run in their first chunk: a phase of its own,
    :func:`_sequence_phases`.)"""
    if path not in ("token_norms", "vectors") or shape.hidden == 0:
        return 0
    e, a, V, h = shape.elsize, shape.acc, shape.vocab, shape.hidden
    low = 4 if e < 4 else 0
    check = 0 if shape.tied else (e + 4 * a) * V * h
    return L * V * (e + 4 + low) + check


@dataclass(frozen=True)
class Plan:
    """One path's plan: ``chunk`` units per pass, peak ``fixed + chunk * unit`` bytes."""

    path: str
    unit: str
    chunk: int
    fixed_bytes: int
    unit_bytes: int
    budget: int | None
    model_bytes: int
    probe_bytes: int = 0
    # (fixed, unit) of each phase of a pass (its peak is the largest phase's); empty: the one
    # phase (fixed_bytes, unit_bytes). fixed_bytes / unit_bytes are the phases' largest.
    phases: tuple[tuple[int, int], ...] = ()

    def _at(self, chunk: int) -> int:
        ph = self.phases or ((self.fixed_bytes, self.unit_bytes),)
        return max(self.probe_bytes, max(f + chunk * u for f, u in ph))

    @property
    def peak_bytes(self) -> int:
        """Planned peak beyond the parameters at the chosen chunk (the largest phase)."""
        return self._at(self.chunk)

    @property
    def need_bytes(self) -> int:
        """The least a pass needs: one unit (beyond the parameters)."""
        return self._at(1)

    @property
    def fits(self) -> bool:
        """Whether one unit fits the budget (always, without a budget)."""
        return self.budget is None or self.need_bytes <= self.budget

    def describe(self) -> str:
        """One line: chunk, peak, budget."""
        b = "no budget" if self.budget is None else f"budget {gib(self.budget)}"
        return (f"{self.path}: {self.chunk} {self.unit} per pass, peak {gib(self.peak_bytes)} "
                f"beyond the {gib(self.model_bytes)} model ({b})")


def plan(shape: ModelShape, path: str, B: int, L: int, budget: int | None, *,
         default: int | None = None, cap: int | None = None, materialised: int = 0,
         response: int | None = None) -> Plan:
    """The plan of ``path`` over ``B`` rows of ``L`` positions inside ``budget`` bytes.

    The chunk is the largest number of units (cotangents, rows or positions, :data:`UNITS`)
    whose ``fixed + chunk * unit`` fits :data:`HEADROOM` of the budget, at least 1, at most
    ``cap`` (default: B rows; :data:`MAX_COTANGENTS` cotangents; ``B * L`` positions).
    Without a budget (no measured device memory) it is ``default`` (default: ``cap``).
    ``response``: sampling's response length (:func:`fixed_bytes`).
    """
    unit = unit_bytes(shape, path, L, materialised=materialised)
    fixed = fixed_bytes(shape, path, B, L, response=response)
    phases = ((fixed, unit),)
    if path in ("token_norms", "vectors") and shape.hidden:
        out = 2 * B * L * shape.acc
        phases = tuple((f + out, u) for f, u in _token_phases(shape, path, L, materialised))
    if path == "sequence_norms" and shape.hidden:
        phases = tuple(_sequence_phases(shape, B, L))
    if cap is None:
        cap = {"cotangents": MAX_COTANGENTS, "rows": B, "positions": B * L}[UNITS[path]]
    cap = max(1, int(cap))
    if budget is None:
        chunk = cap if default is None else default
    else:
        room = int(HEADROOM * budget)
        chunk = max(1, min([cap] + [(room - f) // max(1, u) for f, u in phases]))
    return Plan(path, UNITS[path], int(chunk), int(fixed), int(unit), budget,
                shape.model_bytes, probe_bytes(shape, path, L), phases)


def plan_from_config(config: Any, dtype: torch.dtype | str, path: str, B: int, T: int,
                     device_bytes: int | None, *, fraction: float = MEMORY_FRACTION,
                     **kw: Any) -> Plan:
    """The plan of ``path`` for a model described by its ``config`` alone (nothing loaded):
    ``device_bytes`` of device memory, of which the parameters take theirs and ``fraction``
    of the rest is the budget."""
    shape = ModelShape.from_config(config, dtype)
    budget = None
    if device_bytes is not None:
        budget = int(fraction * max(0, int(device_bytes) - shape.model_bytes))
    return plan(shape, path, B, T, budget, **kw)


def check_plan(p: Plan, what: str) -> Plan:
    """``p`` when one unit fits; UsageError naming ``what``, the bytes needed and the budget."""
    if not p.fits:
        raise UsageError(
            f"{what} does not fit: one {p.unit[:-1]} of {p.path} needs {gib(p.need_bytes)} "
            f"beyond the {gib(p.model_bytes)} model, the budget is {gib(p.budget or 0)}; use a "
            "device with more memory, a shorter sequence or a smaller model")
    return p


def plan_before_load(config: Any, dtype: torch.dtype | str, device: torch.device | str,
                     B: int, T: int, paths: tuple[str, ...] = PATHS, *,
                     fraction: float = MEMORY_FRACTION, what: str = "the model",
                     free: int | None | str = "measure") -> list[Plan]:
    """The plans of ``paths`` for a model known by its ``config`` alone, checked before its
    weights are loaded onto ``device``: UsageError naming what one unit needs when the
    parameters or one unit of a path do not fit the free memory (no check, chunks at their
    defaults, where the device's memory is not measured). ``free``: the device's free bytes
    when the caller measured them already (``"measure"``: ask the device)."""
    if free == "measure":
        free = free_device_bytes(device)
    shape = ModelShape.from_config(config, dtype)
    if free is not None and shape.model_bytes >= free:
        raise UsageError(
            f"{what} does not fit {device}: its parameters alone need {gib(shape.model_bytes)} "
            f"in {dtype}, the device has {gib(free)} free; varbench places a model on one "
            "device (no layer-wise placement): use a device with more memory, a smaller dtype "
            "(--dtype bfloat16) or a smaller model")
    return [check_plan(plan_from_config(config, dtype, p, B, T, free, fraction=fraction),
                       f"{what} ({T} positions, {B} rows)") for p in paths]


def free_device_bytes(device: torch.device | str) -> int | None:
    """Bytes free on a CUDA ``device`` (``torch.cuda.mem_get_info``), None on other devices."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def device_budget(device: torch.device | str, fraction: float = MEMORY_FRACTION) -> int | None:
    """``fraction`` of :func:`free_device_bytes` (None where it is not measured)."""
    free = free_device_bytes(device)
    return None if free is None else int(fraction * free)


def gib(n: float) -> str:
    """``n`` bytes as ``'1.23 GiB'``."""
    return f"{n / 2**30:.3g} GiB"


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of storages made by ops while active and still alive: ``live`` now,
    ``peak`` the most at once. Works on real and fake tensors (FakeTensorMode, meta) alike;
    tensors made before entering (the parameters) are not counted, nor their views or what
    in-place ops write into them."""

    def __init__(self) -> None:
        super().__init__()
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.live = 0
        self.peak = 0

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # an output on an input's storage (a view, an in-place or out= op) allocates nothing:
        # without this a view of a parameter (a Linear's weight.t()) or an in-place add into a
        # gradient made before entering would count that tensor as new
        ins = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs))
               if isinstance(t, torch.Tensor) and t.layout == torch.strided}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                st = t.untyped_storage()
                if st in self._seen or st._cdata in ins:
                    continue
                n = st.nbytes()
                self._seen[st] = n
                self.live += n
                weakref.finalize(st, self._free, n)  # a storage's end is its bytes' end
                self.peak = max(self.peak, self.live)
        return out


__all__ = ["DEFER_ELEMENTS", "HEADROOM", "MAX_COTANGENTS", "MEMORY_FRACTION", "PATHS", "UNITS",
           "LiveBytes", "ModelShape", "Plan", "check_plan", "device_budget", "fixed_bytes",
           "free_device_bytes", "gib", "logit_rows", "logits_fixed", "logits_unit", "plan",
           "plan_before_load", "plan_from_config", "probe_bytes", "unit_bytes",
           "vector_block_bytes"]
