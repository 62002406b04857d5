"""The house rules the import-linter contract cannot express, checked over the source tree.

``lint-imports`` (pyproject's contract, run by ``make test``) forbids upward imports between
packages. These tests forbid private names crossing a package: no module imports a ``_name``,
or a ``_module``, of another package (``varbench._util`` is the shared base layer and is
imported by design), and no subpackage imports the package root (which is only the public
API).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "varbench"


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports():
    """(importing module, imported module, imported names) for every varbench import."""
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        module = ".".join(rel.parts).removesuffix(".__init__")
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.split(".")[0] == "varbench":
                    yield module, node.module, [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name.split(".")[0] == "varbench":
                        yield module, a.name, []


def cross_package_private_imports() -> list[str]:
    bad = []
    for src, target, names in _imports():
        if _package(src) == _package(target) or _package(target) == "_util":
            continue
        private_module = any(p.startswith("_") for p in target.split(".")[1:])
        private_names = [n for n in names if n.startswith("_") and n != "__version__"]
        if private_module or private_names:
            bad.append(f"{src} imports {target} {private_names or ''}".rstrip())
    return bad


def test_no_private_name_crosses_a_package():
    assert cross_package_private_imports() == []


def test_subpackages_do_not_import_the_package_root():
    bad = [f"{src} imports {target} {names}" for src, target, names in _imports()
           if target == "varbench" and _package(src) not in ("", "__main__")]
    assert bad == []


def test_the_scan_sees_a_private_import(tmp_path, monkeypatch):
    """The scan itself can fail: a planted cross-package private import is reported."""
    probe = ROOT / "models" / "_layers_probe.py"
    probe.write_text("from varbench.grads._inputs import check_inputs  # noqa\n")
    try:
        found = cross_package_private_imports()
    finally:
        probe.unlink()
    assert found == ["varbench.models._layers_probe imports varbench.grads._inputs"]


def test_nothing_refers_to_files_outside_the_repository():
    """Docstrings, docs and notebooks cite docs/science.md, never a file beside the checkout."""
    import re
    import subprocess

    top = ROOT.parent
    try:
        files = subprocess.run(["git", "ls-files"], cwd=top, capture_output=True, text=True,
                               check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        files = [str(p.relative_to(top)) for p in top.rglob("*") if p.is_file()]
    outside = re.compile(r"\.\./shared|SCIENCE\.md|DESIGN\.md|shared/SCIENCE|shared/DESIGN")
    bad = []
    for f in files:
        if not f.endswith((".py", ".md", ".toml", ".ipynb", ".cfg", ".txt")):
            continue
        path = top / f
        if not path.is_file() or path.name == "test_layers.py":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if outside.search(line):
                bad.append(f"{f}:{n}: {line.strip()[:80]}")
    assert bad == []
