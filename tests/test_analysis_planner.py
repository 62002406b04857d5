"""varbench.analysis.planner: the prediction formula against a hand computation, the kind's
registration (suite schema, command line and config accept and refuse the same values), and
``varbench plan`` end to end on the micro preset."""

from __future__ import annotations

import json
import math
from dataclasses import fields

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from varbench._util.checks import UsageError
from varbench._util.config import field_docs, flags_of
from varbench.analysis import PlannerConfig, predict_arms
from varbench.analysis.kinds import ANALYSES
from varbench.analysis.variance import VarianceConfig
from varbench.app import executors
from varbench.app.cli import build_parser, main
from varbench.app.suite import parse_case

# the kinds property test's value strategy and argv spelling (tests/test_analysis_kinds.py)
from test_analysis_kinds import _argv, _values  # noqa: E402  isort: skip


def _cells() -> pd.DataFrame:
    return pd.DataFrame({
        "scheme": ["a", "b", "c"], "G": [4, 8, 4], "mode": ["token-mean"] * 3,
        "noise_scale": [2.5, 1.0, float("nan")], "noise_scale_ci_low": [2.0, 0.5, float("nan")],
        "noise_scale_ci_high": [3.0, 2.0, float("nan")],
        "tokens_per_group": [40.0, 80.0, 40.0], "variance": [1.0, 0.5, 2.0],
        "variance_x_tokens": [40.0, 40.0, 80.0], "mse": [1.5, 0.75, 2.5],
        "projection": [0.75, 0.875, 0.75]})


def test_prediction_formula_by_hand():
    """P = 8 x G; B = G x noise_scale; tokens = L (P + B), L = tokens_per_group / G; steps =
    1 + B / P; relative to the best arm; the CI plugs in B's limits."""
    arms = predict_arms(_cells(), 8).set_index("scheme")
    # a: P 32, B 10, L 10 -> 420 tokens, steps 1.3125; b: P 64, B 8, L 10 -> 720, 1.125
    assert arms.loc["a", "P"] == 32 and arms.loc["b", "P"] == 64
    assert arms.loc["a", "B_noise"] == pytest.approx(10.0)
    assert arms.loc["b", "B_noise"] == pytest.approx(8.0)
    assert arms.loc["a", "pred_tokens"] == pytest.approx(420.0)
    assert arms.loc["b", "pred_tokens"] == pytest.approx(720.0)
    assert arms.loc["a", "pred_steps"] == pytest.approx(1.3125)
    assert arms.loc["b", "pred_steps"] == pytest.approx(1.125)
    assert arms.loc["a", "pred_tokens_rel"] == pytest.approx(1.0)
    assert arms.loc["b", "pred_tokens_rel"] == pytest.approx(720 / 420)
    # a's B in [8, 12] -> tokens [400, 440] -> relative [400/420, 440/420]
    assert arms.loc["a", "pred_tokens_rel_ci_low"] == pytest.approx(400 / 420)
    assert arms.loc["a", "pred_tokens_rel_ci_high"] == pytest.approx(440 / 420)
    assert arms.loc["b", "pred_steps_ci_high"] == pytest.approx(1 + 16 / 64)
    assert arms.loc["a", "mse_x_tokens"] == pytest.approx(60.0)
    # ranked: a, b, then the unresolved c (no rank)
    out = predict_arms(_cells(), 8)
    assert list(out["scheme"]) == ["a", "b", "c"]
    assert list(out["rank"].iloc[:2]) == [1.0, 2.0] and math.isnan(out["rank"].iloc[2])
    assert out["arm"].iloc[0] == "a/G=4/token-mean"


def test_prediction_refuses_bad_input():
    with pytest.raises(UsageError, match=r"prompts_per_step=0"):
        predict_arms(_cells(), 0)
    with pytest.raises(UsageError, match=r"noise_scale"):
        predict_arms(_cells().drop(columns="noise_scale"), 8)


def test_kind_is_registered_and_its_flags_come_from_the_config():
    kind = ANALYSES["plan"]
    assert kind.config is PlannerConfig and "plan" in executors.KINDS
    assert executors.KINDS["plan"].analysis is kind
    # every variance knob is a planner knob (one declaration: the subclass), plus its own
    assert {f.name for f in fields(VarianceConfig)} < {f.name for f in fields(PlannerConfig)}
    docs = field_docs(PlannerConfig)
    assert docs["n_ref"] and docs["prompts_per_step"]  # inherited docs reach the help text
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices["plan"]
    opts = {o for a in sub._actions for o in a.option_strings}
    for f in fields(PlannerConfig):
        assert set(flags_of(f)) <= opts, f.name
    vc = PlannerConfig(Gs=(4, 8), prompts_per_step=3).variance_config()
    assert type(vc) is VarianceConfig and vc.Gs == (4, 8)


