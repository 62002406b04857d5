"""Shared fixtures: tiny models built in milliseconds, deterministic seeds."""

from __future__ import annotations

import os

import pytest
import torch

# Two cores: keep intra-op threads bounded so parallel test workers do not thrash.
torch.set_num_threads(int(os.environ.get("VARBENCH_TEST_THREADS", "2")))


@pytest.fixture(scope="module", autouse=False)
def one_thread():
    """Run a module on one intra-op thread: the models are tiny, and on a shared two-core
    machine OpenMP threads spin-waiting on each other made warm start ~20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
