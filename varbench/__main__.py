"""Allow `python -m varbench`."""

import sys

from varbench.app.cli import main

sys.exit(main())
