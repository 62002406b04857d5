"""varbench.models.forward: positions follow the attention mask, so a padded row gives the
logits of the same row without its padding."""

from __future__ import annotations

import torch
from _fixtures_grads import tiny_llama

from varbench.grads.precision import exact_float64
from varbench.models.forward import forward_logits, position_ids_from_mask


def test_position_ids_count_real_tokens_only():
    am = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [1, 1, 1, 1, 1]])
    assert position_ids_from_mask(am).tolist() == [
        [0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 0, 1, 2, 2], [0, 1, 2, 3, 4]]
    assert position_ids_from_mask(am.bool()).dtype == torch.long


def test_padded_rows_equal_their_unpadded_forward():
    model = exact_float64(tiny_llama())
    ids = torch.tensor([[0, 0, 5, 7, 9, 11], [3, 5, 7, 9, 11, 13]])
    am = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        out = forward_logits(model, ids, am).logits
        alone = forward_logits(model, ids[:1, 2:]).logits  # default mask: every token real
        full = model(input_ids=ids[1:]).logits  # no padding: the model's own positions
    assert out.shape == (2, 6, model.config.vocab_size)
    torch.testing.assert_close(out[0, 2:], alone[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out[1], full[0], rtol=1e-10, atol=1e-12)


def test_extra_keywords_reach_the_model():
    model = tiny_llama()
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        out = forward_logits(model, ids, output_hidden_states=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert out.past_key_values is None  # use_cache=False: no cache is built
