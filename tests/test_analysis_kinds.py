"""varbench.analysis.kinds: every analysis declares its knobs once (issue 25).

The library's keyword call, the suite schema and the command line accept and refuse exactly the
same values of every knob of every registered analysis kind (a property test), and a new
analysis kind is a config, a ``run`` and one ``register_analysis`` call: the suite runner and the
command line take it without a change to the application.
"""

from __future__ import annotations

import importlib
import itertools
import json
from dataclasses import dataclass, fields

import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from varbench._util.bounds import KNOBS
from varbench._util.checks import UsageError
from varbench._util.config import Config, flags_of, knob
from varbench.analysis.kinds import ANALYSES, AnalysisKind, register_analysis
from varbench.app import executors
from varbench.app.cli import main
from varbench.app.suite import parse_case
from varbench.estimators.registry import schemes, weighted_schemes
from varbench.report.figures import FIGURES, register_figures

# the modules (varbench.analysis's names `cancellation` etc. are the functions)
ca = importlib.import_module("varbench.analysis.cancellation")
pr = importlib.import_module("varbench.analysis.proxy")
va = importlib.import_module("varbench.analysis.variance")


class Accepted(Exception):
    """Raised where a door has accepted the values and would start the work."""


def _accept(*a, **k):
    raise Accepted


def _values(f) -> st.SearchStrategy:
    """Values of config field ``f``: inside, at and outside its bounds or choices."""
    meta = f.metadata
    if "knob" in meta and meta["knob"] is not None or ("knob" in meta and not meta.get("each")):
        b = KNOBS[meta["knob"] or f.name]
        edges = [v for v in (b.lo, b.hi) if v is not None]
        near = [e + d for e in edges for d in (-1, 0, 1)]
        if b.kind is int:
            near = [int(v) for v in near]
        scalar = st.one_of(st.integers(-3, 40), st.sampled_from(near),
                           st.floats(-1.5, 2.5, allow_nan=False, width=32),
                           st.sampled_from(["auto", "flat"]))
    else:
        if f.name in ("schemes", "scheme"):
            names = schemes() + [f"{s}_exact" for s in schemes()]
        else:
            choices = meta.get("choices")
            names = list(choices() if callable(choices) else choices or ["x"])
        scalar = st.sampled_from([*names, "bogus"])
    if meta.get("each"):
        return st.lists(scalar, min_size=0, max_size=3)
    return scalar


def _argv(f, value) -> list[str]:
    values = value if isinstance(value, list) else [value]
    return [flags_of(f)[0], *map(str, values)]


def _library(kind: str, pol, task, params: dict):
    if kind == "proxy":
        return pr.proxy_correlation({"s": pol}, task, **params)
    if kind == "variance":
        return va.estimator_variance(pol, task, **params)
    return ca.cancellation(pol, [task], **params)


# the registered kinds of the library, and the entry points the test patches to stop at
ENTRY = {"proxy": (pr, "CellCache"), "variance": (va, "sizes"), "cancellation": (ca, "CellCache")}


_EXAMPLE = itertools.count()


@pytest.fixture(scope="module")
def micro():
    import varbench as vb

    return vb.build_policy("micro"), vb.get_task("sort", n=2)


def test_every_registered_analysis_is_tested_here():
    assert set(ENTRY) <= set(ANALYSES)
    assert {k for k, v in executors.KINDS.items() if v.analysis is not None} == set(ANALYSES)


