"""The memory plan at full scale without a GPU: real shapes under FakeTensorMode, traced.

    python benchmarks/plan_scale.py [--T 1024] [--B 8] [--dtype bfloat16] [--layers 0]

Per shape (Qwen2-0.5B, Qwen2.5-1.5B, Gemma-2-2B, Llama-3-8B: real vocabularies, tied where
they are) and path: the planned peak (varbench.models.memplan, one row) and the traced one at
one chunk, their ratio, and the chunks the plan picks for B rows on an 80 GB and a 140 GB GPU
("no fit": one unit does not fit; the plan then refuses, naming the bytes). The model is
built under FakeTensorMode (no memory, no data); the live bytes of what each path allocates
are counted by memplan.LiveBytes (views and in-place writes of tensors made before it, the
parameters, are not). What is traced, per path:

- train_logprobs: the optimizer's gradients, the body's forward and the library's chunked
  ``head_logprobs`` (the trainer's head path) over one row, and their backward;
- sampling: one row's KV cache (the sampler's ``grow_cache``) filled by a prefill over all
  T positions (the longest prompt a T-position plan admits) and that step's logits;
- token_norms: the real ``token_grad_norms`` (chunk_size = the chunk) over the last two
  chunks of one row: the second holds what the first left (ghost state, its cotangents).
  Its host reads run for real on the real masks (:class:`HostReads`), a scalar read of a
  fake tensor (the NaN check) reads 0; the parameters' routes are those ``plan_modules``
  picks on a small real model of the architecture (:func:`small_routes`);
- logits: ``head_stats`` over one chunk of positions, the chunk as one statistics block (as
  CUDA runs it; the CPU's cache blocks hold less).

Every path is traced at the model's depth by default. ``--layers l`` traces token_norms and
train_logprobs on l and 2l layers and extrapolates linearly, traced(n) = traced(l) +
(n - l) / l * (traced(2l) - traced(l)) (tests/test_memplan.py checks it at small scale):
quicker, but it under-counts where a phase that grows faster with depth takes over at full
depth (a tied head's token_norms: the batched embedding backward beside every module's
cotangents of two chunks).
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen2Config

import varbench.grads.exact as exact
from varbench.grads import sequence_grad_norms, token_grad_norms, token_vectors
from varbench.grads.chunking import BLOCK_COPIES
from varbench.grads.ghost import ModuleForm, ModulePlan, plan_modules
from varbench.grads.params import select_params
from varbench.grads.seqnorms import SequenceRoute, sequence_routes
from varbench.grads.vectors import CountSketch, param_blocks
from varbench.models import logits as logits_mod
from varbench.models import memplan
from varbench.models.forward import forward_logits
from varbench.models.head import OutputHead
from varbench.models.logits import head_logprobs, head_stats
from varbench.rollout.batch import RolloutBatch
from varbench.rollout.kvcache import grow_cache

SHAPES = {
    "Qwen2-0.5B": lambda: Qwen2Config(hidden_size=896, num_hidden_layers=24,
                                      num_attention_heads=14, num_key_value_heads=2,
                                      intermediate_size=4864, vocab_size=151936,
                                      tie_word_embeddings=True),
    "Qwen2.5-1.5B": lambda: Qwen2Config(hidden_size=1536, num_hidden_layers=28,
                                        num_attention_heads=12, num_key_value_heads=2,
                                        intermediate_size=8960, vocab_size=151936,
                                        tie_word_embeddings=True),
    "Gemma-2-2B": lambda: Gemma2Config(hidden_size=2304, num_hidden_layers=26,
                                       num_attention_heads=8, num_key_value_heads=4,
                                       head_dim=256, intermediate_size=9216, vocab_size=256000,
                                       tie_word_embeddings=True),
    "Llama-3-8B": lambda: LlamaConfig(hidden_size=4096, num_hidden_layers=32,
                                      num_attention_heads=32, num_key_value_heads=8,
                                      intermediate_size=14336, vocab_size=128256,
                                      tie_word_embeddings=False),
}
GPUS = {"80GB": 80 * 10**9, "140GB": 140 * 10**9}


def with_layers(config, n: int):
    """A copy of ``config`` with ``n`` layers (its per-layer pattern cut to length)."""
    cfg = config.__class__(**config.to_dict())
    cfg.num_hidden_layers = n
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:n]
    cfg._attn_implementation = "sdpa"
    return cfg


def trace(config, dtype, path: str, T: int, chunk: int, block: int | None = None) -> int:
    """Traced peak bytes (beyond the parameters) of one chunk of ``path`` on fake tensors
    (``block``: vectors' bytes of per-token gradients per harness pass)."""
    # the harness's routes, decided on a small real model before anything is traced
    routes = (small_routes(config, dtype) if path == "token_norms" else
              small_sequence_routes(config, dtype) if path == "sequence_norms" else {})
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        ids = torch.zeros(1, T, dtype=torch.long)
        am = torch.ones(1, T, dtype=torch.long)
        with memplan.LiveBytes() as lv:
            if path == "train_logprobs":
                # the optimizer's gradients exist before a step and count beyond the
                # parameters (LiveBytes counts no tensor made before it was entered)
                for q in model.parameters():
                    q.grad = torch.zeros_like(q)
                model.train()
                h = model.base_model(input_ids=ids, attention_mask=am).last_hidden_state
                lp = head_logprobs(h[0, :-1], _head(model), ids[0, 1:])
                lp.sum().backward()
            elif path == "sampling":
                with torch.inference_mode():
                    cache = grow_cache(model, T)
                    out = model(input_ids=ids, attention_mask=am, past_key_values=cache,
                                use_cache=True, logits_to_keep=1)
                    z = out.logits[:, -1].float()
                    torch.softmax(z, -1)
            elif path == "logits":
                # as on CUDA: the whole chunk is one statistics block (the CPU's cache
                # blocking would keep the softmax per block and trace less than CUDA holds)
                with torch.no_grad(), mock.patch.object(logits_mod, "block_rows",
                                                        lambda V, c, dev: max(c, 1)):
                    h = torch.zeros(chunk, config.hidden_size, dtype=dtype)
                    head_stats(h, _head(model), torch.zeros(chunk, dtype=torch.long), chunk=chunk)
            elif path == "token_norms":
                _token_chunk(model, routes, T, chunk)
            elif path == "sequence_norms":
                _sequence_rows(model, routes, T, chunk)
            elif path == "vectors":
                _vector_chunks(model, T, chunk, block)
        return lv.peak


def extrapolated(config, dtype, path: str, T: int, chunk: int, layers: int) -> float:
    """Traced peak of ``path`` at ``config``'s depth from traces at ``layers`` and
    ``2 * layers`` layers, linear in the number of layers."""
    a = trace(with_layers(config, layers), dtype, path, T, chunk)
    b = trace(with_layers(config, 2 * layers), dtype, path, T, chunk)
    return a + (config.num_hidden_layers - layers) / layers * (b - a)


def _head(model) -> OutputHead:
    """The model's output head as the library reads it (read_head's probe compares values,
    which fake tensors do not have)."""
    cap = getattr(model.config, "final_logit_softcapping", None)
    return OutputHead(weight=model.get_output_embeddings().weight, softcap=cap)


class HostReads(TorchDispatchMode):
    """Lets the library's host reads run on fake tensors: an op whose tensor inputs are all
    real (the masks a test passes, their nonzero plan) runs for real; a scalar read of a fake
    tensor (a NaN check) reads 0 / False, the value of a finite, well-formed run."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ts = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if ts and not any(isinstance(t, FakeTensor) for t in ts):
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            return False if args[0].dtype == torch.bool else 0
        return func(*args, **kwargs)


def small_routes(config, dtype) -> dict[str, ModuleForm | None]:
    """Every parameter's ghost route (its form, None: materialised) as
    ``ghost.plan_modules`` decides it on a small real model of ``config``'s architecture
    (the routes are structural; the inspection reads values, which fake tensors lack)."""
    model = _small_model(config, dtype)
    ids = torch.randint(0, 512, (1, 16))
    chosen = select_params(model, None)

    def probe():
        return 16, forward_logits(model, ids, torch.ones_like(ids)).logits

    plan = plan_modules(model, chosen, probe)
    routes: dict[str, ModuleForm | None] = {n: None for n, _ in plan.rest}
    routes.update({n: f for _, n, f in plan.ghost})
    return routes


def small_sequence_routes(config, dtype) -> dict[str, SequenceRoute]:
    """Every module's route of ``sequence_grad_norms`` as ``seqnorms.sequence_routes``
    decides and checks it on a small real model of ``config``'s architecture (the routes are
    structural; the checks read values, which fake tensors lack)."""
    model = _small_model(config, dtype)
    ids = torch.randint(0, 512, (1, 16))
    rm = torch.ones(1, 16)
    rm[0, 0] = 0
    return sequence_routes(model, ids, rm, torch.ones_like(ids))


def _sequence_rows(model, routes: dict[str, SequenceRoute], T: int, rows: int) -> None:
    """``rows`` rows of T positions (all but the first a response) through the real
    ``sequence_grad_norms`` with the small model's ``routes`` (one chunk of ``rows``)."""
    with unset_fake_temporarily():
        ids = torch.zeros(rows, T, dtype=torch.long)
        rm = torch.ones(rows, T)
        rm[:, 0] = 0
        am = torch.ones(rows, T, dtype=torch.long)
    with HostReads():
        sequence_grad_norms(model, ids, rm, am, rows=rows, routes=routes)


