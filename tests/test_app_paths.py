"""Paths derived from data stay inside the output root: suite names, case keys, shard files.

Every traversal attempt (absolute, ``..``, a separator, symlinks, NUL, a very long name) against
``run``, ``merge``, ``compare`` and the case cache is refused with an error naming the value,
and the file it aimed at is left untouched.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from varbench._util.checks import UsageError
from varbench._util.io import inside, safe_name
from varbench.app.cache import CaseCache
from varbench.app.cli import main
from varbench.app.compare import compare_reports
from varbench.app.runner import merge_outputs, run_suite
from varbench.app.suite import load_suite

ONE_CASE = """
[suite]
name = {name}

[[cases]]
name = "c"
kind = "check"
estimator = "centered"
num_steps = 20
baselines = []
"""

BAD_NAMES = ["/tmp/abs", "../escape", "../../x", "baselines/quickstart", "a\x00b", "x" * 300,
             ".hidden", "..", "a/../../b", "C:\\win", ""]


@pytest.fixture
def shard(tmp_path):
    """A finished one-case run directory (a shard to merge)."""
    suite = tmp_path / "one.toml"
    suite.write_text(ONE_CASE.format(name='"one"'))
    out = tmp_path / "shard"
    run_suite(suite, out)
    return out


@pytest.mark.parametrize("bad", BAD_NAMES)
def test_safe_name_refuses(bad):
    with pytest.raises(UsageError, match="not a safe name"):
        safe_name("case key", bad)


def test_inside_follows_symlinks(tmp_path):
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "link").symlink_to(tmp_path)
    assert inside(tmp_path / "root", "ok.json") == tmp_path / "root" / "ok.json"
    with pytest.raises(UsageError, match="outside"):
        inside(tmp_path / "root", "link", "x.json")


@pytest.mark.parametrize("bad", ["/tmp/abs", "../escape", "baselines/quickstart", "a\\u0000b",
                                 "x" * 300])
def test_suite_name_never_a_path(tmp_path, bad, monkeypatch):
    path = tmp_path / "s.toml"
    path.write_text(ONE_CASE.format(name=json.dumps(bad).replace("\\\\", "\\")))
    with pytest.raises(UsageError, match=r"s\.toml.*not a safe name"):
        load_suite(path)
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(path)]) == 2
    assert not (tmp_path / "baselines").exists() and not (tmp_path / "reports").exists()


def test_hand_built_suite_name_checked_again(tmp_path, monkeypatch):
    path = tmp_path / "s.toml"
    path.write_text(ONE_CASE.format(name='"ok"'))
    suite = replace(load_suite(path), name="../../escape")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match="not a safe name"):
        run_suite(suite)


def test_case_name_never_a_path(tmp_path):
    for bad in ("../x", "/abs", "a/b", "x" * 200, "é"):
        text = ONE_CASE.format(name='"s"').replace('name = "c"', f"name = {json.dumps(bad)}")
        (tmp_path / "s.toml").write_text(text)
        with pytest.raises(UsageError, match="key 'name'"):
            load_suite(tmp_path / "s.toml")


def test_run_refuses_symlinked_case_file_and_work_dir(tmp_path, shard):
    victim = tmp_path / "victim.json"
    victim.write_text('{"keep": true}')
    (case_file,) = CaseCache(shard / "cases").files()
    case_file.unlink()
    case_file.symlink_to(victim)
    with pytest.raises(UsageError, match="outside"):
        run_suite(tmp_path / "one.toml", shard)
    assert victim.read_text() == '{"keep": true}'
    case_file.unlink()
    (shard / "work").mkdir(exist_ok=True)
    os.rename(shard / "work", tmp_path / "moved")
    (shard / "work").symlink_to(tmp_path / "moved")
    (tmp_path / "moved" / case_file.stem).symlink_to(tmp_path)  # work/<key> -> outside
    # refused at the door: work/ itself is a symlink, before work/<key> is followed
    with pytest.raises(UsageError, match=r"work' is a symlink.*writes only inside"):
        run_suite(tmp_path / "one.toml", shard)


def test_run_out_dir_nul_and_long(tmp_path):
    for bad in (str(tmp_path / "a\x00b"), str(tmp_path / ("y" * 300))):
        with pytest.raises(UsageError, match="not a valid path"):
            run_suite(_one(tmp_path), bad)


def _one(tmp_path: Path) -> Path:
    p = tmp_path / "one.toml"
    if not p.exists():
        p.write_text(ONE_CASE.format(name='"one"'))
    return p


@pytest.mark.parametrize("bad", ["/tmp/varbench-evil", "../../evil", "a/../../b", "a\x00b",
                                 "k" * 300, ["not", "a", "str"]])
def test_merge_refuses_hostile_manifest_keys(tmp_path, shard, bad):
    manifest = json.loads((shard / "suite.json").read_text())
    manifest["cases"] = manifest["cases"] + [bad]
    (shard / "suite.json").write_text(json.dumps(manifest))
    with pytest.raises(UsageError, match="not a safe name|must be"):
        merge_outputs([shard], tmp_path / "merged")
    assert not (tmp_path / "merged" / "cases").exists() or not list(
        (tmp_path / "merged" / "cases").iterdir())


def test_merge_absolute_key_in_case_file_never_written(tmp_path, shard):
    victim = tmp_path / "victim.json"
    victim.write_text('{"keep": true}')
    (case_file,) = CaseCache(shard / "cases").files()
    payload = json.loads(case_file.read_text())
    payload["key"] = str(victim.with_suffix(""))
    (shard / "cases" / "other.json").write_text(json.dumps(payload))
    manifest = json.loads((shard / "suite.json").read_text())
    manifest["cases"].append(payload["key"])
    (shard / "suite.json").write_text(json.dumps(manifest))
    assert main(["merge", str(shard), "--out", str(tmp_path / "merged")]) == 2
    assert victim.read_text() == '{"keep": true}'


def test_merge_refuses_symlinked_shard_file_and_output(tmp_path, shard):
    secret = tmp_path / "secret.json"
    secret.write_text("{}")
    (shard / "cases" / "evil.json").symlink_to(secret)
    with pytest.raises(UsageError, match="outside"):
        merge_outputs([shard], tmp_path / "merged")
    (shard / "cases" / "evil.json").unlink()
    # an output whose cases/<key>.json is a symlink to a file elsewhere
    out = tmp_path / "merged2"
    (out / "cases").mkdir(parents=True)
    (case_file,) = CaseCache(shard / "cases").files()
    victim = tmp_path / "victim.json"
    victim.write_text('{"keep": true}')
    (out / "cases" / case_file.name).symlink_to(victim)
    with pytest.raises(UsageError, match="outside"):
        merge_outputs([shard], out)
    assert victim.read_text() == '{"keep": true}'


def test_compare_refuses_nul_and_long_paths(tmp_path, shard):
    for bad in (str(tmp_path / "a\x00b"), str(tmp_path / ("z" * 300))):
        with pytest.raises(UsageError, match="not a valid path"):
            compare_reports(bad, shard)
        with pytest.raises(UsageError, match="not a valid path"):
            compare_reports(shard, bad)
    assert main(["compare", str(tmp_path / ("z" * 300)), str(shard)]) == 2


@pytest.mark.parametrize("bad", ["../x", "/abs/x", "a\x00b", "q" * 300])
def test_cache_path_refuses(tmp_path, bad):
    with pytest.raises(UsageError, match="not a safe name"):
        CaseCache(tmp_path / "cases").path(bad)
