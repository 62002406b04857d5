"""Dispatched ops per position / coordinate on the CPU and on a non-CPU device.

An accelerator pays a kernel launch per op, so its logit statistics run one block per chunk
and its streamed CountSketch draws 64x larger chunks; the CPU keeps its cache blocking. The
``meta`` device stands in for an accelerator here (the same non-CPU branch, no values), and a
``TorchDispatchMode`` counts every op that reaches a kernel.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from varbench.grads.vectors import CountSketch
from varbench.models.logits import block_rows, pi_stats


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
