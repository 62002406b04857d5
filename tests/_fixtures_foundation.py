"""Fixtures of the foundation tests (models, tasks, rollout, warm start, CLI)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module", autouse=False)
def one_thread():
    """Run a module on one intra-op thread: the models are tiny, and on a shared two-core
    machine OpenMP threads spin-waiting on each other made warm start ~20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
