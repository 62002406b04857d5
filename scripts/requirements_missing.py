"""Print the requirements of pyproject.toml that this python lacks, one a line.

    python scripts/requirements_missing.py EXTRAS [PIN]

EXTRAS: comma-separated optional-dependency groups (``none`` for the package alone); PIN: one
more requirement. Covers the build backend (an offline install builds without isolation) and,
with ``peers``, verl (installed with ``--no-deps``). A requirement counts as present when an
installed distribution's version is admitted by its specifier. Used by scripts/setup.sh's
offline branch; standard library plus ``packaging``.
"""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent


def missing(extras: list[str], pin: str = "") -> list[str]:
    """The requirements of ``extras`` (plus ``pin``) not installed in an admitted version."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    groups = data["project"]["optional-dependencies"]
    reqs = list(data["build-system"]["requires"]) + list(data["project"]["dependencies"])
    for extra in extras:
        if extra not in groups:
            raise SystemExit(f"EXTRAS: unknown group {extra!r}; choose from {sorted(groups)}")
        reqs += groups[extra]
    if "peers" in extras:
        reqs.append("verl==0.9.1")
    if pin:
        reqs.append(pin)
    out = []
    for text in reqs:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            out.append(f"{req} (not installed)")
            continue
        if not req.specifier.contains(have, prereleases=True):
            out.append(f"{req} (installed: {have})")
    return out


if __name__ == "__main__":
    groups = [e for e in sys.argv[1].split(",") if e and e != "none"] if len(sys.argv) > 1 else []
    for line in missing(groups, sys.argv[2] if len(sys.argv) > 2 else ""):
        print(line)
