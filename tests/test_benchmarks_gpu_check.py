"""benchmarks/gpu_check.py: its CPU smoke run (tiny Qwen2-shaped models, one with the real
151936-token tied head, float32 against float64; the CLI runs as one process against 2 torchrun
ranks) covers every phase and passes; a deliberately wrong value fails its row (exit 1); its
comparisons never pass on nothing (an empty or all-zero reference); every row fails when the
candidate is a different model (so no row compares a quantity the model does not change)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import gpu_check  # noqa: E402


def test_quick_cpu_run_covers_every_phase_and_passes(tmp_path, capsys, monkeypatch):
    """The CPU smoke run passes, and every compared row's value shifted by 3 tolerances (of
    its reference's scale) fails that row (the CLI rows: the wrong-checkpoint test)."""
    import pandas as pd

    real, shifted = gpu_check._compare, []

    def compare(kind, dtype, got, ref, mask):
        err, tol = real(kind, dtype, got, ref, mask)
        g, r = (torch.as_tensor(x).detach().double().cpu() for x in (got, ref))
        if mask is not None:
            r = r[torch.as_tensor(mask).cpu().bool()]
        scale = 1.0 if kind == "nats" or not r.numel() else float(r.abs().max())
        shifted.append(real(kind, dtype, g + 3 * tol * scale, ref, mask)[0] > tol)
        return err, tol

    monkeypatch.setattr(gpu_check, "_compare", compare)
    csv = tmp_path / "table.csv"
    assert gpu_check.main(["--device", "cpu", "--quick", "--dtypes", "float32",
                           "--csv", str(csv)]) == 0
    df = pd.read_csv(csv)
    assert len(shifted) == (df["phase"] != "cli").sum() and all(shifted)
    assert set(df["phase"]) == {*gpu_check.PHASES, "cli"}
    assert (df["result"] == "PASS").all() and (df["tol"] > 0).all()  # no row that cannot fail
    assert {"loop x3 grad/norm", "loop x3 policy/entropy", "logp (KV cache)",
            "g* (exact reference)", "residual (k=1)", "rel_residual (k=1, mixed signs)",
            "token vectors (countsketch(K=256, seed=1))", "token vectors (flat)", "token_sq",
            "sequence_sq"} <= set(df["quantity"])
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


def _wrong_model(monkeypatch):
    """Candidates (not the float64 references) built from another seed: a wrong model."""
    real = gpu_check.on

    def wrong(policy, device, dtype):
        if dtype == torch.float64:
            return real(policy, device, dtype)
        return real(gpu_check.qwen2_policy(policy.meta["size"], seed=1), device, dtype)

    monkeypatch.setattr(gpu_check, "on", wrong)


@pytest.mark.slow
def test_every_row_fails_on_a_wrong_model(monkeypatch, tmp_path):
    """Regression: rows that could not fail (shared-step ratios equal to 1e-16 whatever the
    model, w_t and the entropy of a near-uniform 151936-token softmax, a loop whose loss and
    gradient were 0) passed for any model. With the candidate a different random model every
    row of every phase and both sizes must fail; the real-vocabulary size emits no row of the
    quantities a random model's logit scale fixes there (``VOCAB_SCALE_BOUND``)."""
    import pandas as pd

    _wrong_model(monkeypatch)
    csv = tmp_path / "t.csv"
    assert gpu_check.main(["--device", "cpu", "--quick", "--dtypes", "float32", "--no-cli",
                           "--csv", str(csv)]) == 1
    df = pd.read_csv(csv)
    assert set(df["phase"]) == set(gpu_check.PHASES)
    passed = df[df["result"] == "PASS"]
    assert passed.empty, passed[["size", "phase", "quantity", "err", "tol"]].to_string()
    vocab = df[df["size"] == "quick-vocab"]
    assert not vocab.empty
    for ph, q in gpu_check.VOCAB_SCALE_BOUND:
        assert vocab[(vocab["phase"] == ph) & (vocab["quantity"] == q)].empty
    # the scale-bound rows do fail on the tokenizer-vocabulary size
    quick = df[df["size"] == "quick"]
    for ph, q in gpu_check.VOCAB_SCALE_BOUND:
        rows = quick[(quick["phase"] == ph) & (quick["quantity"] == q)]
        assert len(rows) and (rows["result"] == "FAIL").all(), (ph, q)


@pytest.mark.slow
def test_every_cli_row_fails_when_the_ranks_run_another_model(monkeypatch):
    """The 2-rank runs on another checkpoint than the one-process runs: every CLI row fails."""
    from varbench.models.io import save_policy

    real = gpu_check._torchrun

    def other_checkpoint(argv, out, timeout=300):
        i = argv.index("--policy") + 1
        wrong = Path(argv[i]).parent / "wrong-ckpt"
        if not wrong.exists():
            save_policy(gpu_check.qwen2_policy("quick", seed=1), wrong)
        return real([*argv[:i], str(wrong), *argv[i + 1:]], out, timeout)

    monkeypatch.setattr(gpu_check, "_torchrun", other_checkpoint)
    rows = gpu_check.cli_rows(print)
    assert [r.quantity for r in rows] == [f"varbench {k}: 2 ranks" for k in gpu_check.CLI_RUNS]
    assert not any(r.passed for r in rows), [(r.quantity, r.err) for r in rows]


def test_real_vocabulary_softmax_is_peaked():
    """LOGIT_STD: the random-init 151936-token softmax is far from uniform (else its entropy
    and w_t match for any model)."""
    pol = gpu_check.qwen2_policy("quick-vocab")
    ids = torch.randint(4, 151936, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = pol.model(ids).logits.double()
    ent = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
    assert float(logits.std(-1).mean()) == pytest.approx(gpu_check.LOGIT_STD, rel=0.3)
    assert float(ent.max()) < math.log(151936) - 0.25


@pytest.mark.slow
def test_default_attention_outside_the_batched_backward_phases(monkeypatch):
    """Only the phases with a vmapped backward enter the math-attention context; the others
    run the model's default attention (sdpa: the fused kernels on CUDA)."""
    import contextlib

    state, seen = {"math": False}, {}

    @contextlib.contextmanager
    def recording(model, device=None):
        state["math"] = True
        try:
            yield None
        finally:
            state["math"] = False

    monkeypatch.setattr(gpu_check, "batched_backward_attention", recording)
    for ph in ("forward", "sampling", "norms"):
        def wrapped(pol, ctx, fn=gpu_check.PHASE_FNS[ph], ph=ph):
            if pol is not ctx["ref_policy"]:
                seen.setdefault(ph, set()).add(state["math"])
            return fn(pol, ctx)

        monkeypatch.setitem(gpu_check.PHASE_FNS, ph, wrapped)
    assert gpu_check.main(["--device", "cpu", "--quick", "--dtypes", "float32", "--no-cli",
                           "--phases", "forward", "sampling", "norms"]) == 0
    assert seen == {"forward": {False}, "sampling": {False}, "norms": {True}}
    assert gpu_check.qwen2_policy("quick").model.config._attn_implementation == "sdpa"
