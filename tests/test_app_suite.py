"""varbench.app.suite: the suite schema (errors name the file, the key and the choices),
defaults, seeds and case keys; every shipped suite validates."""

from __future__ import annotations

import sys
from pathlib import Path

import _fixtures_app as fr
import pytest

from varbench._util.checks import UsageError
from varbench.app.suite import SuiteError, load_suite

ROOT = Path(__file__).resolve().parents[1]


def _bad(tmp_path, text, allow_code=False):
    p = tmp_path / "bad.toml"
    p.write_text(text)
    with pytest.raises(SuiteError) as err:
        load_suite(p, allow_code=allow_code)
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
    with pytest.raises(SuiteError, match=r"cases\[0\] \('a'\) key 'estimator' = "
                       r"'never_imported_module_xyz:fn'.*--allow-code"):
        load_suite(p)  # refused before anything is imported
    assert "never_imported_module_xyz" not in sys.modules
    with pytest.raises(SuiteError, match="cannot import module 'never_imported_module_xyz'"):
        load_suite(p, allow_code=True)  # allowed: checked by import (and signature) now
    p.write_text(HEAD + CASE.replace('"rloo"', '"_fixtures_testing:verl_rloo"'))
    suite = load_suite(p, allow_code=True)
    assert suite.cases[0].params["estimator"] == "_fixtures_testing:verl_rloo"


HOSTILE = """
[suite]
name = "hostile"

[defaults]
trust_remote_code = true

[[cases]]
name = "shell"
kind = "train"
task = "subprocess:getoutput"
task_options = {{ cmd = "touch {marker}" }}

[[cases]]
name = "scheme"
kind = "variance"
schemes = ["centered", "{beside}:fn"]
knobs = {{ verifier = "{beside}:verify" }}

[[cases]]
name = "est"
kind = "check"
estimator = "{beside}:fn"
"""


