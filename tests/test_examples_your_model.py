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
    assert all("n/a" not in h["text"] for h in var["headlines"])
    train = next(a for a in out["analyses"] if a["kind"] == "train")
    assert any("held-out sampled accuracy" in h["text"] for h in train["headlines"])
    assert (workdir / "out" / "report.html").is_file()
    shutil.rmtree(workdir / "out")
