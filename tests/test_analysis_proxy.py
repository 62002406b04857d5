"""Tests of the proxy-vs-true analysis on a micro policy."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from scipy import stats as sps

from varbench.analysis.proxy import otb_baseline_records, proxy_correlation
from varbench.models import build_preset
from varbench.report import write_report
from varbench.rollout.sampler import sample
from varbench.tasks import get_task


@pytest.fixture(scope="module")
def result():
    task = get_task("sort", n=3, max_value=3)
    states = {"random init": build_preset("micro", seed=0),
              "other init": build_preset("micro", seed=1)}
    return proxy_correlation(states, task, n_prompts=2, G=4, n_boot=20, reward="positional")


def test_report_renders_proxy_figures(result, tmp_path):
    out = write_report([result], tmp_path)
    figs = {p.name for p in (out / "figures").iterdir()}
    assert {"proxy__proxy_scatter.png", "proxy__proxy_by_position.png",
            "proxy__proxy_calibration.png"} <= figs


def test_records_side_by_side(result):
    tok, cor = result.records["tokens"], result.records["correlations"]
    assert set(tok["state"]) == {"random init", "other init"}
    assert len(tok) == 2 * 2 * 4 * 3  # states x prompts x G x T
    assert set(cor["scope"]) == {"pooled", "position", "sequence", "magnitude"}
    mag = cor[cor["scope"] == "magnitude"]
    assert set(mag["method"]) == {"loglog_slope", "top5_share_y", "top5_share_x",
                                  "top5_share_y_by_x"}
    assert (mag[mag["method"].str.startswith("top5")]["estimate"].between(0, 1)).all()
    assert any("OTB depends on the proxy's magnitudes" in n for n in result.notes)
    assert set(cor[cor["scope"] == "position"]["position"]) == {0, 1, 2}
    assert {"w_t vs token_sq", "w_t vs head_sq", "W_t vs prefix_sq", "W_t vs diag_prefix_sq",
            "W_T vs sequence_sq", "w_t vs token_sq[head]"} <= set(cor["quantity"])
    assert any("inflated by position" in n for n in result.notes)
    assert set(result.records["calibration"]["state"]) == {"random init", "other init"}


def test_records_are_consistent(result):
    tok = result.records["tokens"]
    # Untied head: exact head norm = w_t * ||h||^2 (docs/science.md §2.3): records are aligned.
    np.testing.assert_allclose(tok["head_sq"], tok["w_t"] * tok["h_sq"], rtol=1e-4)
    # Cumulative columns are cumulative sums of per-token ones within each sequence.
    by_seq = tok.groupby(["state", "seq"])
    np.testing.assert_allclose(by_seq["w_t"].cumsum(), tok["W_t"], rtol=1e-5)
    np.testing.assert_allclose(by_seq["token_sq"].cumsum(), tok["diag_prefix_sq"],
                               rtol=1e-4)
    d = tok[tok["state"] == "random init"]
    cor = result.records["correlations"]
    row = cor[(cor["state"] == "random init") & (cor["quantity"] == "w_t vs token_sq")
              & (cor["scope"] == "pooled") & (cor["method"] == "spearman")]
    assert float(row["estimate"].iloc[0]) == pytest.approx(
        sps.spearmanr(d["w_t"], d["token_sq"]).statistic, abs=1e-12)


def test_otb_baseline_difference_is_zero_when_weights_agree():
    pol = build_preset("micro", seed=0)
    task = get_task("sort", n=3, max_value=3)
    batch = sample(pol, task, task.prompts(2, seed=0), 4, seed=0, reward="positional")
    mask = batch.mask != 0
    proxy = 1 - 2 * batch.logprobs.exp() + batch.sum_pi_sq
    tok = pd.DataFrame({"token_sq": proxy[mask].double().numpy()})
    out = otb_baseline_records(batch, tok, state="x").iloc[0]
    assert out["mean_abs_dB"] < 1e-6 and out["mean_abs_dA"] < 1e-6
    tok2 = pd.DataFrame({"token_sq": (proxy[mask] ** 3).double().numpy()})
    out2 = otb_baseline_records(batch, tok2, state="x").iloc[0]
    if float(batch.rewards.std()) > 0:
        assert out2["mean_abs_dB"] > 0


def test_bad_input():
    with pytest.raises(ValueError, match="policies"):
        proxy_correlation({}, get_task("sort"))
    with pytest.raises(ValueError, match="G="):
        proxy_correlation(build_preset("micro"), get_task("sort"), G=0)


def test_magnitude_methods_against_direct_formulas():
    from varbench.stats.estimates import correlations

    gen = np.random.default_rng(0)
    x = gen.lognormal(size=200)
    y = 3 * x**2  # log y = log 3 + 2 log x: slope 2
    seq = np.arange(200) // 4
    df = correlations(x, y, seq, methods=["loglog_slope", "top5_share_y", "top5_share_x",
                                          "top5_share_y_by_x"], n_boot=20).set_index("method")
    assert df.loc["loglog_slope", "estimate"] == pytest.approx(2.0, abs=1e-9)
    top = np.sort(y)[::-1][:10].sum() / y.sum()  # 5% of 200 = 10 tokens
    assert df.loc["top5_share_y", "estimate"] == pytest.approx(top)
    # x ranks tokens exactly as y does here
    assert df.loc["top5_share_y_by_x", "estimate"] == pytest.approx(top)
    assert df.loc["top5_share_x", "estimate"] == pytest.approx(np.sort(x)[::-1][:10].sum()
                                                               / x.sum())


def test_library_cells_are_keyed_by_dtype(tmp_path):
    """Called from Python (no application layer), the cell key still carries the policies'
    device type and dtype: a float64 run never reads a float32 run's cells."""
    task = get_task("sort")
    pol = build_preset("micro")
    kw = dict(n_prompts=1, G=2, n_boot=5, reward="positional", cache_dir=tmp_path)
    proxy_correlation(pol, task, **kw)
    n32 = len(list(tmp_path.glob("*.json")))
    pol.model.to(torch.float64)
    proxy_correlation(pol, task, **kw)
    tags = {p.name.split("__")[0] for p in tmp_path.glob("*.json")}
    assert n32 > 0 and len(tags) == 2
