"""The memory plan (varbench.models.memplan) against peaks traced on the CPU: scaled-down
decoders (hidden 128, V = 32768, tied and untied heads, float32 and bfloat16) with the free
device memory faked by the test, the live bytes counted by a dispatch mode."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import varbench.grads.chunking as chunking
import varbench.grads.exact as exact
from varbench._util.checks import UsageError
from varbench.grads import token_grad_norms
from varbench.models import memplan

V = 32768


def decoder(tied: bool, dtype: torch.dtype, hidden: int = 128, layers: int = 2):
    """A Qwen2-shaped decoder with a real-sized vocabulary, tied or untied head."""
    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=2 * hidden, vocab_size=V,
                      tie_word_embeddings=tied, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).to(dtype)


def inputs(B: int, L: int, prompt: int = 4):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, L), generator=g)
    rm = torch.zeros(B, L)
    rm[:, prompt:] = 1
    return ids, rm, torch.ones(B, L)


def test_live_bytes_counts_what_is_alive():
    with memplan.LiveBytes() as lv:
        a = torch.ones(1024)  # 4 KiB
        b = torch.ones(2048)  # 8 KiB
        del a
        c = b * 2
    assert lv.peak == 8192 + 8192  # a + b, then b + c once a was gone
    assert lv.live == 8192 + 8192
    del b, c


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [True, False])
def test_token_norms_stay_in_a_faked_budget_and_the_plan_is_within_15_percent(
        monkeypatch, tied, dtype):
    model = decoder(tied, dtype)
    B, L = 2, 32
    # 24 response tokens per row: 4 full chunks of 6, the last over all 32 positions (the
    # plan is the peak of a full chunk at the row's end, beside the previous one's cotangents)
    ids, rm, am = inputs(B, L, prompt=8)
    shape = memplan.ModelShape.from_model(model)
    assert shape.tied is tied
    fixed = memplan.fixed_bytes(shape, "token_norms", B, L)
    unit = memplan.unit_bytes(shape, "token_norms", L)
    # memory_fraction 0.5 and the plan's headroom: room for 6 cotangents
    free = int(2 * (fixed + 6 * unit) / memplan.HEADROOM) + 2
    monkeypatch.setattr(chunking, "free_device_bytes", lambda device: free)
    p = chunking.token_plan(model, B, L, "cpu")
    assert p.chunk == 6 and p.budget == free // 2
    used = []
    spy = exact.token_chunks
    monkeypatch.setattr(exact, "token_chunks",
                        lambda m, c, **kw: used.append(c) or spy(m, c, **kw))
    with memplan.LiveBytes() as lv:
        got = token_grad_norms(model, ids, rm, am, progress=False)
    assert used == [6]
    assert lv.peak <= p.budget, (lv.peak, p.budget)
    assert abs(p.peak_bytes / lv.peak - 1) <= 0.15, (p.peak_bytes, lv.peak)
    ref = token_grad_norms(model, ids, rm, am, chunk_size=8, progress=False)
    torch.testing.assert_close(got.token_sq, ref.token_sq, rtol=2e-2 if dtype != torch.float32
                               else 1e-5, atol=0)


def test_a_tied_head_costs_its_per_token_gradient():
    """The issue's case: the tied head's [C, V h] gradient is in the plan, so at the same
    budget a tied model gets fewer cotangents than an untied one."""
    tied = memplan.ModelShape.from_model(decoder(True, torch.float32))
    untied = memplan.ModelShape.from_model(decoder(False, torch.float32))
    L = 8
    t = memplan.unit_bytes(tied, "token_norms", L)
    assert t >= 16 * V * 128
    assert memplan.unit_bytes(untied, "token_norms", L) < t / 4
    budget = 1 << 30
    assert (memplan.plan(tied, "token_norms", 1, L, budget).chunk
            < memplan.plan(untied, "token_norms", 1, L, budget).chunk)


def test_plan_from_config_refuses_before_loading_and_names_the_need():
    cfg = Qwen2Config(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                      num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                      tie_word_embeddings=True)
    p = memplan.plan_from_config(cfg, torch.bfloat16, "token_norms", 8, 1024, 80 << 30)
    assert p.fits and p.chunk >= 1 and p.peak_bytes <= p.budget
    assert 1.4e9 < memplan.ModelShape.from_config(cfg, "bfloat16").n_params < 1.65e9
    small = memplan.plan_from_config(cfg, torch.bfloat16, "token_norms", 8, 1024, 4 << 30)
    assert not small.fits
    with pytest.raises(UsageError, match=r"needs [0-9.]+ GiB .* the budget is"):
        memplan.check_plan(small, "Qwen2.5-1.5B at T = 1024")
    # no device memory known: the path's default, nothing refused
    assert memplan.plan_from_config(cfg, "float32", "sampling", 64, 512, None).chunk == 64


def test_plan_scale_extrapolation_in_layers_holds_at_small_scale():
    """benchmarks/plan_scale.py traces 1 and 2 layers and extrapolates to the model's depth:
    at small scale the extrapolated peak equals the trace of all layers within 5% (the two
    paths it extrapolates)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import plan_scale

    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=4096,
                      tie_word_embeddings=True)
    for path, chunk in (("token_norms", 4), ("train_logprobs", 1)):
        full = plan_scale.trace(plan_scale.with_layers(cfg, 6), torch.float32, path, 32, chunk)
        got = plan_scale.extrapolated(cfg, torch.float32, path, 32, chunk, 1)
        assert abs(got / full - 1) <= 0.05, (path, got, full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [True, False])
