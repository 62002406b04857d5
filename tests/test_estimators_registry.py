"""varbench.estimators.registry: advantages() dispatch, the registry, and the boundary checks
(shapes, masks, non-finite rewards, options)."""

from __future__ import annotations

import pytest
import torch
from _fixtures_estimators import random_case

import varbench.estimators as E

OUTCOME = ["raw", "centered", "normalized", "rloo", "topk", "opo", "reinforce_pp_baseline"]


def test_float32_in_float32_out_and_int_rewards():
    rewards, mask, _ = random_case(2, 3, 4, 0, dtype=torch.float32)
    assert E.advantages("centered", rewards, mask).dtype == torch.float32
    out = E.advantages("centered", torch.tensor([[1, 0, 0]]), torch.ones(1, 3, 2))
    assert out.dtype == torch.float32
    assert out[0, :, 0].tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])


# ---- registry ------------------------------------------------------------------------------


def test_schemes_lists_builtins_in_order():
    assert E.schemes()[:11] == OUTCOME + ["passk", "normalized_batch", "otb", "otb_loo"]


def test_register_custom_scheme_and_duplicates():
    def halved(rewards, mask, opts):
        return E.outcome_rewards(rewards, mask).unsqueeze(-1).expand(mask.shape) * opts.extra[
            "scale"
        ]

    E.register_scheme("test_scaled", extra_options=("scale",))(halved)
    try:
        assert "test_scaled" in E.schemes()
        E.register_scheme("test_scaled", extra_options=("scale",))(halved)  # same fn: fine
        out = E.advantages("test_scaled", torch.tensor([[2.0]]), torch.ones(1, 1, 2), scale=0.5)
        assert out.tolist() == [[[1.0, 1.0]]]
        with pytest.raises(ValueError, match="already registered"):
            E.register_scheme("test_scaled")(lambda r, m, o: r)
        with pytest.raises(TypeError, match="unknown option 'scal'.*'scale'"):
            E.advantages("test_scaled", torch.tensor([[2.0]]), torch.ones(1, 1, 2), scal=1)
    finally:
        E.unregister_scheme("test_scaled")
    assert "test_scaled" not in E.schemes()


def test_unknown_scheme_lists_known():
    with pytest.raises(ValueError, match=r"scheme='nope'.*'centered'"):
        E.advantages("nope", torch.zeros(1, 2), torch.ones(1, 2, 3))


def test_scheme_returning_wrong_shape_is_named():
    E.register_scheme("test_bad_shape")(lambda r, m, o: r)
    try:
        with pytest.raises(ValueError, match="test_bad_shape"):
            E.advantages("test_bad_shape", torch.zeros(1, 2), torch.ones(1, 2, 3))
    finally:
        E.unregister_scheme("test_bad_shape")


# ---- boundary errors -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_rewards_name_the_group(bad):
    rewards = torch.zeros(4, 3)
    rewards[2, 1] = bad
    with pytest.raises(ValueError, match=r"group\(s\) p=\[2\]"):
        E.advantages("centered", rewards, torch.ones(4, 3, 5))


def test_nonfinite_token_reward_under_mask_is_ignored_but_valid_one_is_not():
    rewards = torch.zeros(2, 2, 3)
    mask = torch.ones(2, 2, 3)
    mask[1, 0, 2] = 0
    rewards[1, 0, 2] = float("nan")
    assert torch.isfinite(E.advantages("otb", rewards, mask, token_weights=mask)).all()
    rewards[1, 1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"p=\[1\]"):
        E.advantages("otb", rewards, mask, token_weights=mask)


@pytest.mark.parametrize(
    ("rewards", "mask", "match"),
    [
        (torch.zeros(2, 3), torch.ones(2, 4, 5), r"rewards has shape \[2, 3\], expected \[2, 4\]"),
        (torch.zeros(2, 4, 6), torch.ones(2, 4, 5), r"expected \[2, 4, 5\]"),
        (torch.zeros(2, 4), torch.ones(2, 4), r"mask has shape \[2, 4\]"),
        (torch.zeros(2, 4), torch.zeros(2, 4, 5), "no valid token"),
        (torch.zeros(2, 4), torch.full((2, 4, 5), 0.5), "only 0 and 1"),
    ],
)
def test_shape_and_mask_errors(rewards, mask, match):
    with pytest.raises(ValueError, match=match):
        E.advantages("centered", rewards, mask)


def test_option_errors():
    R, m = torch.zeros(2, 4), torch.ones(2, 4, 5)
    with pytest.raises(ValueError, match="token_weights has shape"):
        E.advantages("otb", R, m, token_weights=torch.ones(2, 4, 4))
    with pytest.raises(ValueError, match="otb needs token_weights"):
        E.advantages("otb", R, m)
    with pytest.raises(ValueError, match="k=0"):
        E.advantages("topk", R, m, k=0)
    with pytest.raises(ValueError, match="k=5 is not valid for passk"):
        E.advantages("passk", R, m, k=5)
    with pytest.raises(ValueError, match="binary"):
        E.advantages("passk", R + 0.5, m)
    with pytest.raises(ValueError, match="eps=-1"):
        E.advantages("normalized", R, m, eps=-1)
    with pytest.raises(ValueError, match="importance_weights"):
        E.advantages("otb", R, m, cumulative_weights=m, importance_weights=m)
    with pytest.raises(TypeError, match="rewards must be a torch.Tensor"):
        E.advantages("centered", [[0.0]], m)


