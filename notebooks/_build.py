"""Write the walkthrough notebooks from the readable source in this directory.

    .venv/bin/python notebooks/_build.py          # rewrite notebooks/*.ipynb (no outputs)
    .venv/bin/python notebooks/_build.py --check  # exit 1 if a committed notebook differs

The source of truth is ``notebooks/src/NN_name.py``: plain Python in which a line ``# %% [md]``
starts a markdown cell (its lines are the markdown, each prefixed by ``# ``) and ``# %%`` starts
a code cell (the "percent" format of jupytext, read here without jupytext). Notebooks are written
without outputs or execution counts, so diffs stay readable; ``tests/test_notebooks.py`` checks
that the committed files equal what this script writes and executes every one of them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def parse_cells(text: str) -> list[tuple[str, str]]:
    """``[(kind, source)]`` of a percent-format file; kind is "markdown" or "code"."""
    cells: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("# %%"):
            kind = "markdown" if line.strip() == "# %% [md]" else "code"
            cells.append((kind, []))
            continue
        if not cells:
            if line.strip():
                raise ValueError(f"text before the first '# %%' marker: {line!r}")
            continue
        kind, lines = cells[-1]
        if kind == "markdown":
            if line.strip() and not line.startswith("#"):
                raise ValueError(f"markdown line does not start with '#': {line!r}")
            line = line[2:] if line.startswith("# ") else line.lstrip("#")
        lines.append(line)
    out = []
    for kind, lines in cells:
        src = "\n".join(lines).strip("\n")
        if src:
            out.append((kind, src))
    return out


def build(path: Path) -> nbformat.NotebookNode:
    """The notebook (no outputs) of one source file."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    for i, (kind, src) in enumerate(parse_cells(path.read_text())):
        cell = (nbformat.v4.new_markdown_cell(src) if kind == "markdown"
                else nbformat.v4.new_code_cell(src))
        cell["id"] = f"{path.stem[:2]}-{i:02d}"  # stable ids: rebuilding changes nothing
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def render(nb: nbformat.NotebookNode) -> str:
    return json.dumps(nb, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="do not write; exit 1 if a notebook differs from its source")
    args = ap.parse_args(argv)
    stale = []
    for src in sorted(SRC.glob("[0-9][0-9]_*.py")):
        target = HERE / f"{src.stem}.ipynb"
        text = render(build(src))
        if args.check:
            if not target.is_file() or target.read_text() != text:
                stale.append(target.name)
        else:
            target.write_text(text)
            print(f"wrote {target.relative_to(HERE.parent)}")
    if stale:
        print(f"out of date (run notebooks/_build.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
