"""Suite schema, case cache/resume, shards and merge, report comparison (in process)."""

from __future__ import annotations

import json
from pathlib import Path

import _fixtures_runner as fr
import pytest

from varbench.app import executors as kinds
from varbench.app.cache import CaseCache
from varbench.app.compare import compare_reports, regressions
from varbench.app.runner import merge_outputs, parse_shard, run_suite, shard_cases
from varbench.app.suite import SuiteError, load_suite

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def counting(monkeypatch):
    """Count case executions (to prove cached cases are not recomputed)."""
    calls: list[str] = []
    real = kinds._EXECUTORS["check"]

    def wrapped(kind, name, params, work, progress, cache):
        calls.append(name)
        return real(kind, name, params, work, progress, cache)

    monkeypatch.setitem(kinds._EXECUTORS, "check", wrapped)
    return calls


def _bad(tmp_path, text):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(SuiteError) as err:
        load_suite(p)
    msg = str(err.value)
    assert str(p) in msg
    return msg


HEAD = '[suite]\nname = "x"\n'
CASE = '[[cases]]\nname = "a"\nkind = "check"\nestimator = "rloo"\n'


def test_schema_errors_name_file_key_and_choices(tmp_path):
    assert "not valid TOML" in _bad(tmp_path, "[suite\n")
    assert "unknown key 'extra'" in _bad(tmp_path, HEAD + "extra = 1\n" + CASE)
    assert "no cases" in _bad(tmp_path, HEAD)
    msg = _bad(tmp_path, HEAD + CASE.replace('"check"', '"varianse"'))
    assert "'varianse'" in msg and "'variance'" in msg and "'check'" in msg
    msg = _bad(tmp_path, HEAD + CASE + "G_size = 4\n")
    assert "unknown key 'G_size'" in msg and "'G'" in msg and "cases[0] ('a')" in msg
    msg = _bad(tmp_path, HEAD + CASE + "G = 'four'\n")
    assert "key 'G' must be a int" in msg
    msg = _bad(tmp_path, HEAD + CASE + 'baselines = ["centred"]\n')
    assert "'centred' is not valid" in msg and "'centered'" in msg
    msg = _bad(tmp_path, HEAD + CASE.replace('"rloo"', '"os.system(1)"'))
    assert "MODULE:FUNCTION" in msg
    assert "duplicate case name" in _bad(tmp_path, HEAD + CASE + CASE)
    assert "apply to no case" in _bad(tmp_path, HEAD + "[defaults]\nlr = 1.0\n" + CASE)
    assert "needs key(s) ['estimator']" in _bad(
        tmp_path, HEAD + '[[cases]]\nname = "a"\nkind = "check"\n')


def test_suite_is_data_nothing_imported_at_validation(tmp_path):
    p = tmp_path / "s.toml"
    p.write_text(HEAD + CASE.replace('"rloo"', '"never_imported_module_xyz:fn"'))
    suite = load_suite(p)  # a reference is only checked for its form, imported when run
    assert suite.cases[0].params["estimator"] == "never_imported_module_xyz:fn"


def test_defaults_seed_and_key(tmp_path):
    suite = load_suite(fr.write_suite(tmp_path))
    assert [c.name for c in suite.cases] == ["rloo", "centered", "topk"]
    assert suite.cases[0].params == {"num_steps": 60, "baselines": ["centered"], "seed": 3,
                                     "estimator": "rloo"}
    other = load_suite(fr.write_suite(tmp_path, name="b.toml"))
    assert [c.key for c in suite.cases] == [c.key for c in other.cases]
    changed = fr.SUITE.format(extra="").replace("num_steps = 60", "num_steps = 61")
    (tmp_path / "c.toml").write_text(changed)
    assert load_suite(tmp_path / "c.toml").cases[0].key != suite.cases[0].key


