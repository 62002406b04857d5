"""varbench.train.collapse: gradient surges against the running median, entropy collapse,
state round trip."""

from __future__ import annotations

from varbench.train.collapse import CollapseDetector


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
