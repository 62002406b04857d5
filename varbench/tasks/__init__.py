"""varbench.tasks: verifiable tasks (sort, arith, toolsum) behind one registry."""

from varbench.tasks import arith, sort, toolsum  # noqa: F401 - registers the tasks
from varbench.tasks.base import SPLITS, Prompt, Task, get_task, register_task, task_names

__all__ = ["SPLITS", "Prompt", "Task", "get_task", "register_task", "task_names"]
