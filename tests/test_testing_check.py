"""varbench.testing.check: check_estimator (known-good estimators pass, known defects are
caught, inputs are judged)."""

from __future__ import annotations

import math

import _fixtures_testing as fx
import pytest
import torch
from _fixtures_estimators import SHAPE_VARIANTS, shapes_scheme

from varbench.estimators.registry import run_scheme
from varbench.testing import EstimatorInputError, check_estimator
from varbench.testing.adapt import load

FAST = {"num_steps": 1500, "baselines": ()}


def _row(res, check):
    return res.row(check)


def test_rloo_passes_without_rescaling():
    res = check_estimator("rloo", require_unbiased=True, **FAST)
    assert res.passed, str(res)
    assert _row(res, "bias (raw)")["required"]
    assert abs(_row(res, "scale along g*")["value"] - 1) < 4 * _row(res, "scale along g*")["se"]


def test_centered_passes_with_rescaling_only():
    res = check_estimator("centered", **FAST)
    assert res.passed, str(res)
    raw = _row(res, "bias (raw)")
    assert not raw["passed"] and not raw["required"]  # measured: biased by the factor 3/4
    scale = _row(res, "scale along g*")
    assert abs(scale["value"] - 0.75) < 4 * scale["se"]  # (G-1)/G, docs/science.md section 2.1
    assert not check_estimator("centered", require_unbiased=True, **FAST).passed


def test_user_function_same_numbers_as_registered_scheme():
    a = check_estimator(fx.centered_by_hand, **FAST)
    b = check_estimator("centered", **FAST)
    assert a.shape == "keywords"
    for check in ("bias (raw)", "bias (rescaled)", "scale along g*"):
        assert _row(a, check)["value"] == pytest.approx(_row(b, check)["value"], rel=1e-5)


@pytest.mark.parametrize("fn", [fx.length_bonus, fx.own_token_baseline])
def test_direction_changing_estimators_fail(fn):
    res = check_estimator(fn, **FAST)
    assert not res.passed
    row = _row(res, "bias (rescaled)")
    assert not row["passed"] and row["p_value"] < 1e-3 and row["debiased"] > 0.05, str(res)


def test_otb_small_group_bias_is_measured_and_reported():
    res = check_estimator("otb", G=2, **FAST)
    raw, resc = _row(res, "bias (raw)"), _row(res, "bias (rescaled)")
    for r in (raw, resc):
        assert math.isfinite(r["value"]) and math.isfinite(r["se"]) and r["se"] > 0
    assert raw["p_value"] < 1e-3  # the sample sits in its own baseline: biased at G = 2
    assert "bias (rescaled)" in str(res)


def test_verl_shaped_function_detected_and_passes():
    res = check_estimator(fx.verl_rloo, require_unbiased=True, **FAST)
    assert res.shape == "verl"
    assert res.passed, str(res)


@pytest.mark.parametrize(
    ("fn", "check"),
    [
        (fx.leaks_into_padding, "shape/mask contract"),
        (fx.position_dependent, "permutation equivariance"),
        (fx.reads_masked_logprobs, "masked-value leakage"),
        ("raw", "all-agree groups"),
    ],
)
def test_contract_defects_caught(fn, check):
    res = check_estimator(fn, num_steps=200, baselines=())
    assert not _row(res, check)["passed"], str(res)
    assert not res.passed


def test_raising_estimator_is_a_failure_not_a_crash():
    res = check_estimator(fx.raises, num_steps=200, baselines=())
    assert not res.passed
    assert "RuntimeError: boom" in _row(res, "shape/mask contract")["detail"]


def test_deterministic_by_seed():
    a = check_estimator("otb", num_steps=300, seed=7, baselines=("centered",))
    b = check_estimator("otb", num_steps=300, seed=7, baselines=("centered",))
    c = check_estimator("otb", num_steps=300, seed=8, baselines=("centered",))
    cols = ["value", "se", "p_value"]
    assert a.table[cols].equals(b.table[cols])
    assert not a.table[cols].equals(c.table[cols])


def test_variance_rows_against_baselines():
    res = check_estimator("rloo", num_steps=500, baselines=("centered", "otb"))
    vs_centered = _row(res, "variance ratio vs centered")
    # rloo = G/(G-1) centered: identical after the best rescaling, on the same groups.
    assert vs_centered["value"] == pytest.approx(1.0, abs=1e-6)  # float32 advantages
    strict = check_estimator("raw", num_steps=500, baselines=("centered",),
                             max_variance_ratio=1.0, require_all_agree_zero=False)
    assert _row(strict, "variance ratio vs centered")["required"]
    assert not _row(strict, "variance ratio vs centered")["passed"]  # raw: no baseline


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("no_such_module_xyz:fn", "module not found: 'no_such_module_xyz'"),
        ("_fixtures_testing:missing", "has no attribute"),
        ("_fixtures_testing:not_a_function", "not a function"),
        ("_fixtures_testing:one_argument", "wrong signature"),
        ("no-colon-and-not-a-scheme", "not a registered scheme"),
    ],
)
def test_bad_input_says_which(ref, message):
    with pytest.raises(EstimatorInputError, match=message):
        check_estimator(ref)


