"""varbench.report.provenance: versions, the git commit (with a dirty flag), device, seeds,
config and wall time attached to every record set."""

from __future__ import annotations

import platform
import shutil
import subprocess

import pytest
import torch
import transformers

from varbench._util.version import VERSION
from varbench.report.provenance import git_commit, provenance

needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          capture_output=True, text=True, check=True).stdout.strip()


@needs_git
def test_git_commit_of_a_repository_and_the_dirty_flag(tmp_path):
    assert git_commit(tmp_path) is None  # not a repository
    _git(tmp_path, "init", "-q")
    assert git_commit(tmp_path) is None  # a repository without a commit
    (tmp_path / "a.txt").write_text("1")
    _git(tmp_path, "add", "a.txt")
    _git(tmp_path, "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "HEAD")
    assert len(head) == 40 and git_commit(tmp_path) == head
    (tmp_path / "untracked.txt").write_text("x")
    assert git_commit(tmp_path) == head  # untracked files do not make it dirty
    (tmp_path / "a.txt").write_text("2")
    assert git_commit(str(tmp_path)) == head + "-dirty"


def test_git_commit_without_git(tmp_path, monkeypatch):
    def no_git(*a, **k):
        raise FileNotFoundError("git")

    monkeypatch.setattr(subprocess, "run", no_git)
    assert git_commit(tmp_path) is None


def test_provenance_fields():
    p = provenance(config={"G": [2, 4]}, seeds={"sample": 3}, device=torch.device("cpu"),
                   wall_time_s=1.5)
    assert p["varbench_version"] == VERSION
    assert p["torch_version"] == torch.__version__
    assert p["transformers_version"] == transformers.__version__
    assert p["python_version"] == platform.python_version()
    assert p["device"] == "cpu" and p["seeds"] == {"sample": 3} and p["config"] == {"G": [2, 4]}
    assert p["wall_time_s"] == 1.5
    # the package's own checkout (or None); its dirty flag may change while others edit
    assert (p["git_commit"] or "").removesuffix("-dirty") == (git_commit() or "").removesuffix(
        "-dirty")
    q = provenance(config={}, seeds=0)
    assert q["device"] == "cpu" and q["wall_time_s"] is None and q["seeds"] == 0
