"""`varbench run` and `validate` under torchrun: 2 gloo ranks each run their shard of the
cases (rank r: shard r+1/2) alone into one --out, then rank 0 writes the report, equal to one
process's; --shard / --plan / --report-only are refused with several ranks."""

from __future__ import annotations

import json

import pytest
import torch
from _fixtures_distributed import torchrun

from varbench.app.cli import main
from varbench.app.compare import compare_reports
from varbench.app.runner import run_suite

# 4 cases, 2 per rank: check cases (their bias test shards its chunks over the ranks, unless
# each rank works alone) and a proxy case (the gradient harness gathers over the ranks).
SUITE = """
[suite]
name = "dp"
title = "two ranks"
seed = 3

[[cases]]
name = "rloo"
kind = "check"
estimator = "rloo"
num_steps = 60
baselines = ["centered"]

[[cases]]
name = "proxy"
kind = "proxy"
preset = "micro"
states = ["random"]
task = "sort"
knobs = { n = 2 }
n_prompts = 2
G = 2
n_boot = 10
seed = 1

[[cases]]
name = "centered"
kind = "check"
estimator = "centered"
G = 3
num_steps = 60
baselines = ["centered"]

[[cases]]
name = "topk"
kind = "check"
estimator = "topk"
estimator_options = { k = 2 }
num_steps = 60
baselines = ["centered"]
"""


def test_run_on_two_gloo_ranks_equals_one_process(tmp_path):
    suite = tmp_path / "dp.toml"
    suite.write_text(SUITE)
    res = torchrun(["-m", "varbench", "run", str(suite), "--out", str(tmp_path / "dp")],
                   timeout=600)
    assert "4 case(s) computed" in res.stdout  # rank 0 counts every rank's cases
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        one = run_suite(suite, tmp_path / "one")
    finally:
        torch.set_num_threads(n)
    assert sorted(one.computed) == ["centered", "proxy", "rloo", "topk"]
    dp, single = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("dp", "one"))
    assert [a["name"] for a in dp["analyses"]] == [a["name"] for a in single["analyses"]]
    # each case ran in one process on either side: the same numbers exactly
    table = compare_reports(tmp_path / "one", tmp_path / "dp", tolerance=0, rel_tolerance=0,
                            abs_tolerance=0)
    assert len(table) > 10 and table["status"].eq("ok").all(), table
    manifest = json.loads((tmp_path / "dp" / "suite.json").read_text())
    assert manifest["shard"] is None and manifest["report_digest"] == manifest["digest"]


@pytest.mark.parametrize("argv", [
    ["run", "SUITE.toml", "--shard", "1/2"],
    ["run", "SUITE.toml", "--plan"],
    ["validate", "--out", "OUT", "--shard", "1/2"],
    ["validate", "--out", "OUT", "--report-only"],
])
def test_own_sharding_flags_are_refused_with_several_ranks(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")  # refused before joining (no MASTER_ADDR needed)
    (tmp_path / "SUITE.toml").write_text(SUITE)
    flag = next(a for a in argv if a.startswith("--") and a != "--out")
    argv = [str(tmp_path / a) if a.isupper() or a.endswith(".toml") else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "WORLD_SIZE=2" in err and flag in err
    assert not (tmp_path / "OUT").exists()
