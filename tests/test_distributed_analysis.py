"""Data-parallel variance and gradient (proxy) harnesses: 2 gloo ranks under torchrun equal one
process (same seed)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pandas as pd
import pytest
import torch
from _fixtures_distributed import assert_frames_close

from varbench.analysis.proxy import proxy_correlation
from varbench.analysis.variance import estimator_variance
from varbench.app.cli import main
from varbench.models import build_preset
from varbench.tasks import get_task

# Small enough to launch 2 ranks in seconds: micro preset, sort n=2, 3 prompts (rank 0 gets
# prompts 0 and 2, rank 1 prompt 1: uneven shards), G=2, M=6. The shaped reward and a sampled
# reference keep the statistics non-degenerate (random init rarely scores on "exact").
KW = {"schemes": ("centered", "rloo", "otb"), "Gs": (2,), "M": 6, "n_prompts": 3,
      "reward": "inclusion_adjacency", "reference": "sampled", "n_ref": 32, "sketch_dim": 64,
      "seed": 3, "progress": False, "min_responses": 0}
CLI = ["variance", "--preset", "micro", "--states", "random", "--task", "sort", "--knob", "n=2",
       "--reward", "inclusion_adjacency", "--prompts", "3", "-G", "2", "-M", "6", "--schemes",
       "centered", "otb", "--reference", "sampled", "--n-ref", "32", "--sketch-dim", "64",
       "--min-responses", "0", "--no-cache", "--no-progress"]
# The gradient harness: exact per-token norms of 9 sequences split 5/4 over the ranks.
PROXY_KW = {"n_prompts": 3, "G": 3, "seed": 3, "n_boot": 20, "progress": False}

# One launch (each costs several seconds of imports per rank): the library call, then the
# `varbench variance` command through the CLI entry point (`python -m varbench` calls the same
# main); the command finds the group joined and leaves it when done.
SCRIPT = """
import pickle, sys
import torch.distributed as dist
from varbench.analysis.variance import estimator_variance
from varbench.app.cli import main
from varbench.models import build_preset
from varbench._util.distributed import init_from_env
from varbench.tasks import get_task

rank, world = init_from_env()
assert world == 2 and dist.get_backend() == "gloo"
res = estimator_variance(build_preset("micro", seed=1), get_task("sort", n=2), **%r)
pickle.dump(res.records, open(sys.argv[1] + str(rank), "wb"))
from varbench.analysis.proxy import proxy_correlation
res = proxy_correlation(build_preset("micro", seed=1), get_task("sort", n=2), **%r)
pickle.dump(res.records, open(sys.argv[1] + "proxy" + str(rank), "wb"))
assert main(%r + ["--out", sys.argv[2]]) == 0
assert not dist.is_initialized()
"""


@pytest.fixture
def one_thread():
    """Ranks run 1 thread each; matching it here makes float32 reductions round alike."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)



def test_two_gloo_ranks_equal_one_process(tmp_path, one_thread):
    script = tmp_path / "dp_variance.py"
    script.write_text(SCRIPT % (KW, PROXY_KW, CLI))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(script), str(tmp_path / "rec"), str(tmp_path / "dp")],
        env=env, text=True, capture_output=True, timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert res.stdout.count("report: ") == 1  # only rank 0 writes and prints

    single = estimator_variance(build_preset("micro", seed=1), get_task("sort", n=2), **KW).records
    for rank in (0, 1):  # every rank returns the full, gathered result
        dp = pickle.loads((tmp_path / f"rec{rank}").read_bytes())
        assert set(dp) == set(single)
        for name in single:
            assert_frames_close(dp[name], single[name], name)
    single_proxy = proxy_correlation(build_preset("micro", seed=1), get_task("sort", n=2),
                                     **PROXY_KW).records
    for rank in (0, 1):
        dp = pickle.loads((tmp_path / f"recproxy{rank}").read_bytes())
        assert set(dp) == set(single_proxy)
        for name in single_proxy:
            assert_frames_close(dp[name], single_proxy[name], f"proxy.{name}")
    assert single_proxy["tokens"]["seq"].nunique() == 9
    by_prompt = single["cells_by_prompt"]
    assert list(by_prompt["prompt"].unique()) == [0, 1, 2]
    assert (by_prompt["variance"] > 0).any()  # a non-degenerate comparison

    assert main([*CLI, "--out", str(tmp_path / "one")]) == 0
    tables = sorted(p.name for p in (tmp_path / "one" / "tables").glob("*.csv"))
    assert sorted(p.name for p in (tmp_path / "dp" / "tables").glob("*.csv")) == tables
    assert any(t.endswith("cells_by_prompt.csv") for t in tables)
    for t in tables:
        assert_frames_close(pd.read_csv(tmp_path / "dp" / "tables" / t),
                             pd.read_csv(tmp_path / "one" / "tables" / t), t)
