"""scripts/setup.sh for real (no fake pythons): a machine whose python holds torch and whose
package registry does not answer gets a venv that reuses that torch, and ``import varbench,
torch`` works inside it; with a registry that answers, the online install is unchanged.

The "system" python is this test venv's base interpreter, given torch (and the rest of this
venv's packages, varbench excepted) through its user site (``$HOME/.local``, as a ``pip
install --user`` image would): a venv made with ``--system-site-packages`` sees the user site,
so the offline branch must reuse it. The registry: pip's configuration files are ignored
(``PIP_CONFIG_FILE`` = os.devnull) and the index is a closed local port (offline) or a
find-links folder with one setuptools wheel (online; the torch install after it then fails fast
on a dead proxy: the test only needs to see which branch ran).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow  # a venv with pip and an editable install: ~30-90 s


def _base_python() -> Path:
    base = Path(getattr(sys, "_base_executable", sys.executable))
    if sys.prefix == sys.base_prefix or not base.exists():
        pytest.skip("needs the test suite to run in a venv over a base interpreter")
    return base


def _build_backend(tmp_path: Path) -> Path:
    """An admitted setuptools (pyproject's build backend) unpacked from a wheel fetched through
    this machine's own pip configuration: a venv's ensurepip setuptools (65.5 on Python 3.11)
    is older than the >=68 the offline build needs, while an image that ships a current stack
    has one."""
    wheels = tmp_path / "backend-wheel"
    got = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                          "-d", str(wheels), "setuptools>=68"], capture_output=True, text=True,
                         timeout=300)
    found = sorted(wheels.glob("setuptools-*.whl")) if got.returncode == 0 else []
    if not found:
        pytest.skip(f"no setuptools>=68 wheel from this machine's registry: {got.stderr[-300:]}")
    dst = tmp_path / "backend"
    with zipfile.ZipFile(found[0]) as z:
        z.extractall(dst)
    return dst


def _system_home(tmp_path: Path) -> Path:
    """A HOME whose user site shows this venv's packages (symlinked, varbench left out) and an
    admitted setuptools to the base interpreter."""
    site = Path(sysconfig.get_paths()["purelib"])
    backend = _build_backend(tmp_path)
    farm = tmp_path / "system-site"
    farm.mkdir()
    for entry in backend.iterdir():
        (farm / entry.name).symlink_to(entry)
    for entry in site.iterdir():
        low = entry.name.lower()
        if low.startswith(("varbench", "__editable__", "setuptools", "_distutils_hack",
                           "distutils-precedence", "pkg_resources")) or low.endswith(".pth"):
            continue  # varbench comes from the checkout copy only; setuptools from backend
        (farm / entry.name).symlink_to(entry)
    home = tmp_path / "home"
    ver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    user_site = home / ".local" / "lib" / ver / "site-packages"
    user_site.mkdir(parents=True)
    (user_site / "system-torch.pth").write_text(f"{farm}\n")
    return home


def _checkout(tmp_path: Path) -> Path:
    """A copy of the files setup.sh installs from (its editable install writes build files)."""
    dst = tmp_path / "checkout"
    dst.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dst / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("scripts", "varbench"):
        shutil.copytree(ROOT / name, dst / name, ignore=ignore)
    return dst


def _closed_port() -> socket.socket:
    """A bound, never-listening local socket: connecting to its port is refused at once."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


def _env(tmp_path: Path, home: Path, **extra: str) -> dict[str, str]:
    return {"PATH": os.pathsep.join(["/usr/bin", "/bin"]), "HOME": str(home),
            "PYTHON": str(_base_python()), "VENV": str(tmp_path / "venv"),
            "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_CACHE_DIR": "1", "OMP_NUM_THREADS": "1", **extra}


def _setup(checkout: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(checkout / "scripts" / "setup.sh")], env=env,
                          capture_output=True, text=True, timeout=600)


def test_unreachable_registry_reuses_the_system_torch(tmp_path):
    base = _base_python()
    home = _system_home(tmp_path)
    checkout = _checkout(tmp_path)
    probe = {"PATH": "/usr/bin:/bin", "HOME": str(home)}
    # the premise: the base interpreter has torch only through the user site
    assert subprocess.run([str(base), "-s", "-c", "import torch"], env=probe,
                          capture_output=True).returncode != 0
    assert subprocess.run([str(base), "-c", "import torch"], env=probe).returncode == 0
    dead = _closed_port()
    try:
        env = _env(tmp_path, home,
                   PIP_INDEX_URL=f"http://127.0.0.1:{dead.getsockname()[1]}/simple")
        proc = _setup(checkout, env)
    finally:
        dead.close()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no package registry answered" in proc.stdout
    venv = tmp_path / "venv"
    cfg = (venv / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = true" in cfg
    assert list(venv.glob(".varbench-installed-*"))
    check = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import varbench, torch; print(varbench.__file__); print(torch.__file__)"],
        env={"PATH": "/usr/bin:/bin", "HOME": str(home)}, capture_output=True, text=True,
        cwd=tmp_path, timeout=300)
    assert check.returncode == 0, check.stderr
    vb_file, torch_file = check.stdout.split()
    assert Path(vb_file).is_relative_to(checkout / "varbench")  # the editable install
    assert Path(torch_file).is_relative_to(tmp_path / "system-site")  # the reused torch
    # a second call only checks the stamp
    again = _setup(checkout, env)
    assert again.returncode == 0 and not again.stdout.strip(), again.stdout + again.stderr


def _setuptools_wheel(folder: Path) -> None:
    """A minimal, valid setuptools wheel (what the registry probe downloads)."""
    name = "setuptools-99.0.0"
    with zipfile.ZipFile(folder / f"{name}-py3-none-any.whl", "w") as z:
        z.writestr(f"{name}.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: setuptools\nVersion: 99.0.0\n")
        z.writestr(f"{name}.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                   "Tag: py3-none-any\n")
        z.writestr(f"{name}.dist-info/RECORD", "")


def test_reachable_registry_keeps_the_online_install(tmp_path):
    home = _system_home(tmp_path)
    checkout = _checkout(tmp_path)
    wheels = tmp_path / "registry"
    wheels.mkdir()
    _setuptools_wheel(wheels)
    dead = _closed_port()
    try:
        proxy = f"http://127.0.0.1:{dead.getsockname()[1]}"
        env = _env(tmp_path, home, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheels),
                   HTTPS_PROXY=proxy, https_proxy=proxy, PIP_RETRIES="0", PIP_TIMEOUT="5")
        proc = _setup(checkout, env)
    finally:
        dead.close()
    out = proc.stdout + proc.stderr
    assert "no package registry answered" not in out
    # the online branch: a venv that does not see the system packages, and torch installed
    # into it (which fails here: the registry has no torch and the network is a dead proxy)
    cfg = (tmp_path / "venv" / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg
    assert proc.returncode != 0 and "torch==2.13.0" in out, out
    assert not list((tmp_path / "venv").glob(".varbench-installed-*"))
