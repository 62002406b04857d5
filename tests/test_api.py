"""The public surface (varbench.__all__) resolves from the package root."""

from __future__ import annotations

import subprocess
import sys

import pytest

import varbench

DESIGN_SURFACE = [
    "advantages", "register_scheme", "schemes", "sum_pi_sq", "logit_proxy",
    "token_grad_norms", "check_estimator",
]


def test_every_exported_name_resolves() -> None:
    for name in varbench.__all__:
        assert getattr(varbench, name) is not None, name


def test_design_surface_is_exported() -> None:
    assert set(DESIGN_SURFACE) <= set(varbench.__all__)


def test_unknown_attribute_raises() -> None:
    try:
        varbench.not_a_thing  # noqa: B018
    except AttributeError as err:
        assert "not_a_thing" in str(err)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")


def test_import_is_light() -> None:
    """`import varbench` must not pull in torch-heavy or plotting modules (fast CLI start)."""
    heavy = "('matplotlib', 'pandas', 'transformers')"
    code = f"import sys, varbench; print(','.join(m for m in {heavy} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_reference_module_collects_every_area() -> None:
    import reference

    assert hasattr(reference, "ref_advantages")
    assert hasattr(reference, "brute_token_grads")
    assert hasattr(reference, "brute_pi_stats")
    assert hasattr(reference, "teacher_forced") and hasattr(reference, "reference_sample")
    assert hasattr(reference, "per_sequence_response_logprobs")


def test_the_old_runner_path_warns_and_resolves() -> None:
    """varbench.runner is a deprecated shim over varbench.app (kept for one release)."""
    import varbench.app
    import varbench.runner

    for name in ("run_suite", "load_suite", "Suite", "compare_reports"):
        with pytest.warns(DeprecationWarning, match=rf"varbench\.runner\.{name} moved to "
                                                    rf"varbench\.app\.{name}"):
            assert getattr(varbench.runner, name) is getattr(varbench.app, name)
    with pytest.raises(AttributeError, match="module 'varbench.runner' has no attribute 'nope'"):
        varbench.runner.nope  # noqa: B018


def test_the_old_cli_path_warns_and_resolves(monkeypatch) -> None:
    """varbench.cli is a deprecated shim over varbench.app.cli (kept for one release)."""
    import importlib

    import varbench.app.cli

    monkeypatch.delitem(sys.modules, "varbench.cli", raising=False)
    with pytest.warns(DeprecationWarning, match=r"varbench\.cli moved to varbench\.app\.cli"):
        old = importlib.import_module("varbench.cli")
    assert old.main is varbench.app.cli.main and old.build_parser is varbench.app.cli.build_parser
