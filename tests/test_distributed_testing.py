"""Data-parallel check harness: 2 gloo ranks under torchrun equal one process, number for number."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd

from varbench.testing import check_estimator

SCRIPT = """
import json, sys
import torch.distributed as dist
from varbench._util.distributed import init_from_env, shutdown
from varbench.testing import check_estimator

rank, world = init_from_env()
assert world == 2 and dist.get_backend() == "gloo"
res = check_estimator("otb", num_steps=1200, seed=4, baselines=("centered",))
if rank == 0:
    json.dump(res.table.to_dict(orient="list"), open(sys.argv[1], "w"))
shutdown()
"""


def test_two_gloo_ranks_equal_one_process(tmp_path, one_thread):
    # one thread here as in each rank (OMP_NUM_THREADS=1): float64 matmuls reduce in an order
    # that depends on the thread count, which moved a 6e-98 p-value in its 14th digit
    script = tmp_path / "dp_check.py"
    script.write_text(SCRIPT)
    out = tmp_path / "table.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(script), str(out)],
        env=env, text=True, capture_output=True, timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    dp = pd.DataFrame(json.loads(out.read_text()))
    # 1200 steps = 3 chunks: rank 0 computes chunks 0 and 2, rank 1 chunk 1.
    single = check_estimator("otb", num_steps=1200, seed=4, baselines=("centered",)).table
    assert list(dp["check"]) == list(single["check"])
    for col in ("value", "se", "p_value"):
        a = pd.to_numeric(dp[col], errors="coerce").to_numpy(dtype=float)
        b = pd.to_numeric(single[col], errors="coerce").to_numpy(dtype=float)
        assert ((a == b) | (pd.isna(a) & pd.isna(b))).all(), (col, a, b)