def _vector_batch(T: int, C: int) -> RolloutBatch:
    """One row of T positions whose last 2 C are its response (a real batch: the harness
    plans its chunks from the mask)."""
    with unset_fake_temporarily():
        Lp, R = T - 2 * C, 2 * C
        mask = torch.ones(1, 1, R)
        z = torch.zeros(1, 1, R)
        return RolloutBatch(prompt_ids=torch.ones(1, Lp, dtype=torch.long),
                            prompt_mask=torch.ones(1, Lp, dtype=torch.long),
                            tokens=torch.ones(1, 1, R, dtype=torch.long), mask=mask,
                            env_mask=z.clone(), logprobs=z, sum_pi_sq=z.clone(),
                            entropy=z.clone(), rewards=torch.zeros(1, 1),
                            lengths=torch.full((1, 1), R))


SKETCH_DIM = 4096  # the count sketch's K in the vectors trace (a variance analysis's order)


def _vector_chunks(model, T: int, C: int, block: int | None) -> None:
    """Two chunks of the real ``token_vectors`` (chunk_size C, count-sketched to
    :data:`SKETCH_DIM`, ``block`` bytes of per-token gradients per harness pass) over the
    last 2 C tokens of one row."""
    with HostReads():
        token_vectors(model, _vector_batch(T, C), sketch_dim=SKETCH_DIM, chunk_size=C,
                      block_bytes=block, pack=False)


