"""Chunk sizes from free device memory (varbench.grads.chunking), checked on the CPU by
standing in for the CUDA memory query."""

from __future__ import annotations

import pytest
import torch
from _fixtures_grads import batch, rollout_batch, tiny_llama

import varbench.grads.chunking as chunking
import varbench.grads.exact as exact
from varbench.grads import token_grad_norms
from varbench.grads.chunking import (
    BLOCK_BYTES,
    DEFAULT_CHUNK,
    auto_block_bytes,
    cotangent_bytes,
    free_device_bytes,
    token_plan,
)
from varbench.grads.vectors import token_vectors
from varbench.models import memplan

CUDA = torch.device("cuda", 0)


@pytest.fixture
def free_gib(monkeypatch):
    """``torch.cuda.mem_get_info`` reporting 2 GiB free of 8 (no GPU needed)."""
    calls = []

    def fake(device=None):
        calls.append(device)
        return 2 << 30, 8 << 30

    monkeypatch.setattr(torch.cuda, "mem_get_info", fake)
    return calls


def test_cpu_keeps_the_measured_defaults():
    model = tiny_llama()
    assert free_device_bytes("cpu") is None
    assert token_plan(model, 2, 10, "cpu").chunk == DEFAULT_CHUNK == 8
    assert auto_block_bytes("cpu") == BLOCK_BYTES
    assert token_plan(model, 2, 10, "cpu", chunk_size=3).chunk == 3  # the knob wins
    assert auto_block_bytes("cpu", block_bytes=77) == 77


def test_cuda_chunk_is_the_plans_in_the_memory_fraction(free_gib):
    """On CUDA the chunk is the memory plan's inside memory_fraction of the free memory
    (the one plan: no other guess), capped, at least one, the knob still winning."""
    model = tiny_llama()
    assert free_device_bytes(CUDA) == 2 << 30 and free_gib == [CUDA]
    shape = memplan.ModelShape.from_model(model)
    for frac in (0.5, 0.25):
        want = memplan.plan(shape, "token_norms", 2, 10, int(frac * (2 << 30))).chunk
        assert token_plan(model, 2, 10, CUDA, memory_fraction=frac).chunk == want
    assert token_plan(model, 2, 10, CUDA).chunk == chunking.MAX_CHUNK  # a tiny model: capped
    assert token_plan(model, 2, 10, CUDA, chunk_size=5).chunk == 5  # the knob wins
    assert auto_block_bytes(CUDA) == (1 << 30) // 2  # half of the fraction's share
    assert auto_block_bytes(CUDA, memory_fraction=1.0) == 1 << 30
    for bad in (0, 1.5, -0.1, True, "half"):
        with pytest.raises(ValueError, match="memory_fraction"):
            token_plan(model, 2, 10, CUDA, memory_fraction=bad)
    with pytest.raises(ValueError, match="chunk_size"):
        token_plan(model, 2, 10, CUDA, chunk_size=0)


def test_cotangent_bytes_is_the_plans_unit_and_counts_a_tied_head():
    """cotangent_bytes is the memory plan's per-cotangent term: for token_vectors the batched
    gather backward's three float32 copies of the L x V vocabulary gradient and one cotangent
    at every module output; for token_norms the largest of the harness's phases (the previous
    chunk's cotangents on top; a tied head's per-token gradient [V h], materialised in
    float32 with its prefix copy); a materialised parameter adds at least its float32 copy."""
    from varbench.models import memplan

    L = 10
    for tied in (False, True):
        model = tiny_llama(tied=tied)
        c = model.config
        shape = memplan.ModelShape.from_model(model)
        assert shape.tied is tied and shape.elsize == 4
        mods = c.num_hidden_layers * L * shape.width * 4
        vocab = 3 * 4 * L * c.vocab_size
        assert cotangent_bytes(model, L) == vocab + mods  # vectors: the block holds the head
        tok = cotangent_bytes(model, L, path="token_norms")
        assert tok == memplan.unit_bytes(shape, "token_norms", L)
        assert tok >= vocab + mods and tok >= 2 * mods  # the previous chunk's too
        if tied:
            assert tok >= 8 * c.vocab_size * c.hidden_size
        assert cotangent_bytes(model, L, 100, path="token_norms") >= tok + 4 * 100
    plain = torch.nn.Linear(3, 2)  # no transformers config: as large as the parameters
    assert cotangent_bytes(plain, 5) == 4 * 8


def test_the_harness_takes_its_chunk_from_free_memory(monkeypatch):
    """With a device that reports free memory, token_grad_norms and token_vectors run with the
    chunk the memory allows (spied on the harness's plan), with the same results."""
    model = tiny_llama()
    ids, rm, am = batch(B=2, L=10)
    used = []
    plan = exact.token_chunks

    def spy(mask, chunk_size, **kw):
        used.append(chunk_size)
        return plan(mask, chunk_size, **kw)

    monkeypatch.setattr(exact, "token_chunks", spy)
    ref = token_grad_norms(model, ids, rm, am, chunk_size=8)
    L = ids.shape[1]
    item = cotangent_bytes(model, L, path="token_norms")
    fixed = memplan.fixed_bytes(memplan.ModelShape.from_model(model), "token_norms", 2, L)
    # room for exactly 3 cotangents at memory_fraction 0.5
    free = int(2 * (fixed + 3 * item) / memplan.HEADROOM) + 2  # the plan's headroom kept
    monkeypatch.setattr(chunking, "free_device_bytes", lambda device: free)
    got = token_grad_norms(model, ids, rm, am)
    assert used == [8, 3]
    torch.testing.assert_close(got.token_sq, ref.token_sq, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.prefix_sq, ref.prefix_sq, rtol=1e-5, atol=0)
    assert token_grad_norms(model, ids, rm, am, memory_fraction=1.0) is not None
    assert used[-1] == 6 + fixed // item
    used.clear()
    # token_vectors gives the chunk half of the fraction (the other half: its gradient block)
    item = cotangent_bytes(model, L)
    fixed = memplan.fixed_bytes(memplan.ModelShape.from_model(model), "vectors", 6, L)
    monkeypatch.setattr(chunking, "free_device_bytes",
                        lambda device: int(4 * (fixed + 3 * item) / memplan.HEADROOM) + 4)
    b = rollout_batch()
    assert b.prompt_ids.shape[1] + b.T == ids.shape[1]  # the same prefix length: same item
    tv = token_vectors(model, b, sketch_dim=None, block_bytes=BLOCK_BYTES)
    assert used == [3]
    tv8 = token_vectors(model, b, sketch_dim=None, chunk_size=8, block_bytes=BLOCK_BYTES)
    assert used == [3, 8]
    torch.testing.assert_close(tv.vec, tv8.vec, rtol=1e-5, atol=1e-7)
