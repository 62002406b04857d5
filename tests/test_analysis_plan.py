"""The variance analysis' cost plan (varbench.analysis.plan, VarianceSizes.plan) names the
gradient path that runs and counts its passes: counted against the backwards an end-to-end
run takes (spies on the projected path's chunk function, the sequence norms and the per-token
vectors), and its chunk plan is the one the projected path chunks by (faked free memory)."""

from __future__ import annotations

import pytest
import torch

import varbench.analysis.variance as varmod
import varbench.grads.projected as projected
from varbench.analysis.plan import path_memory
from varbench.analysis.variance import VarianceConfig, estimator_variance, sizes
from varbench.grads.projected import response_sketches
from varbench.models import build_preset, memplan
from varbench.tasks import get_task

pytestmark = pytest.mark.usefixtures("one_thread")

KW = dict(schemes=["centered", "otb", "otb_exact"], modes=("seq-mean-token-sum", "token-mean"),
          Gs=(2, 4), M=3, n_prompts=1, reference="sampled", n_ref=6, min_responses=0,
          n_boot=20, exact="never", sketch_dim=None)


def _count(monkeypatch):
    """Spies: row-backwards of the projected chunks (rows x coefficient sets), rows of the
    exact sequence norms, of the per-token vectors and of the exact token norms."""
    seen = {"projected": 0, "seq": 0, "vectors": 0, "token_sq": 0}
    blk, seq, tv, tsq = (projected._block_sketches, varmod.sequence_grad_norms,
                         varmod.token_vectors, varmod.token_grad_norms)

    def block(model, ids, am, c, *a, **k):
        seen["projected"] += ids.shape[0] * c.shape[0]
        return blk(model, ids, am, c, *a, **k)

    def seqn(model, ids, *a, **k):
        seen["seq"] += ids.shape[0]
        return seq(model, ids, *a, **k)

    def vec(model, batch, *a, **k):
        seen["vectors"] += batch.P * batch.G
        return tv(model, batch, *a, **k)

    def norms(model, ids, *a, **k):
        seen["token_sq"] += ids.shape[0]
        return tsq(model, ids, *a, **k)

    monkeypatch.setattr(projected, "_block_sketches", block)
    monkeypatch.setattr(varmod, "sequence_grad_norms", seqn)
    monkeypatch.setattr(varmod, "token_vectors", vec)
    monkeypatch.setattr(varmod, "token_grad_norms", norms)
    return seen


@pytest.mark.parametrize("gradients", ["projected", "vectors"])
def test_plan_names_the_path_that_runs_and_counts_its_passes(monkeypatch, gradients):
    """The plan's path is the run's (config['gradients']) and its passes are the backwards the
    run takes: projected, one weighted backward per response x coefficient set x G (1 per
    response-use) plus the reference's, the sequence-norm check's two and the exact token
    norms' one per response; vectors, one batched per-token backward per response."""
    pol = build_preset("micro", seed=1, dtype=torch.float64)
    task = get_task("arith", digits=1)
    V = int(pol.model.get_output_embeddings().weight.shape[0])
    p = sizes(task, VarianceConfig(gradients=gradients, **KW), V).plan
    seen = _count(monkeypatch)
    res = estimator_variance(pol, task, gradients=gradients, progress=False, **KW)
    assert p.path == res.config["gradients"] == gradients
    n = KW["M"] * KW["Gs"][-1]  # responses per prompt (the floor: one round)
    sets = len(KW["schemes"]) * len(KW["modes"])
    assert p.uses == n * len(KW["Gs"]) * sets
    if gradients == "projected":
        assert seen["vectors"] == 0
        assert seen["projected"] == p.cell_passes + n + KW["n_ref"]  # cells, check, g*
        assert p.cell_passes == p.uses and p.passes_per_use == 1
        ran = seen["projected"] + seen["seq"] + seen["token_sq"]
    else:
        assert seen["projected"] == 0 and seen["token_sq"] == 0
        assert seen["vectors"] == p.cell_passes + KW["n_ref"] == n + KW["n_ref"]
        ran = seen["vectors"] + seen["seq"]
    assert seen["seq"] == n
    assert p.passes == ran, (p.passes, seen)
    assert f"gradients: {gradients} path" in p.text()


def test_an_enumerated_table_plans_the_vectors_path():
    """Groups drawn from an enumerated table take the vectors even when projected is asked."""
    task = get_task("sort")  # fixed length: with V = 4, V**T x T <= table_limit
    kw = {**KW, "reference": "exact", "exact": "auto"}
    s = sizes(task, VarianceConfig(**kw), 4)
    assert s.table and s.plan.path == "vectors"
    assert s.plan.memory is None  # no model shape given: no chunk plan stated


def decoder(tied: bool, dtype: torch.dtype):
    """A small Qwen2-shaped decoder with a real-sized vocabulary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, vocab_size=32768,
                      tie_word_embeddings=tied, attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).to(dtype)


def test_the_plans_chunk_is_the_one_the_projected_path_runs(monkeypatch):
    """With free memory faked, the plan's rows per forward (path_memory over a config's shape
    and the free bytes before loading) are the rows response_sketches takes, and sizes() reads
    the same plan; the vectors path's plan is token_vectors' (half the memory fraction)."""
    model = decoder(True, torch.float32)
    shape = memplan.ModelShape.from_model(model)
    B, L = 10, 24  # at 12 positions the first call's head check (probe) outweighs 3 rows
    unit = memplan.unit_bytes(shape, "sequence_norms", L)
    fixed = memplan.fixed_bytes(shape, "sequence_norms", B, L)
    free_after = int(2 * (fixed + 3 * unit) / memplan.HEADROOM) + 2  # room for 3 rows
    monkeypatch.setattr(memplan, "free_device_bytes", lambda device: free_after)
    p = path_memory("projected", shape, B, L, free_after + shape.model_bytes)
    assert p.chunk == 3 and p.path == "sequence_norms"
    rows = []
    blk = projected._block_sketches
    monkeypatch.setattr(projected, "_block_sketches",
                        lambda m, ids, *a, **k: rows.append(ids.shape[0]) or blk(m, ids, *a, **k))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32768, (B, L), generator=g)
    rm = torch.zeros(B, L)
    rm[:, 4:] = 1
    response_sketches(model, ids, rm, coefficients=torch.ones(B, L), k1=4, k2=4, k_dense=8)
    assert rows == [3, 3, 3, 1]
    task = get_task("arith", digits=1)
    T = task.max_new_tokens
    s = sizes(task, VarianceConfig(**{**KW, "M": 5}), 32768, shape=shape,
              free=free_after + shape.model_bytes)
    assert s.plan.memory == path_memory("projected", shape, 5 * 4, T,
                                        free_after + shape.model_bytes)
    v = sizes(task, VarianceConfig(**{**KW, "M": 5, "gradients": "vectors"}), 32768,
              shape=shape, free=free_after + shape.model_bytes)
    assert v.plan.memory.path == "vectors" and v.plan.memory.budget == free_after // 4
    assert "chunks: sequence_norms:" in s.plan.text()
