"""Cancellation under torchrun: 2 gloo ranks (groups split 2/1) equal one process."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import torch
from _fixtures_distributed import assert_frames_close

from varbench.analysis.cancellation import cancellation
from varbench.models import build_preset
from varbench.tasks import get_task

# 3 groups: rank 0 takes groups 0 and 2, rank 1 group 1 (uneven shards); one PPO inner step
# so the coefficients are read at updated parameters; a sketch for the gradient ratio.
KW = {"n_prompts": 3, "G": 4, "inner_steps": (0, 1), "modes": ("seq-mean-token-sum",
      "seq-mean-token-mean"), "sketch_dim": 32, "seed": 2, "reward": "inclusion_adjacency",
      "progress": False}
# A random micro policy's responses part at the first token (no shared steps); a head scaled
# x30 makes it peaked, so every group shares prefixes and has something to cancel.
PEAK = 30.0

SCRIPT = """
import pickle, sys
import torch
import torch.distributed as dist
from varbench._util.distributed import init_from_env, shutdown
from varbench.analysis.cancellation import cancellation
from varbench.models import build_preset
from varbench.tasks import get_task

rank, world = init_from_env()
assert world == 2 and dist.get_backend() == "gloo"
pol = build_preset("micro", seed=1)
with torch.no_grad():
    pol.model.lm_head.weight.mul_(%r)
res = cancellation(pol, [get_task("sort", n=2)], **%r)
pickle.dump(res.records, open(sys.argv[1] + str(rank), "wb"))
shutdown()
"""



def test_cancellation_two_gloo_ranks_equal_one_process(tmp_path):
    script = tmp_path / "dp_cancel.py"
    script.write_text(SCRIPT % (PEAK, KW))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(script), str(tmp_path / "rec")],
        env=env, text=True, capture_output=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: float32 reductions round alike
    try:
        pol = build_preset("micro", seed=1)
        with torch.no_grad():
            pol.model.lm_head.weight.mul_(PEAK)
        single = cancellation(pol, [get_task("sort", n=2)], **KW).records
    finally:
        torch.set_num_threads(n)
    nodes = single["nodes"]
    assert sorted(nodes["p"].unique()) == [0, 1, 2]  # every group has shared steps
    assert nodes["grad_ratio"].notna().any()  # the sharded sketches are compared too
    for rank in (0, 1):  # every rank returns the full, gathered result
        dp = pickle.loads((tmp_path / f"rec{rank}").read_bytes())
        assert set(dp) == set(single)
        for name in single:
            assert_frames_close(dp[name], single[name], name)
