"""varbench.runner: suites (TOML) validated up front, cached resumable runs, shards, comparison.

See :mod:`varbench.runner.schema` for the suite layout and :mod:`varbench.runner.kinds` for the
case kinds.
"""

from varbench.runner.compare import compare_reports
from varbench.runner.run import RunSummary, merge_outputs, run_suite
from varbench.runner.schema import Case, Suite, SuiteError, load_suite

__all__ = ["Case", "RunSummary", "Suite", "SuiteError", "compare_reports", "load_suite",
           "merge_outputs", "run_suite"]
