"""`varbench tasks / sample / warmstart`: output, exit codes and one-line errors, in process."""

from __future__ import annotations

import re

import pytest

from varbench.app.cli import main
from varbench.models import build_preset, save_policy

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def vb(capsys):
    def run(*args: str):
        capsys.readouterr()
        code = main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


def test_tasks_lists_rewards_and_knobs(vb):
    code, out, _ = vb("tasks")
    assert code == 0
    assert "sort" in out and "inclusion_adjacency" in out and "toolsum" in out
    assert re.search(r"\bk\b.*tool calls", out)


def test_sample_default_command(vb):
    code, out, err = vb("sample", "--task", "sort", "-G", "8")
    assert code == 0, err
    assert out.count("prompt ") == 2  # two prompts by default
    assert len(re.findall(r"^\s+\d+\s+\d+\.\d\d\s+3\s", out, flags=re.M)) == 16  # 2 x 8 rows
    m = re.search(r"non-zero Delta: raw (\d+)/16, centered (\d+)/16", out)
    assert m


def test_sample_counts_match_the_rewards(vb):
    code, out, _ = vb("sample", "--task", "sort", "-G", "6", "--prompts", "3",
                      "--reward", "inclusion_adjacency", "--seed", "1")
    assert code == 0
    rewards = [float(x) for x in re.findall(r"^\s+\d+\s+(\d+\.\d\d)\s", out, flags=re.M)]
    assert len(rewards) == 18
    groups = [rewards[i : i + 6] for i in range(0, 18, 6)]
    raw = sum(r != 0 for r in rewards)
    centered = sum(abs(r - sum(g) / 6) > 1e-6 for g in groups for r in g)
    m = re.search(r"raw (\d+)/18, centered (\d+)/18", out)
    assert (int(m.group(1)), int(m.group(2))) == (raw, centered)


def test_sample_warm_and_knobs(vb, tmp_path, monkeypatch):
    monkeypatch.setenv("VARBENCH_CACHE", str(tmp_path))
    code, out, err = vb("sample", "--task", "sort", "--knob", "n=2", "--knob", "max_value=5",
                        "--warm", "-G", "4")
    assert code == 0, err
    assert "(warm start)" in out and "'n': 2" in out
    assert list((tmp_path / "warmstart").iterdir())


def test_sample_local_checkpoint(vb, tmp_path):
    save_policy(build_preset("micro"), tmp_path / "ck")
    code, out, err = vb("sample", "--task", "toolsum", "--policy", str(tmp_path / "ck"), "-G", "2")
    assert code == 0, err
    assert str(tmp_path / "ck") in out


@pytest.mark.parametrize(
    "args,message",
    [
        (("sample", "--task", "nope"), r"task='nope' is not valid; choose one of \['arith'"),
        (("sample", "--policy", "/no/such/dir"), r"policy='/no/such/dir' is not valid.*tiny"),
        (("sample", "--reward", "bogus"), r"reward='bogus' is not valid.*positional"),
        (("sample", "-G", "0"), r"G=0 is not valid"),
        (("sample", "--knob", "m=2"), r"no knob 'm'"),
        (("sample", "--knob", "n"), r"--knob 'n' is not valid"),
        (("sample", "--warm", "--policy", "/tmp"), r"policy=./tmp. is not valid; choose a preset"),
        (("warmstart", "--preset", "huge"), r"policy='huge' is not valid; choose a preset"),
    ],
)
def test_bad_input_exits_2_with_one_line(vb, args, message):
    code, out, err = vb(*args)
    assert code == 2
    assert re.search(message, err), err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_warmstart_command(vb, tmp_path):
    code, out, err = vb("warmstart", "--task", "sort", "--preset", "tiny", "--knob", "n=2",
                        "--knob", "max_value=5", "--cache-dir", str(tmp_path),
                        "--out", str(tmp_path / "saved"))
    assert code == 0, err
    assert "in band: True" in out
    assert (tmp_path / "saved" / "model.safetensors").is_file()
