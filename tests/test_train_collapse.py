"""varbench.train.collapse: gradient surges against the running median, entropy collapse,
state round trip."""

from __future__ import annotations

import numpy as np
import pytest

from varbench._util.checks import UsageError
from varbench.train.collapse import CollapseDetector, calibrate, replay, surge_scores


def test_collapse_grad_surge_against_running_median():
    det = CollapseDetector(surge_factor=5.0, window=4, min_history=3)
    flags = [det.update(g, 1.0)["grad_surge"] for g in [1.0, 1.2, 100.0, 0.9, 1.1, 6.0, 4.0]]
    # 100 comes before 3 norms of history -> not flagged; later median of the last 4 norms:
    # at 6.0 the window is [1.2, 100, 0.9, 1.1] (median 1.15): 6.0 > 5.75 -> surge;
    # at 4.0 the window is [100, 0.9, 1.1, 6.0] (median 3.55): 4.0 < 17.75 -> none.
    assert flags == [0, 0, 0, 0, 0, 1, 0]
    assert det.update(float("nan"), 1.0)["grad_surge"] == 1


def test_collapse_entropy_and_state_roundtrip():
    det = CollapseDetector(entropy_floor=0.1)
    assert det.update(1.0, 2.0)["entropy"] == 0
    assert det.update(1.0, 0.21)["entropy"] == 0
    assert det.update(1.0, 0.19)["entropy"] == 1
    det2 = CollapseDetector(entropy_floor=0.1)
    det2.load_state_dict(det.state_dict())
    assert det2.update(50.0, 0.5) == det.update(50.0, 0.5)


def test_zero_norms_stay_out_of_the_history():
    # steps where every group agreed have norm 0: the next ordinary norm is no surge
    det = CollapseDetector(surge_factor=5.0, window=4, min_history=3)
    flags = [det.update(g, 1.0)["grad_surge"] for g in [1.0, 1.1, 0.9, 0.0, 0.0, 0.0, 0.0, 1.2]]
    assert flags == [0] * 8 and det.norms == [1.0, 1.1, 0.9, 1.2]
    assert surge_scores([1.0, 1.1, 0.9, 0.0, 0.0, 1.2], window=4, min_history=3) == pytest.approx(
        [0, 0, 0, 0.0, 0.0, 1.2])


def test_surge_scores_match_the_detector_flags():
    rng = np.random.default_rng(0)
    norms = list(np.exp(rng.normal(0, 0.8, 60))) + [float("inf"), 30.0, 0.0, 1.0]
    ent = [1.0] * len(norms)
    scores = surge_scores(norms, window=6, min_history=3)
    for f in (2.0, 3.5, 8.0):
        flags = [r["grad_surge"] for r in replay(norms, ent, surge_factor=f, window=6,
                                                 min_history=3)]
        assert flags == [int(s > f) for s in scores]


def test_calibrate_hand_example():
    # scores (max of norm / running median, window 3, history 3): run a -> 2.0, b -> 4.0,
    # c -> 9.0, d -> 6.0 (the last step over median 1)
    runs = [[1, 1, 1, 2], [1, 1, 1, 4], [1, 1, 1, 9], [1, 1, 1, 6]]
    out = calibrate(runs, target_fpr=0.25, default=3.0, window=3, min_history=3)
    assert out["scores"] == [2.0, 4.0, 9.0, 6.0]
    # one run of 4 may stay flagged: the factor is the second largest score, 6.0
    assert out["surge_factor"] == 6.0 and out["fpr"] == 0.25 and out["fpr_default"] == 0.75
    assert calibrate(runs, target_fpr=0.0, default=3.0, window=3, min_history=3)[
        "surge_factor"] == 9.0
    # never more sensitive than the default
    assert calibrate([[1, 1, 1, 1]], default=5.0, window=3, min_history=3)["surge_factor"] == 5.0
    with pytest.raises(UsageError, match="non-finite"):
        calibrate([[1, 1, 1, float("nan")]], window=3, min_history=3)
    with pytest.raises(UsageError, match="traces is empty"):
        calibrate([])


def test_a_real_collapse_is_still_detected_after_calibration():
    # calibrate on noisy but healthy runs; a divergence (norm x 50 over its recent median) and a
    # non-finite norm are still flagged at the calibrated factor
    rng = np.random.default_rng(1)
    healthy = [list(np.exp(rng.normal(0, 0.6, 80))) for _ in range(20)]
    cal = calibrate(healthy, target_fpr=0.05)
    assert cal["fpr"] <= 0.05 and cal["surge_factor"] >= 5.0
    diverging = list(np.exp(rng.normal(0, 0.6, 40))) + [50.0 * 2 ** i for i in range(5)]
    flags = [r["grad_surge"] for r in replay(diverging, [1.0] * len(diverging),
                                             surge_factor=cal["surge_factor"])]
    assert flags[40] == 1 and sum(flags[:40]) == 0
    assert replay([1.0] * 10 + [float("nan")], [1.0] * 11,
                  surge_factor=cal["surge_factor"])[-1]["grad_surge"] == 1
