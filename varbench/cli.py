"""Deprecated: the command line moved to :mod:`varbench.app.cli` (kept for one release)."""

from __future__ import annotations

import warnings

from varbench.app.cli import build_parser, main

warnings.warn("varbench.cli moved to varbench.app.cli; the old path goes away in the next "
              "release", DeprecationWarning, stacklevel=2)

__all__ = ["build_parser", "main"]