# ---- fast boundary checks (registry._binary_mask) ------------------------------------------


_BAD_MASK_VALUES = [0.5, 2.0, -1.0, 257.0, -255.0, 1e-30, 1.0 + 2**-23, 1.0 - 2**-24,
                    float("nan"), float("inf"), -float("inf")]


# (dtype, value) pairs where the value stays non-binary after rounding to the dtype
_BAD_MASKS = [
    (dt, v)
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    for v in _BAD_MASK_VALUES
    if torch.tensor(v, dtype=dt).item() not in (0.0, 1.0)
]


@pytest.mark.parametrize(("dtype", "bad"), _BAD_MASKS)
def test_float_mask_with_any_non_binary_value_is_rejected(dtype, bad):
    mask = torch.ones(3, 4, 5, dtype=dtype)
    mask[1, :, 3:] = 0
    mask[2, 3, 4] = bad
    with pytest.raises(ValueError, match="only 0 and 1"):
        E.advantages("centered", torch.zeros(3, 4), mask)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_integer_masks_accepted_and_non_binary_rejected(dtype):
    rewards = torch.randn(2, 3, dtype=torch.float64)
    mask = (torch.arange(4).expand(2, 3, 4) < torch.tensor([[1, 2, 4], [4, 3, 2]]).unsqueeze(-1))
    want = E.advantages("centered", rewards, mask)
    assert torch.equal(E.advantages("centered", rewards, mask.to(dtype)), want)
    assert torch.equal(E.advantages("centered", rewards, mask.double()), want)
    bad = mask.to(dtype).clone()
    bad[1, 1, 0] = 2
    with pytest.raises(ValueError, match="only 0 and 1"):
        E.advantages("centered", rewards, bad)
    if dtype != torch.uint8:
        bad[1, 1, 0] = -1
        with pytest.raises(ValueError, match="only 0 and 1"):
            E.advantages("centered", rewards, bad)


def test_negative_zero_counts_as_zero_and_empty_masks_are_named():
    rewards = torch.tensor([[1.0, 3.0]])
    mask = torch.tensor([[[1.0, -0.0], [1.0, 1.0]]])
    torch.testing.assert_close(E.advantages("centered", rewards, mask),
                               torch.tensor([[[-1.0, 0.0], [1.0, 1.0]]]), rtol=0, atol=0)
    for m in (torch.zeros(1, 2, 2), -torch.zeros(1, 2, 2), torch.zeros(1, 2, 2, dtype=torch.int64),
              torch.zeros(1, 2, 2, dtype=torch.bool), torch.zeros(0, 2, 2)):
        with pytest.raises(ValueError, match="no valid token"):
            E.advantages("centered", torch.zeros(m.shape[0], 2), m)


def test_nonfinite_masked_token_rewards_take_the_exact_path():
    # The fast finiteness check (a finite total) fails here; the exact, mask-aware one passes.
    rewards = torch.zeros(2, 2, 3)
    mask = torch.ones(2, 2, 3)
    mask[0, 1, 2] = 0
    rewards[0, 1, 2] = float("inf")
    assert torch.isfinite(E.advantages("centered", rewards, mask)).all()
    huge = torch.full((2, 2), 3e38)  # finite values whose float32 total overflows to inf
    assert torch.isfinite(E.advantages("centered", huge, torch.ones(2, 2, 3))).all()


def test_exact_weights_are_one_declared_capability_in_train_and_variance():
    """A user scheme that declares reads=("token_weights",) takes exact weights everywhere
    (TrainConfig(token_weights="exact"), a variance label <name>_exact); one that does not is
    refused by both, whatever its name."""
    from varbench._util.checks import UsageError
    from varbench.analysis.variance import VarianceConfig
    from varbench.estimators.registry import (
        register_scheme,
        unregister_scheme,
        weighted_schemes,
    )
    from varbench.train.config import TrainConfig

    def user(rewards, mask, opts):
        return rewards.unsqueeze(-1) * mask

    register_scheme("user_weighted", reads=("token_weights",))(user)
    register_scheme("otb_named_plain")(user)
    try:
        assert "user_weighted" in weighted_schemes()
        assert "otb_named_plain" not in weighted_schemes()
        TrainConfig(scheme="user_weighted", token_weights="exact")
        VarianceConfig(schemes=("user_weighted", "user_weighted_exact"))
        with pytest.raises(UsageError, match=r"token_weights='exact' is not valid with "
                                             r"scheme='otb_named_plain'"):
            TrainConfig(scheme="otb_named_plain", token_weights="exact")
        with pytest.raises(UsageError, match=r"schemes='otb_named_plain_exact' is not valid"):
            VarianceConfig(schemes=("otb_named_plain_exact",))
    finally:
        unregister_scheme("user_weighted")
        unregister_scheme("otb_named_plain")
