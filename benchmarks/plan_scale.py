"""The memory plan at full scale without a GPU: real shapes under FakeTensorMode, traced.

    python benchmarks/plan_scale.py [--T 1024] [--B 8] [--layers 2]

Per shape (Qwen2-0.5B, Qwen2.5-1.5B, Gemma-2-2B, Llama-3-8B: real vocabularies, tied where
they are) and path: the planned peak (varbench.models.memplan) and the traced one at one
chunk, their ratio, and the chunks the plan picks on an 80 GB and a 140 GB GPU. The model is
built under FakeTensorMode (no memory, no data); the live bytes of what each path's chunk
allocates are counted by memplan.LiveBytes. What is traced, per path:

- train_logprobs: the body's forward and the library's chunked ``head_logprobs`` (the
  trainer's head path) over one row, and their backward;
- sampling: one row's KV cache (transformers' cache, the sampler's ``grow_cache``) filled over
  the prompt and response, and one decode step's logits;
- token_norms: one chunk of the harness's batched backward (``is_grads_batched``) over one
  row with every Linear output a target (its cotangents kept, as the ghost norms keep them)
  and a tied head's per-token gradient materialised and copied to float32, as the harness
  does; the real function's host reads (its plan from the mask) cannot run on fake tensors,
  so the CPU tests (tests/test_memplan.py) hold the real function to the same plan;
- logits: ``head_stats`` over one chunk of positions, the chunk as one statistics block (as
  CUDA runs it; the CPU's cache blocks hold less).

For token_norms and train_logprobs fewer layers (``--layers``, l) are traced and the
per-layer terms extrapolated linearly to the model's depth n: traced(n) = traced(l) +
(n - l) / l * (traced(2l) - traced(l)); tests/test_memplan.py checks that extrapolation at
small scale (within 5%). Sampling and logits are traced at full depth.
"""

from __future__ import annotations

import argparse
from unittest import mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig, Qwen2Config

from varbench.models import logits as logits_mod
from varbench.models import memplan
from varbench.models.forward import forward_logits
from varbench.models.head import OutputHead
from varbench.models.logits import head_logprobs, head_stats, token_logprobs, upcast
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


def trace(config, dtype, path: str, T: int, chunk: int) -> int:
    """Traced peak bytes (beyond the parameters) of one chunk of ``path`` on fake tensors."""
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        V = config.vocab_size
        ids = torch.zeros(1, T, dtype=torch.long)
        am = torch.ones(1, T, dtype=torch.long)
        if path == "train_logprobs":  # the optimizer's gradients exist before a step
            for q in model.parameters():
                q.grad = torch.zeros_like(q)
        with memplan.LiveBytes() as lv:
            if path == "train_logprobs":
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
                _token_chunk(model, ids, am, chunk, V)
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


def _token_chunk(model, ids, am, C: int, V: int) -> None:
    """One chunk of the exact harness: C cotangents of log-probs over one row, batched."""
    outs = []
    lins = [m for m in model.modules() if isinstance(m, torch.nn.Linear)
            and m.weight is not model.get_input_embeddings().weight]
    hooks = [m.register_forward_hook(lambda m, a, o: outs.append(o)) for m in lins]
    try:
        with torch.enable_grad():
            logits = forward_logits(model, ids, am).logits
            lp = token_logprobs(upcast(logits), ids)[0, -C:]
            tied = model.get_input_embeddings().weight
            is_tied = tied is model.get_output_embeddings().weight
            rest = [tied] if is_tied else []
            eye = torch.eye(C, dtype=lp.dtype)
            grads = torch.autograd.grad(lp, outs + rest, grad_outputs=eye,
                                        is_grads_batched=True, allow_unused=True)
            if is_tied:
                g = grads[-1].reshape(C, -1).to(torch.float32)
                torch.einsum("cn,cn->c", g, g)
                cum = g.clone()
                cum.cumsum_(0)
                del g, cum
            for d in grads[: len(outs)]:
                if d is not None:
                    d.to(torch.float32).sum()
    finally:
        for h in hooks:
            h.remove()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--T", type=int, default=1024, help="positions (prompt + response)")
    ap.add_argument("--B", type=int, default=8, help="rows")
    ap.add_argument("--layers", type=int, default=2, help="layers traced (then extrapolated)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES))
    ap.add_argument("--paths", nargs="*",
                    default=["token_norms", "train_logprobs", "sampling", "logits"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"B={args.B} T={args.T} dtype={args.dtype}; traced on {args.layers} and "
          f"{2 * args.layers} layers, extrapolated to the model's depth; peaks in GiB beyond "
          "the parameters at the traced chunk")
    print(f"{'shape':14s} {'path':15s} {'chunk':>5s} {'planned':>8s} {'traced':>8s} "
          f"{'ratio':>6s} {'80GB':>10s} {'140GB':>10s}")
    for name in args.shapes:
        full = SHAPES[name]()
        shape = memplan.ModelShape.from_config(full, dtype)
        for path in args.paths:
            B = args.B
            chunk = {"token_norms": 4, "train_logprobs": 1, "sampling": 1,
                     "logits": 512}[path]
            L = args.T
            p = memplan.plan(shape, path, B, L, None, default=chunk)
            if path in ("token_norms", "train_logprobs"):  # the extrapolation tested
                traced = extrapolated(full, dtype, path, L, chunk, args.layers)
            else:  # cheap at full depth (no backward); their small-scale peak is not linear
                traced = trace(with_layers(full, full.num_hidden_layers), dtype, path, L, chunk)
            # the traced chunk is one row: the plan's per-row fixed outputs ([B, L]) aside
            planned = p.peak_bytes - (memplan.fixed_bytes(shape, path, B, L)
                                      - memplan.fixed_bytes(shape, path, 1, L))
            picks = []
            for gpu in GPUS.values():
                q = memplan.plan_from_config(full, dtype, path, B, L, gpu)
                picks.append(f"{q.chunk} {q.unit[:3]}" if q.fits else "no fit")
            print(f"{name:14s} {path:15s} {chunk:5d} {planned / 2**30:8.2f} "
                  f"{traced / 2**30:8.2f} {planned / traced:6.2f} {picks[0]:>10s} "
                  f"{picks[1]:>10s}", flush=True)


if __name__ == "__main__":
    main()
