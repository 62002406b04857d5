"""varbench.app: the application layer, the only place that turns names into objects.

It owns the command line (``cli`` and the ``cmd_*`` subcommand modules), the resolution of
user-typed specs (``specs``: policies, tasks, dtypes, devices, ``--knob KEY=VALUE``), suites
(``suite``: the TOML schema), the cached resumable runner (``runner``, ``cache``), the case
executors shared by suites and the analysis subcommands (``executors``), and report
comparison (``compare``). Library packages never import it.
"""

from varbench.app.compare import compare_reports
from varbench.app.runner import RunSummary, merge_outputs, run_suite
from varbench.app.suite import Case, Suite, SuiteError, load_suite

__all__ = ["Case", "RunSummary", "Suite", "SuiteError", "compare_reports", "load_suite",
           "merge_outputs", "run_suite"]
