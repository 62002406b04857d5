"""The validation grid's pre-registration (varbench.analysis.validate_prereg): the report hashes
the file and lists every deviation of the run from it (issue 31, point 1)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import pytest
from _fixtures_validate import tiny_design, tiny_grid, write_prereg
from test_app_runner_validate import fake  # noqa: F401  (the fixture)

from varbench._util.checks import UsageError
from varbench.analysis import validate as V
from varbench.analysis import validate_prereg as P
from varbench.app.validation import run_validation


def _block(cfg, path):
    return P.report_block(path, V.config_dict(cfg), V.registered_config)


def test_an_unchanged_grid_lists_no_deviation_and_the_hash_is_the_files(tmp_path):
    path = write_prereg(tmp_path / "p.toml", tiny_design())
    cfg = replace(tiny_grid(), preregistration=str(path))
    b = _block(cfg, path)
    assert b["deviations"] == [] and b["disclosed"] == []
    assert b["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    # the runs' device is placement, not design (the command line sets it)
    on_gpu = replace(cfg, base={**cfg.base, "device": "cuda"})
    assert _block(on_gpu, path)["deviations"] == []
    assert "(no deviation)" in P.headline_text(b)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (dict(seeds=(0, 1, 2)), "seed list: registered 2 seeds [0, 1], ran 3 seeds [0, 1, 2]"),
        (dict(equivalence_margin=0.2), "equivalence margin (proxy claims): registered 0.15, "
                                       "ran 0.2"),
        (dict(collapse_acc_frac=0.3), "collapse definition (final accuracy below this fraction "
                                      "of the warm start's): registered 0.5, ran 0.3"),
        (dict(budgets={"sort": 80, "arith": 40, "toolsum_long": 150}), "token budgets"),
        (dict(base={**tiny_grid().base, "lr": 2e-3}), "base.lr: registered 0.001, ran 0.002"),
    ],
)
def test_a_changed_setting_is_a_named_deviation(tmp_path, change, words):
    path = write_prereg(tmp_path / "p.toml", tiny_design())
    devs = _block(replace(tiny_grid(), **change), path)["deviations"]
    assert len(devs) == 1 and words in devs[0], devs


def test_arms_and_claims_added_dropped_or_changed_are_listed(tmp_path):
    path = write_prereg(tmp_path / "p.toml", tiny_design())
    cfg = tiny_grid()
    arms = (*cfg.arms[1:], {"task": "sort", "scheme": "normalized", "G": 4, "variant": "eq",
                            "prompts_per_step": 1})
    arms = (arms[0], {**arms[1], "seeds": [0, 1]}, arms[2])  # toolsum_long otb/4: seeds changed
    claims = cfg.claims[1:]
    devs = _block(replace(cfg, arms=arms, claims=claims), path)["deviations"]
    assert "arm added: sort normalized/4/eq" in devs[0]
    assert devs[1] == "arm dropped: arith normalized/2/gspo"
    assert devs[2].startswith("arm changed: toolsum_long otb/4: registered") and (
        '"seeds": [0, 1]' in devs[2])
    assert devs[3] == "claim dropped: tokens sort: otb/4 vs normalized/4"
    assert len(devs) == 4


def test_a_changed_analysis_is_a_deviation_and_disclosed_ones_are_kept(tmp_path):
    plan = P.analysis_plan()
    old = {**plan, "stability_measures": ["collapse", "surge"],
           "verdict_rules": {**plan["verdict_rules"], "saving": "CI above 0"}}
    note = {"grid": "reports/claims", "change": "collapse definition", "text": "changed late"}
    path = write_prereg(tmp_path / "p.toml", tiny_design(), analysis=old, disclosed=(note,))
    b = _block(tiny_grid(), path)
    assert b["deviations"] == [
        'analysis stability_measures: registered ["collapse", "surge"], ran ["collapse"]',
        f'analysis verdict_rules.saving: registered "CI above 0", ran '
        f'{json.dumps(plan["verdict_rules"]["saving"])}']
    assert b["disclosed"] == ["reports/claims: collapse definition: changed late"]
    notes = P.notes_of(b)
    assert notes[-1] == ("Disclosed deviation (before the pre-registration): reports/claims: "
                         "collapse definition: changed late")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[registration]\n[design]\n", r"missing \[analysis\] table"),
        ("[registration]\n[design]\n[analysis]\n[extra]\n", r"top level key 'extra'"),
        ("[registration]\nwho = 1\n[design]\n[analysis]\n", r"\[registration\] key 'who'"),
        ("[registration]\n[design]\nbogus = 1\n[analysis]\n", r"\[design\].*key 'bogus'"),
        ("[registration\n", "not valid TOML"),
    ],
)
def test_a_bad_file_is_refused_before_any_training(tmp_path, text, message):
    (tmp_path / "p.toml").write_text(text)
    cfg = replace(tiny_grid(), preregistration=str(tmp_path / "p.toml"))
    with pytest.raises(UsageError, match=message):
        V.check_grid(cfg)
    with pytest.raises(UsageError, match="no such file"):
        V.check_grid(replace(cfg, preregistration=str(tmp_path / "none.toml")))


def test_the_report_carries_the_hash_and_the_deviations(tmp_path, fake):  # noqa: F811
    path = write_prereg(tmp_path / "p.toml", tiny_design())
    cfg = replace(tiny_grid(), preregistration=str(path), prediction=False)
    run_validation(cfg, tmp_path / "w", progress=False, report_dir=tmp_path / "r")
    pre = json.loads((tmp_path / "r" / "summary.json").read_text())["analyses"][0][
        "summary"]["preregistration"]
    assert pre["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    # the design registered prediction = true: skipping it is a deviation, named in the report
    assert pre["deviations"] == ["prediction: registered true, ran false"]
    md = (tmp_path / "r" / "report.md").read_text()
    assert pre["sha256"] in md and "Deviation from the pre-registration: prediction" in md


def test_a_claims_changed_margin_is_that_claim_changed(tmp_path):
    path = write_prereg(tmp_path / "p.toml", tiny_design())
    cfg = tiny_grid()
    claims = tuple({**c, "margin": 0.25} if c["kind"] == "proxy" else c for c in cfg.claims)
    devs = _block(replace(cfg, claims=claims), path)["deviations"]
    assert len(devs) == 1 and devs[0].startswith(
        "claim changed: proxy sort: otb/2 vs otb/4: registered") and '"margin": 0.25' in devs[0]


def test_a_suite_edited_after_registration_lists_its_changes(tmp_path):
    """The shipped smoke suite, edited after its registration (one seed more, a lower collapse
    threshold, an arm dropped), against its unchanged pre-registration file."""
    from pathlib import Path

    from varbench.app.cmd_train import suite_validate_config

    root = Path(__file__).resolve().parents[1] / "suites"
    prereg = tmp_path / "prereg.toml"
    prereg.write_bytes((root / "prereg" / "otb-claims-smoke.toml").read_bytes())
    text = (root / "otb-claims-smoke.toml").read_text()
    text = text.replace('"suites/prereg/otb-claims-smoke.toml"', json.dumps(str(prereg)))
    (tmp_path / "same.toml").write_text(text)
    same = suite_validate_config(str(tmp_path / "same.toml"), None)
    assert _block(same, prereg)["deviations"] == []
    lines = [ln for ln in text.splitlines() if 'variant = "gspo4_ao"' not in ln]
    edited = "\n".join(lines).replace("seeds = [0, 1]\n",
                                      "seeds = [0, 1, 2]\ncollapse_acc_frac = 0.3\n")
    (tmp_path / "edited.toml").write_text(edited)
    cfg = suite_validate_config(str(tmp_path / "edited.toml"), None)
    devs = _block(cfg, prereg)["deviations"]
    assert devs == [
        "arm dropped: arith normalized/4/gspo4_ao",
        "collapse definition (final accuracy below this fraction of the warm start's): "
        "registered 0.5, ran 0.3",
        "seed list: registered 2 seeds [0, 1], ran 3 seeds [0, 1, 2]"], devs


def test_the_plan_prints_the_hash_to_publish_before_the_run(tmp_path):
    import pandas as pd

    from varbench.analysis.validate_plan import plan_text

    path = write_prereg(tmp_path / "p.toml", tiny_design())
    cfg = replace(tiny_grid(), preregistration=str(path))
    timing = pd.DataFrame([{"task": "sort", "G": 2, "wall_s": 1.0, "tokens": 100.0}])
    text = plan_text(cfg, timing)
    assert hashlib.sha256(path.read_bytes()).hexdigest() in text
    assert "(no deviation)" in text
    assert "sha256" not in plan_text(tiny_grid(), timing)


@pytest.mark.parametrize("suite,prereg", [("otb-claims", "otb-claims"), ("gspo-lr", "gspo-lr"),
                                          ("toolsum-eqg", "toolsum-eqg"),
                                          ("toolsum-eqg2", "toolsum-eqg2")])
def test_shipped_suites_follow_their_preregistration(suite, prereg):
    """Each shipped validate suite, as committed, lists no deviation from its own registration
    (an edit to either file without the other shows up here)."""
    from pathlib import Path

    from varbench.app.cmd_train import suite_validate_config

    root = Path(__file__).resolve().parents[1] / "suites"
    cfg = suite_validate_config(str(root / f"{suite}.toml"), None)
    assert _block(cfg, root / "prereg" / f"{prereg}.toml")["deviations"] == []


def test_a_restricted_claim_registers_its_rule_and_earlier_files_read_as_before(tmp_path):
    """The restricted-mean rules belong to the analysis only when a claim uses them: a file that
    registers such a claim without them lists each as a deviation; with them, none; a grid
    without one is compared with the rules it always had."""
    claim = {"kind": "tokens", "task": "sort", "a": "otb/4", "b": "normalized/4",
             "claimed": 0.0, "estimand": "restricted"}
    design = {**tiny_design(), "claims": [claim]}
    cfg = replace(tiny_grid(), claims=(claim,))
    bare = write_prereg(tmp_path / "bare.toml", design)
    devs = _block(cfg, bare)["deviations"]
    assert [d.split(":")[0] for d in devs] == ["analysis verdict_rules.equivalence_restricted",
                                               "analysis verdict_rules.saving_restricted"]
    assert all('registered "(absent)"' in d for d in devs)
    full = write_prereg(tmp_path / "full.toml", design,
                        analysis=P.analysis_plan(["restricted"]))
    assert _block(cfg, full)["deviations"] == []
    assert set(P.analysis_plan()["verdict_rules"]) == {"saving", "equivalence", "rate_diff",
                                                       "correlation"}
