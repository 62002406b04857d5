"""Shared fixtures: tiny models built in milliseconds, deterministic seeds."""

from __future__ import annotations

import os

import torch

# Two cores: keep intra-op threads bounded so parallel test workers do not thrash.
torch.set_num_threads(int(os.environ.get("VARBENCH_TEST_THREADS", "2")))