def vectors_base(shape: memplan.ModelShape, numels: list[int], L: int, C: int) -> int:
    """What token_vectors reserves beside its block of per-token gradients (its share-out,
    ``varbench.grads.chunking.auto_block_bytes``): the chunk's plan (path vectors, chunk
    ``C``) and the count sketch's state (streamed at full size)."""
    chunk = memplan.plan(shape, "vectors", 1, L, None, default=C).peak_bytes
    return chunk + CountSketch.state_bytes(sum(numels))


def vectors_planned(shape: memplan.ModelShape, numels: list[int], tied: int | None, L: int,
                    C: int, block: int) -> tuple[int, int]:
    """``(planned peak, reserved)`` of token_vectors at chunk ``C`` with ``block`` bytes per
    harness pass: the largest over the passes (the blocks ``param_blocks`` cuts) of its chunk
    phase (the vectors plan with the previous chunk's block, ``materialised``) and its block
    phase (``memplan.vector_block_bytes``; ``tied``: the index of a tied weight), beside the
    sketch's state; ``reserved`` is what token_vectors'
    share-out sets aside, :func:`vectors_base` and :data:`BLOCK_COPIES` copies of the block."""
    item = 8 if shape.elsize == 8 else 4
    blocks = param_blocks(numels, C, block, item)
    held = CountSketch.state_bytes(sum(numels))
    # each pass: its chunk phase (the previous chunk's block alive) or its block phase
    passes = max(max(memplan.plan(shape, "vectors", 1, L, None, default=c,
                                  materialised=sum(numels[i] for i in idx)).peak_bytes,
                     memplan.vector_block_bytes(shape, L, c, sum(numels[i] for i in idx),
                                                numels[tied] if tied in idx else 0))
                 for idx, c in blocks)
    largest = max(c * sum(numels[i] for i in idx) * item for idx, c in blocks)
    return held + passes, vectors_base(shape, numels, L, C) + BLOCK_COPIES * largest


def _small_model(config, dtype):
    """A small real model of ``config``'s architecture (hidden 16 per head, V = 512)."""
    d = config.to_dict()
    heads = d["num_attention_heads"]
    d.update(hidden_size=16 * heads, intermediate_size=32 * heads, vocab_size=512,
             head_dim=16)
    cfg = config.__class__(**d)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()


def _token_chunk(model, routes: dict[str, ModuleForm | None], T: int, C: int) -> None:
    """Two chunks of the real ``token_grad_norms`` (chunk_size C) over the last 2 C tokens
    of one row: the second, over all T positions, holds what the first left (the ghost
    engine's per-module inputs, Grams and running prefixes: a row's steady state). Its
    parameters' ``routes`` are those of :func:`small_routes`."""
    mods = dict(model.named_modules())
    params = dict(model.named_parameters())
    mp = ModulePlan()
    for name, form in routes.items():
        if form is None:
            mp.rest.append((name, params[name]))
        elif name.endswith(".weight"):
            mp.ghost.append((mods[name[: -len(".weight")]], name, form))
    mp.methods = {n: "traced" for n in routes}
    with unset_fake_temporarily():  # the masks and ids are real: the harness plans from them
        ids = torch.zeros(1, T, dtype=torch.long)
        rm = torch.zeros(1, T)
        rm[0, T - 2 * C:] = 1
        am = torch.ones(1, T, dtype=torch.long)
    with HostReads(), mock.patch.object(exact, "plan_modules", lambda m, c, probe: mp):
        token_grad_norms(model, ids, rm, am, chunk_size=C, progress=False)


