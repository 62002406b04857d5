"""``MODULE:ATTR`` references: code a user named explicitly, imported only then."""

from __future__ import annotations

import importlib
import re
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
    module, _, attr = ref.partition(":")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as err:
        raise UsageError(f"{what}={ref!r}: cannot import module {module!r} ({err})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{what}={ref!r}: module {module!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
