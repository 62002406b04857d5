"""varbench._util.checks: boundary checks whose errors name the argument, the value and the
choices, as UsageError subclasses of the builtin exception types."""

from __future__ import annotations

import pytest
import torch

from varbench._util.checks import (
    UsageError,
    UsageFileNotFoundError,
    UsageTypeError,
    check_choice,
    check_positive_int,
    check_shape,
)


def test_usage_errors_are_builtin_errors_too():
    assert issubclass(UsageError, ValueError)
    assert issubclass(UsageTypeError, UsageError) and issubclass(UsageTypeError, TypeError)
    assert issubclass(UsageFileNotFoundError, UsageError)
    assert issubclass(UsageFileNotFoundError, FileNotFoundError)


def test_check_choice():
    check_choice("mode", "b", ["a", "b"])
    check_choice("G", 2, range(1, 4))
    with pytest.raises(UsageError, match=r"^mode='c' is not valid; choose one of \['a', 'b'\]$"):
        check_choice("mode", "c", ("b", "a"))
    with pytest.raises(UsageError, match=r"G=5 is not valid; choose one of \['1', '2'\]"):
        check_choice("G", 5, iter([2, 1]))  # any iterable, listed sorted


def test_check_shape():
    x = torch.zeros(2, 3, 4)
    check_shape("x", x, [2, 3, 4])
    check_shape("x", x, [None, 3, None])
    with pytest.raises(UsageError, match=r"x has shape \[2, 3, 4\], expected \[2, \*, 5\]"):
        check_shape("x", x, [2, None, 5])
    with pytest.raises(UsageError, match=r"expected \[2, 3\]"):
        check_shape("x", x, [2, 3])  # another number of axes
    with pytest.raises(UsageTypeError, match="x must be a torch.Tensor, got list"):
        check_shape("x", [[0.0]], [1, 1])


def test_check_positive_int():
    assert check_positive_int("G", 3) == 3
    assert check_positive_int("n", 0, minimum=0) == 0
    for bad in (0, -1, 2.0, "3", True, None):
        with pytest.raises(UsageError, match=r"is not valid; expected an integer >= 1"):
            check_positive_int("G", bad)
    with pytest.raises(UsageError, match=r"^k=1 is not valid; expected an integer >= 2$"):
        check_positive_int("k", 1, minimum=2)


def test_nonfinite_tensor_options_are_named():
    """Regression: NaN/inf in logprobs, token_weights or importance weights gave silent NaN
    advantages."""
    import varbench as vb

    r, m = torch.rand(2, 4), torch.ones(2, 4, 3)
    m[1, 2, 2] = 0
    base = {"logprobs": -torch.rand(2, 4, 3), "sum_pi_sq": torch.rand(2, 4, 3)}
    for key, scheme in (("logprobs", "otb"), ("token_weights", "otb"),
                        ("importance_weights", "otb")):
        for bad in (float("nan"), float("inf")):
            t = torch.ones(2, 4, 3) if key != "logprobs" else base["logprobs"].clone()
            t[0, 1, 2] = bad
            kw = {**base, key: t}
            with pytest.raises(UsageError, match=rf"{key} contains NaN or inf at valid token "
                               r"\[p=0, g=1, t=2\]"):
                vb.advantages(scheme, r, m, **kw)
    lp = base["logprobs"].clone()
    lp[1, 2, 2] = float("nan")  # under mask 0: padding, ignored
    assert torch.isfinite(vb.advantages("otb", r, m, logprobs=lp,
                                        sum_pi_sq=base["sum_pi_sq"])).all()


def test_reward_spread_the_centring_cannot_represent():
    """Regression: rewards of +/-3e38 gave NaN advantages."""
    import varbench as vb

    m = torch.ones(1, 4, 2)
    for scheme in ("centered", "normalized", "rloo"):
        with pytest.raises(UsageError, match=r"rewards of group p=0 span -3e\+38 \.\. 3e\+38"):
            vb.advantages(scheme, torch.tensor([[3e38, -3e38, 0.0, 1.0]]), m)
    ok = vb.advantages("normalized", torch.tensor([[1e18, -1e18, 0.0, 1.0]]), m)
    assert torch.isfinite(ok).all()
    big64 = torch.tensor([[3e38, -3e38, 0.0, 1.0]], dtype=torch.float64)
    assert torch.isfinite(vb.advantages("normalized", big64, m)).all()  # float64 holds it


def test_check_device_and_finite_number():
    from varbench._util.checks import check_device, check_finite_number

    assert check_device("device", "cpu") == torch.device("cpu")
    for bad in ("bogus", "cuda:99", "xla", "meta", 3.5):
        with pytest.raises(UsageError, match="device="):
            check_device("device", bad)
    assert check_finite_number("lr", 1e-3, minimum=0, strict=True) == 1e-3
    for bad in (float("inf"), float("nan"), 0.0, True, "1"):
        with pytest.raises(UsageError, match="lr="):
            check_finite_number("lr", bad, minimum=0, strict=True)


def test_check_nonempty_names_the_argument():
    from varbench._util.checks import check_nonempty

    assert check_nonempty("Gs", (2, 4)) == [2, 4]
    with pytest.raises(UsageError, match=r"Gs=\[\] is empty"):
        check_nonempty("Gs", [])
    with pytest.raises(UsageError, match=r"schemes='otb' is not valid; expected a list"):
        check_nonempty("schemes", "otb")


def test_check_device_also_checks_the_dtype_it_must_hold(monkeypatch):
    """One device check: existence and, given a dtype, the dtype's support on it (the policy
    builder's and the trainer's former second checker)."""
    import torch

    from varbench._util.checks import UsageError, check_device
    from varbench.train.policies import build_policy

    for dt in (torch.bfloat16, torch.float16, torch.float64, None):
        assert check_device("device", "cpu", dtype=dt) == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match=r"device='cuda:1': no CUDA device is visible"):
        build_policy("micro", device="cuda:1")  # before any build
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    with pytest.raises(UsageError, match=r"^dtype=bfloat16 is not supported on device='cuda:0'"):
        build_policy("micro", device="cuda:0", dtype=torch.bfloat16)
    assert check_device("--device", "cuda:0", dtype=torch.float16) == torch.device("cuda:0")


def test_one_dtype_parser_for_the_cli_suites_and_the_trainer():
    """--dtype, a suite's dtype and TrainConfig.dtype are parsed by _util.config.resolve_dtype
    (the app's name is the same function), over the one DTYPES table."""
    import varbench.app.specs as specs
    from varbench._util.checks import UsageError
    from varbench._util.config import DTYPES, resolve_dtype

    assert specs.resolve_dtype is resolve_dtype
    assert resolve_dtype("auto") is None and resolve_dtype(None) is None
    assert resolve_dtype(torch.float64) is torch.float64
    for name in DTYPES[1:]:
        assert resolve_dtype(name) is getattr(torch, name)
    with pytest.raises(UsageError, match=r"^dtype='fp8' is not valid; choose one of \['auto'"):
        resolve_dtype("fp8", "dtype")
    with pytest.raises(UsageError, match=r"^--dtype='half' is not valid"):
        resolve_dtype("half")