def test_shards_partition_the_cases(tmp_path):
    suite = load_suite(fr.write_suite(tmp_path, fr.SLOW_CASE))
    parts = [shard_cases(suite.cases, (i, 3)) for i in (1, 2, 3)]
    names = sorted(c.name for p in parts for c in p)
    assert names == sorted(c.name for c in suite.cases)
    assert [c.name for c in parts[0]] == ["rloo", "slow"]
    assert parse_shard("2/3") == (2, 3)
    for bad in ("0/3", "4/3", "x", "1/0"):
        with pytest.raises(ValueError, match="shard"):
            parse_shard(bad)


def test_run_caches_and_resumes(tmp_path, counting):
    suite = fr.write_suite(tmp_path)
    out = tmp_path / "out"
    first = run_suite(suite, out)
    assert first.computed == ["rloo", "centered", "topk"] and counting == first.computed
    summary = json.loads((out / "summary.json").read_text())
    assert [a["name"] for a in summary["analyses"]] == ["rloo", "centered", "topk"]
    assert (out / "report.html").is_file() and (out / "report.md").is_file()
    counting.clear()
    stamp = (out / "report.html").stat().st_mtime_ns
    second = run_suite(suite, out)
    assert second.cached == ["rloo", "centered", "topk"] and counting == []
    assert (out / "report.html").stat().st_mtime_ns == stamp  # up to date: not re-rendered
    (out / "report.md").unlink()
    run_suite(suite, out)
    assert (out / "report.md").is_file() and counting == []  # re-rendered from the cache
    assert compare_reports(out, out, tolerance=0, rel_tolerance=0)["status"].eq("ok").all()


def test_interrupted_case_leaves_no_result(tmp_path, counting, monkeypatch):
    suite = fr.write_suite(tmp_path)
    out = tmp_path / "out"
    real = kinds._EXECUTORS["check"]

    def interrupt_on_topk(kind, name, params, work, progress, cache):
        if name == "topk":
            raise KeyboardInterrupt
        return real(kind, name, params, work, progress, cache)

    monkeypatch.setitem(kinds._EXECUTORS, "check", interrupt_on_topk)
    with pytest.raises(KeyboardInterrupt):
        run_suite(suite, out)
    assert sorted(p.name.split("-")[0] for p in CaseCache(out / "cases").files()) == [
        "centered", "rloo"]
    monkeypatch.setitem(kinds._EXECUTORS, "check", real)
    again = run_suite(suite, out)
    assert again.cached == ["rloo", "centered"] and again.computed == ["topk"]


def test_corrupt_case_file_is_recomputed(tmp_path):
    suite = fr.write_suite(tmp_path)
    out = tmp_path / "out"
    run_suite(suite, out)
    victim = CaseCache(out / "cases").files()[0]
    victim.write_text(victim.read_text()[:100])  # truncated by a disk failure, say
    logs: list[str] = []
    again = run_suite(suite, out, log=logs.append)
    assert len(again.computed) == 1
    assert any("[corrupt]" in m and str(victim) in m for m in logs)


def test_shards_merge_into_the_full_report(tmp_path):
    suite = fr.write_suite(tmp_path)
    s1 = run_suite(suite, tmp_path / "s1", shard=(1, 2))
    s2 = run_suite(suite, tmp_path / "s2", shard=(2, 2))
    assert s1.report is None and s1.computed == ["rloo", "topk"] and s2.computed == ["centered"]
    with pytest.raises(ValueError, match="missing 1 case"):
        merge_outputs([tmp_path / "s1"], tmp_path / "m1")
    merged = merge_outputs([tmp_path / "s1", tmp_path / "s2"], tmp_path / "merged")
    assert merged.report is not None
    full = run_suite(suite, tmp_path / "full")
    table = compare_reports(full.out_dir, tmp_path / "merged", tolerance=0, rel_tolerance=0)
    assert len(table) > 5 and table["status"].eq("ok").all()
    other = tmp_path / "other.toml"
    other.write_text(fr.SUITE.format(extra="").replace("num_steps = 60", "num_steps = 50"))
    run_suite(other, tmp_path / "o", shard=(1, 2))
    with pytest.raises(ValueError, match="different suites"):
        merge_outputs([tmp_path / "s1", tmp_path / "o"], tmp_path / "m2")


