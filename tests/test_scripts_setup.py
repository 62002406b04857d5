"""scripts/setup.sh and the torch range of pyproject.toml.

The script runs against a fake venv (a ``python`` that records its pip calls and answers
``import torch`` / ``torch.cuda.is_available()`` as told) and a fake ``nvidia-smi`` on PATH, so
its CUDA branch is exercised without a GPU or a network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def _torch_requirement() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(Requirement(d) for d in deps if Requirement(d).name == "torch")


@pytest.mark.parametrize("version,ok", [
    ("2.5.1", False), ("2.4.0", False), ("2.6.0", True), ("2.13.0", True), ("2.13.1", True),
    ("2.13.7", True), ("2.14.0", False),
])
def test_torch_range(version, ok):
    """Regression: ``torch>=2.4,<=2.13.0`` admitted versions transformers 5 refuses (< 2.6)
    and refused the 2.13 patch releases."""
    assert _torch_requirement().specifier.contains(version) is ok


def test_setup_installs_the_default_torch_version_inside_the_range():
    text = (ROOT / "scripts" / "setup.sh").read_text()
    version = text.split("TORCH_VERSION=${TORCH_VERSION:-", 1)[1].split("}", 1)[0]
    assert _torch_requirement().specifier.contains(version)


FAKE_PYTHON = """#!/usr/bin/env bash
# stand-in for $VENV/bin/python: records pip calls; torch "exists" once pip installed it
log="$FAKE_DIR/calls.log"
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
    echo "pip ${*:3}" >> "$log"
    case "$*" in *" torch=="*) touch "$FAKE_DIR/torch-installed" ;; esac
    exit 0
fi
if [ "$1" = "-c" ]; then
    case "$2" in
        *cuda.is_available*) echo "cuda-check" >> "$log"
                             echo "torch (fake); torch.cuda.is_available() = $FAKE_CUDA_OK"
                             [ "$FAKE_CUDA_OK" = 1 ]; exit $? ;;
        *"import torch"*) [ -f "$FAKE_DIR/torch-installed" ]; exit $? ;;
    esac
fi
echo "unexpected: $*" >> "$log"; exit 3
"""

FAKE_SMI = """#!/usr/bin/env bash
echo "| NVIDIA-SMI 550.54   Driver Version: 550.54   CUDA Version: 12.4 |"
"""


def _run(tmp_path: Path, *, gpu: bool, cuda_ok: bool, index: str | None = None):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(FAKE_PYTHON)
    py.chmod(0o755)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    if gpu:
        smi = bindir / "nvidia-smi"
        smi.write_text(FAKE_SMI)
        smi.chmod(0o755)
    path = os.pathsep.join([str(bindir), "/usr/bin", "/bin"])
    if not gpu:
        assert shutil.which("nvidia-smi", path=path) is None, "a real nvidia-smi is on PATH"
    env = {"PATH": path, "HOME": str(tmp_path), "VENV": str(venv), "FAKE_DIR": str(tmp_path),
           "FAKE_CUDA_OK": "1" if cuda_ok else "0"}
    if index:
        env["TORCH_INDEX_URL"] = index
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    log = (tmp_path / "calls.log").read_text().splitlines()
    return proc, log, venv


def test_cuda_machine_installs_a_cuda_build_and_checks_it(tmp_path):
    proc, log, venv = _run(tmp_path, gpu=True, cuda_ok=True)
    assert proc.returncode == 0, proc.stderr
    torch_calls = [c for c in log if "torch==" in c]
    assert torch_calls == ["pip --quiet install torch==2.13.0"]  # PyPI's (CUDA) build
    assert "cuda-check" in log and "whl/cpu" not in " ".join(log)
    assert any("install -e .[dev]" in c for c in log)
    assert list(venv.glob(".varbench-installed-*"))


def test_cuda_machine_with_a_torch_that_cannot_see_the_gpu_fails_clearly(tmp_path):
    """Regression: setup installed PyPI's CUDA torch and never checked it could use the GPU."""
    proc, log, venv = _run(tmp_path, gpu=True, cuda_ok=False)
    assert proc.returncode == 1
    assert "torch.cuda.is_available() = 0" in proc.stdout
    err = proc.stderr
    assert "cannot use it" in err and "CUDA 12.4" in err and "TORCH_INDEX_URL" in err
    assert not any("install -e" in c for c in log)  # stops before installing varbench
    assert not list(venv.glob(".varbench-installed-*"))


def test_cuda_index_override(tmp_path):
    url = "https://download.pytorch.org/whl/cu126"
    proc, log, _ = _run(tmp_path, gpu=True, cuda_ok=True, index=url)
    assert proc.returncode == 0, proc.stderr
    assert [c for c in log if "torch==" in c] == [
        f"pip --quiet install torch==2.13.0 --index-url {url} "
        "--extra-index-url https://pypi.org/simple"]


def test_no_gpu_takes_a_cpu_build_without_a_cuda_check(tmp_path):
    proc, log, _ = _run(tmp_path, gpu=False, cuda_ok=False)
    assert proc.returncode == 0, proc.stderr
    assert "cuda-check" not in log
    assert log[0] == "pip --quiet install --no-deps --no-index torch==2.13.0"  # local wheel
