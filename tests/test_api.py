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


def test_the_deprecated_shims_are_gone() -> None:
    """varbench.runner and varbench.cli (shims over varbench.app, kept for one release) are
    deleted (issue 25): one home for the suite runner and the command line."""
    import importlib

    for old in ("varbench.runner", "varbench.cli"):
        with pytest.raises(ModuleNotFoundError, match=old.replace(".", r"\.")):
            importlib.import_module(old)
    import varbench.app

    assert varbench.app.run_suite and varbench.app.load_suite


def test_public_functions_name_nan_and_wrong_shapes():
    """Issue 32: NaN/inf and mismatched shapes at the public functions are a UsageError naming
    the argument, not an allocator or indexing traceback deep inside, nor a silent NaN."""
    import math

    import torch

    import varbench as vb
    from varbench._util.checks import UsageError

    P, G, T = 2, 4, 3
    r, m = torch.rand(P, G), torch.ones(P, G, T)
    lp, sp = -torch.rand(P, G, T), torch.rand(P, G, T)

    def nan_at(t, v=math.nan):
        t = t.clone()
        t.view(-1)[1] = v
        return t

    logits = torch.randn(2, 3, 5)
    cases = [
        (lambda: vb.outcome_rewards(nan_at(r), m), r"rewards contain NaN or inf"),
        (lambda: vb.outcome_rewards(torch.rand(P, G + 1), m), r"rewards has shape \[2, 5\]"),
        (lambda: vb.reward_to_go(torch.rand(P, G, T + 1), m), r"rewards has shape"),
        (lambda: vb.reward_to_go(r, m * 0.5), r"mask"),
        (lambda: vb.proxy_from_logprobs(lp, sp[..., :2]), r"sum_pi_sq has shape \[2, 4, 2\]"),
        (lambda: vb.cumulative_weights(m, vb.SchemeOptions(logprobs=nan_at(lp), sum_pi_sq=sp)),
         r"logprobs contains NaN or inf at valid token \[p=0, g=0, t=1\]"),
        (lambda: vb.cumulative_weights(m, vb.SchemeOptions(token_weights=sp[..., :2])),
         r"token_weights has shape"),
        (lambda: vb.policy_loss(lp, lp, nan_at(torch.rand(P, G, T)), m), r"adv contains NaN"),
        (lambda: vb.min_replace(nan_at(lp), m), r"weights contains NaN"),
        (lambda: vb.adv_orthogonal(lp, nan_at(torch.rand(P, G, T), math.inf), m),
         r"adv contains NaN or inf"),
        (lambda: vb.sum_pi_sq(torch.tensor(1.0)), r"logits has shape \[\]"),
        (lambda: vb.sum_pi_sq(nan_at(logits)), r"logits contain NaN"),
        (lambda: vb.logit_proxy(nan_at(logits, math.inf), torch.zeros(2, 3, dtype=torch.long)),
         r"logits contain NaN or \+inf"),
        (lambda: vb.logit_proxy(logits, torch.full((2, 3), 8)), r"ids in \[8, 8\], outside"),
    ]
    for call, words in cases:
        with pytest.raises(UsageError, match=words):
            call()
    # padding is not data: NaN under mask 0 is ignored; -inf logits rule a token out
    pad = m.clone()
    pad[0, 0, 1] = 0
    assert torch.isfinite(vb.min_replace(nan_at(lp), pad)).all()
    z = logits.clone()
    z[..., 0] = -math.inf
    assert torch.isfinite(vb.sum_pi_sq(z)).all()
    assert torch.equal(vb.outcome_rewards(r, m), r)
