"""A guarded scope for a user's code: it cannot end the process and so fake a verdict.

A user's estimator, task, verifier or imported module that calls ``exit()``, ``sys.exit()`` or
``os._exit()`` would otherwise end ``varbench check`` / ``varbench run`` with the exit status it
chose (``0``: a pass nobody measured). Inside :func:`user_code` those become
:class:`UserCodeExit`, an ordinary exception that the caller turns into a failed check row or
a failed case. ``KeyboardInterrupt`` is left alone (a Ctrl-C must still stop the run; callers
record it as an unfinished verdict). A process killed from outside, or C code calling
``exit()``, is not caught here: a kill's own exit status is then non-zero.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

try:  # os._exit is posix._exit (nt._exit): patch the name both modules give it
    import posix as _osmod
except ImportError:  # pragma: no cover - Windows
    import nt as _osmod

_LOCK = threading.Lock()
_DEPTH = 0
_REAL_EXIT = os._exit


class UserCodeExit(Exception):  # noqa: N818 - named for what happened, like SystemExit
    """User code tried to end the process (``SystemExit`` or ``os._exit``) inside a guard."""


@contextlib.contextmanager
def user_code(what: str) -> Iterator[None]:
    """Run the body with ``SystemExit`` and ``os._exit`` turned into :class:`UserCodeExit`
    naming ``what`` (e.g. ``"estimator 'mymod:fn'"``). Nests; thread-safe."""
    global _DEPTH

    pid = os.getpid()

    def refuse(code: Any = 0) -> None:
        if os.getpid() != pid:  # a forked child (multiprocessing) ends as it always did
            _REAL_EXIT(code)
        raise UserCodeExit(f"{what} called os._exit({code!r}): user code may not end the "
                           "process; no verdict was reached")

    with _LOCK:
        _DEPTH += 1
        if _DEPTH == 1:
            os._exit = _osmod._exit = refuse  # type: ignore[assignment]
    try:
        yield
    except SystemExit as err:
        raise UserCodeExit(f"{what} raised SystemExit({err.code!r}) (exit() or sys.exit() "
                           "inside user code): no verdict was reached") from None
    finally:
        with _LOCK:
            _DEPTH -= 1
            if _DEPTH == 0:
                os._exit = _osmod._exit = _REAL_EXIT


def guarded(fn: Callable, what: str) -> Callable:
    """``fn`` wrapped so each call runs inside :func:`user_code` ``(what)``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        with user_code(what):
            return fn(*args, **kwargs)

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call
