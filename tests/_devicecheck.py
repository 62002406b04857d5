"""Device-discipline checks that need no GPU.

``strict_device()`` runs a block with ``meta`` as the default device: a tensor made without an
explicit ``device=`` lands on ``meta``, so mixing it with the model's (CPU) tensors raises and
reading its value (``.item()``, ``.numpy()``) fails. Code that passes under it would also keep
every tensor on a CUDA model's device.

``HostSyncs`` records every host synchronisation (``.item()``, ``.tolist()``, ``.numpy()``,
``bool()/float()/int()`` of a tensor, a tensor used as an index) by the varbench call site that
made it. On a GPU each one stalls the stream; a hot loop's count must not grow with the number
of tokens it processes.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

import varbench

_ROOT = str(Path(varbench.__file__).resolve().parent)
SYNC_METHODS = frozenset({"item", "tolist", "numpy", "__bool__", "__float__", "__int__",
                          "__index__"})


@contextlib.contextmanager
def strict_device() -> Iterator[None]:
    """Make ``meta`` the default device for the block (see the module docstring)."""
    with torch.device("meta"):
        yield


class HostSyncs(TorchFunctionMode):
    """Count host syncs per varbench call site ``"module.py:function:line"``.

    ``counts`` maps the site to the number of syncs; ``by_method`` splits it by method name.
    Syncs made outside varbench (transformers, torch) are counted under ``"<external>"`` only
    when ``external=True``.
    """

    def __init__(self, *, external: bool = False) -> None:
        super().__init__()
        self.external = external
        self.counts: Counter[str] = Counter()
        self.by_method: Counter[tuple[str, str]] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in SYNC_METHODS:
            site = self._site()
            if site is not None:
                self.counts[site] += 1
                self.by_method[(site, name)] += 1
        return func(*args, **(kwargs or {}))

    def _site(self) -> str | None:
        frame = sys._getframe(2)
        while frame is not None:
            path = frame.f_code.co_filename
            if path.startswith(_ROOT):
                rel = Path(path).relative_to(_ROOT).as_posix()
                return f"{rel}:{frame.f_code.co_name}:{frame.f_lineno}"
            frame = frame.f_back
        return "<external>" if self.external else None

    def total(self, prefix: str = "") -> int:
        """Syncs at sites whose path starts with ``prefix`` (e.g. ``"analysis/trie.py"``)."""
        return sum(n for s, n in self.counts.items() if s.startswith(prefix))


def growing_sites(small: HostSyncs, large: HostSyncs, *,
                  prefix: str = "") -> dict[str, tuple[int, int]]:
    """Sites (under ``prefix``) whose count grew from the small run to the large one.

    Run the same call twice, the second on more tokens (more positions or more responses with
    the same number of chunks/groups); a site in the result syncs per token.
    """
    out = {}
    for site in set(small.counts) | set(large.counts):
        if site.startswith(prefix) and large.counts[site] > small.counts[site]:
            out[site] = (small.counts[site], large.counts[site])
    return out
