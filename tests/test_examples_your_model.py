"""The "your model, your data" example end to end: a generated JSONL of word problems, a
Qwen2-architecture checkpoint with a locally trained byte-level BPE tokenizer and chat template
saved in bfloat16, and suites/your-model.toml run on them at small settings."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from varbench.app.runner import run_suite

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "your_model"
pytestmark = pytest.mark.usefixtures("one_thread")


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A directory laid out as the suite expects: the data file and the checkpoint."""
    root = tmp_path_factory.mktemp("your_model")
    data = _module("make_word_problems").write_jsonl(
        root / "examples" / "your_model" / "word_problems.jsonl", n=200, seed=0)
    _module("build_checkpoint").build(root / "runs" / "your-model" / "ckpt", data, hidden=32,
                                      layers=1, vocab_size=320)
    return root


def test_generator_is_seeded_distinct_and_checkable():
    make = _module("make_word_problems")
    rows = make.make_rows(300, seed=0)
    assert rows == make.make_rows(300, seed=0)
    assert len({r["question"] for r in rows}) == 300
    for r in rows:  # the demonstration ends with the answer the number verifier reads
        assert r["solution"].endswith(f"The answer is {r['answer']}.")
    committed = (EXAMPLE / "word_problems.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in committed] == rows  # the committed file is this output


def test_checkpoint_is_a_bf16_qwen2_with_bpe_and_chat_template(workdir):
    from varbench.models import load_policy

    pol = load_policy(workdir / "runs" / "your-model" / "ckpt")
    assert type(pol.model).__name__ == "Qwen2ForCausalLM"
    assert next(pol.model.parameters()).dtype == torch.bfloat16
    assert pol.tokenizer.chat_template and pol.tokenizer.eos_token == "<|im_end|>"
    assert len(pol.tokenizer("<sort>", add_special_tokens=False)["input_ids"]) > 1


def _small(text: str) -> str:
    """The suite at test size (same cases and keys, smaller numbers)."""
    for key, value in {"n_prompts": 1, "G": 2, "n_boot": 20, "M": 3, "n_ref": 6, "steps": 1,
                       "eval_every": 1, "eval_prompts": 2, "eval_samples": 1,
                       "prompts_per_step": 2, "max_new_tokens": 5}.items():
        text = re.sub(rf"(?m)^{key} = .*$", f"{key} = {value}", text)
        text = re.sub(rf"{key} = \d+", f"{key} = {value}", text)
    text = re.sub(r"Gs = \[.*\]", "Gs = [2]", text)
    return text.replace('schemes = ["centered", "rloo", "otb"]', 'schemes = ["centered", "otb"]')


def test_your_model_suite_runs(workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    suite = workdir / "your-model.toml"
    suite.write_text(_small((ROOT / "suites" / "your-model.toml").read_text()))
    summary = run_suite(suite, workdir / "out", progress=False)
    assert summary.computed == ["proxy", "variance", "cancellation", "train"]
    out = json.loads((workdir / "out" / "summary.json").read_text())
    kinds = [a["kind"] for a in out["analyses"]]
    assert kinds == ["proxy", "variance", "cancellation", "train"]
    for a in out["analyses"]:  # every record says what precision it was computed in
        dtype = a["provenance"]["model_dtype"]
        assert "bfloat16" in (dtype.values() if isinstance(dtype, dict) else [dtype])
    var = next(a for a in out["analyses"] if a["kind"] == "variance")
    assert all("n/a" not in h["text"] for h in var["headlines"]), [
        h["text"] for h in var["headlines"] if "n/a" in h["text"]]
    train = next(a for a in out["analyses"] if a["kind"] == "train")
    assert any("held-out sampled accuracy" in h["text"] for h in train["headlines"])
    assert (workdir / "out" / "report.html").is_file()
    shutil.rmtree(workdir / "out")


def _cli(*args):
    from varbench.app.cli import main

    return main([str(a) for a in args])


def test_every_command_takes_the_checkpoint_the_data_file_and_bfloat16(workdir, tmp_path,
                                                                       capsys):
    """The issue's acceptance line: sample|proxy|variance|cancellation|train|warmstart all
    accept --policy DIR --task data.jsonl --knob verifier=number --dtype bfloat16."""
    ck = workdir / "runs" / "your-model" / "ckpt"
    data = workdir / "examples" / "your_model" / "word_problems.jsonl"
    common = ["--policy", ck, "--task", data, "--knob", "verifier=number", "--knob",
              "max_new_tokens=4", "--dtype", "bfloat16"]
    assert _cli("sample", *common, "-G", 2, "--prompts", 1) == 0
    out = capsys.readouterr().out
    assert "(bfloat16 on cpu)" in out and "<|im_start|>user" in out  # the chat template
    small = ["--prompts", 1, "-G", 2, "--no-progress", "--no-cache"]
    assert _cli("proxy", *common, *small, "--boot", 10, "--out", tmp_path / "p") == 0
    assert _cli("variance", *common, *small[2:], "--prompts", 1, "-G", 2, "-M", 3,
                "--reference", "sampled", "--n-ref", 4, "--schemes", "centered", "otb",
                "--out", tmp_path / "v") == 0
    assert _cli("cancellation", *common, *small, "--inner-steps", 0, "--sketch-dim", 16,
                "--out", tmp_path / "c") == 0
    for d in ("p", "v", "c"):
        prov = json.loads((tmp_path / d / "summary.json").read_text())["analyses"][0][
            "provenance"]
        assert list(prov["model_dtype"].values()) == ["bfloat16"]
    assert _cli("train", *[x for x in common if x != "--knob" and "=" not in str(x)],
                "--knob", "verifier=number", "--knob", "max_new_tokens=4", "--steps", 1,
                "-G", 2, "--prompts-per-step", 1, "--eval-prompts", 2, "--eval-samples", 1,
                "--out", tmp_path / "t", "--no-warm-start") == 0
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["task"] == str(data)
    with pytest.warns(UserWarning, match="ended after 1 steps"):  # one step: out of band
        assert _cli("warmstart", *common, "--knob", "solution_key=solution", "--max-steps", 1,
                    "--cache-dir", tmp_path / "cache", "--out", tmp_path / "w") == 0
    from varbench.models import load_policy

    assert next(load_policy(tmp_path / "w").model.parameters()).dtype == torch.bfloat16


def test_a_users_task_class_and_the_bpe_tokenizer_on_sort(workdir, capsys):
    ck = workdir / "runs" / "your-model" / "ckpt"
    assert _cli("sample", "--policy", ck, "--task", "_plugin_tasks:EchoTask", "--knob",
                "word=yo", "-G", 2, "--prompts", 1) == 0
    assert "say yo 0:" in capsys.readouterr().out
    # byte-level BPE splits <sort>: a clear error before any work, then --add-task-tokens
    assert _cli("sample", "--policy", ck, "--task", "sort", "-G", 2) == 2
    err = capsys.readouterr().err
    assert "['<sort>']" in err and "--add-task-tokens" in err and "dataset task" in err
    assert _cli("sample", "--policy", ck, "--task", "sort", "-G", 2, "--prompts", 1,
                "--add-task-tokens") == 0
    cap = capsys.readouterr()
    assert "added 1 task token(s) ['<sort>']" in cap.err and "resized its embeddings" in cap.err
    assert "task sort" in cap.out


def test_bf16_unsupported_device_and_bad_dtype_are_usage_errors(monkeypatch, capsys):
    from varbench._util.checks import check_device

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU without bf16
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(Exception, match=r"--dtype=bfloat16 is not supported on "
                                        r"--device='cuda'.*choose one of \['float16', 'float32'\]"):
        check_device("--device", "cuda", dtype=torch.bfloat16)
    with pytest.raises(Exception, match=r"^dtype=bfloat16 is not supported on device='cuda'"):
        check_device("device", "cuda", dtype=torch.bfloat16)  # the library's spelling
    # argparse's refusal is main's exit 2 with one line, like every bad input
    assert _cli("sample", "--dtype", "bf16") == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'bf16'" in err and len(err.strip().splitlines()) == 1, err
