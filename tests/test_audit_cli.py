"""The bad-input audit (tests/audit_cli.py) measured: every case gets a clear error or the
right verdict; no traceback, no unclear message, nothing silently accepted."""

from __future__ import annotations

import audit_cli


def test_audit_has_no_traceback_unclear_or_accepted_case():
    """Prints the table: counts per category of the independent audit (issue 32) and in all."""
    res = audit_cli.audit()
    print("\n" + audit_cli.table(res))
    bad = [r for r in res["cases"] if r[1] != "clear"]
    assert bad == [], audit_cli.table(res)
    assert len(res["cases"]) >= 190
    assert all(sum(c.values()) > 0 for c in res["categories"].values()), audit_cli.table(res)
    assert sum(sum(c.values()) for c in res["categories"].values()) == len(res["cases"])
