"""varbench.tasks: verifiable tasks behind one registry and one spec syntax.

Built-in toy tasks (``sort``, ``arith``, ``toolsum``), dataset tasks read from local files
(:mod:`varbench.tasks.dataset`, checked by :mod:`varbench.tasks.verifiers`), a user's Task class
by ``MODULE:ATTR``, and installed plugins under the ``varbench.tasks`` entry-point group; see
:func:`get_task` and docs/tasks.md.
"""

from varbench.tasks import arith, sort, toolsum  # noqa: F401 - registers the tasks
from varbench.tasks.base import (
    ENTRY_POINT_GROUP,
    SPLITS,
    Prompt,
    Task,
    check_task,
    get_task,
    register_task,
    task_names,
)
from varbench.tasks.dataset import DatasetTask
from varbench.tasks.verifiers import VERIFIERS

__all__ = ["ENTRY_POINT_GROUP", "SPLITS", "VERIFIERS", "DatasetTask", "Prompt", "Task",
           "check_task", "get_task", "register_task", "task_names"]
