"""One writer per directory: an advisory lock file holding the writer's pid.

    with dir_lock(out, what="output directory"):       # refuses when another process holds it
        ...
    with dir_lock(entry, what="warm-start cache entry", wait=600):   # waits for the holder
        ...

The lock is ``<dir>/.varbench.lock`` (or a named file for a cache entry) held with
``fcntl.flock``: the kernel releases it when its holder exits, however it exits, so a lock left
by a killed process is stale by construction and the next writer takes it over (the file, with
the dead pid in it, stays; only the flock counts). The pid written into the file is what the
"busy" message names. Locks are advisory: they order varbench's own writers, nothing else.
Platforms without ``fcntl`` fall back to an exclusive-create pid file, taken over when its pid
is no longer alive.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

from varbench._util.checks import UsageError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

LOCK_NAME = ".varbench.lock"


class BusyError(UsageError):
    """Another live process holds the lock (the message names its pid and the lock file)."""


def lock_path(path: str | Path) -> Path:
    """The lock file of directory ``path`` (inside it)."""
    return Path(path) / LOCK_NAME


def holder(lock: str | Path) -> int | None:
    """The pid written in ``lock`` (None when absent or unreadable)."""
    try:
        text = Path(lock).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


@contextlib.contextmanager
def dir_lock(path: str | Path, *, what: str = "directory", wait: float = 0.0,
             lock_file: str | Path | None = None, poll: float = 0.2) -> Iterator[Path]:
    """Hold the lock of ``path`` for the block; yields the lock file.

    ``wait`` seconds to wait for a live holder (0: refuse at once) before raising
    :class:`BusyError` naming ``what``, the path and the holder's pid. ``lock_file``: where
    the lock lives when not inside ``path`` (a cache entry that is replaced whole). Not
    re-entrant: a second ``dir_lock`` on the same path from the same process waits or refuses
    like any other writer.
    """
    lock = Path(lock_file) if lock_file is not None else lock_path(path)
    lock.parent.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + max(0.0, wait)
    if fcntl is None:  # pragma: no cover - Windows
        yield from _pidfile_lock(lock, path, what, deadline, poll)
        return
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o666)
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise _busy(what, path, lock) from None
                time.sleep(poll)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        os.fsync(fd)
        try:
            yield lock
        finally:
            os.ftruncate(fd, 0)  # released: no pid names a holder any more
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _busy(what: str, path: str | Path, lock: Path) -> BusyError:
    pid = holder(lock)
    who = f"process {pid}" if pid is not None else "another process"
    return BusyError(f"{what} {str(path)!r} is in use by {who} (lock {str(lock)!r}); wait for "
                     "it to finish, or stop it and rerun (a killed holder's lock is taken over)")


def _pidfile_lock(lock: Path, path, what: str, deadline: float,
                  poll: float) -> Iterator[Path]:  # pragma: no cover - Windows
    while True:
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            pid = holder(lock)
            if pid is not None and not pid_alive(pid):
                lock.unlink(missing_ok=True)  # stale: its holder is gone
                continue
            if time.monotonic() >= deadline:
                raise _busy(what, path, lock) from None
            time.sleep(poll)
    try:
        os.write(fd, f"{os.getpid()}\n".encode())
        os.close(fd)
        yield lock
    finally:
        lock.unlink(missing_ok=True)


def pid_alive(pid: int) -> bool:
    """Whether a process with ``pid`` exists (one owned by another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OSError:
        return False
    return True