def test_hostile_suite_runs_nothing_without_allow_code(tmp_path, monkeypatch):
    """A shell command through a factory, remote code, a module beside the suite: refused
    with every entry listed; nothing imported, nothing run (API and `varbench run --shard`)."""
    from varbench.app.cli import main
    from varbench.app.runner import run_suite

    marker = tmp_path / "ran"
    beside = tmp_path / "vb_beside_mod.py"
    beside.write_text(f"open({str(marker)!r}, 'w').write('imported')\n"
                      "def fn(rewards, mask, **kw):\n    return rewards\n"
                      "def verify(q, r, a):\n    return 1.0\n")
    p = tmp_path / "hostile.toml"
    p.write_text(HOSTILE.format(marker=marker, beside="vb_beside_mod"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # even importable, it is not imported
    with pytest.raises(SuiteError) as err:
        load_suite(p)
    msg = str(err.value)
    for entry in ("[defaults] key 'trust_remote_code' = True",
                  "cases[0] ('shell') key 'task' = 'subprocess:getoutput'",
                  "cases[1] ('scheme') key 'schemes' = 'vb_beside_mod:fn'",
                  "cases[1] ('scheme') key 'knobs.verifier' = 'vb_beside_mod:verify'",
                  "cases[2] ('est') key 'estimator' = 'vb_beside_mod:fn'", "--allow-code"):
        assert entry in msg
    with pytest.raises(SuiteError, match="--allow-code"):
        run_suite(p, tmp_path / "out")
    assert main(["run", str(p), "--shard", "1/2", "--out", str(tmp_path / "o2")]) == 2
    assert not marker.exists() and "vb_beside_mod" not in sys.modules


def test_allow_code_checks_by_import_and_type_never_calls(tmp_path, monkeypatch):
    """With allow_code a factory is imported and its type checked, never called at load; a
    factory's signature that cannot take the knobs, or a class that is not a Task, is refused."""
    calls = tmp_path / "called"
    mod = tmp_path / "vb_factory_mod.py"
    mod.write_text("from pathlib import Path\n"
                   f"def make(n=3):\n    Path({str(calls)!r}).write_text('called')\n"
                   "    raise SystemExit(0)\n"
                   "class NotATask:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    case = '[[cases]]\nname = "t"\nkind = "train"\ntask = "{t}"\ntask_options = {o}\n'
    p = tmp_path / "s.toml"
    p.write_text(HEAD + case.format(t="vb_factory_mod:make", o="{ n = 4 }"))
    suite = load_suite(p, allow_code=True)
    assert not calls.exists()  # imported, not called
    assert suite.cases[0].inputs[0].startswith("code:vb_factory_mod:make:")
    p.write_text(HEAD + case.format(t="vb_factory_mod:make", o="{ m = 4 }"))
    with pytest.raises(SuiteError, match="cannot take the knobs"):
        load_suite(p, allow_code=True)
    p.write_text(HEAD + case.format(t="vb_factory_mod:NotATask", o="{}"))
    with pytest.raises(SuiteError, match="not a varbench Task subclass"):
        load_suite(p, allow_code=True)
    assert not calls.exists()


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


@pytest.mark.parametrize("name", sorted(p.stem for p in (ROOT / "suites").glob("*.toml")))
def test_shipped_suites_validate(name, tmp_path, monkeypatch):
    if name == "your-model":  # its paths are relative to where it runs: lay them out
        import shutil

        monkeypatch.chdir(tmp_path)
        (tmp_path / "runs" / "your-model" / "ckpt").mkdir(parents=True)
        shutil.copytree(ROOT / "examples", tmp_path / "examples")
    suite = load_suite(ROOT / "suites" / f"{name}.toml")
    assert suite.cases


def test_task_specs_in_suites_are_resolved_before_any_case(tmp_path):
    """A data path, MODULE:ATTR or unknown task fails at load time, naming the case; a data
    file's content hash is part of the case key."""
    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "4"}\n')
    case = ('[[cases]]\nname = "p"\nkind = "proxy"\npreset = "micro"\ntask = "{t}"\n'
            'knobs = {{ verifier = "number" }}\n')
    ok = tmp_path / "ok.toml"
    ok.write_text(HEAD + case.format(t=data))
    key = load_suite(ok).cases[0].key
    assert load_suite(ok).cases[0].inputs  # the data's fingerprint
    data.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "3+3?", "answer": "6"}\n')
    assert load_suite(ok).cases[0].key != key  # changed data, new key
    assert "no such file" in _bad(tmp_path, HEAD + case.format(t=tmp_path / "missing.jsonl"))
    msg = _bad(tmp_path, HEAD + case.format(t="_plugin_tasks:NOT_A_TASK"), allow_code=True)
    assert "cases[0] ('p') key 'task'" in msg and "not a Task subclass" in msg
    msg = _bad(tmp_path, HEAD + case.format(t="sortt").replace(
        'knobs = { verifier = "number" }', ""))
    assert "task='sortt' is not valid; choose one of" in msg
    msg = _bad(tmp_path, HEAD + case.format(t=data).replace('"number"', '"fuzzy"'))
    assert "verifier='fuzzy' is not valid" in msg
    assert "--device=" in _bad(tmp_path, HEAD + case.format(t=data) + 'device = "tpu"\n')


BAD_KEYS = [  # (case table body, key named in the error, words of the error)
    ('kind = "check"\nestimator = "centered"\nG = 0', "G", "expected an integer >= 1"),
    ('kind = "check"\nestimator = "centered"\nnum_steps = 1', "num_steps", ">= 3"),
    ('kind = "variance"\nGs = []', "Gs", "is empty"),
    ('kind = "variance"\nschemes = []', "schemes", "is empty"),
    ('kind = "variance"\nGs = [2, 0]', "Gs", "element 0"),
    ('kind = "variance"\nsketch_dim = -1', "sketch_dim", ">= 0"),
    ('kind = "variance"\nM = 3200000000', "M", "too large"),
    ('kind = "variance"\nn_ref = 0', "n_ref", ">= 1"),
    ('kind = "variance"\nsketch_dim = "flat"', "sketch_dim", "or 'auto'"),
    ('kind = "variance"\nsketch_dim = 1.5', "sketch_dim", "must be a int or str"),
    ('kind = "variance"\ninterval = "bca"', "interval", "'studentized'"),
    ('kind = "variance"\nexact = "always"', "exact", "'never'"),
    ('kind = "variance"\nlevel = 1.5', "level", "in (0, 1)"),
    ('kind = "variance"\ntarget_rel_se = 0', "target_rel_se", "in (0, inf)"),
    ('kind = "variance"\nM_cap = 0', "M_cap", ">= 1"),
    ('kind = "variance"\ntable_limit = 0', "table_limit", ">= 1"),
    ('kind = "variance"\nsketch_seed = -1', "sketch_seed", ">= 0"),
    ('kind = "variance"\nmin_responses = -1', "min_responses", ">= 0"),
    ('kind = "variance"\nmin_responses = "all"', "min_responses", "or 'auto'"),
    ('kind = "train"\nlr = inf', "lr", "finite"),
    ('kind = "train"\nlr = nan', "lr", "finite"),
    ('kind = "train"\ndevice = "bogus"', "device", "is not valid; use cpu, cuda"),
    ('kind = "train"\ndevice = "cuda:97"', "device", "CUDA device"),
    ('kind = "check"\nestimator = "centered"\nalpha = inf', "alpha", "finite"),
]


@pytest.mark.parametrize("body,key,words", BAD_KEYS)
def test_every_case_fully_validated_before_any_runs(tmp_path, body, key, words, monkeypatch):
    """Regression: a bad key in case 2 was reported after case 1 ran, naming neither file nor
    case; lr=inf, device="bogus", sketch_dim=-1, a huge M, Gs=[], schemes=[] were accepted."""
    from varbench.app import executors
    from varbench.app.runner import run_suite

    ran = []
    monkeypatch.setitem(executors._EXECUTORS, "check",
                        lambda *a, **k: ran.append(a[1]) or pytest.fail("a case ran"))
    path = tmp_path / "bad.toml"
    path.write_text('[suite]\nname = "bad"\n\n[[cases]]\nname = "first"\nkind = "check"\n'
                    'estimator = "centered"\n\n[[cases]]\nname = "second"\n' + body + "\n")
    with pytest.raises(UsageError) as err:
        run_suite(path, tmp_path / "out")
    msg = str(err.value)
    assert str(path) in msg and "cases[1] ('second')" in msg and f"'{key}'" in msg, msg
    assert words in msg, msg
    assert ran == []


def test_a_knob_annotated_int_or_str_takes_both(tmp_path):
    """``sketch_dim: int | str | None`` (default 1024): a suite may give 256 or "auto";
    the type check reads the annotation, not only the default's type."""
    p = tmp_path / "s.toml"
    for key in ("sketch_dim", "min_responses"):
        for value, want in (("256", 256), ('"auto"', "auto"), ("0", 0)):
            p.write_text(HEAD + f'[[cases]]\nname = "v"\nkind = "variance"\n{key} = {value}\n')
            assert load_suite(p).cases[0].params[key] == want
    msg = _bad(tmp_path, HEAD + '[[cases]]\nname = "v"\nkind = "variance"\nM = "auto"\n')
    assert "key 'M' must be a int" in msg  # M: int only


_TRAP = HEAD + """
[defaults]
{default}
[[cases]]
name = "a"
kind = "{kind}"
{body}
"""


@pytest.mark.parametrize("default, kind, body, named", [
    # the trap: the analyses read preset/checkpoint, so they fell back to tiny
    ('policy = "micro"', "proxy", 'states = ["random"]', ("'policy'", "'preset' or 'checkpoint'")),
    ('checkpoint = "runs/ck"', "train", "steps = 1", ("'checkpoint'", "'policy'")),
    ('knobs = { n = 2 }', "train", "steps = 1", ("'knobs'", "'task_options'")),
    ('task_options = { n = 2 }', "variance", "", ("'task_options'", "'knobs'")),
    ('steps = 5', "check", 'estimator = "rloo"', ("'steps'", "'num_steps'")),
])
def test_a_default_a_kind_spells_another_way_is_refused(tmp_path, default, kind, body, named):
    msg = _bad(tmp_path, _TRAP.format(default=default, kind=kind, body=body))
    assert "does not apply to a" in msg and all(n in msg for n in named)


def test_a_default_applies_where_the_case_spells_the_concept_itself(tmp_path):
    """[defaults] preset beside a train case that names its own policy (the quickstart's
    shape) is fine: nothing falls back."""
    p = tmp_path / "ok.toml"
    p.write_text(HEAD + '[defaults]\npreset = "micro"\n[[cases]]\nname = "p"\nkind = "proxy"\n'
                 'states = ["random"]\n[[cases]]\nname = "t"\nkind = "train"\n'
                 'policy = "micro"\nsteps = 1\nwarm_start = false\n')
    suite = load_suite(p)
    assert suite.cases[0].params["preset"] == "micro" and suite.cases[1].params["policy"] == "micro"
