"""--device on every command and suite case kind, through one resolver (varbench.app.specs).

No GPU is needed: ``torch.cuda.is_available`` is monkeypatched True and the function that would
move a model (or run the work) is replaced by one that records the device it was given and
stops. So these tests prove that a one-GPU user's ``varbench proxy|variance|cancellation|train``
(and every other model-building command) asks for ``cuda`` by default, and ``cpu`` without one.
"""

from __future__ import annotations

import argparse
import functools

import pytest
import torch

from varbench.app import executors, specs
from varbench.app.cli import build_parser, main


class Reached(Exception):
    """Raised by the stand-in once it has recorded the device it was given."""


# Commands that build no model and compute nothing on a device (listing, merging, comparing).
NO_DEVICE = {"tasks", "merge", "compare"}


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_command_but_the_model_free_ones_takes_device():
    cmds = _subcommands()
    assert {"proxy", "variance", "cancellation", "train", "validate", "sample", "warmstart",
            "check", "run"} <= set(cmds)
    lacking = {name for name, p in cmds.items()
               if not any("--device" in a.option_strings for a in p._actions)}
    assert lacking == NO_DEVICE


def test_every_suite_case_kind_takes_device():
    for name, kind in executors.KINDS.items():
        assert "device" in kind.parameters(), name


def _fake_cuda(monkeypatch, available: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1 if available else 0)
    if available:  # the cost plan asks the device's free memory before loading (80 GB GPU)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 80 << 30))


def test_resolver_default_follows_cuda_availability(monkeypatch):
    _fake_cuda(monkeypatch, True)
    assert specs.default_device() == "cuda"
    for spec in (None, "", "auto"):
        assert specs.resolve_device(spec) == torch.device("cuda")
    assert specs.resolve_device("cpu") == torch.device("cpu")
    assert specs.resolve_device(torch.device("cuda", 0)) == torch.device("cuda", 0)
    _fake_cuda(monkeypatch, False)
    assert specs.resolve_device(None) == torch.device("cpu")
    with pytest.raises(specs.UsageError, match="no CUDA device"):
        specs.resolve_device("cuda")


@pytest.fixture
def record(monkeypatch):
    """Stand-ins for everything that would move a model or run work: each records the device
    it was handed (as a string) and raises Reached."""
    from importlib import import_module

    # by module path: the package ``varbench`` exports functions named like some modules
    validate_mod = import_module("varbench.app.validation")
    check_mod = import_module("varbench.testing.check")
    loop_mod = import_module("varbench.train.loop")
    policies_mod = import_module("varbench.train.policies")

    seen: list[str] = []

    def build_policy(spec, *, device=None, **kw):
        seen.append(str(device))
        raise Reached

    def check_device(arg, value, *, dtype=None):  # warmstart: before the (CPU) warm start
        seen.append(str(value))
        raise Reached

    def train(config, *a, **k):
        seen.append(str(config.device))
        raise Reached

    def run_validation(cfg, *a, **k):
        seen.append(str(cfg.base["device"]))
        raise Reached

    @functools.wraps(check_mod.check_estimator)  # the suite reads its keys off the signature
    def check_estimator(*a, device=None, **k):
        seen.append(str(device))
        raise Reached

    monkeypatch.setattr(policies_mod, "build_policy", build_policy)
    monkeypatch.setattr(import_module("varbench.app.cmd_foundation"), "check_device",
                        check_device)
    monkeypatch.setattr(loop_mod, "train", train)
    monkeypatch.setattr(validate_mod, "run_validation", run_validation)
    monkeypatch.setattr(check_mod, "check_estimator", check_estimator)
    return seen


SUITE = """
[suite]
name = "dev"
[[cases]]
name = "c"
kind = "{kind}"
{body}
"""

KIND_BODY = {"proxy": 'preset = "micro"', "variance": 'preset = "micro"',
             "cancellation": 'preset = "micro"', "train": 'policy = "micro"',
             "validate": "reduced = true", "check": 'estimator = "centered"'}


def _commands(tmp_path) -> dict[str, list[str]]:
    out = str(tmp_path / "out")
    return {
        "proxy": ["proxy", "--out", out], "variance": ["variance", "--out", out],
        "cancellation": ["cancellation", "--out", out], "train": ["train", "--out", out],
        "validate": ["validate", "--out", out, "--reduced"], "sample": ["sample"],
        "warmstart": ["warmstart"], "check": ["check", "centered"],
    }


@pytest.mark.parametrize("available,want", [(True, "cuda"), (False, "cpu")])
def test_commands_default_to_cuda_when_available(tmp_path, monkeypatch, record, available,
                                                 want):
    """Regression: no analysis command accepted a device and one GPU meant the CPU."""
    _fake_cuda(monkeypatch, available)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # validate --threads
    for name, argv in _commands(tmp_path).items():
        record.clear()
        with pytest.raises(Reached):
            main(argv)
        assert record == [want], name
        record.clear()
        with pytest.raises(Reached):
            main([*argv, "--device", "cpu"])
        assert record == ["cpu"], name


@pytest.mark.parametrize("kind", sorted(KIND_BODY))
def test_suite_kinds_default_to_cuda_when_available(tmp_path, monkeypatch, record, kind):
    from varbench.app.runner import run_suite
    from varbench.app.suite import load_suite

    _fake_cuda(monkeypatch, True)
    path = tmp_path / "s.toml"
    path.write_text(SUITE.format(kind=kind, body=KIND_BODY[kind]))
    case = load_suite(path).cases[0]
    assert case.config()["placement"]["device"] == "cuda"
    with pytest.raises(Reached):
        executors.KINDS[kind].execute(case.name, case.params, tmp_path / "w", False)
    assert record == ["cuda"]
    record.clear()
    with pytest.raises(Reached):  # `varbench run --device cpu`: every case that names none
        run_suite(path, tmp_path / "out", device="cpu")
    assert record == ["cpu"]
    cpu_case = load_suite(path, device="cpu").cases[0]
    assert cpu_case.config()["placement"]["device"] == "cpu"
    assert cpu_case.key != case.key  # a CPU result never answers for a CUDA one


def test_train_config_file_device_is_kept(tmp_path, monkeypatch, record):
    _fake_cuda(monkeypatch, True)
    cfg = tmp_path / "run.toml"
    cfg.write_text('device = "cpu"\n')
    with pytest.raises(Reached):
        main(["train", "--out", str(tmp_path / "o"), "--config", str(cfg)])
    assert record == ["cpu"]
    cfg.write_text("lr = 0.001\n")  # a file that names no device: the default
    record.clear()
    with pytest.raises(Reached):
        main(["train", "--out", str(tmp_path / "o"), "--config", str(cfg)])
    assert record == ["cuda"]


def test_one_rank_model_moves_to_the_resolved_device(monkeypatch):
    """Regression: models moved to the GPU only under NCCL with more than one rank. Here the
    policy builder receives the resolved device with one rank (world size 1)."""
    from importlib import import_module

    policies_mod = import_module("varbench.train.policies")
    seen = []
    real = policies_mod.build_policy

    def build(spec, **kw):
        seen.append(kw["device"])
        return real(spec, **kw)

    monkeypatch.setattr(policies_mod, "build_policy", build)
    pols = executors._ranked_states("micro", ["random"], None, 0, False, device="cpu",
                                    dtype="auto", trust_remote_code=False,
                                    add_task_tokens=False)
    assert seen == [torch.device("cpu")]
    assert next(iter(pols.values())).device == torch.device("cpu")