def _summary(path: Path, figures: dict[str, tuple[float | None, float | None]]) -> Path:
    analyses: dict[str, list] = {}
    for key, (v, se) in figures.items():
        a, h = key.split("/")
        analyses.setdefault(a, []).append({"key": h, "value": v, "se": se, "text": key})
    path.mkdir(parents=True)
    (path / "summary.json").write_text(json.dumps(
        {"schema": "varbench.report/1", "analyses": [
            {"name": a, "kind": "x", "headlines": hs} for a, hs in analyses.items()]}))
    return path


def test_compare_with_standard_errors(tmp_path):
    base = _summary(tmp_path / "b", {"v/ratio": (0.50, 0.01), "v/exact": (2.0, None),
                                     "v/gone": (1.0, 0.1), "v/nan": (None, None)})
    new = _summary(tmp_path / "n", {"v/ratio": (0.53, 0.01), "v/exact": (2.01, None),
                                    "v/nan": (None, None), "v/extra": (3.0, 0.1)})
    t = compare_reports(base, new, tolerance=3.0, rel_tolerance=0.01).set_index("figure")
    assert t.loc["v/ratio", "status"] == "ok"  # 0.03 <= 3 * sqrt(2) * 0.01 + 0.005
    assert t.loc["v/exact", "status"] == "ok"  # 0.01 <= 0.01 * 2
    assert t.loc["v/gone", "status"] == "missing"
    assert t.loc["v/nan", "status"] == "ok" and t.loc["v/extra", "status"] == "new"
    tight = compare_reports(base, new, tolerance=1.0, rel_tolerance=0.0).set_index("figure")
    assert tight.loc["v/ratio", "status"] == "regression"
    assert tight.loc["v/exact", "status"] == "regression"
    assert len(regressions(tight)) == 3
    with pytest.raises(FileNotFoundError, match="summary.json"):
        compare_reports(tmp_path / "nowhere", new)


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "suites").glob("*.toml")))
def test_shipped_suites_validate(name):
    suite = load_suite(ROOT / "suites" / f"{name}.toml")
    assert suite.cases


KIND_CASES = """
[suite]
name = "kinds"
seed = 0
[defaults]
preset = "micro"
states = ["random"]
[[cases]]
name = "proxy"
kind = "proxy"
n_prompts = 1
G = 2
n_boot = 10
[[cases]]
name = "variance"
kind = "variance"
schemes = ["centered", "otb"]
Gs = [2]
M = 3
n_prompts = 1
knobs = { n = 2 }
[[cases]]
name = "cancel"
kind = "cancellation"
tasks = ["arith"]
n_prompts = 1
G = 2
inner_steps = [0]
sketch_dim = 0
[[cases]]
name = "train"
kind = "train"
policy = "micro"
warm_start = false
steps = 1
G = 2
prompts_per_step = 1
eval_every = 1
eval_prompts = 2
eval_samples = 1
[[cases]]
name = "validate"
kind = "validate"
reduced = true
tasks = ["sort"]
"""


def test_every_kind_dispatches_to_the_library(tmp_path):
    """Each analysis kind builds its Policy/Task from the suite's settings and returns results
    (micro preset at random init; `validate` is only validated, it trains for minutes)."""
    from varbench.report.result import AnalysisResult

    p = tmp_path / "kinds.toml"
    p.write_text(KIND_CASES)
    suite = load_suite(p)
    assert [c.kind for c in suite.cases] == ["proxy", "variance", "cancellation", "train",
                                            "validate"]
    for case in suite.cases[:4]:
        results = kinds.KINDS[case.kind].execute(case.name, case.params, tmp_path / case.name,
                                                 False)
        assert results and all(isinstance(r, AnalysisResult) for r in results)
        assert all(r.records and r.name == case.name for r in results), case.name
    assert (tmp_path / "train" / "run" / "records.csv").is_file()
