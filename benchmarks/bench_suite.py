"""Suite runner benchmark: wall time of a suite cold (nothing cached) and warm (every case cached).

    .venv/bin/python benchmarks/bench_suite.py                  # reduced suite, ~1-3 min
    .venv/bin/python benchmarks/bench_suite.py --suite suites/quickstart.toml   # the real one

Both runs happen in this process, side by side, into a fresh temporary output directory; the
warm run is the same command again (what a user's rerun after an interruption or a finished
run costs). Target: warm < 5% of cold. A third timing runs the warm case through the CLI in a
subprocess, which adds the Python/torch/transformers import a user pays on every command.
Warm starts of the policies are cached outside the output directory ($VARBENCH_CACHE) and are
not part of "cold" unless that cache is empty.

Second part: the data-parallel check harness (``check_estimator`` under ``torchrun``, gloo) on
the same work with 1 and with 2 ranks, timed inside the ranks after the process group is up;
prints the speed-up (on 2 cores expect <= 2x). ``--skip-distributed`` leaves it out.

Third part: the variance harness (``estimator_variance``, prompts sharded over ranks and the
per-prompt records gathered) on the same work with 1 and 2 ranks, timed the same way; prints the
speed-up and whether rank 0's records equal the 1-rank records (rtol 1e-5). Prompt p always runs
on rank p % world, so with an even prompt count the shards are balanced.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REDUCED = """
[suite]
name = "bench"
title = "bench suite (reduced quickstart)"
seed = 0

[defaults]
preset = "tiny"
states = ["warm"]

[[cases]]
name = "variance"
kind = "variance"
task = "sort"
schemes = ["centered", "normalized", "rloo", "topk", "otb"]
Gs = [2, 4]
M = 8
n_prompts = 1

[[cases]]
name = "cancellation"
kind = "cancellation"
tasks = ["arith"]
n_prompts = 2
G = 4
inner_steps = [0]

[[cases]]
name = "train"
kind = "train"
policy = "tiny"
scheme = "otb"
G = 4
prompts_per_step = 4
token_budget = 480
eval_every = 5
eval_prompts = 32

[[cases]]
name = "check-rloo"
kind = "check"
estimator = "rloo"
num_steps = 2000
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--suite", default=None, help="suite file (default: a reduced quickstart)")
    ap.add_argument("--steps", type=int, default=8000, help="check steps for the 1 vs 2 ranks run")
    ap.add_argument("--variance-prompts", type=int, default=4,
                    help="prompts for the 1 vs 2 ranks variance run")
    ap.add_argument("--skip-distributed", action="store_true")
    ap.add_argument("--skip-suite", action="store_true")
    args = ap.parse_args()
    if not args.skip_suite:
        bench_suite(args)
    if not args.skip_distributed:
        bench_ranks(args.steps)
        bench_variance_ranks(args.variance_prompts)


RANK_SCRIPT = """
import json, sys, time
import torch, torch.distributed as dist
from varbench._util.distributed import init_from_env, shutdown
from varbench.testing import check_estimator
torch.set_num_threads(1)
rank, world = init_from_env("gloo")
if world > 1:
    dist.barrier()
t0 = time.perf_counter()
res = check_estimator("otb", num_steps=int(sys.argv[2]), baselines=("centered", "rloo"))
if world > 1:
    dist.barrier()
if rank == 0:
    json.dump({"wall": time.perf_counter() - t0, "table": res.table.to_json()},
              open(sys.argv[1], "w"))
shutdown()
"""


def bench_ranks(steps: int) -> None:
    times, tables = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "ranks.py"
        script.write_text(RANK_SCRIPT)
        for n in (1, 2):
            out = Path(tmp) / f"r{n}.json"
            res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc_per_node", str(n), str(script), str(out), str(steps)],
                                 capture_output=True, text=True)
            assert res.returncode == 0, res.stderr[-2000:]
            data = json.loads(out.read_text())
            times[n], tables[n] = data["wall"], data["table"]
    print(f"check_estimator('otb', num_steps={steps}, baselines centered+rloo), gloo, "
          "1 thread per rank")
    print(f"{'ranks':34} {'wall s':>9} {'speed-up':>9}")
    for n in (1, 2):
        print(f"{n:<34} {times[n]:9.2f} {times[1] / times[n]:9.2f}")
    print(f"tables identical: {tables[1] == tables[2]}")


