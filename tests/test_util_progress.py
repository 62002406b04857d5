"""varbench._util.progress: the one progress-bar policy (explicit choice, else a terminal and no
CI variable)."""

from __future__ import annotations

import sys

import pytest

from varbench._util.progress import show_progress


@pytest.fixture
def terminal(monkeypatch):
    def set_(tty: bool, ci: str | None):
        monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
        if ci is None:
            monkeypatch.delenv("CI", raising=False)
        else:
            monkeypatch.setenv("CI", ci)

    return set_


@pytest.mark.parametrize("tty", [False, True])
@pytest.mark.parametrize("ci", [None, "true"])
def test_an_explicit_choice_wins(terminal, tty, ci):
    terminal(tty, ci)
    assert show_progress(True) is True
    assert show_progress(False) is False


@pytest.mark.parametrize(
    ("tty", "ci", "want"),
    [(True, None, True), (True, "", True), (True, "true", False), (True, "1", False),
     (False, None, False), (False, "true", False)],
)
def test_none_honours_the_terminal_and_the_ci_variable(terminal, tty, ci, want):
    terminal(tty, ci)
    assert show_progress(None) is want
    assert show_progress() is want
