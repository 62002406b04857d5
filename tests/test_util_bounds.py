"""varbench._util.bounds: one declaration of every numeric knob's bounds, read by the command
line, the suite schema, TrainConfig and the library entry points; a memory estimate refuses a
rollout that cannot fit before any model call (issue 32 point 3)."""

from __future__ import annotations

import math

import pytest

from varbench._util import bounds
from varbench._util.bounds import KNOBS, Bound, check_knob, check_memory
from varbench._util.checks import UsageError, UsageTypeError
from varbench.app.cli import main


def test_bound_admits_its_type_and_range_only():
    b = Bound(int, 1, 8)
    assert [b.admits(v) for v in (1, 8, 0, 9, 2.0, True, "2")] == [True, True] + [False] * 5
    f = Bound(float, 0, 1, lo_open=True)
    assert [f.admits(v) for v in (1, 0.5, 0, math.nan, math.inf, -math.inf)] == \
        [True, True, False, False, False, False]
    assert b.describe() == "an integer >= 1 and <= 8"
    assert f.describe() == "a finite number in (0, 1]"
    with pytest.raises(UsageError, match=r"^G=9 is too large; expected an integer >= 1 and <= 8$"):
        b.check("G", 9)
    with pytest.raises(UsageTypeError, match=r"^G=2.5 is not valid"):
        b.check("G", 2.5)
    assert check_knob("G", 4, minimum=2) == 4
    with pytest.raises(UsageError, match=r"Gs=1 is not valid; expected an integer >= 2"):
        check_knob("G", 1, arg="Gs", minimum=2)  # a tighter minimum, never a looser one
    assert check_knob("G", 1, minimum=0) == 1 and KNOBS["G"].lo == 1


def test_every_float_knob_refuses_nan_and_inf():
    for key, b in KNOBS.items():
        if b.kind is float:
            for bad in (math.nan, math.inf, -math.inf):
                with pytest.raises(UsageError, match=f"^{key}="):
                    check_knob(key, bad)


def _suite_error(tmp_path, body: str) -> str:
    from varbench.app.suite import load_suite

    p = tmp_path / "s.toml"
    p.write_text(f'[suite]\nname = "b"\n[[cases]]\nname = "c"\n{body}\n')
    with pytest.raises(UsageError) as err:
        load_suite(p)
    return str(err.value)


def test_the_declaration_is_the_one_every_door_reads(tmp_path, monkeypatch):
    """Tightening G's bound in the declaration tightens the suite schema, TrainConfig, the
    library and the command line alike: no second table anywhere."""
    from varbench.testing.check import check_estimator
    from varbench.train import TrainConfig

    monkeypatch.setitem(KNOBS, "G", Bound(int, 1, 10))
    assert "expected an integer >= 1 and <= 10" in _suite_error(
        tmp_path, 'kind = "check"\nestimator = "centered"\nG = 11')
    with pytest.raises(UsageError, match=r"G=11 is too large; expected an integer >= 1 and <= 10"):
        TrainConfig(G=11)
    with pytest.raises(UsageError, match=r"^G=11 is too large"):
        check_estimator("centered", G=11)
    assert main(["check", "centered", "-G", "11"]) == 2


