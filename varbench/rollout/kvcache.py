"""A KV cache written in place: the fast path of transformers' DynamicCache for sampling.

DynamicCache concatenates every layer's [B, H, L, D] keys and values with each new token, a copy
of the whole cache per step. ``GrowLayer`` preallocates ``capacity`` positions and writes each
step's column; ``keys``/``values`` are views of the filled prefix, with the same values and
shapes, so attention computes the same numbers (tests/test_rollout_kvcache.py compares whole sampled
batches against DynamicCache bit for bit).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

try:  # transformers >= 5.11: per-layer kinds (sliding, chunked, shared, dummy) in one helper
    from transformers.cache_utils import get_layer_types_and_kwargs
except ImportError:  # older 5.x: no helper; grow_cache reads the config itself (see _layer_kinds)
    get_layer_types_and_kwargs = None


class GrowLayer(DynamicLayer):
    """A DynamicLayer that writes into preallocated capacity instead of ``torch.cat``.

    DynamicLayer copies the whole [B, H, L, D] cache at every step (O(L) per token); here a
    step writes its own column and ``keys``/``values`` are views of the first L columns: the
    same values and shapes, so attention computes the same numbers.
    """

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.length = capacity, 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device = key_states.device
        self._k = key_states.new_empty((*key_states.shape[:2], self.capacity,
                                        key_states.shape[-1]))
        self._v = value_states.new_empty((*value_states.shape[:2], self.capacity,
                                          value_states.shape[-1]))
        self._views()
        self.is_initialized = True

    def _views(self) -> None:
        self.keys = self._k[:, :, : self.length]
        self.values = self._v[:, :, : self.length]

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self._k.shape[2]:  # more tokens than planned (not in sample): reallocate
            self.capacity = 2 * end
            k, v = self.keys, self.values
            self.lazy_initialization(key_states, value_states)
            self._k[:, :, : self.length], self._v[:, :, : self.length] = k, v
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def reset(self) -> None:
        self.length = 0
        super().reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count, got {tokens_to_remove}")
        if self.is_initialized:
            self.length = max(0, self.length + tokens_to_remove)
            self._views()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._k = self._k.repeat_interleave(repeats, dim=0)
            self._v = self._v.repeat_interleave(repeats, dim=0)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self._k, self._v = self._k[indices], self._v[indices]
            self._views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx.to(self.device))


def grow_cache(model, capacity: int) -> Cache | None:
    """An empty cache of ``GrowLayer`` for ``model``, or None (the model builds its default).

    Only for decoders whose every layer is plain full attention: sliding-window, chunked or
    linear-attention layers keep state that only transformers' own layer classes handle.
    """
    n = _full_attention_layers(model)
    return None if n is None else Cache(layers=[GrowLayer(capacity) for _ in range(n)])


def _full_attention_layers(model) -> int | None:
    """The number of cached layers of ``model``'s decoder when every one is plain full
    attention, else None (sliding-window, chunked, linear or unknown layers)."""
    try:
        kinds = _layer_kinds(model.config.get_text_config(decoder=True))
    except Exception:  # a config without per-layer metadata: leave the cache to the model
        return None
    if not kinds or any(k != "full_attention" for k in kinds):
        return None
    return len(kinds)


def _layer_kinds(config) -> list[str] | None:
    """The attention kind of each cached layer of a decoder ``config`` (None: unsure).

    transformers >= 5.11 answers with ``get_layer_types_and_kwargs``. Before it, this reads what
    transformers' own ``DynamicCache(config=...)`` reads: ``layer_types``, else one kind per
    hidden layer from ``sliding_window`` / ``attention_chunk_size``; a config that shares KV
    layers (``num_kv_shared_layers``, ``kv_sharing_modes``) gives None, so the model keeps its
    own cache rather than a fast path that might not match it.
    """
    if get_layer_types_and_kwargs is not None:
        kinds, _ = get_layer_types_and_kwargs(config)
        return list(kinds)
    if getattr(config, "num_kv_shared_layers", None) or getattr(config, "kv_sharing_modes", None):
        return None
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        return list(kinds)
    if getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * config.num_hidden_layers
    if getattr(config, "attention_chunk_size", None) is not None:
        return ["chunked_attention"] * config.num_hidden_layers
    return ["full_attention"] * config.num_hidden_layers


def autograd_cache(model) -> Cache | None:
    """An empty, differentiable cache of transformers' own ``DynamicLayer`` for ``model``, or
    None when a layer is not plain full attention (the same rule as :func:`grow_cache`).

    For teacher-forced passes that backpropagate through cached keys and values: DynamicLayer
    concatenates (out of place), while ``GrowLayer`` writes in place into storage that autograd
    may have saved.
    """
    n = _full_attention_layers(model)
    return None if n is None else Cache(layers=[DynamicLayer() for _ in range(n)])
