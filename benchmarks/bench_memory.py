"""Peak memory of the variance harness (per-token sketched gradient vectors) against the
number of parameters: the stored CountSketch hash vs the streamed one, side by side.

    .venv/bin/python benchmarks/bench_memory.py [--sizes 64 128 256 384] [--sketch-dim 256]

For each model size (a Llama config, 2 layers, hidden H; vocabulary 30) and each contender, a
fresh subprocess builds the model and a fixed rollout batch (one prompt, G responses, T tokens),
records its resident memory, runs ``token_vectors`` once (the harness the variance analysis
calls) and reports the peak resident memory above that baseline (Linux ``VmHWM``; CPU; large
blocks are mmap'd so freed memory leaves the resident set):

- stored:   the CountSketch hash held per coordinate (int64 bucket + float32 sign: 12 B/param);
- streamed: the hash redrawn chunk by chunk from saved generator states (O(chunk) memory);
- blocked:  streamed, and the parameters cut into blocks whose per-token gradients fit in
  ``--block-mb`` (``token_vectors(block_bytes=...)``): the ``C x D`` block no longer grows with D
  (peak about ``max(budget, one gradient of the largest parameter)``).

Columns: parameters D; the model's own weights (MB); the harness's block of ``chunk_size``
per-token gradients, ``C x D`` floats, which every exact per-token route materialises (MB);
the peak extra memory of each contender (MB), and the stored minus streamed difference per
parameter (bytes). The [B, L, K] result itself is the same for both (K x tokens).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from varbench.grads.vectors import CountSketch, token_vectors
from varbench.models import build_tokenizer
from varbench.rollout.sampler import sample
from varbench.models.presets import Policy
from varbench.tasks import get_task

H, K, mode, G, chunk = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), 8
block = int(sys.argv[5]) if mode == "blocked" else 1 << 40  # bytes of per-token gradients
torch.set_num_threads(1)
tok = build_tokenizer()
cfg = LlamaConfig(vocab_size=len(tok), hidden_size=H, intermediate_size=2 * H,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, max_position_embeddings=64)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).eval()
pol = Policy(model=model, tokenizer=tok, name=f"h{H}")
task = get_task("sort", n=4)
batch = sample(pol, task, task.prompts(1, seed=0), G, seed=0)
D = sum(p.numel() for p in model.parameters())

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith(("VmHWM", "VmRSS")):
            yield line.split()[0], int(line.split()[1]) * 1024

def rss():
    return dict(hwm())["VmRSS:"]

# warm-up on a tiny input so lazy allocations (autograd, kernels) are not counted
token_vectors(model, batch, sketch=CountSketch.for_model(model, K, 0, device="cpu"),
              chunk_size=chunk)
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # reset the peak (VmHWM) to the current RSS
base = rss()
sk = CountSketch([p.numel() for p in model.parameters()], K, 1, stream=(mode != "stored"))
tv = token_vectors(model, batch, sketch=sk, chunk_size=chunk, block_bytes=block)
peak = dict(hwm())["VmHWM:"]
print(json.dumps({"D": D, "model_mb": D * 4 / 2**20, "chunk_mb": chunk * D * 4 / 2**20,
                  "extra_mb": (peak - base) / 2**20, "tokens": int(batch.mask.sum()),
                  "streamed": sk.streamed,
                  "largest_mb": max(p.numel() for p in model.parameters()) * 4 / 2**20}))
"""


def measure(hidden: int, sketch_dim: int, mode: str, G: int, block_mb: float = 0.0) -> dict:
    # Blocks above 64 kB are mmap'd and unmapped on free, so resident memory follows the live
    # tensors instead of glibc's retained arenas.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536",
           "MALLOC_TRIM_THRESHOLD_": "0"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(hidden), str(sketch_dim), mode,
                          str(G), str(int(block_mb * 2**20))], capture_output=True, text=True,
                         env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256, 384],
                    help="hidden sizes (2 layers each)")
    ap.add_argument("--sketch-dim", type=int, default=256)
    ap.add_argument("-G", type=int, default=2, help="responses (4 tokens each)")
    ap.add_argument("--block-mb", type=float, default=8.0,
                    help="the blocked contender's budget of per-token gradients (MB)")
    args = ap.parse_args()
    print(f"{'D':>10} {'model MB':>9} {'C x D MB':>9} {'largest MB':>10} {'stored MB':>10} "
          f"{'streamed MB':>12} {'blocked MB':>11} {'(stored-streamed)/D B':>22}")
    for h in args.sizes:
        st = measure(h, args.sketch_dim, "stored", args.G)
        sm = measure(h, args.sketch_dim, "streamed", args.G)
        bl = measure(h, args.sketch_dim, "blocked", args.G, args.block_mb)
        per = (st["extra_mb"] - sm["extra_mb"]) * 2**20 / st["D"]
        print(f"{st['D']:>10} {st['model_mb']:>9.2f} {st['chunk_mb']:>9.2f} "
              f"{st['largest_mb']:>10.2f} {st['extra_mb']:>10.2f} {sm['extra_mb']:>12.2f} "
              f"{bl['extra_mb']:>11.2f} {per:>22.1f}")


if __name__ == "__main__":
    main()
