"""`varbench run` and `validate` under torchrun: 2 gloo ranks each run their shard of the
cases (rank r: shard r+1/2) alone into one --out, then rank 0 writes the report, equal to one
process's; --shard / --plan / --report-only are refused with several ranks."""

from __future__ import annotations

import json

import _fixtures_app as fr
import pandas as pd
import pytest
import torch
from _fixtures_distributed import torchrun

from varbench.app.cli import main
from varbench.app.compare import compare_reports
from varbench.app.runner import run_suite

# 4 cases, 2 per rank: the mini suite's check cases (their bias test shards its chunks over
# the ranks, unless each rank works alone) and a proxy case (the gradient harness gathers over
# the ranks).
PROXY_CASE = "[[cases]]" + fr.PROXY_SUITE.split("[[cases]]", 1)[1]


def test_run_on_two_gloo_ranks_equals_one_process(tmp_path):
    suite = fr.write_suite(tmp_path, PROXY_CASE)
    res = torchrun(["-m", "varbench", "run", str(suite), "--out", str(tmp_path / "dp")],
                   timeout=600)
    assert "4 case(s) computed" in res.stdout  # rank 0 counts every rank's cases
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        one = run_suite(suite, tmp_path / "one")
    finally:
        torch.set_num_threads(n)
    assert sorted(one.computed) == ["centered", "proxy", "rloo", "topk"]  # 2 cases per rank
    dp, single = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("dp", "one"))
    assert [a["name"] for a in dp["analyses"]] == [a["name"] for a in single["analyses"]]
    # each case ran in one process on either side: the same numbers exactly
    table = compare_reports(tmp_path / "one", tmp_path / "dp", tolerance=0, rel_tolerance=0,
                            abs_tolerance=0)
    assert len(table) > 10 and table["status"].eq("ok").all(), table
    manifest = json.loads((tmp_path / "dp" / "suite.json").read_text())
    assert manifest["shard"] is None and manifest["report_digest"] == manifest["digest"]


# a validation grid of 5 runs (2 schemes x 2 seeds + the hacking probe) on the random-init
# micro policy, a few dozen tokens each
GRID = """
[suite]
name = "dpgrid"

[[cases]]
name = "grid"
kind = "validate"
tasks = ["sort"]
schemes = ["normalized", "otb"]
Gs = [2]
seeds = [0, 1]
budgets = { sort = 60 }
eval_responses = 4
hacking_rewards = ["positional"]
hacking_G = 2
hacking_seeds = [0]
prediction = false

[cases.base]
policy = "micro"
warm_start = false
prompts_per_step = 2
lr = 1e-3
eval_prompts = 4
eval_samples = 1
agg = "token-mean"
steps = 100000
"""


def test_validate_on_two_gloo_ranks_equals_one_process(tmp_path):
    grid = tmp_path / "grid.toml"
    grid.write_text(GRID)
    res = torchrun(["-m", "varbench", "validate", "--suite", str(grid), "--out",
                    str(tmp_path / "dp")], timeout=600)
    assert "report: " in res.stdout
    assert main(["validate", "--suite", str(grid), "--out", str(tmp_path / "one")]) == 0
    assert len(list((tmp_path / "dp" / "cases").glob("*.json"))) == 5  # both ranks' runs
    for table in ("claims", "cells", "curves", "tokens_to_threshold", "hacking", "stability"):
        a, b = (pd.read_csv(tmp_path / d / "tables" / f"validation__{table}.csv")
                for d in ("one", "dp"))
        wall = [c for c in a.columns if "wall" in c]  # measured time: not a result
        assert len(a) > 0, table
        pd.testing.assert_frame_equal(a.drop(columns=wall), b.drop(columns=wall), obj=table)


@pytest.mark.parametrize("argv", [
    ["run", "SUITE.toml", "--shard", "1/2"],
    ["run", "SUITE.toml", "--plan"],
    ["validate", "--out", "OUT", "--shard", "1/2"],
    ["validate", "--out", "OUT", "--report-only"],
])
def test_own_sharding_flags_are_refused_with_several_ranks(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")  # refused before joining (no MASTER_ADDR needed)
    fr.write_suite(tmp_path, PROXY_CASE, name="SUITE.toml")
    flag = next(a for a in argv if a.startswith("--") and a != "--out")
    argv = [str(tmp_path / a) if a.isupper() or a.endswith(".toml") else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "WORLD_SIZE=2" in err and flag in err
    assert not (tmp_path / "OUT").exists()