def test_bad_options():
    with pytest.raises(ValueError, match="alpha"):
        check_estimator("rloo", alpha=2.0)
    with pytest.raises(ValueError, match="G"):
        check_estimator("rloo", G=0)


@pytest.mark.parametrize("variant", list(SHAPE_VARIANTS))
def test_every_shape_checks_like_the_canonical_implementation(variant):
    """Through check_estimator's loader, each shape returns the canonical advantages exactly
    (float64; the raw output, not masked afterwards), and the check table is identical."""
    fn = SHAPE_VARIANTS[variant]
    gen = torch.Generator().manual_seed(0)
    mask = (torch.arange(5) < torch.randint(1, 6, (3, 4, 1), generator=gen)).double()
    rewards = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    lp = -torch.rand(3, 4, 5, generator=gen, dtype=torch.float64) * mask
    sp = torch.rand(3, 4, 5, generator=gen, dtype=torch.float64) * mask
    got = load(fn, {"scale": 0.5}).call(rewards, mask, logprobs=lp, sum_pi_sq=sp)
    want = run_scheme(shapes_scheme, rewards, mask, {"scale": 0.5, "logprobs": lp,
                                                     "sum_pi_sq": sp}, extra_options=("scale",))
    assert torch.equal(got, want)
    opts = dict(num_steps=300, baselines=("centered",), estimator_options={"scale": 0.5})
    res, ref = check_estimator(fn, **opts), check_estimator(shapes_scheme, **opts)
    assert res.shape == variant.split("_")[0].replace("kwargs", "keywords")
    cols = ["check", "passed", "value", "se", "p_value"]
    assert res.table[cols].equals(ref.table[cols]), str(res)


def test_an_option_the_estimator_cannot_take_is_named_before_running():
    with pytest.raises(EstimatorInputError, match=r"option k=2 cannot be passed.*'k'"):
        check_estimator(SHAPE_VARIANTS["keywords"], estimator_options={"k": 2})
    with pytest.raises(EstimatorInputError, match="declared extra option.*'temperature'"):
        check_estimator(SHAPE_VARIANTS["keywords"], estimator_options={"temperature": 1})
    with pytest.raises(EstimatorInputError, match=r"estimator_options=\['temperature'\]"):
        check_estimator("centered", estimator_options={"temperature": 1})
    with pytest.raises(EstimatorInputError, match=r"unbiased_std=False cannot be passed"):
        load(_no_options, {"unbiased_std": False})
    load(fx.verl_rloo, {"epsilon": 1e-3})  # verl_rloo names epsilon (and takes **kw)


def _no_options(rewards, mask):
    return rewards.unsqueeze(-1) * mask


def test_all_zero_estimator_and_g1_get_a_failed_verdict():
    """Regression: ZeroDivisionError on an estimator returning all zeros and on G = 1."""
    import torch

    from varbench.testing.check import check_estimator

    def zeros(rewards, mask, **kw):
        return torch.zeros(mask.shape, dtype=rewards.dtype)

    for res in (check_estimator(zeros, num_steps=30, baselines=()),
                check_estimator("centered", G=1, num_steps=30, baselines=("rloo",))):
        assert not res.passed
        row = res.row("bias (rescaled)")
        assert not row["passed"] and "no gradient signal" in row["detail"]
    ok = check_estimator("rloo", G=2, num_steps=30, baselines=("centered",))
    assert "variance ratio vs centered" in set(ok.table["check"])


def test_estimators_run_on_the_device_and_must_answer_there():
    """check_estimator(device=...) runs the estimator on that device: an estimator that
    answers on another device (it made a tensor without the inputs' device) is caught."""
    import torch

    from varbench.testing.check import on_device

    seen = []

    def cpu_only(rewards, mask, **stats):
        seen.append(rewards.device.type)
        return torch.zeros(mask.shape)  # on the CPU whatever the inputs

    meta = torch.device("meta")
    call = on_device(cpu_only, meta)
    with pytest.raises(ValueError, match="tensor on cpu for inputs on meta"):
        call(torch.zeros(2, 3), torch.ones(2, 3, 4), logprobs=torch.zeros(2, 3, 4))
    assert seen == ["meta"]
    assert on_device(cpu_only, torch.device("cpu")) is cpu_only  # the identity on the CPU
