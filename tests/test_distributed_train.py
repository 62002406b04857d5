"""`train` under torchrun: 2 gloo ranks (each step's 3 groups split 2/1, a one-group minibatch
leaving rank 1 without rows) equal one process in float64, straight and resumed from a
checkpoint; `update_forward='sampler'` is refused with several ranks (library and CLI); a rank
failing inside `distributed.each_rank_alone` stops the other instead of leaving it waiting."""

from __future__ import annotations

import pickle

import pandas as pd
import torch
from _fixtures_distributed import torchrun

from varbench.app.cli import main
from varbench.grads.precision import exact_float64
from varbench.models import Policy, build_preset
from varbench.train.config import TrainConfig
from varbench.train.loop import train
from varbench.train.records import TIMING_FIELDS, read_records

# P = 3 groups (rank 0: groups 0 and 2, rank 1: group 1); 2 epochs x 2 minibatches of 2 and 1
# groups (in the 1-group minibatch rank 1 has nothing: its gradient share is zero); a KL term
# (the frozen reference's and pi_old's log-probs sharded too); evaluations by rank 0 only.
# Seed 0: every step has nonzero advantages. A step without any has only the KL term's
# gradient at pi_old = ref, rounding noise that Adam scales up by 1/eps: two exact ways of
# computing it would then differ by more than rounding.
CFG = dict(policy="micro", warm_start=False, G=4, prompts_per_step=3, steps=3, lr=3e-3,
           reward="positional", dtype="float64", eval_every=2, eval_prompts=2, eval_samples=2,
           seed=0, epochs=2, minibatches=2, kl_coef=0.05, checkpoint_every=1)

SCRIPT = """
import dataclasses, pickle, sys
import torch
from varbench._util.checks import UsageError
from varbench._util.distributed import each_rank_alone, init_from_env, rank_world, shutdown
from varbench.grads.precision import exact_float64
from varbench.models import Policy, build_preset
from varbench.train.config import TrainConfig
from varbench.train.loop import train

def policy():
    micro = build_preset("micro", seed=1)
    return Policy(model=exact_float64(micro.model), tokenizer=micro.tokenizer, name="micro")

out = sys.argv[1]
rank, world = init_from_env()
assert world == 2
cfg = TrainConfig(**%r)
full = train(cfg, out + "/full", policy=policy(), progress=False)
train(dataclasses.replace(cfg, steps=2), out + "/resumed", policy=policy(), progress=False)
resumed = train(cfg, out + "/resumed", policy=policy(), resume=True, progress=False)
try:
    train(dataclasses.replace(cfg, update_forward="sampler", epochs=1, minibatches=1),
          policy=policy(), progress=False)
    refusal = None
except UsageError as err:
    refusal = str(err)
def alone(r, w):  # distributed.each_rank_alone: rank 0 fails, rank 1 must not wait for it
    assert rank_world() == (0, 1)  # inside: no collectives
    if r == 0:
        raise ValueError("rank zero broke")
    return r
try:
    each_rank_alone(alone)
    failed = None
except Exception as err:
    failed = f"{type(err).__name__}: {err}"
params = lambda res: {n: p.detach().clone() for n, p in res.policy.model.named_parameters()}
pickle.dump({"full": full.records, "resumed": resumed.records, "params": params(full),
             "resumed_params": params(resumed), "refusal": refusal, "failed": failed},
            open(f"{out}/rank{rank}.pkl", "wb"))
shutdown()
"""


def _policy() -> Policy:
    micro = build_preset("micro", seed=1)
    # float64 throughout (transformers' RMSNorm would round to float32 inside a .double() model)
    return Policy(model=exact_float64(micro.model), tokenizer=micro.tokenizer, name="micro")


def _no_time(df: pd.DataFrame) -> pd.DataFrame:
    return df.drop(columns=list(TIMING_FIELDS)).reset_index(drop=True)


