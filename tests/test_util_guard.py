"""varbench._util.guard: user code cannot end the process inside the guarded scope."""

from __future__ import annotations

import os

import pytest

from varbench._util.guard import UserCodeExit, guarded, user_code


def test_exit_and_os_exit_become_an_error_and_os_exit_is_restored():
    real = os._exit
    with pytest.raises(UserCodeExit, match=r"estimator 'f' raised SystemExit\(0\)"):
        with user_code("estimator 'f'"):
            raise SystemExit(0)
    with pytest.raises(UserCodeExit, match=r"called os._exit\(3\)"):
        guarded(lambda: os._exit(3), "estimator 'g'")()
    assert os._exit is real
    with user_code("outer"), pytest.raises(UserCodeExit):  # nested scopes
        with user_code("inner"):
            os._exit(0)
    assert os._exit is real
    with pytest.raises(KeyboardInterrupt), user_code("k"):  # a Ctrl-C still stops
        raise KeyboardInterrupt


def test_a_forked_child_still_exits():
    """multiprocessing's fork children end through os._exit: the guard must let them."""
    with user_code("forks"):
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 7
