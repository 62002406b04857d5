"""benchmarks/gpu_check.py: its CPU smoke run (tiny Qwen2-shaped model, float32 against
float64) covers every phase and passes; a row beyond its tolerance makes it exit 1; its
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
    assert set(df["phase"]) == set(gpu_check.PHASES)
    assert (df["result"] == "PASS").all() and (df["tol"] >= 0).all()
    assert {"loop: 3 steps finite", "logp (KV cache)", "g* (exact reference)",
            "residual (k=1)", "token_sq", "sequence_sq"} <= set(df["quantity"])
    assert "0 FAIL" in capsys.readouterr().out


def test_a_row_beyond_tolerance_exits_1(monkeypatch, capsys):
    monkeypatch.setitem(gpu_check.TOLERANCES, ("float32", "rel"), 0.0)
    assert gpu_check.main(["--device", "cpu", "--quick", "--dtypes", "float32",
                           "--phases", "forward"]) == 1
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
    assert 256 <= cfg["max_position_embeddings"]  # the default --seq
