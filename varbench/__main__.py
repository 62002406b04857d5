"""Allow `python -m varbench`.

``python -m`` puts the current directory first on ``sys.path``; the ``varbench`` script does
not. It is dropped here (unless ``PYTHONPATH`` names it too, or ``-P`` already kept it off), so
a module lying in the current directory, e.g. beside a suite file, is never imported in place
of a package varbench or a suite names: ``PYTHONPATH=.`` puts it back on purpose.
"""

import os
import sys

if not getattr(sys.flags, "safe_path", False) and sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]  # a PYTHONPATH entry for it comes later and stays

from varbench.app.cli import main  # noqa: E402 - after the path is fixed

sys.exit(main())
