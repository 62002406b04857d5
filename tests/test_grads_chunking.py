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
    auto_chunk,
    cotangent_bytes,
    free_device_bytes,
)
from varbench.grads.vectors import token_vectors

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
    assert free_device_bytes("cpu") is None
    assert auto_chunk("cpu", 10**9) == DEFAULT_CHUNK == 8
    assert auto_block_bytes("cpu") == BLOCK_BYTES
    assert auto_chunk("cpu", 1, chunk_size=3) == 3  # the knob wins
    assert auto_block_bytes("cpu", block_bytes=77) == 77


def test_cuda_chunk_is_the_memory_fraction_over_the_cotangent_size(free_gib):
    assert free_device_bytes(CUDA) == 2 << 30 and free_gib == [CUDA]
    # floor(0.5 * 2 GiB / 4 MiB) = 256, under the cap
    assert auto_chunk(CUDA, 4 << 20) == 256
    assert auto_chunk(CUDA, 4 << 20, memory_fraction=0.25) == 128
    assert auto_chunk(CUDA, 1) == chunking.MAX_CHUNK  # capped
    assert auto_chunk(CUDA, 1, cap=40) == 40
    assert auto_chunk(CUDA, 10 << 30) == 1  # at least one cotangent
    assert auto_chunk(CUDA, 4 << 20, chunk_size=5) == 5  # the knob wins
    assert auto_block_bytes(CUDA) == (1 << 30) // 2  # half of the fraction's share
    assert auto_block_bytes(CUDA, memory_fraction=1.0) == 1 << 30
    for bad in (0, 1.5, -0.1, True, "half"):
        with pytest.raises(ValueError, match="memory_fraction"):
            auto_chunk(CUDA, 1, memory_fraction=bad)
    with pytest.raises(ValueError, match="chunk_size"):
        auto_chunk(CUDA, 1, chunk_size=0)


def test_cotangent_bytes_counts_logits_and_layers():
    model = tiny_llama()
    c = model.config
    L = 10
    per_pos = c.vocab_size + c.num_hidden_layers * (4 * c.hidden_size + 3 * c.intermediate_size
                                                    + c.num_attention_heads * L)
    assert cotangent_bytes(model, L) == 4 * L * per_pos
    assert cotangent_bytes(model, L, n_grad=100) == 4 * (L * per_pos + 100)
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
    item = cotangent_bytes(model, ids.shape[1])
    # room for exactly 3 cotangents at memory_fraction 0.5
    monkeypatch.setattr(chunking, "free_device_bytes", lambda device: 6 * item + 1)
    got = token_grad_norms(model, ids, rm, am)
    assert used == [8, 3]
    torch.testing.assert_close(got.token_sq, ref.token_sq, rtol=1e-5, atol=0)
    torch.testing.assert_close(got.prefix_sq, ref.prefix_sq, rtol=1e-5, atol=0)
    assert token_grad_norms(model, ids, rm, am, memory_fraction=1.0) is not None
    assert used[-1] == 6
    used.clear()
    # token_vectors gives the chunk half of the fraction (the other half: its gradient block)
    monkeypatch.setattr(chunking, "free_device_bytes", lambda device: 12 * item + 1)
    b = rollout_batch()
    assert b.prompt_ids.shape[1] + b.T == ids.shape[1]  # the same prefix length: same item
    tv = token_vectors(model, b, sketch_dim=None, block_bytes=BLOCK_BYTES)
    assert used == [3]
    tv8 = token_vectors(model, b, sketch_dim=None, chunk_size=8, block_bytes=BLOCK_BYTES)
    assert used == [3, 8]
    torch.testing.assert_close(tv.vec, tv8.vec, rtol=1e-5, atol=1e-7)
