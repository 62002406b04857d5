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


@pytest.mark.parametrize("sub", ["cases", "tables"])
def test_merge_refuses_a_symlinked_subdirectory_of_out(tmp_path, shard, sub):
    """--out/cases or --out/tables pointing elsewhere: a write there would land outside the
    output directory; refused before anything is written (issue 32)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "merged"
    out.mkdir()
    (out / sub).symlink_to(elsewhere)
    with pytest.raises(UsageError, match=f"{sub}' is a symlink"):
        merge_outputs([shard], out)
    assert list(elsewhere.iterdir()) == []
    assert main(["merge", str(shard), "--out", str(out)]) == 2


def test_merge_refuses_a_manifest_listing_a_key_twice(tmp_path, shard):
    manifest = json.loads((shard / "suite.json").read_text())
    manifest["cases"] = manifest["cases"] * 2
    (shard / "suite.json").write_text(json.dumps(manifest))
    with pytest.raises(UsageError, match=r"listed more than once: \['c-"):
        merge_outputs([shard], tmp_path / "merged")
    assert not (tmp_path / "merged" / "report.md").exists()


@pytest.mark.parametrize("breakage", [
    lambda r: r.update(headlines="not a list"),
    lambda r: r.update(records={"cells": [1, 2]}),
    lambda r: r["headlines"].append({"key": 3, "text": None}),
    lambda r: r.pop("summary"),
])
def test_merge_refuses_a_sealed_but_malformed_result_before_copying(tmp_path, shard, breakage):
    """A shard's case file whose seal matches its content but whose results varbench never
    writes is refused by name before anything reaches --out (was a KeyError/AttributeError in
    the renderer after the files were copied)."""
    from varbench._util.io import seal_json

    (case_file,) = CaseCache(shard / "cases").files()
    payload = json.loads(case_file.read_text())
    breakage(payload["results"][0])
    case_file.write_text(json.dumps(seal_json(payload)))
    out = tmp_path / "merged"
    with pytest.raises(UsageError, match="corrupt"):
        merge_outputs([shard], out)
    assert not (out / "cases").exists() or not list((out / "cases").iterdir())
    assert not (out / "report.md").exists()


@pytest.mark.parametrize("name", ['"quickstart\\n"', '"one\\r"', '"x\\t"'])
def test_names_with_a_trailing_line_break_are_refused(tmp_path, monkeypatch, name):
    """$ matched before a final newline: a suite named "quickstart\\n" wrote reports/quickstart
    plus a newline. Names are matched whole (fullmatch), suite and case names alike."""
    monkeypatch.chdir(tmp_path)
    p = tmp_path / "nl.toml"
    p.write_text(ONE_CASE.format(name=name))
    with pytest.raises(UsageError, match="not a safe name"):
        load_suite(p)
    p.write_text(ONE_CASE.format(name='"ok"').replace('name = "c"', f"name = {name}"))
    with pytest.raises(UsageError, match="key 'name' must be a string"):
        load_suite(p)
    with pytest.raises(UsageError, match="not a safe name"):
        safe_name("case key", "c-0123456789abcdef\n")
    assert not (tmp_path / "reports").exists()


@pytest.mark.parametrize("name", ["baselines", "claims", "Claims"])
def test_a_suite_named_like_published_results_has_no_default_out(tmp_path, monkeypatch, name):
    """reports/baselines holds the golden baseline and reports/claims the published claims: a
    suite of that name is refused without --out, and runs with one."""
    monkeypatch.chdir(tmp_path)
    p = tmp_path / "resv.toml"
    p.write_text(ONE_CASE.format(name=f'"{name}"'))
    assert main(["run", str(p)]) == 2
    assert not (tmp_path / "reports").exists()
    with pytest.raises(UsageError, match=f"suite name '{name}' is reserved"):
        run_suite(p)
    assert run_suite(p, tmp_path / "mine").computed == ["c"]
