"""varbench.tasks.dataset and the task spec syntax: data files of every format, knobs, splits
(seeded, disjoint, stable under row order), chat templates, demonstrations, bad input."""

from __future__ import annotations

import csv
import json

import pytest

from varbench._util.checks import UsageError, UsageFileNotFoundError
from varbench.tasks import DatasetTask, Prompt, get_task, register_task
from varbench.tasks.verifiers import error_counts

ROWS = [{"question": f"What is {a} + {b}?", "answer": str(a + b),
         "solution": f"{a} + {b} = {a + b}. The answer is {a + b}."}
        for a in range(8) for b in range(5)]


def _jsonl(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_format_reads_the_same_rows(tmp_path):
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    j = _jsonl(tmp_path / "d.jsonl")
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    with (tmp_path / "d.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(ROWS[0]))
        w.writeheader()
        w.writerows(ROWS)
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    ref = get_task(str(j))
    for ext in ("json", "csv", "parquet"):
        t = get_task(str(tmp_path / f"d.{ext}"))
        assert isinstance(t, DatasetTask) and t.rows == ref.rows
        assert t._pools == ref._pools  # the same held-out rows


def test_save_to_disk_directory_and_split_knob(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "one"))
    assert get_task(str(tmp_path / "one")).rows == get_task(str(_jsonl(tmp_path / "x.jsonl"))).rows
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:30]),
                               "test": datasets.Dataset.from_list(ROWS[30:])})
    dd.save_to_disk(str(tmp_path / "dict"))
    # train from 'train', held out from 'test': the splits are honoured, never mixed
    t = get_task(str(tmp_path / "dict"))
    assert len(t.rows) == 40 and t.heldout_source == "test"
    assert sorted(t._pools["train"]) == list(range(30))
    assert sorted(t._pools["heldout"]) == list(range(30, 40))
    assert len(get_task(str(tmp_path / "dict"), split="test").rows) == 10
    with pytest.raises(UsageError, match=r"knob split='dev' is not valid; choose one of "
                                         r"\['test', 'train'\]"):
        get_task(str(tmp_path / "dict"), split="dev")


def test_splits_are_disjoint_seeded_and_stable_under_row_order(tmp_path):
    a = get_task(str(_jsonl(tmp_path / "a.jsonl")))
    b = get_task(str(_jsonl(tmp_path / "b.jsonl", ROWS[::-1] + ROWS[:3])))  # reordered + dups
    held_a = {a.rows[i][0] for i in a._pools["heldout"]}
    train_a = {a.rows[i][0] for i in a._pools["train"]}
    assert held_a and train_a and not held_a & train_a
    assert len(held_a) == 8  # round(0.2 * 40)
    assert held_a == {b.rows[i][0] for i in b._pools["heldout"]}  # row order does not matter
    other = get_task(str(tmp_path / "a.jsonl"), split_seed=1)
    assert held_a != {other.rows[i][0] for i in other._pools["heldout"]}
    assert a.split_size("heldout") == 8 and a.split_size("train") == 32
    p = a.prompts(3, split="heldout", seed=0)
    assert p == a.prompts(3, split="heldout", seed=0) and all(x.text.rstrip("\n").startswith(
        "What is") for x in p)
    assert {x.meta["question"] for x in a.prompts(8, split="heldout")} == held_a  # distinct


def test_knobs_prompt_answer_columns_limit_system(tmp_path):
    rows = [{"problem": f"q{i}", "gold": str(i), "x": 1} for i in range(10)]
    path = _jsonl(tmp_path / "p.jsonl", rows)
    t = get_task(str(path), answer_key="gold", limit=5, system="Be brief.", verifier="exact")
    assert t.prompt_key == "problem" and len(t.rows) == 5
    p = t.prompts(1)[0]
    assert p.text == f"Be brief.\n\n{p.meta['question']}\n" and p.answer == p.meta["question"][1:]
    assert t.score(p, f"it is {p.answer}") == 0.0 and t.score(p, p.answer) == 1.0  # exact
    assert get_task(str(path), answer_key="gold", verifier="number").score(p, f"= {p.answer}")


class _ChatTok:
    """A tokenizer stand-in with a chat template (what DatasetTask.bind reads)."""

    chat_template = "x"
    bos_token = None

    def __init__(self, fail=False):
        self.fail = fail

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        if self.fail:
            raise ValueError("template exploded")
        body = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return body + ("<assistant>" if add_generation_prompt else "")


def test_chat_template_auto_true_false_and_failure(tmp_path):
    path = str(_jsonl(tmp_path / "c.jsonl"))
    t = get_task(path, system="S")
    t.bind(_ChatTok())
    p = t.prompts(1)[0]
    assert p.text == f"<system>S</system><user>{p.meta['question']}</user><assistant>"
    t = get_task(path, chat=False)
    t.bind(_ChatTok())
    assert t.prompts(1)[0].text.endswith("?\n")
    plain = type("T", (), {"chat_template": None})()
    with pytest.raises(UsageError, match="chat=true: the tokenizer has no chat template"):
        get_task(path, chat="true").bind(plain)
    with pytest.raises(UsageError, match="chat template fails.*template exploded.*chat=false"):
        get_task(path).bind(_ChatTok(fail=True))


