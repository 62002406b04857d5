"""varbench.report.figures: importing it leaves the user's matplotlib backend alone (the
figures themselves are drawn by the writer tests)."""

from __future__ import annotations


def test_importing_the_report_layer_keeps_the_users_matplotlib_backend() -> None:
    """Notebooks rely on their inline backend: varbench must never call matplotlib.use()."""
    import subprocess
    import sys

    code = (
        "import matplotlib; matplotlib.use('svg'); "
        "import varbench.report.figures; "
        "print(matplotlib.get_backend())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "svg"
