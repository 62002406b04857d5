"""Every chunked path inside a faked device budget (issue 27 point 2), on the CPU.

Scaled-down Qwen2 decoders (hidden 64, V = 8192 where the path reads a vocabulary; tied and
untied heads; float32 and bfloat16) with the free device memory faked by the test at what the
memory plan (varbench.models.memplan) needs for a chunk of 2 units: the path must take the
plan's chunk (fewer units than unchunked), and the live bytes it allocates (memplan.LiveBytes
on real tensors) must stay inside the budget. Then, in float64, the chunked values must equal
the unchunked ones (stated tolerances: the chunks only regroup the same sums).
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import varbench.grads.chunking as chunking
from varbench.grads import sequence_grad_norms, token_grad_norms
from varbench.grads.seqnorms import sequence_rows
from varbench.grads.vectors import token_vectors
from varbench.models import Policy, build_tokenizer, memplan
from varbench.rollout import sample
from varbench.rollout import sampler as sampler_mod
from varbench.rollout.batch import RolloutBatch
from varbench.rollout.logprobs import logprob_rows, response_logprobs
from varbench.tasks import get_task

pytestmark = pytest.mark.usefixtures("one_thread")

V = 8192
MATRIX = [(tied, dtype) for tied in (True, False) for dtype in (torch.float32, torch.bfloat16)]
IDS = [f"{'tied' if t else 'untied'}-{str(d).split('.')[-1]}" for t, d in MATRIX]


def decoder(tied: bool, dtype: torch.dtype, vocab: int = V, hidden: int = 64):
    """A two-layer Qwen2-shaped decoder, tied or untied head."""
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=2 * hidden, vocab_size=vocab,
                      tie_word_embeddings=tied, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).to(dtype).eval()


def fake_free(monkeypatch, free: int | None) -> None:
    """The device reports ``free`` bytes (memplan and the harness read the same number)."""
    monkeypatch.setattr(memplan, "free_device_bytes", lambda device: free)
    monkeypatch.setattr(chunking, "free_device_bytes", lambda device: free)


def free_for(p: memplan.Plan, chunk: int, fraction: float = memplan.MEMORY_FRACTION) -> int:
    """Free bytes whose budget (``fraction`` of them) plans exactly ``chunk`` units of ``p``
    (and holds its probe phase, which must not exceed them)."""
    need = max(f + chunk * u for f, u in (p.phases or ((p.fixed_bytes, p.unit_bytes),)))
    assert p.probe_bytes <= need, "the probe phase would decide the budget: plan more units"
    return math.ceil(need / memplan.HEADROOM / fraction) + 8


def token_inputs(B: int, L: int, prompt: int = 8):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, L), generator=g)
    rm = torch.zeros(B, L)
    rm[:, prompt:] = 1
    return ids, rm, torch.ones(B, L, dtype=torch.long)


def rollout(P: int, G: int, T: int, Lp: int, vocab: int = V) -> RolloutBatch:
    """A RolloutBatch [P, G, T] of random tokens, one response shorter than T."""
    g = torch.Generator().manual_seed(3)
    mask = torch.ones(P, G, T)
    mask[0, 1, T // 2:] = 0
    tokens = torch.randint(1, vocab, (P, G, T), generator=g) * mask.long()
    z = torch.zeros(P, G, T)
    return RolloutBatch(prompt_ids=torch.randint(1, vocab, (P, Lp), generator=g),
                        prompt_mask=torch.ones(P, Lp, dtype=torch.long), tokens=tokens,
                        mask=mask, env_mask=z.clone(), logprobs=z, sum_pi_sq=z, entropy=z,
                        rewards=torch.zeros(P, G), lengths=mask.sum(-1).long())


# -- token norms (varbench.grads.token_grad_norms) ------------------------------------------

@pytest.mark.parametrize("tied,dtype", MATRIX, ids=IDS)
def test_token_norms_stay_in_a_faked_budget(monkeypatch, tied, dtype):
    model = decoder(tied, dtype)
    B, L = 2, 24
    ids, rm, am = token_inputs(B, L)
    shape = memplan.ModelShape.from_model(model)
    free = free_for(memplan.plan(shape, "token_norms", B, L, None), 4)
    fake_free(monkeypatch, free)
    assert chunking.token_plan(model, B, L, "cpu").chunk == 4  # 16 tokens per row
    with memplan.LiveBytes() as lv:
        token_grad_norms(model, ids, rm, am, progress=False)
    assert 0 < lv.peak <= free // 2, (lv.peak, free // 2)


def test_token_norms_chunks_do_not_change_the_values_in_float64(monkeypatch):
    model = decoder(True, torch.float64)
    B, L = 2, 24
    ids, rm, am = token_inputs(B, L)
    one = token_grad_norms(model, ids, rm, am, chunk_size=L, progress=False)  # one per row
    shape = memplan.ModelShape.from_model(model)
    fake_free(monkeypatch, free_for(memplan.plan(shape, "token_norms", B, L, None), 3))
    assert chunking.token_plan(model, B, L, "cpu").chunk == 3
    got = token_grad_norms(model, ids, rm, am, progress=False)
    for name in ("token_sq", "prefix_sq", "diag_prefix_sq"):
        torch.testing.assert_close(getattr(got, name), getattr(one, name), rtol=1e-10,
                                   atol=0, msg=name)


# -- sequence norms (varbench.grads.sequence_grad_norms) ------------------------------------

def _sequence_free(model, B: int, L: int, rows: int) -> int:
    shape = memplan.ModelShape.from_model(model)
    return free_for(memplan.plan(shape, "sequence_norms", B, L, None), rows)


@pytest.mark.parametrize("tied,dtype", MATRIX, ids=IDS)
def test_sequence_norms_stay_in_a_faked_budget(monkeypatch, tied, dtype):
    model = decoder(tied, dtype)
    B, L = 8, 48
    ids, rm, am = token_inputs(B, L)
    free = _sequence_free(model, B, L, 3)
    fake_free(monkeypatch, free)
    assert sequence_rows(model, B, L, "cpu") == 3  # chunks of 3, 3, 2 rows
    with memplan.LiveBytes() as lv:
        sequence_grad_norms(model, ids, rm, am)
    assert 0 < lv.peak <= free // 2, (lv.peak, free // 2)


def test_sequence_norms_chunks_do_not_change_the_values_in_float64(monkeypatch):
    model = decoder(False, torch.float64)
    B, L = 8, 48
    ids, rm, am = token_inputs(B, L)
    one = sequence_grad_norms(model, ids, rm, am, rows=B)
    fake_free(monkeypatch, _sequence_free(model, B, L, 3))
    assert sequence_rows(model, B, L, "cpu") == 3
    torch.testing.assert_close(sequence_grad_norms(model, ids, rm, am), one, rtol=1e-10, atol=0)


# -- per-token vectors (varbench.grads.token_vectors) ---------------------------------------

def _vectors_free(model, batch: RolloutBatch, chunk: int) -> int:
    """Free bytes whose half-fraction plans ``chunk`` cotangents (token_vectors gives the
    chunk half of memory_fraction) and leaves the other half to the gradient block."""
    shape = memplan.ModelShape.from_model(model)
    B, L = batch.tokens.shape[0] * batch.tokens.shape[1], (batch.prompt_ids.shape[1]
                                                            + batch.tokens.shape[2])
    return free_for(memplan.plan(shape, "vectors", B, L, None), chunk,
                    memplan.MEMORY_FRACTION / 2)


@pytest.mark.parametrize("tied,dtype", MATRIX, ids=IDS)
def test_token_vectors_stay_in_a_faked_budget(monkeypatch, tied, dtype):
    model = decoder(tied, dtype, hidden=32)
    batch = rollout(2, 2, 10, 6)
    free = _vectors_free(model, batch, 4)
    fake_free(monkeypatch, free)
    B, L = 4, 16
    assert chunking.token_plan(model, B, L, "cpu", path="vectors",
                               memory_fraction=memplan.MEMORY_FRACTION / 2).chunk == 4
    with memplan.LiveBytes() as lv:
        token_vectors(model, batch, sketch_dim=256)
    assert 0 < lv.peak <= free // 2, (lv.peak, free // 2)


def test_token_vectors_chunks_do_not_change_the_values_in_float64(monkeypatch):
    model = decoder(True, torch.float64, hidden=32)
    batch = rollout(2, 2, 10, 6)
    one = token_vectors(model, batch, sketch_dim=256, chunk_size=64, block_bytes=1 << 40)
    fake_free(monkeypatch, _vectors_free(model, batch, 4))
    got = token_vectors(model, batch, sketch_dim=256)
    torch.testing.assert_close(got.vec, one.vec, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(got.token_sq, one.token_sq, rtol=1e-10, atol=0)


# -- sampling (varbench.rollout.sample: rows per KV cache) ----------------------------------

def _policy(tied: bool, dtype: torch.dtype) -> Policy:
    tok = build_tokenizer()
    return Policy(model=decoder(tied, dtype, vocab=len(tok)), tokenizer=tok,
                  name=f"qwen2-{'tied' if tied else 'untied'}")


def _sampling_free(policy: Policy, task, prompts, G: int, groups: int) -> tuple[int, int, int]:
    """(free bytes that plan ``groups`` groups per KV cache, L, T)."""
    T = task.max_new_tokens
    L = sampler_mod.encode_prompts(policy.tokenizer, prompts)[0].shape[1] + T
    shape = memplan.ModelShape.from_model(policy.model)
    p = memplan.plan(shape, "sampling", len(prompts) * G, L, None, response=T)
    return free_for(p, groups * G), L, T


@pytest.mark.parametrize("tied,dtype", MATRIX, ids=IDS)
def test_sampling_stays_in_a_faked_budget(monkeypatch, tied, dtype):
    policy = _policy(tied, dtype)
    task = get_task("sort")
    prompts, G = task.prompts(4, seed=2), 2
    free, L, T = _sampling_free(policy, task, prompts, G, 1)
    fake_free(monkeypatch, free)
    assert sampler_mod.sampling_prompts(policy, 4, G, L, response=T) == 1
    with memplan.LiveBytes() as lv:
        sample(policy, task, prompts, G, seed=0)
    assert 0 < lv.peak <= free // 2, (lv.peak, free // 2)


def test_sampling_chunks_do_not_change_the_values_in_float64(monkeypatch):
    policy = _policy(True, torch.float64)
    task = get_task("sort")
    prompts, G = task.prompts(4, seed=2), 2
    whole = sample(policy, task, prompts, G, greedy=True)
    free, L, T = _sampling_free(policy, task, prompts, G, 1)
    fake_free(monkeypatch, free)
    assert sampler_mod.sampling_prompts(policy, 4, G, L, response=T) == 1
    got = sample(policy, task, prompts, G, greedy=True)
    assert torch.equal(got.tokens, whole.tokens) and torch.equal(got.mask, whole.mask)
    for name in ("logprobs", "sum_pi_sq", "entropy"):
        torch.testing.assert_close(getattr(got, name), getattr(whole, name), rtol=1e-12,
                                   atol=1e-12, msg=name)


# -- the training step's log-probs (varbench.rollout.logprob_rows / response_logprobs) ------

def _train_free(model, batch: RolloutBatch, rows: int) -> int:
    P, G, T = batch.tokens.shape
    shape = memplan.ModelShape.from_model(model)
    L = batch.prompt_ids.shape[1] + T
    return free_for(memplan.plan(shape, "train_logprobs", P * G, L, None), rows)


def _step(model, batch: RolloutBatch, rows: int | None) -> torch.Tensor:
    """One training step's log-probs and their backward (the gradients exist before, as the
    optimizer keeps them)."""
    for q in model.parameters():
        q.grad = torch.zeros_like(q)
    lp = response_logprobs(model, batch, rows=rows)
    lp.sum().backward()
    return lp.detach()


@pytest.mark.parametrize("tied,dtype", MATRIX, ids=IDS)
def test_train_logprobs_stay_in_a_faked_budget(monkeypatch, tied, dtype):
    model = decoder(tied, dtype).train()
    batch = rollout(3, 2, 12, 8)
    free = _train_free(model, batch, 2)
    fake_free(monkeypatch, free)
    rows = logprob_rows(model, batch, 3)
    assert rows == 2
    with memplan.LiveBytes() as lv:
        _step(model, batch, rows)
    assert 0 < lv.peak <= free // 2, (lv.peak, free // 2)


def test_train_logprobs_chunks_do_not_change_the_values_in_float64(monkeypatch):
    model = decoder(True, torch.float64).train()
    batch = rollout(3, 2, 12, 8)
    one = _step(model, batch, None)
    grads = [q.grad.clone() for q in model.parameters()]
    fake_free(monkeypatch, _train_free(model, batch, 2))
    rows = logprob_rows(model, batch, 3)
    assert rows == 2
    got = _step(model, batch, rows)
    torch.testing.assert_close(got, one, rtol=1e-12, atol=1e-12)
    for q, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(q.grad, g, rtol=1e-10, atol=1e-14)
