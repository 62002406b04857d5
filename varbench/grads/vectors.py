"""Per-token gradient vectors, computed ONCE, contracted with any number of coefficient sets.

The one sketch and the one "vectors once, many coefficient sets" path of varbench (used by the
variance analysis, the cancellation analysis and :mod:`varbench.grads.group`):

- :class:`CountSketch` ``S: R^D -> R^K``, seeded; the only random sketch of gradient vectors.
- :func:`token_vectors`: per-token gradients of every response token of a RolloutBatch from the
  exact harness (``varbench.grads.exact.iter_token_grads``), one chunk of ``[C, numel]`` rows at
  a time, each chunk reduced immediately to its exact ``||g_t||^2`` (the exact OTB weight) and to
  ``v_t = S g_t`` (or the flat ``g_t`` with ``sketch_dim=None``: exact, D floats per token).
- :func:`combine`: ``g_hat_p = sum_{i,t} c_{p,i,t} v_{p,i,t}`` for one or many coefficient sets
  (advantage scheme x aggregation mode x ...): adding a set costs an einsum, not a backward.

Since S is linear, ``combine(token_vectors(..., sketch=S).vec, c) = S g_hat`` exactly (up to
rounding), with ``g_hat`` the exact group gradient of
:func:`varbench.grads.group.group_gradients` (the slow one-backward-per-group reference).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from varbench._util.checks import UsageError, UsageTypeError, check_positive_int, check_shape
from varbench.grads._inputs import check_inputs
from varbench.grads.chunking import (
    MEMORY_FRACTION,
    auto_block_bytes,
    free_device_bytes,
    token_plan,
)
from varbench.grads.exact import iter_token_grads, packed_chunk
from varbench.grads.params import ParamFilter, select_params


@dataclass
class TokenVectors:
    """``vec [P, G, T, K]`` per-token gradient vectors (sketched or flat) and exact
    ``token_sq [P, G, T]`` = ||g_t||^2; both 0 where the batch mask is 0. ``dim`` is K,
    ``n_params`` is D, ``sketch`` says "countsketch(K=.., seed=..)" or "flat"."""

    vec: torch.Tensor
    token_sq: torch.Tensor
    dim: int
    n_params: int
    sketch: str


class CountSketch:
    """A fixed, seeded CountSketch ``S: R^D -> R^K`` of a list of parameter tensors.

    Coordinate i of the flat gradient (``select_params`` order, ``D = sum(numels)``) goes to bucket
    ``h(i)`` with sign ``s(i)``: ``(S x)_j = sum_{i: h(i) = j} s(i) x_i``, where the ``h(i)`` are
    iid uniform on ``{0, .., K-1}`` and the ``s(i)`` iid uniform on ``{-1, +1}``, independent.
    For any fixed x, y (expectation over the random S)::

        E[<Sx, Sy>]   = <x, y>
        Var[<Sx, Sy>] = (||x||^2 ||y||^2 + <x, y>^2 - 2 sum_i x_i^2 y_i^2) / K
        Var[||Sx||^2] = (2 / K) (||x||^4 - sum_i x_i^4)

    (so the relative std of ``||Sx||^2`` is at most ``sqrt(2/K)``, that of a Gaussian JL sketch
    of the same K; derivation: ``<Sx, Sy> - <x, y> = sum_{i != l} s_i s_l [h_i = h_l] x_i y_l``,
    whose only non-vanishing second moments pair (i, l) with itself or with (l, i), each with
    ``P(h_i = h_l) = 1/K``). Traces, norms and inner products of estimates are therefore preserved
    in expectation over S.

    Hash: the buckets of every parameter, then the signs of every parameter, drawn in that
    order, ``chunk`` coordinates per draw, by a ``torch.Generator`` ON ``device`` seeded with
    ``seed``: the state is generated where it is used, never copied. The same S in every run on
    one device type; CPU and CUDA generators draw different numbers (a CUDA S differs from the
    CPU S of the same seed, as sampled tokens do). Two ways to hold it, the same S either way:

    - stored (default while ``12 * D <= store_bytes``, 64 MiB: D up to ~5.6M): an int64 bucket
      and a float32 sign per coordinate on ``device`` (plus one sign copy per further dtype
      applied);
    - streamed (larger D, or ``stream=True``): only the generator's state at every chunk of
      ``chunk`` coordinates is kept (a few bytes to 5 kB per chunk, on the host); each
      application redraws the hash chunk by chunk on ``device`` and adds that chunk in, so the
      extra memory is O(chunk), not O(D). The cost is one pass of the generator over D per
      application.

    Applying S costs one ``index_add_`` per parameter (chunk and slice of at most
    ``APPLY_ELEMENTS`` products), O(D) per vector; inputs must be
    on ``device`` (nothing of theirs is copied). On the CPU the bucket sums are accumulated in
    a fixed order (bitwise reproducible); CUDA's ``index_add_`` uses atomics (reproducible to
    rounding only).
    """

    STORE_BYTES = 64 << 20  # store the hash below this size (12 bytes per coordinate)
    # Coordinates per streamed chunk: on the CPU small enough to stay in cache; on an accelerator
    # every op is a kernel launch (~8 per chunk), so chunks are 64x larger there (an 8B model's
    # application is ~480 chunks, not ~30k), at 12 bytes per coordinate of transient hash (192
    # MiB). The application's temporary product is bounded separately (APPLY_ELEMENTS).
    CHUNK = 1 << 18
    ACCEL_CHUNK = 1 << 24
    # Elements of one ``grads[..., chunk] * signs`` product: rows are applied in slices this
    # size, so the extra memory of an application is O(APPLY_ELEMENTS), not O(rows x chunk).
    APPLY_ELEMENTS = 1 << 24

    @classmethod
    def state_bytes(cls, n_params: int, chunk: int | None = None) -> int:
        """Bytes a sketch of ``n_params`` coordinates holds on its device while applied:
        stored (``12 n_params <= STORE_BYTES``), a bucket and a sign per coordinate; streamed,
        one chunk's draw (``chunk`` coordinates, default ``CHUNK``) and one application's
        product (``APPLY_ELEMENTS``)."""
        if 12 * n_params <= cls.STORE_BYTES:
            return 12 * n_params
        return 12 * (cls.CHUNK if chunk is None else chunk) + 4 * cls.APPLY_ELEMENTS

    @classmethod
    def default_chunk(cls, device: str | torch.device) -> int:
        """Coordinates per streamed chunk on ``device`` (CPU: ``CHUNK``; else ``ACCEL_CHUNK``)."""
        return cls.CHUNK if torch.device(device).type == "cpu" else cls.ACCEL_CHUNK

    def __init__(
        self,
        numels: Sequence[int],
        dim: int,
        seed: int = 0,
        *,
        device: str | torch.device | None = None,
        stream: bool | None = None,
        chunk: int | None = None,
    ) -> None:
        check_positive_int("dim", dim)
        if isinstance(seed, bool):
            raise UsageTypeError(f"seed must be an int, got {seed!r}")
        try:
            seed = operator.index(seed)
        except TypeError:
            raise UsageTypeError(f"seed must be an int, got {type(seed).__name__}") from None
        dev = torch.device("cpu") if device is None else torch.device(device)
        g = _generator(dev, seed)
        numels = [int(n) for n in numels]
        chunk = (self.default_chunk(dev) if chunk is None
                 else check_positive_int("chunk", chunk))
        if stream is None:
            stream = 12 * sum(numels) > self.STORE_BYTES
        self.seed: int | None = seed
        desc = f"countsketch(K={dim}, seed={seed})"
        if stream:
            self._init_streamed(numels, dim, g, chunk, desc, dev)
            return
        # drawn in the streamed chunks (identical on the CPU, whose stream does not depend on
        # the pieces; on CUDA the Philox offset advances per draw, so the pieces must match)
        buckets = [_draw(g, dim, n, chunk, dev) for n in numels]
        signs = [_draw(g, 2, n, chunk, dev).float() * 2 - 1 for n in numels]
        self._init(buckets, signs, dim, desc, dev)

    @classmethod
    def from_hashes(
        cls,
        buckets: Sequence[torch.Tensor],
        signs: Sequence[torch.Tensor],
        dim: int,
        *,
        device: str | torch.device | None = None,
    ) -> CountSketch:
        """The CountSketch with the given hash: ``buckets[i]`` (ints in ``[0, dim)``) and
        ``signs[i]`` (+-1) for parameter i (e.g. to enumerate every S of a tiny D)."""
        check_positive_int("dim", dim)
        if len(buckets) != len(signs):
            raise UsageError(f"{len(buckets)} bucket tensors but {len(signs)} sign tensors")
        b_list, s_list = [], []
        for i, (b, s) in enumerate(zip(buckets, signs, strict=True)):
            check_shape(f"buckets[{i}]", b, [None])
            check_shape(f"signs[{i}]", s, [b.numel()])
            if b.dtype.is_floating_point or torch.any((b < 0) | (b >= dim)):
                raise UsageError(f"buckets[{i}] must hold integers in [0, {dim})")
            if not torch.all((s == 1) | (s == -1)):
                raise UsageError(f"signs[{i}] must hold only +1 and -1")
            b_list.append(b.long())
            s_list.append(s.float())
        sk = cls.__new__(cls)
        sk._init(b_list, s_list, dim, f"countsketch(K={dim}, explicit hashes)", device)
        sk.seed = None
        return sk

    @classmethod
    def for_params(
        cls,
        params: Sequence[torch.Tensor],
        dim: int,
        seed: int = 0,
        *,
        device: str | torch.device | None = None,
    ) -> CountSketch:
        """The sketch of ``params`` (their numels; state on their device unless ``device``)."""
        params = list(params)
        if not params:
            raise UsageError("params is empty")
        return cls([p.numel() for p in params], dim, seed,
                   device=params[0].device if device is None else device)

    @classmethod
    def for_model(
        cls,
        model: torch.nn.Module,
        dim: int,
        seed: int = 0,
        *,
        params: ParamFilter = None,
        device: str | torch.device | None = None,
    ) -> CountSketch:
        """The sketch of ``model``'s selected parameters (:func:`select_params` order), with its
        state on the parameters' device (or ``device``: pass the ``device`` you give to
        ``sequence_grads`` / ``group_gradients`` / ``token_sketches`` when they copy the model)."""
        return cls.for_params([p for _, p in select_params(model, params)], dim, seed,
                              device=device)

    def _init_streamed(self, numels, dim, g, chunk, desc, device) -> None:
        """Keep the generator state at each chunk start (drawing once to advance it)."""
        self.dim = int(dim)
        self.numels = tuple(numels)
        self.n_params = sum(numels)
        self.description = desc
        self.device = device
        self.chunk = int(chunk)
        self.buckets, self._signs = None, None
        self._states: dict[str, list[list[torch.Tensor]]] = {}
        for kind, hi in (("buckets", dim), ("signs", 2)):
            per_param = []
            for n in numels:
                states = []
                for start in range(0, n, chunk):
                    states.append(None if g is None else g.get_state())
                    torch.randint(0, hi, (min(chunk, n - start),), generator=g, device=device)
                per_param.append(states)
            self._states[kind] = per_param

    @property
    def streamed(self) -> bool:
        """Whether the hash is redrawn per application instead of stored (see the class doc)."""
        return self.buckets is None

    def _chunks(self, i: int, dtype: torch.dtype):
        """``(start, buckets, signs)`` of parameter i, chunk by chunk, on ``device``."""
        if not self.streamed:
            yield 0, self.buckets[i], self._signs_in(dtype)[i]
            return
        g = _generator(self.device, 0)
        n = self.numels[i]
        for c, (sb, ss) in enumerate(zip(self._states["buckets"][i], self._states["signs"][i],
                                         strict=True)):
            start = c * self.chunk
            size = min(self.chunk, n - start)
            if g is not None:
                g.set_state(sb)
            b = torch.randint(0, self.dim, (size,), generator=g, device=self.device)
            if g is not None:
                g.set_state(ss)
            s = (torch.randint(0, 2, (size,), generator=g, device=self.device) * 2 - 1).to(dtype)
            yield start, b, s

    def hashes(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(buckets, signs)`` of every parameter materialised (O(D) memory: for tests and
        small sketches)."""
        if not self.streamed:
            return list(self.buckets), list(self.signs)
        bs, ss = [], []
        for i in range(len(self.numels)):
            parts = list(self._chunks(i, torch.float32))
            bs.append(torch.cat([b for _, b, _ in parts]))
            ss.append(torch.cat([s for _, _, s in parts]))
        return bs, ss

    def _init(self, buckets, signs, dim, desc, device) -> None:
        dev = torch.device("cpu") if device is None else torch.device(device)
        self.dim = int(dim)
        self.numels = tuple(int(b.numel()) for b in buckets)
        self.n_params = sum(self.numels)
        self.description = desc
        self.buckets = [b.to(dev) for b in buckets]  # moved once, here
        self.device = self.buckets[0].device if self.buckets else dev
        self._signs = {torch.float32: [s.to(self.device) for s in signs]}

    def __repr__(self) -> str:
        mode = ", streamed" if self.streamed else ""
        return f"CountSketch({self.description}, D={self.n_params}, device={self.device}{mode})"

    @property
    def signs(self) -> list[torch.Tensor] | None:
        """Per-parameter float32 signs (+-1) on ``device`` (None when streamed: see
        :meth:`hashes`)."""
        return None if self._signs is None else self._signs[torch.float32]

    def _signs_in(self, dtype: torch.dtype) -> list[torch.Tensor]:
        if dtype not in self._signs:  # +-1 is exact in every floating dtype; made once
            self._signs[dtype] = [s.to(dtype) for s in self._signs[torch.float32]]
        return self._signs[dtype]

    def check_params(self, params: Sequence[torch.Tensor]) -> None:
        """Raise unless this sketch was built for exactly these parameters' sizes and device."""
        numels = tuple(p.numel() for p in params)
        if numels != self.numels:
            raise UsageError(
                f"the sketch was built for {len(self.numels)} parameters ({self.n_params} "
                f"numbers), these are {len(numels)} ({sum(numels)}): build it with "
                "CountSketch.for_model(model, dim, seed, params=...) with the same params"
            )
        if params and params[0].device != self.device:
            raise UsageError(
                f"the sketch's state is on {self.device}, the parameters on {params[0].device}: "
                "build it on the parameters' device (CountSketch.for_model(..., device=...))"
            )

    def __call__(self, grads: Sequence[torch.Tensor],
                 indices: Sequence[int] | None = None) -> torch.Tensor:
        """``[..., numel_i]`` per parameter -> ``[..., K]``: ``S`` of the concatenation.

        ``indices``: the parameters ``grads`` belong to (default all, in order); S is linear, so
        summing the results over a partition of the parameters gives ``S`` of the whole vector
        (how :func:`token_vectors` streams parameter blocks)."""
        idx = list(range(len(self.numels))) if indices is None else [int(i) for i in indices]
        if len(grads) != len(idx):
            raise UsageError(f"expected {len(idx)} gradient tensors, got {len(grads)}")
        if any(not 0 <= i < len(self.numels) for i in idx):
            raise UsageError(f"indices {idx} out of range for {len(self.numels)} parameters")
        g0 = grads[0]
        if g0.device != self.device:
            raise UsageError(
                f"the sketch's state is on {self.device}, the input on {g0.device}: build the "
                "sketch on the input's device (CountSketch.for_model(..., device=...))"
            )
        if not g0.dtype.is_floating_point:
            raise UsageTypeError(f"inputs must be floating point, got {g0.dtype}")
        out = torch.zeros(*g0.shape[:-1], self.dim, dtype=g0.dtype, device=self.device)
        for j, (i, g) in enumerate(zip(idx, grads, strict=True)):
            check_shape(f"grads[{j}]", g, [*g0.shape[:-1], self.numels[i]])
            if g.dtype != g0.dtype or g.device != g0.device:
                raise UsageError("all gradient tensors must share one dtype and device")
            per_row = math.prod(g.shape[1:-1]) if g.dim() > 1 else 1
            for start, b, s in self._chunks(i, g0.dtype):
                part = g if self.chunk_of(i) is None else g[..., start:start + b.numel()]
                if g.dim() < 2:
                    out.index_add_(-1, b, part * s)
                    continue
                # slices of the first axis (each row's bucket sums are its own: same numbers)
                step = max(1, self.APPLY_ELEMENTS // max(b.numel() * per_row, 1))
                for r in range(0, g.shape[0], step):
                    out[r:r + step].index_add_(-1, b, part[r:r + step] * s)
        return out

    def chunk_of(self, i: int) -> int | None:
        """Coordinates per chunk of parameter i (None: stored, one piece)."""
        return None if not self.streamed else self.chunk

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., D] -> [..., K]``: ``S x`` for each row of a flat (``select_params`` order) x."""
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[-1] != self.n_params:
            shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise UsageError(f"x has shape {shape}, expected [..., {self.n_params}]")
        return self(torch.split(x, list(self.numels), dim=-1))


def _generator(device: torch.device, seed: int) -> torch.Generator | None:
    """A seeded generator on ``device`` (None on ``meta``, which has no values to draw)."""
    if device.type == "meta":
        return None
    return torch.Generator(device=device).manual_seed(seed)


def _draw(g: torch.Generator | None, hi: int, n: int, chunk: int,
          device: torch.device) -> torch.Tensor:
    """``[n]`` uniform ints in ``[0, hi)`` from ``g`` on ``device``, ``chunk`` per draw."""
    parts = [torch.randint(0, hi, (min(chunk, n - s),), generator=g, device=device)
             for s in range(0, n, chunk)]
    if not parts:
        return torch.zeros(0, dtype=torch.long, device=device)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def param_blocks(numels: Sequence[int], chunk_size: int, block_bytes: int,
                 itemsize: int) -> list[tuple[list[int], int]]:
    """Consecutive parameter blocks ``(indices, C)`` with ``C x sum(numel) x itemsize <=
    block_bytes`` where it can hold (``C = chunk_size``, lowered for a lone parameter too large
    for the budget at that C, down to 1). One block when everything fits."""
    blocks: list[tuple[list[int], int]] = []
    cur: list[int] = []
    size = 0
    for i, n in enumerate(numels):
        if cur and chunk_size * (size + n) * itemsize > block_bytes:
            blocks.append((cur, chunk_size))
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        blocks.append((cur, chunk_size))
    return [(idx, max(1, min(c, block_bytes // max(1, sum(numels[i] for i in idx) * itemsize))))
            if len(idx) == 1 else (idx, c) for idx, c in blocks]


def token_vectors(
    model: torch.nn.Module,
    batch,
    *,
    sketch_dim: int | None = 1024,
    sketch_seed: int = 0,
    sketch: CountSketch | None = None,
    params: ParamFilter = None,
    chunk_size: int | None = None,
    progress: bool = False,
    out_device: str | torch.device | None = None,
    block_bytes: int | None = None,
    memory_fraction: float = MEMORY_FRACTION,
    pack: bool | None = None,
) -> TokenVectors:
    """Per-token gradient vectors of every response token of ``batch`` (a RolloutBatch).

    The sketch: ``sketch`` when given (a :class:`CountSketch` built for these ``params`` on the
    model's device; ``sketch_dim``/``sketch_seed`` are then ignored), else
    ``CountSketch(numels, sketch_dim, sketch_seed)`` on the model's device, or flat gradients
    when ``sketch_dim`` is None or ``>= D``. Results accumulate on the model's device (``B*T*K``
    floats) and are moved to ``out_device`` (default: stay there) once, at the end; the model
    runs where its parameters are.

    Memory beyond the model: the ``[B, T, K]`` result (response positions only), one block of
    per-token gradients and the sketch's state (O(chunk) when streamed, see
    :class:`CountSketch`). The parameters are cut into consecutive blocks whose ``[C, numel]``
    per-token gradients fit in ``block_bytes`` (``C = chunk_size``, lowered to fit down to 1
    for a single parameter larger than the budget): each block runs the exact harness on its
    own and its sketch and squared norms are summed in (S is linear), so peak extra memory is
    ``max(block_bytes, one gradient of the largest parameter)`` whatever D; the price is one
    harness pass per block (one block, the default cost, whenever ``C x D`` fits). Flat vectors
    (no sketch) are ``B*T*D`` floats by definition. Precision: vectors and ``token_sq`` are
    float32 (float64 for a float64 model) whatever the model dtype: bf16 gradients are upcast
    before they are squared or sketched.
    Cost: the exact harness's per-token backward (about one backward per token over its prefix).

    Knobs: ``chunk_size`` (tokens per batched backward) and ``block_bytes`` default to the CPU's
    measured values (8, 256 MiB) and on CUDA to ``memory_fraction`` of the free device memory,
    half for the chunk's activation gradients, half for the gradient block
    (:mod:`varbench.grads.chunking`); ``pack``: several sequences per forward (default on CUDA,
    :func:`varbench.grads.exact.iter_token_grads`).
    """
    flat = batch.flat()
    ids, rmask, amask = check_inputs(flat.input_ids, flat.response_mask, flat.attention_mask)
    plist = [p for _, p in select_params(model, params)]
    dev = plist[0].device
    ids, rmask, amask = ids.to(dev), rmask.to(dev), amask.to(dev)
    numels = [p.numel() for p in plist]
    D = sum(numels)
    if sketch is not None:
        if not isinstance(sketch, CountSketch):
            raise UsageTypeError(
                f"sketch must be a CountSketch or None, got {type(sketch).__name__}"
            )
        sketch.check_params(plist)
        sk, K = sketch, sketch.dim
    elif sketch_dim is None or sketch_dim >= D:
        sk, K = None, D
    else:
        sk = CountSketch(numels, int(sketch_dim), sketch_seed, device=dev)
        K = sk.dim
    out_device = dev if out_device is None else torch.device(out_device)
    B, L = ids.shape
    # statistics in float32 or better whatever the model dtype (bf16 sums lose ~3 digits)
    dtype = torch.float64 if plist[0].dtype == torch.float64 else torch.float32
    # accumulated on the model's device; moved to out_device once, at the end. Only response
    # positions (flat()'s last L - prompt_len columns; its response mask is 0 on the prompt)
    # get a vector: [B, L, K] would hold L / T times the memory, all zeros but T columns.
    Lp = flat.prompt_len
    vec = torch.zeros(B, L - Lp, K, dtype=dtype, device=dev)
    tsq = torch.zeros(B, L, dtype=dtype, device=dev)
    # CUDA: the activation gradients of a chunk get half the fraction (the plan's chunk), the
    # block of per-token gradients what the chunk's planned peak leaves of the fraction
    measured = chunk_size is None and free_device_bytes(dev) is not None
    cplan = token_plan(model, B, L, dev, path="vectors", chunk_size=chunk_size,
                       memory_fraction=memory_fraction / 2)
    chunk_size = cplan.chunk
    # beside the block: the sketch's hash (stored: a bucket and a sign per coordinate; streamed:
    # one chunk's draw and one application's product)
    held = 0 if sk is None else (12 * sk.n_params if not sk.streamed else
                                 CountSketch.state_bytes(sk.n_params, sk.chunk))
    block_bytes = auto_block_bytes(dev, block_bytes=block_bytes, memory_fraction=memory_fraction,
                                   chunk_plan=cplan if measured else None, held=held)
    if measured and (dev.type == "cuda" if pack is None else pack):
        # a packed chunk's cotangents each span its rows: keep tokens x rows in the budget
        offs = [0]
        for n in rmask.count_nonzero(1).tolist():  # one host read per call
            offs.append(offs[-1] + n)
        chunk_size = packed_chunk(offs, chunk_size)
    offsets = [0]
    for n in numels:
        offsets.append(offsets[-1] + n)
    for idx, chunk in param_blocks(numels, chunk_size, block_bytes, dtype.itemsize):
        block = [plist[i] for i in idx]
        for rows, cols, grads in iter_token_grads(model, ids, rmask, amask, block, chunk,
                                                  progress=progress, pack=pack):
            if grads[0].dtype != dtype:
                grads = [g.to(dtype) for g in grads]
            # (rows, cols) are distinct within a chunk: a plain indexed add is exact
            tsq[rows, cols] += sum(g.pow(2).sum(1) for g in grads)
            if sk is None:
                vec[rows, cols - Lp, offsets[idx[0]]:offsets[idx[-1] + 1]] = torch.cat(grads, 1)
            else:
                vec[rows, cols - Lp] += sk(grads, idx)
    vec, tsq = vec.to(out_device), tsq.to(out_device)
    P, G, T = batch.tokens.shape
    return TokenVectors(
        vec=vec.reshape(P, G, T, K),
        token_sq=batch.to_groups(tsq),
        dim=K,
        n_params=D,
        sketch="flat" if sk is None else sk.description,
    )


def combine(sketches: torch.Tensor | TokenVectors, coeffs: torch.Tensor) -> torch.Tensor:
    """``sum_{i,t} c_{p,i,t} v_{p,i,t}``: ``[P, G, T, K]`` per-token vectors ``sketches``
    (sketched or flat, e.g. ``token_vectors(...).vec``, or the :class:`TokenVectors` itself)
    and ``[P, G, T]`` coefficients -> ``[P, K]``; ``[S, P, G, T]`` (S coefficient sets) ->
    ``[S, P, K]``.

    Contracts in the vectors' dtype on the vectors' device (the coefficients are cast and
    moved; the large vector tensor is never copied). Coefficients off the mask multiply zero
    vectors, so they do not matter.
    """
    vec = sketches.vec if isinstance(sketches, TokenVectors) else sketches
    check_shape("sketches", vec, [None, None, None, None])
    P, G, T, _ = vec.shape
    c = coeffs.to(device=vec.device, dtype=vec.dtype)
    if coeffs.dim() == 3:
        check_shape("coeffs", coeffs, [P, G, T])
        return torch.einsum("pgtk,pgt->pk", vec, c)
    check_shape("coeffs", coeffs, [None, P, G, T])
    return torch.einsum("pgtk,spgt->spk", vec, c)
