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
    policy = setup.policy_for(cfg, task)
    batch = sample(policy, task, task.prompts(2, split="train", seed=1), 3, seed=1,
                   reward=reward)
    with torch.inference_mode():
        lp = bench_train.sampling_calls(policy.model.eval(), batch, 3)
    assert lp.shape == (6, batch.T)
    torch.testing.assert_close(lp, batch.logprobs.reshape(6, batch.T), rtol=0, atol=1e-6)


def test_bptt_calls_backpropagate_to_the_teacher_forced_gradient():
    """The bptt figure times the right work: the sampler's calls on a differentiable cache
    give the gradient of a teacher-forced forward (float64, rtol 1e-8)."""
    from varbench.grads.precision import exact_float64
    from varbench.rollout import response_logprobs, sample
    from varbench.rollout.kvcache import autograd_cache
    from varbench.train import setup

    cfg = bench_train._config("tiny", 3, 2, 1, 1e-4)
    task, reward = setup.build_task(cfg)
    policy = setup.policy_for(cfg, task)
    model = exact_float64(policy.model).eval()  # float64 throughout, rotary tables too
    batch = sample(policy, task, task.prompts(2, split="train", seed=2), 3, seed=2,
                   reward=reward)
    params = [p for p in model.parameters() if p.requires_grad]
    coef = torch.linspace(-1, 1, 6, dtype=torch.float64)[:, None]
    lp = bench_train.sampling_calls(model, batch, 3, cache=autograd_cache(model))
    got = torch.autograd.grad((coef * lp).sum(), params)
    ref_lp = response_logprobs(model, batch).reshape(6, batch.T)
    want = torch.autograd.grad((coef * ref_lp).sum(), params)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-12)
    before = [p.detach().clone() for p in params]
    bench_train.bptt_step(model, batch, 3, params, torch.optim.SGD(params, lr=0.1))
    assert any(not torch.equal(b, p) for b, p in zip(before, params, strict=True))


def test_floor_is_its_two_parts():
    f = bench_train.floor_ms("tiny", 2, 2, reps=3)
    assert f["calls_ms"] > 0 and f["bwd_ms"] >= 0
    assert f["floor_ms"] == f["calls_ms"] + f["bwd_ms"]
    assert f["fwd_ms"] > 0 and f["tf_floor_ms"] == f["floor_ms"] + f["fwd_ms"]
    assert f["bptt_ms"] > 0 and f["tf_ms"] > f["calls_ms"]


def test_the_benchmark_runs_end_to_end_and_prints_both_tables():
    out = subprocess.run(
        [sys.executable, str(BENCH / "bench_train.py"), "--steps", "2", "--prompts", "2",
         "--presets", "tiny", "--G", "2"],
        capture_output=True, text=True, timeout=600, check=True,
        env={**os.environ, "PYTHONPATH": str(BENCH.parent)}).stdout
    rows = [line.split() for line in out.splitlines() if line.startswith("tiny ")]
    assert [r[2] for r in rows[:3]] == ["new", "bptt", "old"]  # the ratio table
    # this/old wall ratio = tok/s wall over old's (a 1-step window is noisy: it may even be
    # negative, so the check is the arithmetic, not the sign)
    old_tps = float(rows[2][3])
    for r in rows[:2]:
        assert abs(float(r[-3]) - float(r[3]) / old_tps) < 0.01 * abs(float(r[-3])) + 0.011
    assert rows[2][-3:] == ["-", "-", "-"]  # old against itself
    floor = rows[3]
    # preset, G, calls, backward, floor, update fwd, +fwd, tf, bptt, old/3,
    # 3 x (ms, /floor, /+fwd): new, bptt, old
    assert len(floor) == 2 + 8 + 3 * 3
    calls, bwd, fl, fwd, tf, tf_step, bptt, target = map(float, floor[2:10])
    assert abs(fl - calls - bwd) < 0.15 and abs(tf - fl - fwd) < 0.15
    assert tf_step > calls and bptt > 0
    old_ms = float(floor[16])
    assert abs(target - old_ms / 3) < 0.1
    ms, over, over_tf = map(float, floor[10:13])  # new's ms/step over each floor
    # ratios printed to 2 decimals (+-0.005) of numbers printed to 1 decimal (+-0.05 each):
    # the propagated rounding bound of ms / d is 0.05 / d + 0.05 |ms| / d^2 (ms may even be
    # negative on a 1-step window)
    for ratio, d in ((over, fl), (over_tf, tf)):
        assert abs(ratio - ms / d) <= 0.005 + 0.05 / d + 0.05 * abs(ms) / d**2 + 1e-9
