"""Slow references for every fast path (Python loops, one autograd call per token).

The references live beside the tests of their area (``reference_<package>.py``); this module is
the one place to import them from.
"""

from reference_estimators import *  # noqa: F401,F403
from reference_grads import *  # noqa: F401,F403
from reference_models import *  # noqa: F401,F403
from reference_rollout import *  # noqa: F401,F403
from reference_train import *  # noqa: F401,F403
