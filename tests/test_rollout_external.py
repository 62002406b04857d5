"""varbench.rollout.external: rollouts sampled elsewhere read back into the sampler's
RolloutBatch (float64, exact up to rounding), the analyses on them equal to the same analyses
on the same responses sampled in-process, and every refusal naming its problem."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest
import torch

from varbench._util.checks import UsageError
from varbench.analysis.cancellation import cancellation
from varbench.analysis.proxy import proxy_correlation
from varbench.analysis.variance import estimator_variance
from varbench.models import Policy, build_preset
from varbench.rollout import sample
from varbench.rollout.external import default_logprob_tol, read_rollouts, rollout_batch
from varbench.tasks import get_task

pytestmark = pytest.mark.usefixtures("one_thread")

FIELDS = ("prompt_ids", "prompt_mask", "tokens", "mask", "env_mask", "logprobs", "sum_pi_sq",
          "entropy", "rewards", "lengths")
# float64 model: the file's batch's statistics come from one teacher-forced forward, the
# sampler's from its KV-cached decode steps: the same numbers up to float64 rounding
ATOL = 1e-12


@pytest.fixture(scope="module")
def micro64():
    return build_preset("micro", seed=0, dtype=torch.float64)


def rows_of(batch, policy, *, style: str) -> list[dict]:
    """One file row per response of ``batch``: ``text`` (prompt and response text, behaviour
    log-probs), ``ids`` (token ids, as vLLM outputs) or ``verl`` (verl's column names)."""
    tok = policy.tokenizer
    out = []
    for p in range(batch.P):
        prompt = batch.meta["prompt_objects"][p]
        pids = batch.prompt_ids[p][batch.prompt_mask[p] != 0].tolist()
        for i in range(batch.G):
            real = (batch.mask[p, i] + batch.env_mask[p, i]) != 0
            ids = batch.tokens[p, i][real].tolist()
            lp = batch.logprobs[p, i][real].tolist()
            r = float(batch.rewards[p, i])
            env = batch.env_mask[p, i][real].long().tolist()
            if style == "text":
                row = {"prompt": prompt.text, "response": tok.decode(ids), "reward": r,
                       "logprobs": lp}
            elif style == "ids":
                row = {"prompt_token_ids": pids, "token_ids": ids, "reward": r, "logprobs": lp}
            else:  # verl: uid groups, decoded input/output, ids, rollout log-probs, score
                row = {"uid": f"u{p}", "input": prompt.text, "prompt_ids": pids,
                       "response_ids": ids, "output": tok.decode(ids, skip_special_tokens=True),
                       "rollout_log_probs": lp, "score": r, "gts": prompt.answer}
            if batch.env_mask.any():
                row.update(response_ids=ids, env_mask=env)
            out.append(row)
    return out


def write(path, rows):
    """``rows`` as JSONL or Parquet (by the suffix)."""
    if path.suffix == ".parquet":
        pytest.importorskip("pyarrow")
        pd.DataFrame(rows).to_parquet(path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def assert_same(a, b, atol=ATOL):
    for k in FIELDS:
        x, y = getattr(a, k), getattr(b, k)
        assert x.shape == y.shape and x.dtype == y.dtype, k
        assert torch.allclose(x.double(), y.double(), rtol=0, atol=atol), k
    assert a.texts == b.texts and a.prompts == b.prompts


def assert_same_numbers(a: pd.DataFrame, b: pd.DataFrame) -> None:
    """Two records' numeric columns equal (float64 runs: up to rounding)."""
    num = [c for c in a.columns if pd.api.types.is_numeric_dtype(a[c])]
    assert len(a) == len(b) > 0
    pd.testing.assert_frame_equal(a[num], b[num], rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name,style,ext", [
    ("sort", "text", ".jsonl"), ("arith", "text", ".parquet"), ("arith", "ids", ".jsonl"),
    ("arith", "verl", ".parquet"), ("toolsum", "verl", ".jsonl"), ("toolsum", "ids", ".parquet"),
])
def test_loaded_batch_equals_the_samplers(tmp_path, micro64, name, style, ext):
    task = get_task(name, **({"digits": 2} if name == "arith" else {}))
    prompts = task.prompts(3, seed=1)
    want = sample(micro64, task, prompts, 4, seed=2)
    path = write(tmp_path / f"r{ext}", rows_of(want, micro64, style=style))
    got = rollout_batch(path, micro64, task, 3, 4, seed=1)
    assert_same(got, want)
    if name == "toolsum":
        assert want.env_mask.any()  # the environment's tokens were exercised


def _variance_file(tmp_path, policy, task, knobs):
    """The responses the in-process variance run samples (groups, then the reference), per
    prompt, as a file."""
    rows = []
    Gmax = max(knobs["Gs"])
    for p, prompt in enumerate(task.prompts(knobs["n_prompts"], seed=knobs["seed"])):
        p_seed = knobs["seed"] + 1000 * p
        for n, s in ((knobs["M"] * Gmax, p_seed), (knobs["n_ref"], p_seed + 7919)):
            rows += rows_of(sample(policy, task, [prompt], n, seed=s), policy, style="ids")
    return write(tmp_path / "v.jsonl", rows)


VAR = {"schemes": ("raw", "centered", "rloo"), "Gs": (2, 4), "M": 3, "n_prompts": 2,
       "n_ref": 8, "min_responses": 0, "reference": "sampled", "sketch_dim": None,
       "n_boot": 20, "seed": 0}


def no_sampling(monkeypatch, module: str) -> None:
    """From here on ``module`` cannot sample: what it computes comes from the file."""
    def refuse(*a, **k):
        raise AssertionError(f"{module} sampled although it was given rollouts")
    import importlib

    monkeypatch.setattr(importlib.import_module(f"varbench.analysis.{module}"), "sample", refuse)


def test_variance_on_a_file_equals_the_in_process_run(tmp_path, micro64, monkeypatch):
    task = get_task("arith", digits=2)
    want = estimator_variance(micro64, task, **VAR)
    path = _variance_file(tmp_path, micro64, task, VAR)
    no_sampling(monkeypatch, "variance")
    got = estimator_variance(micro64, task, rollouts=str(path), **VAR)
    for key in ("cells", "paired"):
        assert_same_numbers(want.records[key], got.records[key])
    assert got.config["rollouts"].startswith(str(path))
    # too few responses for the groups and the reference: refused, naming how many
    with pytest.raises(UsageError, match=r"has 20 responses; variance \(4 groups of G=4 "
                                         r"\+ n_ref=8\) needs 24"):
        estimator_variance(micro64, task, rollouts=str(path), **{**VAR, "M": 4})


def test_proxy_and_cancellation_on_a_file_equal_the_in_process_runs(tmp_path, micro64,
                                                                    monkeypatch):
    sort = get_task("sort", n=2)
    batch = sample(micro64, sort, sort.prompts(2, seed=1), 3, seed=1)
    path = write(tmp_path / "p.parquet", rows_of(batch, micro64, style="verl"))
    kw = {"n_prompts": 2, "G": 3, "seed": 1, "n_boot": 10}
    want = proxy_correlation({"s": micro64}, sort, **kw)
    no_sampling(monkeypatch, "proxy")
    got = proxy_correlation({"s": micro64}, sort, rollouts=str(path), **kw)
    for key in ("tokens", "otb_baseline", "correlations"):
        pd.testing.assert_frame_equal(want.records[key], got.records[key], rtol=1e-9,
                                      atol=1e-12)
    arith = get_task("arith", digits=2)
    batch = sample(micro64, arith, arith.prompts(2, seed=0), 4, seed=0)
    path = write(tmp_path / "c.jsonl", rows_of(batch, micro64, style="ids"))
    kw = {"n_prompts": 2, "G": 4, "seed": 0, "inner_steps": (0, 1), "sketch_dim": 16,
          "modes": ("seq-mean-token-sum",), "transforms": ("none",)}
    want = cancellation(micro64, [arith], **kw)
    no_sampling(monkeypatch, "cancellation")
    got = cancellation(micro64, [arith], rollouts=str(path), **kw)
    assert_same_numbers(want.records["configs"], got.records["configs"])
    with pytest.raises(UsageError, match="pass one task"):
        cancellation(micro64, [arith, get_task("toolsum")], rollouts=str(path), **kw)
    with pytest.raises(UsageError, match=r"prompt 0 .* has 4 responses; cancellation \(G=5\)"):
        cancellation(micro64, [arith], rollouts=str(path), **{**kw, "G": 5})


def _other_text_tokenizer(kind: str):
    """A tokenizer trained on other text (English words): word-level (cannot spell the
    task's symbols) or byte-level BPE (spells anything, with other ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = ["the cat sat on the mat", "a dog ran in the park", "one two three four"] * 20
    if kind == "word":
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.train_from_iterator(text, trainers.WordLevelTrainer(special_tokens=["<pad>",
                                                                                "<unk>"]))
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        tok.train_from_iterator(text, trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<pad>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


@pytest.fixture(scope="module")
def arith_file(tmp_path_factory, micro64):
    task = get_task("arith", digits=2)
    batch = sample(micro64, task, task.prompts(2, seed=0), 3, seed=0)
    d = tmp_path_factory.mktemp("refusals")
    return task, d, rows_of(batch, micro64, style="text"), rows_of(batch, micro64, style="verl")


def test_a_mismatched_tokenizer_is_refused(arith_file, micro64):
    task, d, text_rows, verl_rows = arith_file
    word = Policy(micro64.model, _other_text_tokenizer("word"), "word-tok")
    with pytest.raises(UsageError, match=r"row 1: prompt .* does not round-trip through the "
                                         r"policy's tokenizer .* a mismatched tokenizer"):
        read_rollouts(write(d / "t.jsonl", text_rows), word, task)
    # a byte-level tokenizer spells any text, so text alone cannot tell; the ids can
    bpe = Policy(micro64.model, _other_text_tokenizer("bpe"), "bpe-tok")
    ids_rows = [{k: v for k, v in r.items() if k not in ("input",)} for r in verl_rows]
    with pytest.raises(UsageError, match=r"row 1: response_ids decode to .*\(a mismatched "
                                         r"tokenizer\)"):
        read_rollouts(write(d / "b.jsonl", ids_rows), bpe, task)


def test_a_mismatched_checkpoint_is_refused(arith_file, micro64):
    task, d, text_rows, _ = arith_file
    other = build_preset("micro", seed=1, dtype=torch.float64)
    ro = read_rollouts(write(d / "t.jsonl", text_rows), other, task, rescore="off")
    with pytest.raises(UsageError, match=r"row 1: behaviour log-probs differ .* above "
                                         r"logprob_tol=1e-06 \(the default for float64\): "
                                         "the responses were sampled from another checkpoint"):
        ro.batch([0, 1], 0, 3)
    # the file's own checkpoint passes at the default; a tolerance above the gap passes too
    read_rollouts(d / "t.jsonl", micro64, task).batch([0, 1], 0, 3)
    read_rollouts(d / "t.jsonl", other, task, logprob_tol=50.0, rescore="off").batch([0], 0, 3)
    assert default_logprob_tol(torch.bfloat16) > default_logprob_tol(torch.float32) > (
        default_logprob_tol(torch.float64))
    # float32: the sampler's own log-probs pass the default, other weights' do not
    f32, f32_other = build_preset("micro", seed=0), build_preset("micro", seed=1)
    batch = sample(f32, task, task.prompts(2, seed=0), 3, seed=0)
    path = write(d / "f32.jsonl", rows_of(batch, f32, style="ids"))
    assert_same(read_rollouts(path, f32, task).batch([0, 1], 0, 3), batch, atol=1e-6)
    with pytest.raises(UsageError, match=r"above logprob_tol=0.001 \(the default for float32\)"):
        read_rollouts(path, f32_other, task, rescore="off").batch([0, 1], 0, 3)


@pytest.mark.parametrize("edit,match", [
    (lambda r: r.pop("reward"), r"no column reward \(or score\); its columns are .*valid "
                                "columns: prompt \\(or input\\)"),
    (lambda r: r.update(reward=math.nan), r"row 1: reward=nan is not a finite number"),
    (lambda r: r.update(response_ids=[1, 99]), r"row 1: response_ids holds id 99 outside "
                                               r"the model's vocabulary \[0, 30\)"),
    (lambda r: r.update(reward=r["reward"] + 0.5), r"row 1: reward .* but task 'arith' "
                                                   "scores the response"),
    (lambda r: r.update(logprobs=r["logprobs"][:-1]), r"row 1: \d+ logprobs for a response "
                                                      r"of \d+ tokens"),
])
def test_bad_rows_are_refused_naming_file_row_and_value(arith_file, micro64, edit, match):
    task, d, text_rows, _ = arith_file
    rows = [dict(r) for r in text_rows]
    for r in rows:
        edit(r) if r is rows[0] or "column" in match else None
    path = write(d / "bad.jsonl", rows)
    with pytest.raises(UsageError, match=f"rollouts='{path}'.*" + match):
        read_rollouts(path, micro64, task, known=task.prompts(2, seed=0)).batch([0], 0, 3)


def test_parquet_without_pyarrow_names_the_extra(arith_file, micro64, monkeypatch):
    import builtins

    task, d, text_rows, _ = arith_file
    path = write(d / "t.parquet", text_rows)
    real = builtins.__import__

    def no_pyarrow(name, *a, **k):
        if name.startswith("pyarrow"):
            raise ImportError(name)
        return real(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_pyarrow)
    with pytest.raises(UsageError, match=r"needs pyarrow; pip install 'varbench\[parquet\]'"):
        read_rollouts(path, micro64, task)


def test_cli_refuses_a_bad_file_with_exit_2_and_one_line(tmp_path, capsys):
    from varbench.app.cli import main

    path = write(tmp_path / "r.jsonl", [{"prompt": "<sort>12=", "response": "12"}])
    code = main(["proxy", "--preset", "micro", "--states", "random", "--task", "sort",
                 "--knob", "n=2", "--prompts", "1", "-G", "1", "--no-progress", "--rollouts",
                 str(path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1 and "no column reward (or score)" in err


def test_the_readme_example_runs(tmp_path, capsys, monkeypatch):
    """The README's file and command, as printed there (the notice says nothing is sampled)."""
    import shlex
    from pathlib import Path

    from varbench.app.cli import main

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("cat > rollouts.jsonl <<'EOF'\n", 1)[1]
    rows, rest = block.split("\nEOF\n", 1)
    command = shlex.split(rest.split("\n", 1)[0])
    assert command[:2] == ["varbench", "proxy"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rollouts.jsonl").write_text(rows + "\n")
    assert main([*command[1:], "--boot", "10", "--no-progress", "--out", "o"]) == 0
    assert "responses read from rollouts='rollouts.jsonl', not sampled" in capsys.readouterr().err


def test_variance_exact_reference_on_a_file_of_the_tasks_prompts(tmp_path, micro64,
                                                                 monkeypatch):
    """An enumerated reference needs no sampling: with the task's own prompts it is allowed,
    and the cells equal the in-process run's; prompts the task cannot score are refused."""
    task = get_task("sort", n=2)
    kw = {**VAR, "reference": "exact", "exact": "never", "n_ref": 2}
    want = estimator_variance(micro64, task, **kw)
    rows = []
    for p, prompt in enumerate(task.prompts(2, seed=0)):
        rows += rows_of(sample(micro64, task, [prompt], 3 * 4, seed=1000 * p), micro64,
                        style="text")
    path = write(tmp_path / "e.jsonl", rows)
    no_sampling(monkeypatch, "variance")
    got = estimator_variance(micro64, task, rollouts=str(path), **kw)
    assert_same_numbers(want.records["cells"], got.records["cells"])
    assert (got.records["reference"]["reference"].str.startswith("exact enumeration")).all()
    other = [{**r, "prompt": r["prompt"].replace("=", "==")} for r in rows]
    with pytest.raises(UsageError, match=r"prompt 0 .* is not one of task 'sort''s prompts.*"
                                         r"reference='exact' needs that"):
        estimator_variance(micro64, task, rollouts=str(write(tmp_path / "o.jsonl", other)), **kw)


def test_groups_follow_the_uid_column_and_must_share_a_prompt(arith_file, micro64):
    task, d, _, verl_rows = arith_file
    # one uid per response pair: the first prompt's 3 responses become groups of 2 and 1
    rows = [{**r, "uid": f"{r['uid']}-{k // 2}"} for k, r in enumerate(verl_rows[:3])]
    ro = read_rollouts(write(d / "u.jsonl", rows), micro64, task)
    assert [len(r) for r in ro.rows] == [2, 1] and ro.prompts[0] == ro.prompts[1]
    mixed = [dict(verl_rows[0]), {**verl_rows[3], "uid": verl_rows[0]["uid"]}]
    with pytest.raises(UsageError, match="row 2: group \"u0\" has another prompt than its "
                                         "first row 1"):
        read_rollouts(write(d / "m.jsonl", mixed), micro64, task)


def test_a_suite_case_takes_the_rollouts_key(tmp_path, capsys):
    """The suite key comes with the config field: the case reads the file (and says so)."""
    from _fixtures_app import proxy_suite

    from varbench.app.runner import run_suite

    policy = build_preset("micro", seed=1)  # the case's random state: its seed
    task = get_task("sort", n=2)
    batch = sample(policy, task, task.prompts(2, seed=1), 2, seed=1)
    path = write(tmp_path / "r.jsonl", rows_of(batch, policy, style="text"))
    suite = proxy_suite(tmp_path / "s.toml", f'rollouts = "{path}"\nlogprob_tol = 1e-4\n')
    run_suite(suite, tmp_path / "out", progress=False)
    assert f"responses read from rollouts='{path}', not sampled" in capsys.readouterr().err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["analyses"][0]["provenance"]["config"]["rollouts"].startswith(str(path))


def test_variance_adaptive_m_draws_the_files_next_groups(tmp_path, micro64, monkeypatch):
    """Adaptive M takes its pilot round, then further rounds, from the file in order: a file
    holding the in-process run's pilot (seed p_seed + PILOT_SEED), its rounds (seeds p_seed +
    104729 r) then its reference gives the same cells."""
    from varbench.analysis.variance import PILOT_SEED

    task = get_task("sort", n=2)  # partial credit at random init: nonzero estimates
    kw = {**VAR, "M_cap": 6, "target_rel_se": 1e-9, "n_prompts": 1, "reward": "positional"}
    want = estimator_variance(micro64, task, **kw)
    assert (want.records["reference"]["M_used"] == 6).all()  # it grew to the cap
    prompt = task.prompts(1, seed=0)[0]
    rows = []
    for n, s in ((12, PILOT_SEED), (12, 0), (12, 104729), (8, 7919)):
        rows += rows_of(sample(micro64, task, [prompt], n, seed=s, reward="positional"),
                        micro64, style="ids")
    path = write(tmp_path / "a.jsonl", rows)
    no_sampling(monkeypatch, "variance")
    got = estimator_variance(micro64, task, rollouts=str(path), **kw)
    assert_same_numbers(want.records["cells"], got.records["cells"])
    # the cap's 7 groups and the pilot's 3
    with pytest.raises(UsageError, match=r"has 44 responses; variance \(10 groups of G=4 \+ "
                                         r"n_ref=8\) needs 48"):
        estimator_variance(micro64, task, rollouts=str(path), **{**kw, "M_cap": 7})


def test_rescore_warn_and_off_keep_the_files_rewards(arith_file, micro64):
    task, d, text_rows, _ = arith_file
    rows = [dict(r) for r in text_rows]
    rows[0]["reward"] += 0.5
    path = write(d / "w.jsonl", rows)
    known = task.prompts(2, seed=0)
    with pytest.warns(UserWarning, match=r"row 1: reward .* 1 row\(s\) disagree; the file's "
                                         "rewards are used"):
        ro = read_rollouts(path, micro64, task, known=known, rescore="warn")
    assert float(ro.batch([0], 0, 3).rewards[0, 0]) == rows[0]["reward"]
    ro = read_rollouts(path, micro64, task, known=known, rescore="off")
    assert float(ro.batch([0], 0, 3).rewards[0, 0]) == rows[0]["reward"]
    # a prompt the task does not know is not re-scored
    assert read_rollouts(path, micro64, task).known == [False, False]
