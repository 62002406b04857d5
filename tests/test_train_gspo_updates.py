"""Issue 31 point 1 (GSPO arms): with one update per step the sequence ratio is exactly 1 and
nothing clips; with several updates per batch (epochs x minibatches > 1) the later updates are
off-policy, the ratio departs from 1 and the GSPO clip range acts."""

from __future__ import annotations

import pytest
import torch

from varbench.train.config import TrainConfig
from varbench.train.loop import train

# random-init micro policy, no warm start: a second per run; sort with the positional reward
# (partial credit), so a random policy's groups have non-zero advantages
GSPO = dict(policy="micro", warm_start=False, task="sort", reward="positional",
            scheme="normalized", G=4, prompts_per_step=4, steps=6, eval_every=4,
            eval_prompts=4, eval_samples=1,
            lr=1e-2, ratio="sequence", agg="seq-mean-token-mean", clip_low=3e-4,
            clip_high=4e-4, seed=0)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_one_update_per_step_has_ratio_one_and_no_clipping():
    df = train(TrainConfig(**GSPO), progress=False).records.iloc[1:]
    assert (df["grad/norm"] > 0).sum() >= 2  # the policy did move between steps
    assert (df["ppo/clip_frac"] == 0).all()
    assert df["ppo/approx_kl"].abs().max() < 1e-6  # log r = 0 up to float32 rounding


@pytest.mark.parametrize("updates", [dict(minibatches=2), dict(epochs=2),
                                     dict(epochs=2, minibatches=2)])
@pytest.mark.parametrize("transform", ["none", "min_replace", "adv_orthogonal"])
def test_several_updates_per_batch_move_the_ratio_and_clip(updates, transform):
    df = train(TrainConfig(**GSPO, **updates, transform=transform),
               progress=False).records.iloc[1:]
    # averaged over the step's updates: the first is on-policy (ratio 1), the later ones not
    assert (df["grad/norm"] > 0).sum() >= 2
    assert (df["ppo/clip_frac"] > 0).any(), df["ppo/clip_frac"].tolist()
    assert df["ppo/approx_kl"].abs().max() > 1e-5
