"""The walkthrough notebooks: committed without outputs, in sync with their source, and runnable.

Each notebook is executed top to bottom on a fresh ipykernel with ``VARBENCH_NOTEBOOK_FAST=1``
(its small setting) and a per-session ``VARBENCH_CACHE``, so the warm starts are built from
nothing once per session and shared by the notebooks that follow. The kernel is a kernelspec
written into a temporary ``JUPYTER_PATH`` whose command is this interpreter (the project's
``.venv``), so the test needs nothing outside the virtual environment and never picks up a
kernel installed elsewhere on the machine.

Execution takes roughly 20-50 s per notebook on two busy cores, so only one notebook runs in the
default test run; the others are ``slow`` (``make test-slow``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NB_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = (
    "01_proxy_correlation",
    "02_variance",
    "03_cancellation",
    "04_training",
    "05_custom_estimator",
    "06_your_model",
)
KERNEL = "varbench-notebook-test"
CELL_TIMEOUT_S = 600  # per cell; a loaded CI machine is slow, a hung kernel still ends


def _load_build():
    spec = importlib.util.spec_from_file_location("notebooks_build", NB_DIR / "_build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_notebook_has_a_source_and_a_test():
    build = _load_build()
    sources = sorted(p.stem for p in build.SRC.glob("[0-9][0-9]_*.py"))
    committed = sorted(p.stem for p in NB_DIR.glob("[0-9][0-9]_*.ipynb"))
    assert sources == committed == sorted(NOTEBOOKS)


def test_notebooks_match_their_source(capsys):
    build = _load_build()
    code = build.main(["--check"])
    assert code == 0, capsys.readouterr().err


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_committed_without_outputs(name):
    nb = nbformat.read(NB_DIR / f"{name}.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "a notebook without code"
    assert all(c.outputs == [] and c.execution_count is None for c in code)
    assert nb.cells[0].cell_type == "markdown"  # the intro says what is measured and why
    first = code[0].source
    assert 'FAST = os.environ.get("VARBENCH_NOTEBOOK_FAST") == "1"' in first


def test_build_parser_rejects_stray_text():
    build = _load_build()
    with pytest.raises(ValueError, match="before the first"):
        build.parse_cells("x = 1\n# %%\ny = 2\n")
    with pytest.raises(ValueError, match="does not start with"):
        build.parse_cells("# %% [md]\nnot a comment\n")
    assert build.parse_cells("# %% [md]\n# # Title\n#\n# text\n# %%\nx = 1\n\n") == [
        ("markdown", "# Title\n\ntext"), ("code", "x = 1")]


@pytest.fixture(scope="module")
def kernel_dirs(tmp_path_factory):
    """(JUPYTER_PATH root holding a kernelspec for this interpreter, shared VARBENCH_CACHE)."""
    root = tmp_path_factory.mktemp("jupyter")
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "varbench notebook test", "language": "python",
    }))
    return root, tmp_path_factory.mktemp("varbench-cache")


def _params():
    out = []
    for name in NOTEBOOKS:
        marks = ()  # every notebook runs in the default test target (FAST settings)
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.mark.parametrize("name", _params())
def test_notebook_runs_top_to_bottom(name, kernel_dirs, monkeypatch):
    root, cache = kernel_dirs
    monkeypatch.setenv("JUPYTER_PATH", str(root))
    monkeypatch.setenv("VARBENCH_NOTEBOOK_FAST", "1")
    monkeypatch.setenv("VARBENCH_CACHE", str(cache))
    nb = nbformat.read(NB_DIR / f"{name}.ipynb", as_version=4)
    client = NotebookClient(nb, kernel_name=KERNEL, timeout=CELL_TIMEOUT_S,
                            resources={"metadata": {"path": str(NB_DIR)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError (with the cell's traceback) on any error
    print(f"{name}: executed in {time.perf_counter() - start:.1f} s")  # shown with -s / -rP
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, f"{name} drew no figure"
    last = [c for c in nb.cells if c.cell_type == "code"][-1]
    text = "".join(o.get("data", {}).get("text/markdown", "") for o in last.outputs)
    assert "Notebook wall time" in text, "the interpretation cell wrote nothing"
