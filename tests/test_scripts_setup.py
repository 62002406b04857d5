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


# --- offline: a machine with a system torch and no package registry ---------------------------

FAKE_SYSTEM_PYTHON = """#!/usr/bin/env bash
# stand-in for a system python that holds torch; its pip reaches a registry iff FAKE_ONLINE=1
log="$FAKE_DIR/calls.log"
if [ "$1" = "-c" ]; then
    case "$2" in *"import torch"*) [ "$FAKE_SYSTEM_TORCH" = 1 ]; exit $? ;; esac
fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ] && [ "$3" = "--version" ]; then exit 0; fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ] && [ "$3" = "download" ]; then
    echo "system-pip download" >> "$log"; [ "$FAKE_ONLINE" = 1 ]; exit $?
fi
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
    echo "venv ${*:3}" >> "$log"
    dir="${@: -1}"; mkdir -p "$dir/bin"; cp "$FAKE_DIR/venv-python" "$dir/bin/python"
    case "$*" in *--system-site-packages*) touch "$FAKE_DIR/torch-installed" ;; esac
    exit 0
fi
echo "unexpected system: $*" >> "$log"; exit 3
"""

# the venv's python: FAKE_PYTHON, plus the offline branch's requirements check
FAKE_VENV_PYTHON = FAKE_PYTHON.replace(
    'if [ "$1" = "-c" ]; then',
    'if [ "$1" = "scripts/requirements_missing.py" ]; then\n'
    '    echo "missing-check $2" >> "$log"; printf "%s" "$FAKE_MISSING"; exit 0\nfi\n'
    'if [ "$1" = "-c" ]; then', 1)


def _run_new_venv(tmp_path: Path, *, online: bool, system_torch: bool = True,
                  missing: str = "", **extra_env: str):
    """setup.sh with no venv yet and PYTHON a fake system python."""
    (tmp_path / "venv-python").write_text(FAKE_VENV_PYTHON)
    (tmp_path / "venv-python").chmod(0o755)
    sysbin = tmp_path / "sys"
    sysbin.mkdir()
    spy = sysbin / "python3"
    spy.write_text(FAKE_SYSTEM_PYTHON)
    spy.chmod(0o755)
    venv = tmp_path / "venv"
    env = {"PATH": os.pathsep.join(["/usr/bin", "/bin"]), "HOME": str(tmp_path),
           "VENV": str(venv), "PYTHON": str(spy), "FAKE_DIR": str(tmp_path),
           "FAKE_CUDA_OK": "0", "FAKE_ONLINE": "1" if online else "0",
           "FAKE_SYSTEM_TORCH": "1" if system_torch else "0", "FAKE_MISSING": missing,
           **extra_env}
    assert shutil.which("nvidia-smi", path=env["PATH"]) is None, "a real nvidia-smi is on PATH"
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "setup.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    logf = tmp_path / "calls.log"
    log = logf.read_text().splitlines() if logf.exists() else []
    return proc, log, venv


def test_no_registry_and_a_system_torch_reuses_it(tmp_path):
    """Regression: a GPU image with CUDA torch and no registry got a fresh venv that could not
    see the system torch, then failed installing torch."""
    proc, log, venv = _run_new_venv(tmp_path, online=False)
    assert proc.returncode == 0, proc.stderr
    assert "no package registry answered" in proc.stdout
    assert "system-pip download" in log  # the probe ran
    assert "venv --system-site-packages --without-pip " + str(venv) in log
    assert not [c for c in log if "torch==" in c]  # torch is reused, never installed
    installs = [c for c in log if c.startswith("pip") and " install " in c]
    assert installs == ["pip --quiet install --no-index --no-build-isolation -e .[dev]"]
    assert "missing-check dev" in log
    assert list(venv.glob(".varbench-installed-*"))


def test_offline_names_every_missing_requirement_and_installs_nothing(tmp_path):
    missing = "ruff>=0.6 (not installed)\ntransformers<6,>=5.0 (installed: 4.57.0)"
    proc, log, venv = _run_new_venv(tmp_path, online=False, missing=missing)
    assert proc.returncode == 1
    assert "ruff>=0.6 (not installed)" in proc.stderr
    assert "transformers<6,>=5.0 (installed: 4.57.0)" in proc.stderr
    assert "WHEELHOUSE" in proc.stderr
    assert not [c for c in log if c.startswith("pip") and " install " in c]
    assert not list(venv.glob(".varbench-installed-*"))


def test_offline_takes_missing_requirements_from_a_wheelhouse(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    proc, log, _ = _run_new_venv(tmp_path, online=False, missing="ruff>=0.6 (not installed)",
                                 WHEELHOUSE=str(wheels), EXTRAS="dev,peers")
    assert proc.returncode == 0, proc.stderr
    installs = [c for c in log if c.startswith("pip") and " install " in c]
    off = f"--no-index --no-build-isolation --find-links {wheels}"
    assert installs == [f"pip --quiet install {off} -e .[dev,peers]",
                        f"pip --quiet install {off} --no-deps verl==0.9.1"]


def test_a_reachable_registry_keeps_the_online_install(tmp_path):
    proc, log, venv = _run_new_venv(tmp_path, online=True)
    assert proc.returncode == 0, proc.stderr
    assert "venv " + str(venv) in log  # no --system-site-packages
    assert [c for c in log if "torch==" in c][0] == (
        "pip --quiet install --no-deps --no-index torch==2.13.0")


def test_offline_forced_without_a_system_torch_fails_clearly(tmp_path):
    proc, log, _ = _run_new_venv(tmp_path, online=True, system_torch=False,
                                 VARBENCH_OFFLINE="1")
    assert proc.returncode == 1
    assert "reuses an installed torch" in proc.stderr and "PYTHON" in proc.stderr
    assert not [c for c in log if c.startswith("venv")]


def test_offline_flag_value_is_checked(tmp_path):
    proc, _, _ = _run_new_venv(tmp_path, online=True, VARBENCH_OFFLINE="yes")
    assert proc.returncode == 2
    assert "VARBENCH_OFFLINE=yes" in proc.stderr and "0, 1 or auto" in proc.stderr


def test_extras_none_installs_the_package_alone(tmp_path):
    proc, log, _ = _run_new_venv(tmp_path, online=True, EXTRAS="none")
    assert proc.returncode == 0, proc.stderr
    assert "pip --quiet install -e ." in log


def test_requirements_missing_reads_the_installed_versions(monkeypatch):
    """The offline check against the real pyproject and importlib.metadata."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import requirements_missing as rm
    finally:
        sys.path.pop(0)
    from importlib import metadata

    assert rm.missing([]) == []  # this test's own venv holds every core requirement
    real = metadata.version

    def fake(name):
        if name == "transformers":
            return "4.57.0"
        if name == "ruff":
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(rm.metadata, "version", fake)
    got = rm.missing(["dev"], "pyarrow>=1")
    assert got == ["transformers<6,>=5.0 (installed: 4.57.0)", "ruff>=0.6 (not installed)"]
    with pytest.raises(SystemExit, match="unknown group 'nope'"):
        rm.missing(["nope"])
