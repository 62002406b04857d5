"""varbench.testing.contract: the deterministic contract checks, run directly on estimators with
known defects (check_estimator's use of them: tests/test_testing_check.py)."""

from __future__ import annotations

import _fixtures_testing as fx
import pytest
import torch

from varbench.testing.contract import contract_rows, random_batch

CHECKS = ["shape/mask contract", "permutation equivariance", "masked-value leakage",
          "all-agree groups", "edge: G = 1", "edge: near-constant rewards",
          "edge: long responses", "edge: empty responses"]


def _by_check(fn, seed=0):
    rows = contract_rows(fn, seed)
    assert [r["check"] for r in rows] == CHECKS
    return {r["check"]: r for r in rows}


def test_a_correct_estimator_passes_every_check():
    rows = _by_check(fx.centered_by_hand)
    assert all(r["passed"] for r in rows.values()), rows
    assert _by_check(fx.centered_by_hand, seed=0) == rows  # seeded: the same table


@pytest.mark.parametrize(
    ("fn", "fails", "passes"),
    [
        (fx.leaks_into_padding, {"shape/mask contract", "masked-value leakage"},
         {"permutation equivariance"}),
        (fx.position_dependent, {"permutation equivariance"},
         {"shape/mask contract", "masked-value leakage"}),
        (fx.reads_masked_logprobs, {"masked-value leakage"},
         {"shape/mask contract", "permutation equivariance"}),
    ],
)
def test_each_defect_fails_its_check(fn, fails, passes):
    rows = _by_check(fn)
    failed = {k for k, r in rows.items() if not r["passed"]}
    assert fails <= failed, rows
    assert not passes & failed, rows


def test_an_estimator_that_raises_is_a_failed_row_not_a_crash():
    rows = _by_check(fx.raises)
    assert not any(r["passed"] for r in rows.values())
    assert all(r["detail"] == "estimator raised RuntimeError: boom" for r in rows.values())

    def not_a_tensor(rewards, mask, **kw):
        return [0.0]

    row = _by_check(not_a_tensor)["shape/mask contract"]
    assert not row["passed"] and "returned list, expected a torch.Tensor" in row["detail"]


def test_random_batch_is_plausible():
    b = random_batch(3, 4, 7, torch.Generator().manual_seed(0), min_len=2)
    m = b["mask"]
    assert m.shape == (3, 4, 7) and (m.sum(-1) >= 2).all()
    assert (m[..., 1:] <= m[..., :-1]).all()  # right-padded
    assert set(b["rewards"].unique().tolist()) <= {0.0, 0.5, 1.0}
    assert (b["logprobs"] <= 0).all() and (b["logprobs"][m == 0] == 0).all()
    sp = b["sum_pi_sq"]
    assert (sp[m == 1] > 0).all() and (sp <= 1).all() and (sp[m == 0] == 0).all()