@pytest.mark.parametrize("kind", sorted(ENTRY))
@settings(max_examples=120, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_library_suite_and_cli_accept_and_refuse_the_same(kind, data, micro, tmp_path,
                                                          monkeypatch, capsys):
    """A value of any knob is accepted by the keyword call, a suite case and the subcommand
    alike, or refused by all three, each naming the knob (the key or its flag)."""
    # hermetic: a drawn path value ("x", "bogus") is read relative to an empty directory, and
    # every example writes into its own --out, so no example sees what an earlier one left
    monkeypatch.chdir(tmp_path)
    out = tmp_path / f"o{next(_EXAMPLE)}"
    ak = ANALYSES[kind]
    f = data.draw(st.sampled_from(fields(ak.config)), label="field")
    value = data.draw(_values(f), label=f.name)
    base = {k: list(v) if isinstance(v, tuple) else v for k, v in ak.cli_defaults.items()}
    params = {**base, f.name: value}
    names = [f.name, *flags_of(f)]

    module, entry = ENTRY[kind]
    monkeypatch.setattr(module, entry, _accept)
    try:
        _library(kind, *micro, params)
        lib = None
    except Accepted:
        lib = True
    except UsageError as err:
        lib = str(err)
    assert lib is not None, "the library ran past its checks"

    try:
        parse_case({"name": "c", "kind": kind, **params})
        suite = True
    except UsageError as err:
        suite = str(err)

    monkeypatch.setattr(executors.CaseKind, "execute", _accept)
    capsys.readouterr()
    argv = [kind, *(a for k, v in base.items() if k != f.name
                    for a in _argv(next(x for x in fields(ak.config) if x.name == k), v)),
            *_argv(f, value), "--out", str(out)]
    try:
        code = main(argv)
        cli = capsys.readouterr().err
        assert code == 2, cli
    except Accepted:
        cli = True

    verdicts = {"library": lib is True, "suite": suite is True, "cli": cli is True}
    assert len(set(verdicts.values())) == 1, (f.name, value, verdicts, lib, suite, cli)
    for door, msg in (("library", lib), ("suite", suite), ("cli", cli)):
        if msg is not True:
            assert any(n in msg for n in names), (door, f.name, value, msg)


def test_exact_weights_follow_the_declared_capability():
    """``<scheme>_exact`` exists exactly for the schemes that declare they read token
    weights (register_scheme(..., reads=...)), in the config as in the suite."""
    assert set(weighted_schemes()) == {"otb", "otb_loo"}
    va.VarianceConfig(schemes=("otb_exact", "otb_loo_exact"))
    for label in ("rloo_exact", "centered_exact"):
        with pytest.raises(UsageError, match=rf"schemes='{label}' is not valid"):
            va.VarianceConfig(schemes=(label,))


@pytest.mark.parametrize("config", [va.VarianceConfig, ca.CancellationConfig])
def test_no_sketch_is_one_spelling_after_the_config(config):
    """0 (a suite's or a flag's "no sketch") becomes None in the config's declaration, whether
    the config comes from keywords or from a suite case; the run reads None only."""
    assert config(sketch_dim=0).sketch_dim is None
    assert config.from_dict({"sketch_dim": 0}).sketch_dim is None
    assert config(sketch_dim=None).sketch_dim is None
    assert config(sketch_dim=8).sketch_dim == 8
    with pytest.raises(UsageError, match=r"sketch_dim=-1"):
        config(sketch_dim=-1)


# --- a new analysis kind: a config, a run, one register_analysis call --------------------------

@dataclass(frozen=True)
class CountConfig(Config):
    """Counts the prompts of a task (a toy analysis)."""

    n_prompts: int = knob(2, flags=("--prompts",))
    """Prompts drawn."""
    seed: int = knob(0)
    """Seed of the prompts."""


def _count_run(policies, tasks, config, *, cache_dir=None, progress=None, settings=None):
    from varbench.report import provenance
    from varbench.report.result import AnalysisResult, Headline

    prompts = tasks[0].prompts(config.n_prompts, seed=config.seed)
    table = pd.DataFrame({"state": list(policies) * len(prompts),
                          "prompt": [p.text for p in prompts for _ in policies]})
    cfg = {**config.to_dict(), **(settings or {})}
    return [AnalysisResult("count", "count", {"prompts": table}, {},
                           [Headline("prompts", float(len(prompts)), None,
                                     f"{len(prompts)} prompts")], cfg,
                           provenance(config=cfg, seeds=config.seed), [])]


def _count_figures(result, fig_dir, prefix):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.bar([0], [len(result.records["prompts"])])
    name = f"{prefix}prompts.png"
    fig.savefig(fig_dir / name)
    plt.close(fig)
    return [(name, "Prompts counted.")]


def test_a_second_figure_maker_for_one_kind_is_refused():
    with pytest.raises(UsageError, match="'variance' are already registered"):
        register_figures("variance", _count_figures)
    assert FIGURES["variance"] is ANALYSES["variance"].figures


def _count_plan(tasks, config, vocab_size):
    from varbench.analysis.plan import Plan

    return Plan("count", 0, passes=0)


def test_a_new_kind_is_a_config_a_run_and_one_registration(tmp_path, monkeypatch, capsys):
    kind = AnalysisKind("count", CountConfig, _count_run, _count_figures, _count_plan,
                        "count a task's prompts", states=("random",))
    monkeypatch.setitem(ANALYSES, "count", kind)  # removed again after the test
    monkeypatch.setitem(FIGURES, "count", _count_figures)
    assert register_analysis(kind) is kind  # the one declaration (again: the same kind)
    # the suite schema: its keys are the config's fields and the policy spec
    suite = tmp_path / "s.toml"
    suite.write_text('[suite]\nname = "n"\n[[cases]]\nname = "c"\nkind = "count"\n'
                     'preset = "micro"\nn_prompts = 3\n')
    from varbench.app.runner import run_suite
    from varbench.app.suite import SuiteError, load_suite

    assert load_suite(suite).cases[0].params["n_prompts"] == 3
    run_suite(suite, tmp_path / "out", progress=False)
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["analyses"][0]["headlines"][0]["value"] == 3
    # its declared figures are drawn in the report (no figure table to edit elsewhere)
    assert (tmp_path / "out" / "figures" / "c__prompts.png").is_file()
    assert "c__prompts.png" in (tmp_path / "out" / "report.md").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(suite.read_text().replace("n_prompts = 3", "n_prompts = 0"))
    with pytest.raises(SuiteError, match=r"key 'n_prompts'.*>= 1"):
        load_suite(bad)
    # the command line: a subcommand with a flag per field, the declared spelling too
    assert main(["count", "--preset", "micro", "--prompts", "4", "--no-progress",
                 "--out", str(tmp_path / "cli")]) == 0
    summary = json.loads((tmp_path / "cli" / "summary.json").read_text())
    assert summary["analyses"][0]["headlines"][0]["value"] == 4
    assert main(["count", "--n-prompts", "0", "--out", str(tmp_path / "x")]) == 2
    assert "n_prompts" in capsys.readouterr().err
