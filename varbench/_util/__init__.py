"""varbench._util: the base layer every package may import (and that imports no package).

``checks`` (boundary checks and :class:`UsageError`), ``io`` (atomic writes, strict JSON),
``progress`` (the one progress-bar policy), ``distributed`` (process groups under torchrun),
``imports`` (``MODULE:ATTR`` references), ``guard`` (a scope user code cannot exit from).
"""
