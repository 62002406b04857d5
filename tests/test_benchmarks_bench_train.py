"""benchmarks/bench_train.py: its step-time floor times the sampler's own model work (the
floor's calls reproduce the sampler's log-probs), and the whole benchmark runs end to end on a
tiny setting, printing the ratio table and the floor table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench_train  # noqa: E402


def test_floor_calls_are_the_samplers_model_work():
    from varbench.rollout import sample
    from varbench.train import setup

    cfg = bench_train._config("tiny", 3, 2, 1, 1e-4)
    task, reward = setup.build_task(cfg)
    policy = setup.build_policy(cfg, task)
    batch = sample(policy, task, task.prompts(2, split="train", seed=1), 3, seed=1,
                   reward=reward)
    with torch.inference_mode():
        lp = bench_train.sampling_calls(policy.model.eval(), batch, 3)
    assert lp.shape == (6, batch.T)
    torch.testing.assert_close(lp, batch.logprobs.reshape(6, batch.T), rtol=0, atol=1e-6)


def test_floor_is_its_two_parts():
    f = bench_train.floor_ms("tiny", 2, 2, reps=3)
    assert f["calls_ms"] > 0 and f["bwd_ms"] >= 0
    assert f["floor_ms"] == f["calls_ms"] + f["bwd_ms"]
    assert f["fwd_ms"] > 0 and f["tf_floor_ms"] == f["floor_ms"] + f["fwd_ms"]


def test_the_benchmark_runs_end_to_end_and_prints_both_tables():
    out = subprocess.run(
        [sys.executable, str(BENCH / "bench_train.py"), "--steps", "2", "--prompts", "2",
         "--presets", "tiny", "--G", "2"],
        capture_output=True, text=True, timeout=600, check=True,
        env={**os.environ, "PYTHONPATH": str(BENCH.parent)}).stdout
    rows = [line.split() for line in out.splitlines() if line.startswith("tiny ")]
    assert [r[2] for r in rows[:2]] == ["new", "old"]  # the ratio table
    assert float(rows[1][-3]) > 0  # new/old wall ratio
    floor = rows[2]
    # preset, G, calls, backward, floor, update fwd, +fwd, 2 x (ms, /floor, /+fwd)
    assert len(floor) == 2 + 5 + 2 * 3
    calls, bwd, fl, fwd, tf = map(float, floor[2:7])
    assert abs(fl - calls - bwd) < 0.15 and abs(tf - fl - fwd) < 0.15
    ms, over, over_tf = map(float, floor[7:10])  # new's ms/step over each floor
    # 2 decimals of ratios of 1-decimal numbers (ms may even be negative on a 1-step window)
    assert abs(over - ms / fl) < 0.01 * abs(over) + 0.01
    assert abs(over_tf - ms / tf) < 0.01 * abs(over_tf) + 0.01
