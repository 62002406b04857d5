"""varbench._util.distributed in one process: no process group is joined and every helper is
the identity (the torchrun equivalence: tests/test_distributed_*.py)."""

from __future__ import annotations

import torch.distributed as dist

from varbench._util import distributed as D


def test_one_process_joins_no_group(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert D.init_from_env() == (0, 1)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert D.init_from_env(backend="gloo") == (0, 1)
    assert not dist.is_initialized()
    assert D.rank_world() == (0, 1)
    D.shutdown()  # a no-op without a group
    assert not dist.is_initialized()


def test_gather_objects_in_one_process_is_the_object_itself():
    obj = {"rows": [1, 2]}
    out = D.gather_objects(obj)
    assert out == [obj] and out[0] is obj
