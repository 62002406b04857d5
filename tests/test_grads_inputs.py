"""varbench.grads._inputs: boundary checks of the exact paths, eval mode, model preparation."""

from __future__ import annotations

import pytest
import torch
from _fixtures_grads import batch, tiny_llama

from varbench.grads._inputs import check_inputs, prepare, prepare_model


def test_eval_mode_switches_a_training_model_and_restores_it():
    """Per-token quantities must not see dropout; a model in training mode is restored after."""
    from varbench.grads._inputs import eval_mode

    model = tiny_llama()
    model.train()
    seen = []
    with eval_mode(model):
        seen = [m.training for m in model.modules()]
    assert not any(seen)
    assert all(m.training for m in model.modules())
    model.eval()
    with eval_mode(model):
        assert not model.training
    assert not model.training


def test_check_inputs_normalises_dtypes_and_default_mask():
    ids, rm, am = batch()
    i2, r2, a2 = check_inputs(ids.int(), rm, am.bool())
    assert i2.dtype == torch.long and a2.dtype == torch.long and torch.equal(r2, rm)
    assert torch.equal(i2, ids) and torch.equal(a2, am)
    _, _, ones = check_inputs(ids, rm * am, None)
    assert ones.dtype == torch.long and bool((ones == 1).all())


def test_check_inputs_refusals():
    ids, rm, am = batch()
    with pytest.raises(ValueError, match=r"input_ids has shape \[36\], expected \[\*, \*\]"):
        check_inputs(ids.reshape(-1), rm, am)
    with pytest.raises(TypeError, match="integer tensor, got dtype torch.bool"):
        check_inputs(ids.bool(), rm, am)
    with pytest.raises(ValueError, match=r"attention_mask has shape \[3, 11\]"):
        check_inputs(ids, rm, am[:, :-1])
    with pytest.raises(ValueError, match="L=1; need L >= 2"):
        check_inputs(ids[:, :1], rm[:, :1], am[:, :1])
    bad = rm.clone()
    bad[0, 5] = 0.5
    with pytest.raises(ValueError, match="response_mask must contain only 0 and 1"):
        check_inputs(ids, bad, am)


def test_prepare_model_copies_only_when_dtype_or_device_differ():
    model = tiny_llama()
    assert prepare_model(model, None, None) is model
    assert prepare_model(model, torch.float32, "cpu") is model
    copy = prepare_model(model, torch.float64, None)
    assert copy is not model and next(copy.parameters()).dtype == torch.float64
    assert next(model.parameters()).dtype == torch.float32  # the caller's model is untouched
    assert [n for n, _ in copy.named_parameters()] == [n for n, _ in model.named_parameters()]
    with pytest.raises(TypeError, match="floating dtype, got torch.int64"):
        prepare_model(model, torch.int64, None)
    ids, rm, am = batch()
    m2, i2, r2, a2 = prepare(model, ids, rm, am, torch.float64, None)
    assert next(m2.parameters()).dtype == torch.float64 and torch.equal(i2, ids)
