"""``MODULE:ATTR`` references: code a user named explicitly, imported only then."""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path
from typing import Any

from varbench._util.checks import UsageError

REF = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


def is_reference(text: Any) -> bool:
    """Whether ``text`` has the ``MODULE:ATTR`` form."""
    return isinstance(text, str) and bool(REF.match(text))


def import_object(ref: str, *, what: str = "reference") -> Any:
    """The object ``MODULE:ATTR`` names (dotted ATTR allowed); UsageError naming ``what``."""
    if not is_reference(ref):
        raise UsageError(f"{what}={ref!r} is not valid; expected MODULE:ATTR, e.g. mypkg.adv:fn")
    from varbench._util.guard import UserCodeExit, user_code

    module, _, attr = ref.partition(":")
    try:
        with user_code(f"importing {module!r} for {what}={ref!r}"):
            obj: Any = importlib.import_module(module)
    except ImportError as err:
        raise UsageError(f"{what}={ref!r}: cannot import module {module!r} ({err})"
                         f"{_cwd_hint(module)}") from None
    except UserCodeExit as err:
        raise UsageError(str(err)) from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{what}={ref!r}: module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _cwd_hint(module: str) -> str:
    """A hint when ``module`` lies in the current directory, which is not on the import path
    (``python -m varbench`` drops it, as the ``varbench`` script never adds it)."""
    top = module.partition(".")[0]
    cwd = Path.cwd()
    if str(cwd) in sys.path or "" in sys.path:
        return ""
    if (cwd / f"{top}.py").is_file() or (cwd / top).is_dir():
        return ("; the current directory is not on the import path: set PYTHONPATH=. (or "
                "install the module) to import it from here")
    return ""