def test_demonstrations_only_with_solution_key(tmp_path):
    path = str(_jsonl(tmp_path / "s.jsonl"))
    t = get_task(path, solution_key="solution", verifier="number")
    p = t.prompts(1)[0]
    assert t.has_demonstrations and t.score(p, t.demonstration(p)) == 1.0
    bare = get_task(path)
    assert not bare.has_demonstrations
    with pytest.raises(UsageError, match="no demonstrations; set --knob solution_key"):
        bare.demonstration(bare.prompts(1)[0])


def test_a_raising_verifier_scores_zero_and_is_counted(tmp_path):
    t = get_task(str(_jsonl(tmp_path / "v.jsonl")),
                 verifier="_plugin_tasks:raising_verifier")
    p = t.prompts(1)[0]
    before = error_counts().get("_plugin_tasks:raising_verifier", (0, ""))[0]
    assert t.score(p, "ab") == 1.0
    assert t.score(p, "abc") == 0.0 and t.score(p, "x") == 0.0
    assert t.verifier_errors == 2 and "RuntimeError: odd response" in t.first_verifier_error
    n, first = error_counts()["_plugin_tasks:raising_verifier"]
    assert n - before == 2 and "odd response" in first


@pytest.mark.parametrize("make,match", [
    (lambda d: str(d / "missing.jsonl"), r"task='.*missing.jsonl': no such file"),
    (lambda d: (d / "x.txt").write_text("a") and str(d / "x.txt"),
     r"unknown data file extension '.txt'; choose one of \['.jsonl', '.json', '.csv'"),
    (lambda d: _jsonl(d / "e.jsonl", []) and str(d / "e.jsonl"), r"the data set is empty"),
    (lambda d: _jsonl(d / "n.jsonl", [{"text": "a", "label": "b"}]) and str(d / "n.jsonl"),
     r"no prompt column one of \['prompt', 'question', 'problem'\]; columns found: "
     r"\['text', 'label'\]"),
    (lambda d: _jsonl(d / "na.jsonl", [{"question": "a"}, {"question": "b"}])
     and str(d / "na.jsonl"), r"no answer column 'answer'; columns found: \['question'\]"),
    (lambda d: (d / "bad.jsonl").write_text('{"question": 1}\n{oops\n') and str(d / "bad.jsonl"),
     r"line 2 is not valid JSON"),
])
def test_bad_data_is_a_usage_error_naming_file_and_choices(tmp_path, make, match):
    with pytest.raises(UsageError, match=match):
        get_task(make(tmp_path))


def test_missing_file_is_file_not_found_and_bad_knobs_name_the_choices(tmp_path):
    with pytest.raises(UsageFileNotFoundError):
        get_task(str(tmp_path / "nope.csv"))
    path = str(_jsonl(tmp_path / "k.jsonl"))
    with pytest.raises(UsageError, match=r"verifier='fuzzy' is not valid; choose one of "
                                         r"\['auto', 'exact', 'number', 'math', 'choice'\]"):
        get_task(path, verifier="fuzzy")
    with pytest.raises(UsageError, match=r"knob heldout=1.5 is not valid"):
        get_task(path, heldout=1.5)
    with pytest.raises(UsageError, match=r"has no knob 'colour'"):
        get_task(path, colour=1)


def test_module_attr_task_class_factory_and_refusals():
    t = get_task("_plugin_tasks:EchoTask", word="yo")
    assert t.name == "echo" and t.prompts(2)[1] == Prompt("say yo 1:", "yo")
    assert get_task("_plugin_tasks:make_echo", word="x").knobs == {"word": "x"}
    with pytest.raises(UsageError, match=r"cannot import module 'no_such_mod'"):
        get_task("no_such_mod:Task")
    with pytest.raises(UsageError, match=r"has no attribute 'Nope'"):
        get_task("_plugin_tasks:Nope")
    with pytest.raises(UsageError, match=r"names a int, not a Task subclass or a factory"):
        get_task("_plugin_tasks:NOT_A_TASK")
    with pytest.raises(UsageError, match=r"the factory returned str, not a varbench Task"):
        get_task("_plugin_tasks:not_a_factory")
    with pytest.raises(UsageError, match=r"class Prompt, which is not a varbench Task"):
        get_task("varbench.tasks:Prompt")


def test_register_task_public_and_entry_points(monkeypatch):
    from _plugin_tasks import EchoTask, make_echo

    from varbench.tasks import base

    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    register_task(make_echo, name="echo2")
    assert get_task("echo2").knobs == {"word": "hi"}
    with pytest.raises(UsageError, match="'echo2' is already registered"):
        register_task(make_echo, name="echo2")

    class FakeEP:
        name, value = "plugged", "_plugin_tasks:EchoTask"

        def load(self):
            return EchoTask

    monkeypatch.setattr(base, "_entry_points", lambda: {"plugged": FakeEP()})
    assert "plugged" in base.task_names()
    assert get_task("plugged", word="z").knobs == {"word": "z"}
    with pytest.raises(UsageError, match=r"task='nope' is not valid; choose one of \[.*'plugged'"):
        get_task("nope")


