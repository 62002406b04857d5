"""varbench.report: analysis records -> tables, figures, report.md, report.html, summary.json."""

from varbench.report.provenance import git_commit, provenance
from varbench.report.writer import SCHEMA, write_report

__all__ = ["SCHEMA", "git_commit", "provenance", "write_report"]
