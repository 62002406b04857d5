"""benchmarks/gpu_check.py: its CPU smoke run (tiny Qwen2-shaped models, one with the real
151936-token tied head, float32 against float64; the CLI runs as one process against 2 torchrun
ranks) covers every phase and passes; a deliberately wrong value fails its row (exit 1); its
comparisons never pass on nothing (an empty or all-zero reference)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_check  # noqa: E402


def test_quick_cpu_run_covers_every_phase_and_passes(tmp_path, capsys):
    import pandas as pd

    csv = tmp_path / "table.csv"
    assert gpu_check.main(["--device", "cpu", "--quick", "--dtypes", "float32",
                           "--csv", str(csv)]) == 0
    df = pd.read_csv(csv)
    assert set(df["phase"]) == {*gpu_check.PHASES, "cli"}
    assert (df["result"] == "PASS").all() and (df["tol"] > 0).all()  # no row that cannot fail
    assert {"loop x3 (loss, grad norm, entropy)", "logp (KV cache)", "g* (exact reference)",
            "residual (k=1)", "token_sq", "sequence_sq"} <= set(df["quantity"])
    assert {f"varbench {k}: 2 ranks" for k in gpu_check.CLI_RUNS} <= set(df["quantity"])
    vocab = df[df["size"] == "quick-vocab"]  # the real-vocabulary tied head, every phase
    assert set(vocab["phase"]) == set(gpu_check.PHASES) - set(gpu_check.ENUMERATES_VOCAB)
    assert "0 FAIL" in capsys.readouterr().out


def test_real_vocabulary_model_is_tied_with_151936_rows():
    pol = gpu_check.qwen2_policy("quick-vocab")
    emb = pol.model.get_input_embeddings().weight
    assert emb.shape[0] == 151936 and pol.model.get_output_embeddings().weight is emb


def test_a_wrong_value_fails_its_row(monkeypatch, capsys, tmp_path):
    import pandas as pd

    real = gpu_check.PHASE_FNS["forward"]

    def off_by_a_percent(pol, ctx):  # the candidate's entropy 1% off; the reference's true
        out = real(pol, ctx)
        if pol is not ctx["ref_policy"]:
            v, kind, mask = out["entropy"]
            out["entropy"] = (v * 1.01, kind, mask)
        return out

    monkeypatch.setitem(gpu_check.PHASE_FNS, "forward", off_by_a_percent)
    csv = tmp_path / "t.csv"
    assert gpu_check.main(["--device", "cpu", "--quick", "--dtypes", "float32", "--phases",
                           "forward", "--no-cli", "--csv", str(csv)]) == 1
    df = pd.read_csv(csv)
    bad = df[df["result"] == "FAIL"]
    assert set(bad["quantity"]) == {"entropy"} and len(bad) == 2  # both sizes


def test_a_wrong_table_fails_the_torchrun_comparison(tmp_path):
    import pandas as pd

    for d in ("a", "b"):
        (tmp_path / d / "tables").mkdir(parents=True)
    t = pd.DataFrame({"x": [1.0, 2.0, float("nan")], "y": [3, 4, 5], "s": ["u", "v", "w"]})
    t.to_csv(tmp_path / "a" / "tables" / "t.csv", index=False)
    t.to_csv(tmp_path / "b" / "tables" / "t.csv", index=False)
    assert gpu_check._tables_err(tmp_path / "a", tmp_path / "b") == 0.0
    t.assign(x=[1.0, 2.001, float("nan")]).to_csv(tmp_path / "a" / "tables" / "t.csv",
                                                  index=False)
    assert gpu_check._tables_err(tmp_path / "a", tmp_path / "b") > gpu_check.CLI_TOL
    t.assign(s=["u", "v", "x"]).to_csv(tmp_path / "a" / "tables" / "t.csv", index=False)
    assert gpu_check._tables_err(tmp_path / "a", tmp_path / "b") == math.inf
    (tmp_path / "b" / "tables" / "t.csv").unlink()
    assert gpu_check._tables_err(tmp_path / "a", tmp_path / "b") == math.inf  # nothing to compare


def test_a_row_beyond_tolerance_exits_1(monkeypatch, capsys):
    monkeypatch.setitem(gpu_check.TOLERANCES, ("float32", "rel"), 0.0)
    assert gpu_check.main(["--device", "cpu", "--quick", "--dtypes", "float32",
                           "--phases", "forward", "--no-cli"]) == 1
    assert "   FAIL " in capsys.readouterr().out


def test_comparisons_never_pass_on_nothing():
    err = gpu_check.max_err
    z = torch.zeros(3)
    assert err(z, z) == math.inf and err(z, z, relative=False) == math.inf
    assert err(torch.ones(2), torch.ones(3)) == math.inf
    assert err(torch.ones(2), torch.ones(2), torch.zeros(2)) == math.inf
    a, b = torch.tensor([1.0, 2.1]), torch.tensor([1.0, 2.0])
    assert err(a, b) == pytest.approx(0.05) and err(a, b, relative=False) == pytest.approx(0.1)
    assert not gpu_check.Row("s", "p", "float32", "q", math.nan, 1.0, "cpu").passed


def test_cuda_without_a_gpu_is_a_fail_not_a_pass(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["--device", "cuda"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_realistic_size_is_qwen2_0_5b_shaped_and_seq_fits_its_context():
    cfg = gpu_check.SIZES["realistic"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["intermediate_size"]) == (896, 24, 14, 2, 4864)
    assert (cfg["vocab"], cfg["tied"]) == (151936, True)
    assert 256 <= cfg["max_position_embeddings"]  # the default --seq
