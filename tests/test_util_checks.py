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
