"""Dispatched ops per position / coordinate on the CPU and on a non-CPU device.

An accelerator pays a kernel launch per op, so its logit statistics run one block per chunk
and its streamed CountSketch draws 64x larger chunks; the CPU keeps its cache blocking. The
``meta`` device stands in for an accelerator here (the same non-CPU branch, no values), and a
``TorchDispatchMode`` counts every op that reaches a kernel. The CUDA branch is also forced on
the CPU (``block_rows`` asked for "cuda", the sketch given the accelerator's chunk), where it
runs with values: its op counts per position and its numbers against the cache-blocked path
and a float64 reference, for the logit statistics (``pi_stats``, ``head_stats``, the
differentiable ``head_logprobs`` forward and backward) and the streamed count sketch.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from varbench.grads.vectors import CountSketch
from varbench.models import logits as logits_mod
from varbench.models.head import OutputHead
from varbench.models.logits import block_rows, head_logprobs, head_stats, pi_stats


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _ops(fn) -> int:
    with _Count() as c:
        fn()
    return c.n


def test_block_rows_by_device():
    V = 151936
    assert block_rows(V, 512, "cpu") == 3  # 2 MiB blocks: cache blocking
    assert block_rows(V, 512, torch.device("cuda")) == 512  # one block per chunk
    assert block_rows(V, 512, "meta") == 512
    assert block_rows(64, 8, "cpu") == 8  # never more than the chunk
    assert block_rows(V, 0, "cuda") == 1


def _stat_ops(device: str, n: int, V: int) -> int:
    g = torch.Generator().manual_seed(0)
    z = torch.randn(n, V, generator=g).to(device)
    y = torch.randint(0, V, (n,), generator=g).to(device)
    return _ops(lambda: pi_stats(z, y, chunk=512))


def test_logit_statistics_ops_per_position():
    V = 1 << 17  # CPU blocks of 4 rows
    cpu = {n: _stat_ops("cpu", n, V) for n in (32, 64)}
    acc = {n: _stat_ops("meta", n, V) for n in (32, 64)}
    # CPU: ~11 ops per 4-row block, so the count grows with the positions
    assert cpu[64] - cpu[32] >= 8 * (32 // 4), cpu
    # accelerator: one block for the whole 512-row chunk: the count does not grow with n
    assert acc[64] == acc[32], acc
    assert acc[64] <= 64, acc  # a few dozen ops for the whole chunk (46 measured)
    assert acc[64] * 8 < cpu[64], (acc, cpu)


def test_streamed_countsketch_ops_per_coordinate():
    D_cpu, D_acc = 1 << 22, 1 << 26
    cpu = CountSketch([D_cpu], 64, seed=1, device="cpu", stream=True)
    acc = CountSketch([D_acc], 64, seed=1, device="meta", stream=True)
    assert (cpu.chunk, acc.chunk) == (CountSketch.CHUNK, CountSketch.ACCEL_CHUNK)
    x_cpu = torch.randn(2, D_cpu)
    x_acc = torch.empty(2, D_acc, device="meta")
    per_coord_cpu = _ops(lambda: cpu.apply(x_cpu)) / D_cpu
    per_coord_acc = _ops(lambda: acc.apply(x_acc)) / D_acc
    # 64x larger chunks: at least 32x fewer launches per coordinate
    assert per_coord_acc * 32 <= per_coord_cpu, (per_coord_acc, per_coord_cpu)
    # the accelerator's ops: ~15 per 2^24-coordinate chunk (58 measured for 4 chunks)
    assert _ops(lambda: acc.apply(x_acc)) <= 16 * (D_acc // CountSketch.ACCEL_CHUNK)


def test_row_slices_give_the_same_numbers(monkeypatch):
    """Applying in row slices of APPLY_ELEMENTS products is bitwise the one-slice result."""
    sk = CountSketch([5000, 300], 32, seed=3, stream=True, chunk=1024)
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(6, 3, 5000, generator=g, dtype=torch.float64),
          torch.randn(6, 3, 300, generator=g, dtype=torch.float64)]
    whole = sk(xs)
    monkeypatch.setattr(CountSketch, "APPLY_ELEMENTS", 1024 * 3 * 2)  # two rows per slice
    sliced = sk(xs)
    assert torch.equal(whole, sliced)
    # and the reference: S x from the materialised hashes
    bs, ss = sk.hashes()
    ref = torch.zeros(6, 3, 32, dtype=torch.float64)
    for x, b, s in zip(xs, bs, ss, strict=True):
        ref.index_add_(-1, b, x * s.double())
    torch.testing.assert_close(sliced, ref, rtol=1e-12, atol=1e-12)
    vec = sk([xs[0][0, 0], xs[1][0, 0]])  # a single vector: no leading axis
    torch.testing.assert_close(vec, ref[0, 0], rtol=1e-12, atol=1e-12)


# --- the CUDA branch forced on the CPU: same code, real values ------------------------------

def _force_accelerator(monkeypatch) -> None:
    """``block_rows`` answers as for a CUDA device (one block per chunk) on any device."""
    real = logits_mod.block_rows
    monkeypatch.setattr(logits_mod, "block_rows", lambda V, c, device: real(V, c, "cuda"))


def _ref_stats(z: torch.Tensor, y: torch.Tensor):
    """float64 reference: (logp, entropy, sum pi^2) of softmax(z) at tokens y."""
    lp = z.double().log_softmax(-1)
    p = lp.exp()
    return lp.gather(-1, y[:, None]).squeeze(-1), -(p * lp).sum(-1), p.square().sum(-1)


@pytest.mark.parametrize("fn", ["pi_stats", "head_stats"])
def test_forced_cuda_path_ops_per_position_and_values(monkeypatch, fn):
    """Both branches on the CPU: the cache-blocked one grows ~11 ops per 4-row block, the CUDA
    one is flat in the positions of a chunk; the numbers agree (float32 against float64)."""
    V, H, C = 1 << 17, 8, 512  # CPU blocks of 4 rows
    g = torch.Generator().manual_seed(0)
    w = torch.randn(V, H, generator=g) * 0.5
    head = OutputHead(w)
    h = {n: torch.randn(n, H, generator=g) for n in (32, 64)}
    y = {n: torch.randint(0, V, (n,), generator=g) for n in (32, 64)}

    def run(n):
        if fn == "pi_stats":
            return pi_stats(h[n] @ w.t(), y[n], chunk=C)
        return head_stats(h[n], head, y[n], chunk=C)

    cpu_ops = {n: _ops(lambda n=n: run(n)) for n in (32, 64)}
    cpu_out = run(64)
    _force_accelerator(monkeypatch)
    acc_ops = {n: _ops(lambda n=n: run(n)) for n in (32, 64)}
    acc_out = run(64)
    assert cpu_ops[64] - cpu_ops[32] >= 8 * (32 // 4), cpu_ops  # per block: grows with n
    assert acc_ops[64] == acc_ops[32] and acc_ops[64] <= 64, acc_ops  # one block per chunk
    assert acc_ops[64] * 8 < cpu_ops[64], (acc_ops, cpu_ops)
    ref = _ref_stats(h[64].double() @ w.double().t(), y[64])
    for got_cpu, got_acc, want in zip((cpu_out.logp, cpu_out.entropy, cpu_out.sum_pi_sq),
                                      (acc_out.logp, acc_out.entropy, acc_out.sum_pi_sq), ref,
                                      strict=True):
        torch.testing.assert_close(got_acc, got_cpu, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_acc.double(), want, rtol=1e-5, atol=1e-6)


def test_forced_cuda_path_head_logprobs_forward_and_backward(monkeypatch):
    """The training path's head: forward ops flat in the positions of a chunk on the CUDA
    branch; its log-probs, entropies and gradients equal autograd's in float64."""
    V, H, C = 1 << 15, 8, 256  # CPU blocks of 16 rows
    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.5
    h0 = torch.randn(64, H, generator=g, dtype=torch.float64)
    y = torch.randint(0, V, (64,), generator=g)
    ga, gb = torch.randn(64, generator=g, dtype=torch.float64), torch.randn(
        64, generator=g, dtype=torch.float64)

    def fwd(n, dtype=torch.float32):
        hh = h0[:n].to(dtype).clone().requires_grad_()
        ww = w0.to(dtype).clone().requires_grad_()
        lp, ent = head_logprobs(hh, OutputHead(ww), y[:n], entropy=True, chunk=C)
        return hh, ww, lp, ent

    cpu = {n: _ops(lambda n=n: fwd(n)) for n in (32, 64)}
    _force_accelerator(monkeypatch)
    acc = {n: _ops(lambda n=n: fwd(n)) for n in (32, 64)}
    assert cpu[64] - cpu[32] >= 8 * (32 // 16), cpu
    assert acc[64] == acc[32] and acc[64] * 2 < cpu[64], (acc, cpu)
    hh, ww, lp, ent = fwd(64, torch.float64)  # the forced branch, in float64
    with _Count() as c:
        (lp * ga + ent * gb).sum().backward()
    assert c.n <= 64, c.n  # backward: one pass for the single 64-row chunk
    href = h0.clone().requires_grad_()
    wref = w0.clone().requires_grad_()
    lsm = (href @ wref.t()).log_softmax(-1)
    lp_ref = lsm.gather(-1, y[:, None]).squeeze(-1)
    ent_ref = -(lsm.exp() * lsm).sum(-1)
    (lp_ref * ga + ent_ref * gb).sum().backward()
    tol = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(lp.detach(), lp_ref.detach(), **tol)
    torch.testing.assert_close(ent.detach(), ent_ref.detach(), **tol)
    torch.testing.assert_close(hh.grad, href.grad, **tol)
    torch.testing.assert_close(ww.grad, wref.grad, **tol)


def test_forced_accelerator_chunk_sketch_on_cpu(monkeypatch):
    """The streamed sketch with the accelerator's chunk (scaled down 2^8x, as CHUNK) on the
    CPU: ~64x fewer ops per coordinate than the CPU chunk, and S x equals the reference built
    from its own materialised hash (float64)."""
    monkeypatch.setattr(CountSketch, "CHUNK", CountSketch.CHUNK >> 8)
    monkeypatch.setattr(CountSketch, "ACCEL_CHUNK", CountSketch.ACCEL_CHUNK >> 8)
    D = 1 << 18
    cpu = CountSketch([D], 64, seed=1, device="cpu", stream=True)
    acc = CountSketch([D], 64, seed=1, device="cpu", stream=True,
                      chunk=CountSketch.default_chunk("cuda"))
    assert (cpu.chunk, acc.chunk) == (CountSketch.CHUNK, CountSketch.ACCEL_CHUNK)
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    ops_cpu, ops_acc = _ops(lambda: cpu.apply(x)), _ops(lambda: acc.apply(x))
    assert ops_acc * 32 <= ops_cpu, (ops_acc, ops_cpu)
    assert ops_acc <= 16 * (D // acc.chunk), ops_acc
    for sk in (cpu, acc):
        bs, ss = sk.hashes()
        ref = torch.zeros(2, 64, dtype=torch.float64).index_add_(-1, bs[0], x * ss[0].double())
        torch.testing.assert_close(sk.apply(x), ref, rtol=1e-12, atol=1e-12)
