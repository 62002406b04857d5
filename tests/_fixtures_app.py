"""Helpers for the app tests (suite, runner, cmd_runner): small suites of cheap `check` cases."""

from __future__ import annotations

import time
from pathlib import Path

import torch


def sleepy_centered(rewards, mask, **kw):
    """Centered advantages, slowly (so a test can interrupt a case in the middle)."""
    time.sleep(0.3)
    m = mask.to(rewards.dtype)
    return (rewards - rewards.mean(1, keepdim=True)).unsqueeze(-1) * m


SUITE = """
[suite]
name = "mini"
title = "mini suite"
seed = 3

[defaults]
num_steps = 60
baselines = ["centered"]

[[cases]]
name = "rloo"
kind = "check"
estimator = "rloo"

[[cases]]
name = "centered"
kind = "check"
estimator = "centered"
G = 3

[[cases]]
name = "topk"
kind = "check"
estimator = "topk"
estimator_options = {{ k = 2 }}

{extra}
"""

SLOW_CASE = """
[[cases]]
name = "slow"
kind = "check"
estimator = "_fixtures_app:sleepy_centered"
num_steps = 10
baselines = []
"""


def write_suite(dir_: Path, extra: str = "", name: str = "mini.toml") -> Path:
    path = Path(dir_) / name
    path.write_text(SUITE.format(extra=extra))
    return path


torch.set_num_threads(1)