@pytest.mark.parametrize("argv,words", [
    (["sample", "-G", "10000000"], "-G=10000000 is too large"),
    (["sample", "--temperature", "inf"], "--temperature=inf is not valid"),
    (["sample", "--seed", "-1"], "--seed=-1 is not valid"),
    (["sample", "--device", "meta"], "--device='meta' is not valid"),
    (["check", "centered", "--steps", "1000000000000"], "--steps=1000000000000 is too large"),
    (["check", "centered", "--alpha", "nan"], "--alpha=nan is not valid"),
    (["train", "-G", "1000000000", "--out", "OUT"], "-G=1000000000 is too large"),
    (["train", "--temperature", "inf", "--out", "OUT"], "--temperature=inf is not valid"),
    (["train", "--seed", "-3", "--out", "OUT"], "--seed=-3 is not valid"),
    (["train", "--device", "meta", "--steps", "1", "--out", "OUT"], "'meta' is not valid"),
    (["warmstart", "--max-steps", "0"], "--max-steps=0 is not valid"),
    (["compare", "a", "b", "--tolerance", "inf"], "--tolerance=inf is not valid"),
])
def test_flags_refused_before_work_in_one_line(tmp_path, capsys, argv, words):
    argv = [str(tmp_path / "o") if a == "OUT" else a for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()  # refused before any work


def test_library_entry_points_read_the_same_bounds():
    import varbench as vb

    pol, task = vb.build_policy("micro"), vb.get_task("sort", n=2)
    prompts = task.prompts(1)
    cases = [
        (lambda: vb.TrainConfig(G=10**12), r"G=1000000000000 is too large"),
        (lambda: vb.TrainConfig(temperature=math.inf), r"temperature=inf is not valid"),
        (lambda: vb.TrainConfig(seed=-1), r"seed=-1 is not valid"),
        (lambda: vb.train(vb.TrainConfig(device="meta", policy="micro", steps=1)),
         r"device='meta' is not valid"),
        (lambda: vb.estimator_variance(pol, task, M=10**12), r"M=1000000000000 is too large"),
        (lambda: vb.estimator_variance(pol, task, level=math.nan), r"level=nan is not valid"),
        (lambda: vb.estimator_variance(pol, task, n_boot=0), r"n_boot=0 is not valid"),
        (lambda: vb.sample(pol, task, prompts, 2, temperature=math.inf), r"temperature=inf"),
        (lambda: vb.sample(pol, task, prompts, 2, top_p=math.nan), r"top_p=nan"),
        (lambda: vb.sample(pol, task, prompts, 2, seed=-1), r"seed=-1 is not valid"),
        (lambda: vb.proxy_correlation(pol, task, G=10**9), r"G=1000000000 is too large"),
        (lambda: vb.cancellation(pol, [task], lr=math.inf), r"lr=inf is not valid"),
        (lambda: vb.check_estimator("centered", num_steps=10**12), r"num_steps=10+ is too"),
    ]
    for call, words in cases:
        with pytest.raises(UsageError, match=words):
            call()


def test_memory_estimate_refuses_what_cannot_fit(tmp_path, monkeypatch):
    """A size within its bound that this machine's memory cannot hold is refused before any
    model call, naming the argument, the value, the estimate and the limit."""
    import varbench as vb
    from varbench.rollout import sampler

    pol, task = vb.build_policy("micro"), vb.get_task("sort", n=2)
    monkeypatch.setattr(bounds, "memory_limit", lambda device="cpu": (1 << 20, "test RAM"))
    calls = []
    monkeypatch.setattr(sampler, "_stepper", lambda model: calls.append(1))
    with pytest.raises(UsageError, match=r"^G=4096 needs at least .* GiB \(P=2 prompts x "
                       r"G=4096 responses.*more than test RAM \(0.000977 GiB\)"):
        vb.sample(pol, task, task.prompts(2), 4096)
    assert calls == []
    with pytest.raises(UsageError, match=r"G=4096 needs at least"):
        vb.train(vb.TrainConfig(policy="micro", warm_start=False, G=4096, steps=1,
                                eval_prompts=1, eval_samples=1), tmp_path / "run")
    assert not (tmp_path / "run" / "records.csv").exists()
    assert main(["sample", "--policy", "micro", "-G", "4096"]) == 2
    check_memory("G", 4, 1 << 19)  # fits: nothing said
    monkeypatch.setattr(bounds, "memory_limit", lambda device="cpu": (0, "unknown"))
    check_memory("G", 4, 1e30)  # an unknown limit refuses nothing


def test_memory_limit_is_this_machines():
    n, where = bounds.memory_limit("cpu")
    assert n > 1 << 26 and where == "this machine's RAM"