def test_logit_statistics_take_the_plans_chunk_and_stay_in_a_faked_budget(
        monkeypatch, tied, dtype):
    """head_stats and head_logprobs without a chunk ask memplan.logit_rows: with free memory
    faked, the chunk is the plan's, the traced peak stays inside the budget and (the chunk as
    one statistics block, as on CUDA) the plan is within 15% of it."""
    from varbench.models import logits as lg
    from varbench.models.head import read_head

    model = decoder(tied, dtype)
    head, why = read_head(model)
    assert head is not None, why
    H = model.config.hidden_size
    e = torch.empty((), dtype=dtype).element_size()
    unit, fixed = memplan.logits_unit(V, e), memplan.logits_fixed(V, H, e)
    free = int(2 * (fixed + 40 * unit) / memplan.HEADROOM) + 2
    monkeypatch.setattr(memplan, "free_device_bytes", lambda device: free)
    budget = free // 2
    n = 200
    g = torch.Generator().manual_seed(2)
    h = torch.randn(n, H, generator=g).to(dtype)
    y = torch.randint(0, V, (n,), generator=g)
    assert lg._chunk_rows(V, None, h, H) == 40
    monkeypatch.setattr(lg, "block_rows", lambda V, c, dev: max(c, 1))
    with memplan.LiveBytes() as lv:
        got = lg.head_stats(h, head, y)
    assert lv.peak <= budget, (lv.peak, budget)
    planned = fixed + 40 * unit
    assert abs(planned / lv.peak - 1) <= 0.15, (planned, lv.peak)
    ref = lg.head_stats(h, head, y, chunk=n)
    torch.testing.assert_close(got.logp, ref.logp, rtol=0, atol=0)
    # the differentiable path (its weight gradient in the plan): at most its default chunk,
    # its peak inside the budget
    gfixed = memplan.logits_fixed(V, H, e, grad=True)
    free = int(2 * (gfixed + 20 * memplan.logits_unit(V, e, grad=True)) / memplan.HEADROOM) + 2
    monkeypatch.setattr(memplan, "free_device_bytes", lambda device: free)
    budget = free // 2
    assert lg._chunk_rows(V, None, h, H, grad=True) == 20
    hh = h.clone().requires_grad_(True)
    with memplan.LiveBytes() as lv:
        lg.head_logprobs(hh, head, y).sum().backward()
    assert lv.peak <= budget, (lv.peak, budget)
    # one position that cannot fit is refused, naming the need
    monkeypatch.setattr(memplan, "free_device_bytes", lambda device: 2 * fixed)
    with pytest.raises(UsageError, match=r"one position .* needs [0-9.]+ GiB"):
        lg._chunk_rows(V, None, h, H)


def test_plan_before_load_refuses_a_model_larger_than_the_device(monkeypatch):
    """A Llama-3-8B-shaped config on a faked 12 GiB device is refused before any weight is
    loaded, naming its parameters' bytes; on 140 GB every path plans at least one unit."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256)
    monkeypatch.setattr(memplan, "free_device_bytes", lambda device: 12 << 30)
    with pytest.raises(UsageError,
                       match=r"does not fit cuda: its parameters alone need 1[45](\.[0-9]+)? GiB"):
        memplan.plan_before_load(cfg, torch.bfloat16, "cuda", 8, 1024)
    monkeypatch.setattr(memplan, "free_device_bytes", lambda device: 140 * 10**9)
    plans = memplan.plan_before_load(cfg, torch.bfloat16, "cuda", 8, 1024)
    assert [p.path for p in plans] == list(memplan.PATHS)
    assert all(p.fits and p.chunk >= 1 for p in plans)
    monkeypatch.setattr(memplan, "free_device_bytes", lambda device: None)
    assert all(p.budget is None for p in memplan.plan_before_load(cfg, "float32", "cpu", 2, 64))


def _plan_scale():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import plan_scale

    return plan_scale


@pytest.mark.parametrize("path", ["sequence_norms", "vectors"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen2-tied", "qwen2-untied", "gemma2-tied"])
def test_plan_scale_rows_of_sequence_norms_and_vectors_within_15_percent(arch, dtype, path):
    """benchmarks/plan_scale.py's sequence_norms and vectors rows at a scaled-down shape
    (hidden 128, 3 layers, V = 4096, 128 positions; Qwen2 tied and untied, Gemma-2 with its
    four norms a layer and soft-capped logits): the real sequence_grad_norms (routes decided
    on a small real model, given) and token_vectors (block from a 140 GB budget) traced on
    fake tensors, and the plan within 15% of the trace either way."""
    from transformers import Gemma2Config

    ps = _plan_scale()
    kw = dict(hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=512, vocab_size=4096,
              tie_word_embeddings=arch.endswith("-tied"))
    cfg = Gemma2Config(head_dim=32, **kw) if arch.startswith("gemma2") else Qwen2Config(**kw)
    chunk, L = ps.CHUNKS[path], 128
    planned, block, _ = ps.planned_peak(cfg, dtype, path, L, chunk)
    traced = ps.trace(ps.with_layers(cfg, 3), dtype, path, L, chunk, block)
    assert traced > 0 and abs(planned / traced - 1) <= 0.15, (planned, traced)