VARIANCE_SCRIPT = """
import pickle, sys, time
import torch, torch.distributed as dist
from varbench.analysis.variance import estimator_variance
from varbench.models import build_preset
from varbench._util.distributed import init_from_env, shutdown
from varbench.tasks import get_task
torch.set_num_threads(1)
rank, world = init_from_env("gloo")
policy, task = build_preset("tiny", seed=0), get_task("sort", n=3)
if world > 1:
    dist.barrier()
t0 = time.perf_counter()
res = estimator_variance(policy, task, schemes=("centered", "rloo", "otb", "otb_exact"),
                         Gs=(2, 4, 8), M=8, n_prompts=int(sys.argv[2]),
                         reward="inclusion_adjacency", reference="sampled", n_ref=128,
                         sketch_dim=256, seed=0, progress=False,
                         min_responses=0)  # the same work at every world size: no floor
if world > 1:
    dist.barrier()
if rank == 0:
    pickle.dump({"wall": time.perf_counter() - t0, "records": res.records},
                open(sys.argv[1], "wb"))
shutdown()
"""


def _records_close(a: dict, b: dict) -> bool:
    import numpy as np
    import pandas as pd

    for name in a:
        x, y = a[name], b[name]
        if list(x.columns) != list(y.columns) or len(x) != len(y):
            return False
        for col in x.columns:
            if pd.api.types.is_numeric_dtype(x[col]):
                if not np.allclose(x[col].to_numpy(float), y[col].to_numpy(float), rtol=1e-5,
                                   atol=1e-9, equal_nan=True):
                    return False
            elif list(x[col]) != list(y[col]):
                return False
    return set(a) == set(b)


def bench_variance_ranks(n_prompts: int) -> None:
    import pickle

    times, records = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "variance_ranks.py"
        script.write_text(VARIANCE_SCRIPT)
        for n in (1, 2):
            out = Path(tmp) / f"v{n}.pkl"
            res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  "--nproc_per_node", str(n), str(script), str(out),
                                  str(n_prompts)], capture_output=True, text=True)
            assert res.returncode == 0, res.stderr[-2000:]
            data = pickle.loads(out.read_bytes())
            times[n], records[n] = data["wall"], data["records"]
    print(f"estimator_variance(tiny, sort n=3, {n_prompts} prompts, G 2 4 8, M=8, 4 schemes, "
          "sampled reference n_ref=128, sketch 256), gloo, 1 thread per rank")
    print(f"{'ranks':34} {'wall s':>9} {'speed-up':>9}")
    for n in (1, 2):
        print(f"{n:<34} {times[n]:9.2f} {times[1] / times[n]:9.2f}")
    print(f"records equal (rtol 1e-5): {_records_close(records[1], records[2])}")


def bench_suite(args: argparse.Namespace) -> None:

    from varbench.app.runner import run_suite

    with tempfile.TemporaryDirectory() as tmp:
        suite = Path(args.suite) if args.suite else Path(tmp) / "bench.toml"
        if args.suite is None:
            suite.write_text(REDUCED)
        out = Path(tmp) / "out"
        t0 = time.perf_counter()
        cold = run_suite(suite, out, progress=False)
        t_cold = time.perf_counter() - t0
        t0 = time.perf_counter()
        warm = run_suite(suite, out, progress=False)
        t_warm = time.perf_counter() - t0
        t0 = time.perf_counter()
        cli = subprocess.run([sys.executable, "-m", "varbench", "run", str(suite), "--out",
                              str(out)], capture_output=True, text=True)
        t_cli = time.perf_counter() - t0
        assert cli.returncode == 0, cli.stderr
        assert not warm.computed and len(warm.cached) == len(cold.computed)
    print(f"suite: {suite.name if args.suite else 'reduced quickstart (built in)'}, "
          f"{len(cold.computed)} cases")
    print(f"{'run':34} {'wall s':>9} {'vs cold':>9}")
    print(f"{'cold (computes every case)':34} {t_cold:9.2f} {1.0:9.3f}")
    print(f"{'warm (all cached, in process)':34} {t_warm:9.2f} {t_warm / t_cold:9.3f}")
    print(f"{'warm via CLI (incl. imports)':34} {t_cli:9.2f} {t_cli / t_cold:9.3f}")
    print(f"warm/cold = {100 * t_warm / t_cold:.2f}% (target < 5%)")


if __name__ == "__main__":
    main()
