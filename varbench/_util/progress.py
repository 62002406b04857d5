"""The one progress-bar policy: on at a terminal, off in CI logs and when asked to be off."""

from __future__ import annotations

import os
import sys


def show_progress(progress: bool | None = None) -> bool:
    """Whether to draw progress bars.

    ``True`` or ``False`` is the caller's explicit choice; ``None`` (the default everywhere)
    means on when standard error is a terminal and the ``CI`` environment variable is unset.
    """
    if progress is not None:
        return bool(progress)
    return sys.stderr.isatty() and not os.environ.get("CI")
