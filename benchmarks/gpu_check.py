"""One-command CUDA check of the gradient harness: run every path with device='cuda' and
compare against CPU float64.

Run on a GPU machine: python benchmarks/gpu_check.py   (exit 0 = all checks pass)
float64 on CUDA must match CPU float64 to rtol 1e-8; float32 on CUDA (TF32 off) to rtol 1e-3.
Also times token_grad_norms on the `small` preset at T=512 on CUDA.
"""

from __future__ import annotations

import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from varbench.grads import (
    CountSketch,
    exact_float64,
    forward_stats,
    sequence_grads,
    sketched_token_norms,
    tail_token_norms,
    token_grad_norms,
)


def main() -> int:
    # `--device cpu` dry-runs the same script on the CPU (float32 vs float64 still compared)
    dev = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check")
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=40,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    base = LlamaForCausalLM(cfg)
    m64 = exact_float64(base)
    B, L = 3, 40
    ids = torch.randint(1, 40, (B, L))
    am = torch.ones(B, L, dtype=torch.long)
    am[1, :3] = 0
    ids = ids * am
    rm = torch.zeros(B, L)
    rm[:, 8:] = 1
    rm[2, 20] = 0
    failures = 0

    def check(name, got, ref, rtol):
        nonlocal failures
        got = got.detach().double().cpu()
        ok = torch.allclose(got, ref.double(), rtol=rtol, atol=1e-10)
        err = ((got - ref).abs() / ref.abs().clamp(min=1e-12)).max().item()
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {name:40s} max rel err {err:.2e} (rtol {rtol:g})")

    ref = token_grad_norms(m64, ids, rm, am, progress=False)
    for dev_dtype, rtol in ((torch.float64, 1e-8), (torch.float32, 1e-3)):
        model = m64 if dev_dtype == torch.float64 else base
        tag = str(dev_dtype).replace("torch.", "")
        for method in ("ghost", "materialize"):
            got = token_grad_norms(model, ids, rm, am, device=dev, method=method, progress=False)
            check(f"token_sq {dev} {tag} {method}", got.token_sq, ref.token_sq, rtol)
            check(f"prefix_sq {dev} {tag} {method}", got.prefix_sq, ref.prefix_sq, rtol)
        st_ref = forward_stats(m64, ids, rm, am, hidden_norms=True)
        st = forward_stats(model.to(dev), ids.to(dev), rm.to(dev), am.to(dev), hidden_norms=True)
        model.to("cpu")
        check(f"proxy {dev} {tag}", st.proxy, st_ref.proxy, rtol)
        tail_ref = tail_token_norms(m64, ids, rm, am)
        check(
            f"tail {dev} {tag}",
            tail_token_norms(model, ids, rm, am, device=dev).prefix_sq,
            tail_ref.prefix_sq,
            rtol,
        )
        s_dev = CountSketch.for_model(model, 4, seed=1, device=dev)
        s_ref = CountSketch.for_model(m64, 4, seed=1)  # the same S: its state is drawn on the CPU
        check(
            f"sequence sketch {dev} {tag}",
            sequence_grads(model, ids, rm, am, sketch=s_dev, device=dev),
            sequence_grads(m64, ids, rm, am, sketch=s_ref),
            rtol,
        )
        sk = sketched_token_norms(model, ids, rm, am, k=8, seed=3, device=dev)
        sk_ref = sketched_token_norms(m64, ids, rm, am, k=8, seed=3)
        check(f"sketched prefix {dev} {tag}", sk.prefix_sq, sk_ref.prefix_sq, max(rtol, 1e-6))
    try:
        from varbench.models import build_policy

        small = build_policy("small").model
        T = 512 if dev == "cuda" else 32
        ids = torch.randint(4, 30, (4, 8 + T))
        rm = torch.zeros(4, 8 + T)
        rm[:, 8:] = 1
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        token_grad_norms(small, ids, rm, device=dev, progress=False)
        sync()
        peak = torch.cuda.max_memory_allocated() / 2**20 if dev == "cuda" else float("nan")
        print(
            f"small preset T={T} B=4 token_grad_norms on {dev}: "
            f"{time.perf_counter() - t0:.2f}s, peak {peak:.0f} MiB"
        )
    except ImportError as e:  # pragma: no cover - foundation not present
        print(f"skipped small-preset timing: {e}")
    print("gpu_check:", "PASS" if failures == 0 else f"{failures} FAILED")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
