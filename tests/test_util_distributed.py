"""varbench._util.distributed in one process: no process group is joined and every helper is
the identity (the torchrun equivalence: tests/test_distributed_*.py); the backend choice with
torch.cuda and the group calls monkeypatched (no GPU needed)."""

from __future__ import annotations

import pytest
import torch
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


# --- backend choice: NCCL only with one GPU per rank (torch.cuda monkeypatched; no GPU needed)

ENV = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")


def _machine(monkeypatch, gpus: int, **env: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("gpus,env,backend,words", [
    (0, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, "gloo", "no CUDA device"),
    (1, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "gloo", "1 GPU(s) for 2 ranks"),
    (4, {"WORLD_SIZE": "2"}, "gloo", "LOCAL_RANK is not set"),
    (2, {"LOCAL_RANK": "3", "WORLD_SIZE": "2"}, "gloo", "LOCAL_RANK=3"),
    (2, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, "nccl", "one GPU per rank"),
    (8, {"LOCAL_RANK": "0", "WORLD_SIZE": "4"}, "nccl", "one GPU per rank"),
])
def test_choose_backend(monkeypatch, gpus, env, backend, words):
    """Regression: NCCL was chosen whenever CUDA was visible (two ranks on one GPU failed)."""
    _machine(monkeypatch, gpus, **env)
    got, reason = D.choose_backend()
    assert got == backend and words in reason


def _fake_group(monkeypatch) -> dict:
    calls: dict = {"set_device": [], "init": []}
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls["set_device"].append(i))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group",
                        lambda backend: calls["init"].append(backend))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    return calls


def test_two_ranks_on_one_gpu_join_gloo_and_say_why(monkeypatch, capsys):
    _machine(monkeypatch, 1, WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2")
    calls = _fake_group(monkeypatch)
    assert D.init_from_env() == (0, 2)
    assert calls == {"set_device": [], "init": ["gloo"]}  # no rank is put on GPU 0
    err = capsys.readouterr().err
    assert "gloo" in err and "1 GPU(s) for 2 ranks" in err and "CPU" in err
    D._STATE.clear()


def test_local_rank_unset_never_puts_every_rank_on_gpu0(monkeypatch):
    _machine(monkeypatch, 4, WORLD_SIZE="2")
    calls = _fake_group(monkeypatch)
    D.init_from_env()
    assert calls == {"set_device": [], "init": ["gloo"]}
    D._STATE.clear()


def test_one_gpu_per_rank_joins_nccl_on_local_rank(monkeypatch, capsys):
    _machine(monkeypatch, 2, WORLD_SIZE="2", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2")
    calls = _fake_group(monkeypatch)
    D.init_from_env()
    assert calls == {"set_device": [1], "init": ["nccl"]}
    assert "nccl" in capsys.readouterr().err
    D._STATE.clear()
    with pytest.raises(D.UsageError, match="LOCAL_RANK"):  # nccl asked for, no rank's GPU
        _machine(monkeypatch, 2, WORLD_SIZE="2")
        D.init_from_env(backend="nccl")


@pytest.mark.parametrize("backend,want", [("gloo", "cpu"), ("nccl", "cuda:1")])
def test_rank_device(monkeypatch, backend, want):
    assert D.rank_device() is None  # no group: the caller chooses (one process: the GPU)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_backend", lambda: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert str(D.rank_device()) == want
    from varbench.app.specs import default_device

    assert default_device() == want  # the CLI's default inside a group