def test_two_gloo_ranks_train_as_one_process_in_float64(tmp_path):
    """Tolerance 1e-9 relative + 1e-12 absolute (records and parameters): float64 rounding of
    the forward split over two ranks and of the summed gradient shares, amplified at most by
    Adam's normalisation over three steps (the tolerance of the loop's slow-reference test)."""
    script = tmp_path / "dp_train.py"
    script.write_text(SCRIPT % (CFG,))
    torchrun([str(script), str(tmp_path)], timeout=600)
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks
    try:
        single = train(TrainConfig(**CFG), tmp_path / "single", policy=_policy(), progress=False)
    finally:
        torch.set_num_threads(n)
    want = _no_time(single.records)
    # every step learned from its advantages; KL(pi_old || ref) is exactly 0 at step 1 (pi_old
    # is the reference), positive after
    assert want["adv/abs_mean"].iloc[1:].gt(0).all() and want["grad/norm"].iloc[1:].gt(0.1).all()
    assert want["policy/kl_ref"].iloc[1] == 0 and want["policy/kl_ref"].iloc[2:].gt(0).all()
    assert want["eval/acc_sampled"].notna().sum() == 3  # steps 0, 2 and 3 evaluated
    start = dict(_policy().model.named_parameters())
    moved = max(float((p.detach() - start[n].detach()).abs().max())
                for n, p in single.policy.model.named_parameters())
    assert moved > 1e-4  # the parameters really moved: not start vs start
    close = dict(check_exact=False, rtol=1e-9, atol=1e-12)
    for rank in (0, 1):
        got = pickle.loads((tmp_path / f"rank{rank}.pkl").read_bytes())
        for key in ("full", "resumed"):  # every rank returns rank 0's records
            pd.testing.assert_frame_equal(_no_time(got[key]), want, **close, obj=f"{key}{rank}")
        for key in ("params", "resumed_params"):
            for name, p in single.policy.model.named_parameters():
                torch.testing.assert_close(got[key][name], p.detach(), rtol=1e-9, atol=1e-12,
                                           msg=f"{key} {name} rank {rank}")
        assert "update_forward='sampler'" in got["refusal"] and "2 ranks" in got["refusal"]
        # each_rank_alone: the failing rank raises its own error, the other names it
        assert got["failed"] == ("ValueError: rank zero broke" if rank == 0 else
                                 "UsageError: 1 other rank(s) failed (rank 0: ValueError: rank "
                                 "zero broke); what every rank finished is kept, rerun the "
                                 "same command to resume")
    for run in ("full", "resumed"):  # rank 0 wrote the records, once
        pd.testing.assert_frame_equal(_no_time(read_records(tmp_path / run / "records.csv")),
                                      want, **close)


def test_cli_train_on_two_ranks_writes_once_and_refuses_an_existing_run(tmp_path):
    out = tmp_path / "out"
    argv = ["-m", "varbench", "train", "--policy", "micro", "--no-warm-start", "--steps", "2",
            "-G", "2", "--prompts-per-step", "3", "--eval-prompts", "2", "--eval-samples", "1",
            "--out", str(out)]
    res = torchrun(argv)
    assert res.stdout.count("held-out accuracy (sampled)") == 1  # rank 0 prints
    records = read_records(out / "records.csv")
    assert list(records["step"]) == [0, 1, 2] and records["grad/norm"].iloc[1:].notna().all()
    again = torchrun(argv, ok=False)  # refused by rank 0, on every rank, nothing replaced
    assert again.returncode != 0 and "already holds a run" in again.stderr
    pd.testing.assert_frame_equal(read_records(out / "records.csv"), records)


def test_cli_refuses_sampler_forward_with_several_ranks_before_joining(tmp_path, monkeypatch,
                                                                        capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")  # no MASTER_ADDR: joining would fail, not refuse
    out = tmp_path / "out"
    assert main(["train", "--out", str(out), "--policy", "micro", "--no-warm-start",
                 "--update-forward", "sampler"]) == 2
    err = capsys.readouterr().err
    assert "update_forward='sampler'" in err and "2 ranks" in err
    assert not out.exists()


def test_sampler_forward_still_trains_in_one_process():
    """The refusal is for several ranks only: in one process (world 1) the sampler's own
    forward trains as before."""
    cfg = TrainConfig(**{**CFG, "checkpoint_every": 0, "epochs": 1,
                         "minibatches": 1, "kl_coef": 0.0}, update_forward="sampler")
    res = train(cfg, policy=_policy(), progress=False)
    assert len(res.records) == 4 and res.records["grad/norm"].iloc[1:].gt(0).any()
