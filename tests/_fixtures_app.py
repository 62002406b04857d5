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


PROXY_SUITE = """
[suite]
name = "one"
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
"""


def proxy_suite(path: Path, extra: str = "") -> Path:
    """A one-case proxy suite (micro, random init, sort n=2, 2 prompts x G=2, seed 1) with
    ``extra`` lines appended to its case, written to ``path``."""
    path.write_text(PROXY_SUITE + extra)
    return path


def write_suite(dir_: Path, extra: str = "", name: str = "mini.toml") -> Path:
    path = Path(dir_) / name
    path.write_text(SUITE.format(extra=extra))
    return path


torch.set_num_threads(1)