CHUNKS = {"token_norms": 4, "sequence_norms": 1, "vectors": 4, "train_logprobs": 1,
          "sampling": 1, "logits": 512}  # the traced chunk of each path (its units)


def planned_peak(config, dtype, path: str, L: int, chunk: int
                 ) -> tuple[int, int | None, int | None]:
    """``(planned peak, vectors' block bytes, vectors' reserve)`` of the traced chunk of
    ``path``: one row (sampling: all L positions sampled, as the trace's prefill holds them);
    vectors: at the block a 140 GB GPU's budget leaves beside the chunk (token_vectors'
    share-out), with what that share-out reserves (:func:`vectors_planned`)."""
    shape = memplan.ModelShape.from_config(config, dtype)
    if path != "vectors":
        peak = memplan.plan(shape, path, 1, L, None, default=chunk, response=L).peak_bytes
        return peak, None, None
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = AutoModelForCausalLM.from_config(with_layers(config, config.num_hidden_layers),
                                                 dtype=dtype)
        chosen = [p for _, p in select_params(model, None)]
        emb = model.get_input_embeddings().weight
        tied = next((i for i, p in enumerate(chosen) if p is emb), None) if shape.tied else None
        numels = [p.numel() for p in chosen]
    budget = int(memplan.MEMORY_FRACTION * (GPUS["140GB"] - shape.model_bytes))
    block = max(1, (budget - vectors_base(shape, numels, L, chunk)) // BLOCK_COPIES)
    planned, reserved = vectors_planned(shape, numels, tied, L, chunk, block)
    return planned, block, reserved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=1024, help="positions (prompt + response)")
    ap.add_argument("--B", type=int, default=8, help="rows")
    ap.add_argument("--layers", type=int, default=0,
                    help="token_norms / train_logprobs: trace this many layers and twice as "
                         "many, extrapolated (quicker; under-counts where a phase that grows "
                         "faster with depth takes over); 0 (default): the model's depth")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--paths", nargs="*", default=list(CHUNKS), choices=list(CHUNKS))
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    how = (f"traced on {args.layers} and {2 * args.layers} layers, extrapolated to the "
           "model's depth" if args.layers else "traced at the model's depth")
    print(f"B={args.B} T={args.T} dtype={args.dtype}; {how}; peaks in GiB beyond the "
          "parameters at the traced chunk")
    print(f"{'shape':14s} {'path':15s} {'chunk':>5s} {'planned':>8s} {'traced':>8s} "
          f"{'ratio':>6s} {'80GB':>10s} {'140GB':>10s}")
    refused: list[str] = []
    reserves: list[str] = []
    for name in args.shapes:
        full = SHAPES[name]()
        for path in args.paths:
            B = args.B
            chunk = CHUNKS[path]
            L = args.T
            planned, block, reserved = planned_peak(full, dtype, path, L, chunk)
            if reserved is not None:
                reserves.append(f"{name} vectors: token_vectors reserves "
                                f"{reserved / 2**30:.2f} GiB (chunk plan + sketch + "
                                f"{BLOCK_COPIES} x the {block / 2**30:.2f} GiB block)")
            if args.layers and path in ("token_norms", "train_logprobs"):
                traced = extrapolated(full, dtype, path, L, chunk, args.layers)
            else:
                traced = trace(with_layers(full, full.num_hidden_layers), dtype, path, L, chunk,
                               block)
            picks = []
            for gpu_name, gpu in GPUS.items():
                q = memplan.plan_from_config(full, dtype, path, B, L, gpu, response=L)
                picks.append(f"{q.chunk} {q.unit[:3]}" if q.fits else "no fit")
                if not q.fits:
                    refused.append(f"{name} {path} on {gpu_name}: one {q.unit[:-1]} needs "
                                   f"{memplan.gib(q.need_bytes)} beyond the "
                                   f"{memplan.gib(q.model_bytes)} parameters, the budget "
                                   f"({memplan.MEMORY_FRACTION:g} of the rest) is "
                                   f"{memplan.gib(q.budget or 0)}")
            print(f"{name:14s} {path:15s} {chunk:5d} {planned / 2**30:8.2f} "
                  f"{traced / 2**30:8.2f} {planned / traced:6.2f} {picks[0]:>10s} "
                  f"{picks[1]:>10s}", flush=True)
    for line in refused:  # what does not fit, and why
        print("no fit:", line)
    for line in reserves:  # the share-out beside the predicted peak
        print(line)


if __name__ == "__main__":
    main()
