"""The projected path's chunks under a faked device budget (as tests/test_memplan.py fakes
one): on scaled-down Qwen2-shaped decoders (hidden 128, V = 32768, tied and untied heads,
float32 and bfloat16) response_sketches takes the memory plan's rows per forward
(seqnorms.sequence_plan), each row adds at most the plan's per-row bytes (memplan.LiveBytes:
every storage made while it runs, the parameters excluded), and chunking changes nothing.
The whole call's peak (the first call's head check included: memplan.probe_bytes) stays inside
the budget.

Tolerance: chunked against one chunk in float64 (the model's float64 copy), rtol 1e-12 of the
largest entry: the chunks change only which rows share a batched matmul (observed ~1e-16)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import varbench.grads.projected as projected
from varbench.grads.projected import response_sketches
from varbench.grads.seqnorms import sequence_plan
from varbench.models import memplan

pytestmark = pytest.mark.usefixtures("one_thread")

V = 32768
B, L, PROMPT = 8, 64, 4  # at 48 positions (bf16) the first call's head check outweighs 3 rows
RTOL_64 = 1e-12


def decoder(tied: bool, dtype: torch.dtype, hidden: int = 128, layers: int = 2):
    """A Qwen2-shaped decoder with a real-sized vocabulary, tied or untied head."""
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=2 * hidden, vocab_size=V,
                      tie_word_embeddings=tied, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).to(dtype).eval()


def inputs():
    """``B`` rows of ``L`` ids (responses after a ``PROMPT``-token prompt), two coefficient
    sets (a sequence-level one and a per-token one)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, L), generator=g)
    rm = torch.zeros(B, L)
    rm[:, PROMPT:] = 1
    c = torch.randn(B, 1, generator=g) * rm
    coef = torch.stack([c, c * torch.rand(B, L, generator=g) * 2])
    return ids, rm, coef


def _fake_free(monkeypatch, shape, rows: int) -> int:
    """Fake the device's free bytes (the model loaded) so that the plan allows ``rows`` rows;
    returns the budget (``MEMORY_FRACTION`` of it)."""
    phases = memplan.plan(shape, "sequence_norms", B, L, None).phases  # the largest decides
    free = int(2 * max(f + rows * u for f, u in phases) / memplan.HEADROOM) + 2
    monkeypatch.setattr(memplan, "free_device_bytes", lambda device: free)
    p = sequence_plan(shape, B, L, free)
    assert p.chunk == rows
    return p.budget


def _spy_rows(monkeypatch) -> list[int]:
    used: list[int] = []
    blk = projected._block_sketches
    monkeypatch.setattr(projected, "_block_sketches",
                        lambda m, ids, *a, **k: used.append(ids.shape[0]) or blk(m, ids, *a, **k))
    return used


def _peak(model, rows: int, S: int = 2) -> int:
    """Traced peak of one response_sketches call over ``rows`` rows in one chunk."""
    ids, rm, coef = inputs()
    with memplan.LiveBytes() as lv:
        response_sketches(model, ids[:rows], rm[:rows], coefficients=coef[:S, :rows],
                          rows=rows, k1=16, k2=16, k_dense=64)
    return lv.peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [True, False])
def test_projected_chunks_take_the_plans_rows_and_its_per_row_bytes(monkeypatch, tied, dtype):
    """With free memory faked for 3 rows, response_sketches runs chunks of 3, 3, 2 rows; each
    row adds at most the plan's per-row bytes (the traced peak's slope from 1 to 3 rows, two
    coefficient sets, after the first call's self-check)."""
    model = decoder(tied, dtype)
    shape = memplan.ModelShape.from_model(model)
    assert shape.tied is tied
    _fake_free(monkeypatch, shape, 3)
    used = _spy_rows(monkeypatch)
    ids, rm, coef = inputs()
    r = response_sketches(model, ids, rm, coefficients=coef, k1=16, k2=16, k_dense=64)
    assert used == [3, 3, 2]
    assert r.vec.shape[:2] == (2, B) and r.vec.dtype == torch.float32
    slope = (_peak(model, 3) - _peak(model, 1)) / 2
    assert 0 < slope <= memplan.unit_bytes(shape, "sequence_norms", L), slope


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [True, False])
def test_projected_chunks_stay_in_a_faked_budget(monkeypatch, tied, dtype):
    """The traced peak of the whole call (first call: self-check included) inside the budget
    the plan's 3 rows were planned into."""
    model = decoder(tied, dtype)
    budget = _fake_free(monkeypatch, memplan.ModelShape.from_model(model), 3)
    ids, rm, coef = inputs()
    with memplan.LiveBytes() as lv:
        response_sketches(model, ids, rm, coefficients=coef, k1=16, k2=16, k_dense=64)
    assert lv.peak <= budget, (lv.peak, budget)


@pytest.mark.parametrize("tied", [True, False])
def test_projected_chunks_change_nothing_in_float64(monkeypatch, tied):
    """The faked budget's chunks (3, 3, 2 rows) against one chunk of all 8, float64 copy."""
    model = decoder(tied, torch.float64)
    _fake_free(monkeypatch, memplan.ModelShape.from_model(model), 3)
    used = _spy_rows(monkeypatch)
    ids, rm, coef = inputs()
    kw = dict(coefficients=coef, k1=16, k2=16, k_dense=64, seed=3)
    chunked = response_sketches(model, ids, rm, **kw).vec
    assert used == [3, 3, 2]
    one = response_sketches(model, ids, rm, rows=B, **kw).vec
    assert used[3:] == [B] and chunked.dtype == torch.float64
    scale = float(one.abs().max())
    torch.testing.assert_close(chunked, one, rtol=0, atol=RTOL_64 * scale)