def test_the_task_written_in_docs_tasks_md_works(monkeypatch):
    """docs/tasks.md's Task example, executed as written, through the public registry."""
    import re
    from pathlib import Path

    from varbench.tasks import base

    doc = (Path(__file__).resolve().parents[1] / "docs" / "tasks.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "class Capitals" in b)
    ns: dict = {}
    exec(compile(code, "docs/tasks.md", "exec"), ns)  # noqa: S102 - our own documentation
    monkeypatch.setattr(base, "_REGISTRY", dict(base._REGISTRY))
    register_task(ns["Capitals"])
    t = get_task("capitals")
    train, held = t.prompts(3), t.prompts(1, split="heldout")
    assert {p.answer for p in train}.isdisjoint({p.answer for p in held})
    assert t.score(train[0], f" {train[0].answer} ") == 1.0 and t.score(train[0], "Rome") == 0.0
    assert t.demonstration(held[0]) == held[0].answer


# ---- issue 29: one missing-value rule, encoding errors, DatasetDict splits
@pytest.mark.parametrize("fmt", ["jsonl", "json", "csv", "parquet"])
@pytest.mark.parametrize("bad", [None, "", "  "])
def test_one_missing_value_rule_for_every_format(tmp_path, fmt, bad):
    rows = [dict(r) for r in ROWS[:6]]
    rows[3]["answer"] = bad
    path = tmp_path / f"m.{fmt}"
    if fmt == "jsonl":
        _jsonl(path, rows)
    elif fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "csv":
        with path.open("w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows([{k: ("" if v is None else v) for k, v in r.items()} for r in rows])
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(UsageError, match=r"row 4 has no answer \(column 'answer'"):
        get_task(str(path))


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_non_utf8_bytes_are_one_line_errors_naming_the_line(tmp_path, fmt):
    path = tmp_path / f"latin.{fmt}"
    if fmt == "jsonl":
        path.write_bytes(b'{"question": "a", "answer": "1"}\n{"question": "caf\xe9", '
                         b'"answer": "2"}\n')
    else:
        path.write_bytes(b"question,answer\na,1\ncaf\xe9,2\n")
    line = 2 if fmt == "jsonl" else 3  # the CSV's header is line 1
    with pytest.raises(UsageError, match=rf"line {line} is not UTF-8 \(byte 0xe9") as err:
        get_task(str(path))
    assert "\n" not in str(err.value)


def test_csv_keeps_answers_as_text(tmp_path):
    (tmp_path / "z.csv").write_text('question,answer\n"a, b",007\nc,8\n')
    t = get_task(str(tmp_path / "z.csv"))
    assert sorted(a for _, a, _ in t.rows) == ["007", "8"]


def test_dataset_dict_test_rows_never_reach_training(tmp_path):
    datasets = pytest.importorskip("datasets")
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:30]),
                               "validation": datasets.Dataset.from_list(ROWS[30:])})
    dd.save_to_disk(str(tmp_path / "dv"))
    t = get_task(str(tmp_path / "dv"))
    held = {r["question"] for r in ROWS[30:]}
    assert t.heldout_source == "validation"
    assert {p.meta["question"] for p in t.prompts(60)} & held == set()
    assert {p.meta["question"] for p in t.prompts(10, split="heldout")} <= held
    odd = datasets.DatasetDict({"a": datasets.Dataset.from_list(ROWS[:20]),
                                "b": datasets.Dataset.from_list(ROWS[20:])})
    odd.save_to_disk(str(tmp_path / "odd"))
    with pytest.raises(UsageError, match=r"splits \['a', 'b'\].*--knob split=NAME"):
        get_task(str(tmp_path / "odd"))


def test_default_verifier_auto_reads_gsm8k_answers(tmp_path):
    rows = [{"question": f"q{i}", "answer": f"{i} + 1 = {i + 1}.\n#### {i + 1}"}
            for i in range(6)]
    t = get_task(str(_jsonl(tmp_path / "g.jsonl", rows)))
    p = t.prompts(1)[0]
    assert t.verifier == "number"
    assert t.score(p, f"so #### {p.answer.split('#### ')[1]}") == 1.0


def test_number_refuses_answers_it_cannot_read_before_work(tmp_path, monkeypatch):
    from varbench.tasks import verifiers as vf

    monkeypatch.setattr(vf, "has_math_verify", lambda: False)
    import varbench.tasks.dataset as ds

    monkeypatch.setattr(ds, "has_math_verify", lambda: False)
    rows = [{"question": "q1", "answer": "7"}, {"question": "q2", "answer": "\\sqrt{2}"}]
    with pytest.raises(UsageError, match=r"verifier=number cannot read a number in the answer "
                                         r"of row 2"):
        get_task(str(_jsonl(tmp_path / "l.jsonl", rows)), verifier="number")
