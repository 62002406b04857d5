"""The bad-input audit (tests/audit_cli.py) measured: every case gets a clear error or the
right verdict; no traceback, no unclear message, nothing silently accepted."""

from __future__ import annotations

import audit_cli


def test_audit_has_no_traceback_unclear_or_accepted_case():
    res = audit_cli.audit()
    bad = [r for r in res["cases"] if r[1] != "clear"]
    assert bad == [], audit_cli.table(res)
    assert len(res["cases"]) >= 120
