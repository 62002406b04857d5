"""Allow `python -m varbench`."""

import sys

from varbench.cli import main

sys.exit(main())
