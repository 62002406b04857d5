"""pytest plugin: check a user's advantage estimator with one line in their test suite.

Registered through the ``pytest11`` entry point, so installing varbench makes it available::

    def test_my_estimator(varbench_check):
        varbench_check("mypkg.adv:my_estimator")          # or the function itself

or, with the marker (the test body may stay empty)::

    @pytest.mark.varbench_estimator("mypkg.adv:my_estimator", G=8)
    def test_my_estimator():
        pass

A failing check fails the test with the full pass/fail table as the message. Keyword
arguments go to :func:`varbench.testing.check_estimator` (e.g. ``require_unbiased=True``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

MARKER = "varbench_estimator"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(estimator, **options): run varbench.check_estimator on estimator "
        "(a callable, MODULE:FUNCTION or a scheme name) and fail the test if it fails",
    )


def _assert_passes(estimator: Any, **options: Any):
    from varbench.testing.check import check_estimator

    result = check_estimator(estimator, **options)
    if not result.passed:
        pytest.fail(f"varbench check_estimator failed\n{result}", pytrace=False)
    return result


@pytest.fixture
def varbench_check() -> Callable[..., Any]:
    """``varbench_check(estimator, **options)``: run the checks, fail the test on a failure,
    return the :class:`~varbench.testing.check.CheckResult` on a pass."""
    return _assert_passes


def pytest_runtest_call(item: pytest.Item) -> None:
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return
    if len(marker.args) != 1:
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.{MARKER} takes one estimator (callable, "
            f"MODULE:FUNCTION or scheme name), got {len(marker.args)} positional arguments"
        )
    _assert_passes(marker.args[0], **marker.kwargs)