@pytest.mark.parametrize("key,value,ok", [
    ("prompts_per_step", 4, True), ("prompts_per_step", 0, False), ("Gs", [4, 16], True),
    ("Gs", [1, 4], False), ("schemes", ["otb", "bogus"], False), ("M", 2, False),
    ("modes", ["token-mean", "seq-mean-token-sum"], True), ("modes", ["nope"], False),
    ("n_boot", 0, False)])
def test_config_suite_and_cli_agree(key, value, ok, tmp_path, monkeypatch, capsys):
    """The config, a suite case and the subcommand accept or refuse a value alike, naming it."""
    def verdict(fn):
        try:
            fn()
            return True
        except UsageError as err:
            return str(err)

    lib = verdict(lambda: PlannerConfig.from_dict({key: value}))
    suite = verdict(lambda: parse_case({"name": "c", "kind": "plan", key: value}))

    class Accepted(Exception):
        pass

    def accept(*a, **k):
        raise Accepted

    monkeypatch.setattr(executors.CaseKind, "execute", accept)
    f = next(x for x in fields(PlannerConfig) if x.name == key)
    vals = value if isinstance(value, list) else [value]
    capsys.readouterr()
    try:
        code = main(["plan", flags_of(f)[0], *map(str, vals), "--out", str(tmp_path / "o")])
        assert code == 2
        cli = capsys.readouterr().err
    except Accepted:
        cli = True
    assert (lib is True) == (suite is True) == (cli is True) == ok, (lib, suite, cli)
    if not ok:
        for msg in (lib, suite, cli):
            assert key in msg or flags_of(f)[0] in msg, msg


@pytest.fixture(scope="module")
def micro():
    import varbench as vb

    return vb.build_policy("micro"), vb.get_task("sort", n=2)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_knob_is_accepted_or_refused_alike(data, micro, tmp_path, monkeypatch, capsys):
    """Any field of PlannerConfig, a value drawn inside, at or outside its bounds (the kinds
    property test's strategy): the config, the suite schema and the subcommand agree."""
    f = data.draw(st.sampled_from(fields(PlannerConfig)), label="field")
    value = data.draw(_values(f), label=f.name)

    class Accepted(Exception):
        pass

    def verdict(fn):
        try:
            fn()
            return True
        except Accepted:
            return True
        except UsageError as err:
            return str(err)

    def accept(*a, **k):
        raise Accepted

    from varbench.analysis import planner, variance

    def library():  # the keyword call, up to the point where the work would start
        pol, task = micro
        cfg = PlannerConfig(**{f.name: tuple(value) if isinstance(value, list) else value})
        planner.run({"s": pol}, [task], cfg)

    monkeypatch.setattr(variance, "sizes", accept)
    lib = verdict(library)
    assert lib is not None
    suite = verdict(lambda: parse_case({"name": "c", "kind": "plan", f.name: value}))
    monkeypatch.setattr(executors.CaseKind, "execute", accept)
    capsys.readouterr()
    try:
        assert main(["plan", *_argv(f, value), "--out", str(tmp_path / "o")]) == 2
        cli = capsys.readouterr().err
    except Accepted:
        cli = True
    assert (lib is True) == (suite is True) == (cli is True), (f.name, value, lib, suite, cli)
    names = [f.name, *flags_of(f)]
    for msg in (lib, suite, cli):
        if msg is not True:
            assert any(n in msg for n in names), (f.name, value, msg)


SMALL = ["--preset", "micro", "--task", "sort", "--Gs", "2", "4", "-M", "4", "--prompts", "1",
         "--n-ref", "16", "--min-responses", "0", "--n-boot", "50", "--no-progress"]


def test_cli_smoke_writes_the_ranked_table_and_figure(tmp_path, capsys):
    out = tmp_path / "plan"
    assert main(["plan", *SMALL, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "#1 " in printed and "x the best arm's" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["analyses"][0]["kind"] == "plan"
    arms = pd.read_csv(out / "tables" / "plan__arms.csv")
    cells = pd.read_csv(out / "tables" / "plan__cells.csv")
    assert len(arms) == len(cells) == 8  # 4 schemes x 2 G
    # B_noise is G x the variance cells' group noise scale (the same measurement)
    m = arms.merge(cells, on=["scheme", "G", "mode"])
    ok = np.isfinite(m["noise_scale"])
    assert ok.any()
    np.testing.assert_allclose(m.loc[ok, "B_noise"], m.loc[ok, "G"] * m.loc[ok, "noise_scale"],
                               rtol=1e-12)
    assert (out / "figures" / "plan__plan.png").stat().st_size > 0
    # --plan: the cost, nothing sampled
    assert main(["plan", *SMALL, "--plan", "--out", str(tmp_path / "p")]) == 0
    assert "varbench plan --plan: plan (1 policy: warm)" in capsys.readouterr().out


def test_cli_bad_value_exits_2(tmp_path, capsys):
    assert main(["plan", *SMALL, "--prompts-per-step", "0", "--out", str(tmp_path / "x")]) == 2
    assert "prompts_per_step" in capsys.readouterr().err
    assert main(["plan", *SMALL, "--modes", "bogus", "--out", str(tmp_path / "y")]) == 2
