"""varbench.train.policies: the one policy builder (a preset at random init or warm-started on
a task, or a local checkpoint directory) and its refusals."""

from __future__ import annotations

import pytest
import torch

from varbench._util.checks import UsageError
from varbench.models import build_preset, load_policy, save_policy
from varbench.tasks import get_task
from varbench.train import warmstart
from varbench.train.policies import build_policy, is_checkpoint_dir

pytestmark = pytest.mark.usefixtures("one_thread")


def _same_weights(a, b) -> bool:
    sa, sb = a.model.state_dict(), b.model.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_preset_at_random_init():
    p = build_policy("micro", seed=3)
    assert p.name == "micro" and _same_weights(p, build_preset("micro", seed=3))
    assert not _same_weights(p, build_preset("micro", seed=4))
    q = build_policy("micro", seed=3, dtype=torch.float64, device="cpu")
    assert next(q.model.parameters()).dtype == torch.float64


@pytest.fixture
def warm_calls(monkeypatch):
    """warm_start replaced by a spy (the real one trains for seconds; tested on its own)."""
    calls = []

    def spy(preset, task, *, seed, progress, add_task_tokens=False, trust_remote_code=False):
        calls.append({"preset": preset, "task": task, "seed": seed, "progress": progress})
        if preset not in ("micro", "tiny", "small"):
            return load_policy(preset)
        return build_preset(preset, seed=100 + seed)

    monkeypatch.setattr(warmstart, "warm_start", spy)
    return calls


def test_preset_warm_started_on_a_task(warm_calls):
    task = get_task("sort", n=2)
    p = build_policy("micro", task=task, warm=True, seed=2, progress=False)
    assert warm_calls == [{"preset": "micro", "task": task, "seed": 2, "progress": False}]
    assert _same_weights(p, build_preset("micro", seed=102))
    build_policy("micro", task=task, warm=True, seed=2, warm_seed=7, dtype=torch.float64)
    assert warm_calls[-1]["seed"] == 7  # warm_seed picks the warm start, not seed
    with pytest.raises(UsageError, match="warm-starting policy 'micro' needs a task"):
        build_policy("micro", warm=True)


def test_checkpoint_directory(tmp_path, warm_calls):
    saved = build_preset("micro", seed=5)
    ck = save_policy(saved, tmp_path / "ck")
    assert is_checkpoint_dir(ck) and is_checkpoint_dir(str(ck))
    p = build_policy(str(ck))
    assert _same_weights(p, saved)
    assert next(build_policy(ck, dtype=torch.float64).model.parameters()).dtype == torch.float64
    # a checkpoint directory warm-starts like a preset (from its own weights)
    task = get_task("sort")
    build_policy(ck, task=task, warm=True, seed=3)
    assert warm_calls == [{"preset": str(ck), "task": task, "seed": 3, "progress": None}]
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    for not_ck in (tmp_path / "empty", tmp_path / "file", tmp_path / "absent"):
        assert not is_checkpoint_dir(not_ck)


def test_bad_spec_names_the_presets_and_checkpoints(tmp_path):
    (tmp_path / "empty").mkdir()
    for bad in ("nope", str(tmp_path / "empty")):
        with pytest.raises(UsageError, match=r"policy='.*' is not valid; choose a preset "
                                             r"\[.*'micro'.*\] or a local checkpoint directory "
                                             r"containing config\.json"):
            build_policy(bad)


def test_every_route_refuses_a_non_policy_with_the_one_message(tmp_path, capsys):
    """The loader, the builder, the warm start and the CLI (train's --policy, warmstart's) all
    raise models.presets.not_a_policy: the same text, only the argument's name differs."""
    from varbench.app.cli import main
    from varbench.models import load_policy
    from varbench.models.presets import not_a_policy
    from varbench.tasks import get_task
    from varbench.train.policies import check_policy_spec
    from varbench.train.warmstart import warm_start

    bad = str(tmp_path / "absent")
    want = str(not_a_policy("ARG", bad)).removeprefix("ARG")
    seen = {}
    for arg, call in (("policy", lambda: load_policy(bad)),
                      ("policy", lambda: build_policy(bad)),
                      ("--policy", lambda: check_policy_spec(bad, arg="--policy")),
                      ("preset", lambda: warm_start(bad, get_task("sort", n=3)))):
        with pytest.raises(UsageError) as err:
            call()
        seen[arg] = str(err.value)
        assert str(err.value) == arg + want
    assert len(seen) == 3
    for argv in (["warmstart", "--task", "sort", "--policy", bad],
                 ["validate", "--policy", bad, "--out", str(tmp_path / "run")]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        assert "--policy" + want in capsys.readouterr().err, argv
