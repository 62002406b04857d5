"""varbench.rollout.kvcache: the preallocated KV cache is a fast path of transformers'
DynamicCache (identical sampled batches) and its layer grows, crops and selects rows."""

from __future__ import annotations

import copy

import pytest
import torch

from varbench.models import build_preset
from varbench.rollout import sample
from varbench.tasks import get_task

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def micro():
    return build_preset("micro", seed=0)


@pytest.mark.parametrize("name,knobs", [("sort", {}), ("arith", {"digits": 2}), ("toolsum", {})])
def test_preallocated_cache_equals_transformers_dynamic_cache(micro, monkeypatch, name, knobs):
    """The in-place KV cache is a fast path of DynamicCache: identical batches, bit for bit."""
    from varbench.rollout import sampler

    task = get_task(name, **knobs)
    prompts = task.prompts(4, seed=1)
    assert sampler._grow_cache(micro.model, 8) is not None  # the fast path is really taken
    fast = sample(micro, task, prompts, 8, seed=3)
    monkeypatch.setattr(sampler, "_grow_cache", lambda model, capacity: None)
    slow = sample(micro, task, prompts, 8, seed=3)
    for f in ("tokens", "mask", "env_mask", "logprobs", "sum_pi_sq", "entropy", "rewards"):
        assert torch.equal(getattr(fast, f), getattr(slow, f)), f
    assert fast.texts == slow.texts


def test_preallocated_cache_layer_grows_crops_and_selects():
    from varbench.rollout.kvcache import GrowLayer

    layer = GrowLayer(capacity=2)
    k = torch.arange(2 * 3 * 4, dtype=torch.float64).reshape(2, 1, 3, 4)
    ref_k, ref_v = [], []
    for i in range(3):  # 3 tokens into capacity 2: must reallocate and keep the old ones
        ks, vs = k[:, :, i : i + 1], -k[:, :, i : i + 1]
        keys, values = layer.update(ks, vs)
        ref_k.append(ks), ref_v.append(vs)
        assert torch.equal(keys, torch.cat(ref_k, 2)) and torch.equal(values, torch.cat(ref_v, 2))
    assert layer.get_seq_length() == 3
    layer.crop(-1)
    assert torch.equal(layer.keys, k[:, :, :2])
    layer.batch_select_indices(torch.tensor([1]))
    assert torch.equal(layer.keys, k[1:, :, :2])
    layer.batch_repeat_interleave(2)
    assert torch.equal(layer.values, -k[[1, 1], :, :2])


def test_layer_kinds_without_transformers_helper_reads_the_config(micro, monkeypatch):
    """transformers < 5.11 has no get_layer_types_and_kwargs: the config is read directly, the
    fast path is still taken for full attention, and a sliding or shared config gets None."""
    from varbench.rollout import kvcache

    cfg = micro.model.config.get_text_config(decoder=True)
    if kvcache.get_layer_types_and_kwargs is not None:
        expected = kvcache._layer_kinds(cfg)
    else:
        expected = ["full_attention"] * cfg.num_hidden_layers
    monkeypatch.setattr(kvcache, "get_layer_types_and_kwargs", None)
    assert kvcache._layer_kinds(cfg) == expected
    assert kvcache.grow_cache(micro.model, 8) is not None
    sliding = copy.deepcopy(cfg)
    sliding.layer_types = None
    sliding.sliding_window = 4
    assert kvcache._layer_kinds(sliding) == ["sliding_attention"] * cfg.num_hidden_layers
    shared = copy.deepcopy(cfg)
    shared.num_kv_shared_layers = 1
    assert kvcache._layer_kinds(shared) is None
