"""varbench against the real TRL 1.16.0: real GRPOTrainer runs on the CPU with varbench's
callback (fp32, bf16, LoRA; the variance record against an offline measurement of the same
batch and weights; TensorBoard), TRL's group-scaled advantages against varbench's schemes, and
the subclass hook that puts varbench's advantages (OTB included) into TRL."""

from __future__ import annotations

import types

import pytest
import torch
from _fixtures_peers import TRL_LOSSES, rel_diff, require, trl_loss_case

trl = require("trl")
datasets = require("datasets")

import varbench.estimators as E  # noqa: E402
from varbench._util.checks import UsageError  # noqa: E402
from varbench.grads.stats import forward_stats  # noqa: E402
from varbench.integrations.trl import VarbenchCallback, with_varbench_advantages  # noqa: E402
from varbench.models import build_preset  # noqa: E402
from varbench.models.logits import token_logprobs  # noqa: E402
from varbench.report import write_report  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _reward(completions, **kwargs):
    return [float(c.count("1")) - 0.5 * float(c.count("2")) + 0.1 * len(c)
            for c in completions]


def _trainer(tmp_path, cls=None, scale_rewards="group", steps=2, model=None, reward=_reward,
             **config):
    policy = build_preset("micro", seed=0)
    tok = policy.tokenizer
    ds = datasets.Dataset.from_dict({"prompt": ["<sort>3,1,2", "<add>1+2=", "<sort>2,2,1",
                                                "<sum>4:"] * 4})
    config = {"per_device_train_batch_size": 8, "report_to": [], **config}
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), num_generations=4, max_completion_length=6,
        max_steps=steps, learning_rate=1e-3, logging_steps=1, save_strategy="no",
        use_cpu=True, seed=0, scale_rewards=scale_rewards, temperature=1.0,
        dataloader_num_workers=0, **config,
    )
    cls = cls or trl.GRPOTrainer
    return cls(model=model if model is not None else policy.model, reward_funcs=reward,
               args=args, train_dataset=ds, processing_class=tok)


class _Keep:
    """Wraps the callback's measurement to keep, for the first measured batch, TRL's batch
    dict and a copy of the trainable weights at that moment (for the offline reference)."""

    def __init__(self, cb):
        self.out, self.weights = None, None
        real = cb._measure

        def measure(out):
            if self.out is None:
                self.out = {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v)
                            for k, v in out.items()}
                self.weights = {n: p.detach().clone()
                                for n, p in cb._trainer.model.named_parameters()}
            real(out)
        cb._measure = measure


def _offline_diff(model, out, loss_type: str, *, max_len: int = 6, items: float | None = None,
                  K: int = 1) -> list[torch.Tensor]:
    """``w_1 g_1 - w_2 g_2`` of one process's batch by varbench's own formulas on a model with
    the measured weights (float64): TRL's documented normalisers (grpo: mean over rows of the
    row's token mean; bnpo/dapo: token sum over ``items``, the used tokens of every process;
    dr_grpo: token sum over rows x max_completion_length), ratio 1, no KL, averaged over ``K``
    processes as DDP averages."""
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attn = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    m = out["completion_mask"].double()
    A = out["advantages"].double()
    B, T = m.shape
    Lp = out["prompt_ids"].shape[1]
    params = [p for p in model.parameters() if p.requires_grad]
    n = B // 2
    N = float(m.sum()) if items is None else items
    grads = []
    for rows in (slice(0, n), slice(n, B)):
        logits = model(input_ids=ids[rows], attention_mask=attn[rows]).logits.double()
        logp = token_logprobs(logits, ids[rows])[:, Lp:]
        term = -A[rows, None] * logp * m[rows]
        if loss_type == "grpo":
            loss = (term.sum(1) / m[rows].sum(1).clamp(min=1)).sum() / B  # w = 1/2 of a mean
        elif loss_type == "bnpo":
            loss = term.sum() / m.sum()
        elif loss_type == "dapo":
            loss = term.sum() / (N / K)
        else:  # dr_grpo
            loss = term.sum() / (B * max_len)
        grads.append(torch.autograd.grad(loss / K, params))
    return [a - b for a, b in zip(*grads, strict=True)]


def _offline_variance(model, out, loss_type: str, max_len: int = 6) -> float:
    """Split-half variance ``||w_1 g_1 - w_2 g_2||^2`` of one process's batch, offline."""
    return sum(float(d.pow(2).sum()) for d in _offline_diff(model, out, loss_type,
                                                            max_len=max_len))


def _measured_and_offline(tmp_path, loss_type: str, **config) -> tuple[dict, float]:
    """(the callback's grad_var_split record of a one-step run, the float64 offline value of
    the same batch and weights)."""
    trainer = _trainer(tmp_path, steps=1, loss_type=loss_type, **config)
    cb = VarbenchCallback(every=1, measures=("variance",))
    keep = _Keep(cb.attach(trainer))
    trainer.train()
    (rec,) = [r for r in cb.records if r["metric"] == "grad_var_split"]
    ref = build_preset("micro", seed=0, dtype=torch.float64).model
    ref.load_state_dict({k: v.double() for k, v in keep.weights.items()})
    return rec, _offline_variance(ref, keep.out, loss_type)


def test_grpo_trainer_run_with_varbench_callback_renders_a_report(tmp_path):
    trainer = _trainer(tmp_path)
    cb = VarbenchCallback(every=1, proxy_rows=3,
                          measures=("counts", "cancellation", "variance", "proxy_seq", "proxy"))
    cb.attach(trainer)
    trainer.train()
    metrics = {r["metric"] for r in cb.records}
    assert {"groups", "all_agree_groups", "nonzero_raw", "nonzero_centered", "grad_var_split",
            "grad_sq_batch", "proxy_exact_corr", "proxy_seq_spearman",
            "proxy_seq_scale"} <= metrics, metrics
    assert {r["step"] for r in cb.records} == {1, 2}
    assert {r["generation"] for r in cb.records} == {1, 2}
    by = {(r["step"], r["metric"]): r for r in cb.records}
    assert by[(1, "groups")]["value"] == 2 and by[(1, "responses")]["value"] == 8
    assert by[(1, "grad_var_split")]["value"] > 0  # was 0.0 in fp32 (a copy without grads)
    assert by[(1, "grad_var_split")]["params"] == sum(p.numel()
                                                      for p in trainer.model.parameters())
    assert -1 <= by[(1, "proxy_exact_corr")]["value"] <= 1
    logged = [h for h in trainer.state.log_history if "varbench/grad_var_split" in h]
    assert len(logged) == 2  # through trainer.log, beside TRL's own metrics
    assert all(p.grad is None or True for p in trainer.model.parameters())
    res = cb.result()
    assert res.config["loss_type"] == trainer.loss_type and res.config["generations"] == 2
    out = write_report([res], tmp_path / "report")
    text = (out / "report.md").read_text()
    assert "grad_var_split" in text and "trl run" in text
    (fig,) = (out / "figures").glob("*in_run.png")
    assert fig.name in text and fig.stat().st_size > 0


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "bnpo", "dr_grpo"])
def test_callback_variance_equals_an_offline_measurement_fp32(tmp_path, loss_type):
    """The record of the first batch = the split-half variance computed offline, by varbench's
    formulas in float64, on the same batch and the weights that generated it."""
    rec, want = _measured_and_offline(tmp_path, loss_type, bf16=False)
    assert rec["dtype"] == "torch.float32" and rec["loss_type"] == loss_type
    assert want > 0
    assert abs(rec["value"] - want) <= 1e-5 * want  # float32 arithmetic against float64


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_halves_run_in_trls_micro_batches(tmp_path, loss_type):
    """A generation batch 4x TRL's micro-batch (per_device_train_batch_size=2,
    steps_per_generation=4): each half runs 2 rows per forward+backward, never more, and the
    record still equals the offline value of the whole batch."""
    import trl as _trl

    sizes = []
    real = _trl.GRPOTrainer._compute_loss

    def spy(self, model, inputs):
        sizes.append(inputs["completion_ids"].shape[0])
        return real(self, model, inputs)

    orig = _trl.GRPOTrainer._compute_loss
    _trl.GRPOTrainer._compute_loss = spy
    try:
        rec, want = _measured_and_offline(tmp_path, loss_type, bf16=False,
                                          per_device_train_batch_size=2, steps_per_generation=4)
    finally:
        _trl.GRPOTrainer._compute_loss = orig
    assert sizes and max(sizes) == 2
    assert abs(rec["value"] - want) <= 1e-5 * want


def test_callback_variance_in_bf16_tracks_the_fp32_measurement(tmp_path):
    """bf16=True: measured in what TRL trains in (its autocast forward), near the float64
    offline value within bf16's rounding (unit roundoff 2^-8 = 3.9e-3; measured 3.0e-3)."""
    rec, want = _measured_and_offline(tmp_path, "grpo", bf16=True)
    assert rec["value"] > 0
    assert abs(rec["value"] - want) <= 1e-2 * want


def test_callback_variance_in_fp16_tracks_the_fp32_measurement(tmp_path):
    """fp16=True: within fp16's rounding of the float64 offline value (unit roundoff 2^-11).
    On the CPU accelerate sets no loss scaler and its forward stays float32 (measured 1.1e-7),
    so this checks the callback under TRL's fp16 setting; fp16 arithmetic and the scaler's
    scale (split_variance multiplies by it) are exercised only on a GPU."""
    assert _trainer(tmp_path / "probe", steps=1, bf16=False,
                    fp16=True).accelerator.mixed_precision == "fp16"
    rec, want = _measured_and_offline(tmp_path, "grpo", bf16=False, fp16=True)
    print(f"fp16 rel err {abs(rec['value'] - want) / want:.2e}")
    assert rec["value"] > 0
    assert abs(rec["value"] - want) <= 5e-3 * want


def test_callback_on_a_lora_model_measures_the_adapters_only(tmp_path):
    peft = require("peft")
    base = build_preset("micro", seed=0).model
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8,
                                                       target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # B != 0, so the A factors get gradients too
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
    trainer = _trainer(tmp_path, steps=1, bf16=True, model=model, loss_type="grpo")
    cb = VarbenchCallback(every=1, measures=("variance", "proxy_seq"))
    keep = _Keep(cb.attach(trainer))
    trainer.train()
    (rec,) = [r for r in cb.records if r["metric"] == "grad_var_split"]
    assert {"proxy_seq_spearman", "proxy_seq_scale"} <= {r["metric"] for r in cb.records}
    lora = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    assert rec["params"] == sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    ref = peft.get_peft_model(build_preset("micro", seed=0).model,
                              peft.LoraConfig(r=4, lora_alpha=8,
                                              target_modules=["q_proj", "v_proj"]))
    ref.load_state_dict(keep.weights, strict=True)
    ref = ref.double()
    want = _offline_variance(ref, keep.out, "grpo")
    assert rec["value"] > 0
    assert abs(rec["value"] - want) <= 1e-2 * want


def test_callback_counts_each_generation_batch_once(tmp_path):
    """steps_per_generation=2: one batch feeds two optimizer steps; one record set per batch,
    tagged with its generation and the first step that uses it."""
    trainer = _trainer(tmp_path, steps=4, per_device_train_batch_size=4, steps_per_generation=2)
    cb = VarbenchCallback(every=1, measures=("counts", "variance")).attach(trainer)
    trainer.train()
    var = [r for r in cb.records if r["metric"] == "grad_var_split"]
    assert [r["generation"] for r in var] == [1, 2] and [r["step"] for r in var] == [1, 3]
    cb2 = VarbenchCallback(every=2, measures=("counts",))
    trainer = _trainer(tmp_path / "b", steps=4, per_device_train_batch_size=4,
                       steps_per_generation=2)
    cb2.attach(trainer)
    trainer.train()
    assert {r["generation"] for r in cb2.records} == {1} and cb2.generations == 2
    # num_iterations=2: each batch feeds two optimizer steps (TRL computes its old log-probs
    # at generation, so the measured ratio is exactly 1): one record set per batch
    cb3 = VarbenchCallback(every=1, measures=("counts", "variance"))
    trainer = _trainer(tmp_path / "c", steps=4, num_iterations=2)
    cb3.attach(trainer)
    trainer.train()
    var = [r for r in cb3.records if r["metric"] == "grad_var_split"]
    assert [r["generation"] for r in var] == [1, 2] and [r["step"] for r in var] == [1, 3]
    assert all(r["value"] > 0 for r in var)


def test_callback_metrics_reach_a_tensorboard_event_file(tmp_path, monkeypatch):
    require("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "tb"
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(logdir))
    trainer = _trainer(tmp_path, steps=2, report_to=["tensorboard"])
    cb = VarbenchCallback(every=1, measures=("counts", "variance")).attach(trainer)
    trainer.train()
    files = list(logdir.rglob("events.out.tfevents.*"))
    assert files
    tags = set()
    for f in files:
        acc = EventAccumulator(str(f))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert "train/varbench/grad_var_split" in tags and "train/varbench/groups" in tags, tags
    values = []
    for f in files:
        acc = EventAccumulator(str(f))
        acc.Reload()
        if "train/varbench/grad_var_split" in acc.Tags()["scalars"]:
            values += [e.value for e in acc.Scalars("train/varbench/grad_var_split")]
    recs = [r["value"] for r in cb.records if r["metric"] == "grad_var_split"]
    assert values == pytest.approx(recs, rel=1e-6)  # TensorBoard stores float32


_TWO_RANKS = r"""
import pickle, sys
from pathlib import Path
import torch
import test_peers_trl as t
from varbench.integrations.trl import VarbenchCallback

out = Path(sys.argv[1])
trainer = t._trainer(out, steps=1, bf16=False, loss_type=sys.argv[2])
cb = VarbenchCallback(every=1, measures=("counts", "cancellation", "variance", "proxy_seq"))
keep = t._Keep(cb.attach(trainer))
trainer.train()
rank = trainer.accelerator.process_index
(out / f"rank{rank}.pkl").write_bytes(pickle.dumps(
    {"records": cb.records, "out": keep.out, "weights": keep.weights,
     "last": cb._last, "world": trainer.accelerator.num_processes}))
# a gloo group still alive at interpreter exit can abort the process after its results are out
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
"""


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_callback_under_two_processes_measures_the_global_batch(tmp_path, loss_type):
    """torchrun, 2 gloo ranks, 2 groups each: every rank uses its own rewards (TRL's
    advantages of its rows follow from them), and every rank records the same split variance,
    equal to the offline global one (the ranks' half differences averaged as DDP averages)."""
    import pickle
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANKS)
    tests = str(Path(__file__).resolve().parent)
    root = str(Path(tests).parent)
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{root}:{tests}"}
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", str(script), str(tmp_path), loss_type],
                         env=env, text=True, capture_output=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ranks = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in (0, 1)]
    assert all(r["world"] == 2 for r in ranks)
    for k, r in enumerate(ranks):  # rank k's rewards give TRL's advantages of its rows
        R = r["last"]["rewards"]  # every process's, as TRL gathers them
        B = r["out"]["completion_mask"].shape[0]
        want = E.advantages("normalized", R[k * B:(k + 1) * B].reshape(2, 4).double(),
                            torch.ones(2, 4, 1, dtype=torch.bool), eps=1e-4)[..., 0]
        assert (r["out"]["advantages"].double() - want.reshape(-1)).abs().max() <= 1e-6
    recs = [{(x["metric"]): x["value"] for x in r["records"]} for r in ranks]
    assert recs[0] == recs[1]
    assert recs[0]["groups"] == 4 and recs[0]["responses"] == 16
    # counts summed over ranks, each from its own slice (rank 1 once counted rank 0's)
    assert recs[0]["nonzero_raw"] == int((ranks[0]["last"]["rewards"] != 0).sum())
    ref = build_preset("micro", seed=0, dtype=torch.float64).model
    ref.load_state_dict({k: v.double() for k, v in ranks[0]["weights"].items()})
    items = sum(float(r["out"]["completion_mask"].sum()) for r in ranks)
    diffs = [_offline_diff(ref, r["out"], loss_type, items=items, K=2) for r in ranks]
    want = sum(float((a + b).pow(2).sum()) for a, b in zip(*diffs, strict=True))
    assert want > 0
    print(f"2 ranks {loss_type}: rel err {abs(recs[0]['grad_var_split'] - want) / want:.2e}")
    assert abs(recs[0]["grad_var_split"] - want) <= 1e-5 * want
    assert "proxy_seq_spearman" in recs[0]


def test_callback_refuses_what_it_cannot_measure():
    for bad in ({"every": 0}, {"every": True}, {"measures": ("nope",)}, {"measures": "counts"},
                {"proxy_rows": 0}):
        with pytest.raises(UsageError, match=next(iter(bad))):
            VarbenchCallback(**bad)
    fake = types.SimpleNamespace(
        accelerator=types.SimpleNamespace(num_processes=2), loss_type="grpo", num_generations=4,
        args=types.SimpleNamespace(per_device_train_batch_size=6, steps_per_generation=1))
    with pytest.raises(UsageError, match="whole groups.*6 is not a multiple of num_generations"):
        VarbenchCallback().attach(fake)
    fake.accelerator.num_processes, fake.loss_type = 1, "mystery"
    with pytest.raises(UsageError, match="loss_type='mystery'"):
        VarbenchCallback().attach(fake)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_trl_advantages_of_a_real_run_match_varbench(tmp_path, scale):
    """TRL's advantages of the batch its trainer generated = varbench's scheme on the same
    rewards: group -> normalized(eps=1e-4), batch -> normalized_batch(eps=1e-4), none ->
    centered."""
    trainer = _trainer(tmp_path, scale_rewards=scale, steps=1)
    cb = VarbenchCallback(every=1, measures=("counts",)).attach(trainer)
    trainer.train()
    b = cb._last
    R = b["rewards"].reshape(2, 4).double()
    mask = b["completion_mask"].reshape(2, 4, -1).bool() | True  # TRL: outcome per completion
    scheme, kw = {"group": ("normalized", {"eps": 1e-4}),
                  "batch": ("normalized_batch", {"eps": 1e-4}),
                  "none": ("centered", {})}[scale]
    want = E.advantages(scheme, R, mask, **kw)[..., 0].reshape(-1)
    got = b["advantages"].double()
    assert (got - want).abs().max() <= 4.8e-7 * max(1.0, float(want.abs().max()))


def test_subclass_hook_puts_varbench_advantages_into_trl(tmp_path):
    cls = with_varbench_advantages(trl.GRPOTrainer, "rloo")
    trainer = _trainer(tmp_path, cls=cls, steps=1)
    cb = VarbenchCallback(every=1, measures=("counts",)).attach(trainer)
    trainer.train()
    b = cb._last
    mask = b["completion_mask"].reshape(2, 4, -1)
    want = E.advantages("rloo", b["rewards"].reshape(2, 4).float(), mask)
    assert b["advantages"].shape == mask.reshape(8, -1).shape
    torch.testing.assert_close(b["advantages"].float(), want.reshape(8, -1), rtol=0, atol=0)


class _Spy(trl.GRPOTrainer):
    def _generate_and_score_completions(self, *args, **kwargs):
        out = super()._generate_and_score_completions(*args, **kwargs)
        self.trl_advantages = out["advantages"].clone()
        return out


def _some_unscorable(completions, **kwargs):
    return [None if i % 3 == 0 else v for i, v in enumerate(_reward(completions))]


def test_hook_treats_unscorable_completions_as_trl_does(tmp_path):
    """Every reward function returned None for rows 0, 3, 6: TRL leaves them out of the group
    baseline and gives them advantage 0; the hook with normalized(eps=1e-4) gives TRL's
    own group-scaled advantages on every row."""
    cls = with_varbench_advantages(_Spy, "normalized", eps=1e-4)
    trainer = _trainer(tmp_path, cls=cls, steps=1, reward=_some_unscorable)
    cb = VarbenchCallback(every=1, measures=("counts",)).attach(trainer)
    trainer.train()
    got = cb._last["advantages"]
    assert got.dim() == 2 and torch.isnan(cb._last["rewards"]).sum() == 3
    assert (got[[0, 3, 6]] == 0).all()
    want = trainer.trl_advantages
    assert (got[:, 0].double() - want.double()).abs().max() <= 1e-6


def test_hook_runs_otb_with_token_statistics_from_the_model(tmp_path):
    cls = with_varbench_advantages(trl.GRPOTrainer, "otb")
    trainer = _trainer(tmp_path, cls=cls, steps=1)
    cb = VarbenchCallback(every=1, measures=("counts",)).attach(trainer)
    trainer.train()
    b = cb._last
    ids = torch.cat([b["prompt_ids"], b["completion_ids"]], 1)
    cm = b["completion_mask"]
    resp = torch.cat([torch.zeros_like(b["prompt_mask"]), cm], 1)
    st = forward_stats(build_preset("micro", seed=0, dtype=torch.float64).model, ids, resp,
                       torch.cat([b["prompt_mask"], cm], 1))
    Lp = b["prompt_ids"].shape[1]
    m = cm.reshape(2, 4, -1) != 0
    want = E.advantages("otb", b["rewards"].reshape(2, 4).double(), m,
                        logprobs=st.logp[:, Lp:].reshape(2, 4, -1),
                        sum_pi_sq=st.sum_pi_sq[:, Lp:].reshape(2, 4, -1)).reshape(8, -1)
    got = b["advantages"].double()
    assert got.abs().max() > 0
    assert (got - want).abs().max() <= 1e-5 * max(1.0, float(want.abs().max()))


def test_hook_refuses_up_front(tmp_path):
    with pytest.raises(UsageError, match="foo"):
        with_varbench_advantages(trl.GRPOTrainer, "rloo", foo=1)
    cls = with_varbench_advantages(trl.GRPOTrainer, "otb")
    with pytest.raises(UsageError, match="temperature=0.7"):
        policy = build_preset("micro", seed=0)
        args = trl.GRPOConfig(output_dir=str(tmp_path), num_generations=4, use_cpu=True,
                              per_device_train_batch_size=8, temperature=0.7, report_to=[],
                              max_steps=1)
        cls(model=policy.model, reward_funcs=_reward, args=args, processing_class=policy.tokenizer,
            train_dataset=datasets.Dataset.from_dict({"prompt": ["<sort>3,1,2"] * 8}))


@pytest.mark.parametrize("loss_type", list(TRL_LOSSES))
def test_trl_losses_and_gradients_match_varbench_policy_loss(tmp_path, loss_type):
    """TRL's own _compute_loss on a batch with an empty completion and padding, against
    policy_loss on the same log-probs: loss and every parameter gradient."""
    trainer = _trainer(tmp_path, steps=1, loss_type=loss_type, bf16=False, epsilon=0.2,
                       epsilon_high=0.28)
    ours, theirs, g_ours, g_theirs, (logp, old, A, mask) = trl_loss_case(trainer, loss_type)
    assert rel_diff(ours, theirs.detach()) <= 4.8e-7
    for a, b in zip(g_ours, g_theirs, strict=True):
        assert rel_diff(a, b) <= 4.8e-7
    if loss_type == "dr_grpo":  # the constant is TRL's max_completion_length, not the width
        wide, _ = E.policy_loss(logp, old, A, mask, TRL_LOSSES[loss_type][0], clip=(0.2, 0.28),
                                max_len=12)
        assert rel_diff(wide, theirs.detach()) > 1e-3


def _bpe_tokenizer():
    """A byte-level BPE (trained here in well under a second) with eos and pad tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(["<sort>3,1,2 1,2,3", "<add>1+2=3", "<sum>4: 4"] * 50,
                           trainers.BpeTrainer(vocab_size=300,
                                               special_tokens=["<unk>", "<eos>", "<pad>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")


@pytest.mark.parametrize("arch", ["qwen2-tied", "gpt-neox"])
@pytest.mark.parametrize("bf16", [False, True])
def test_callback_on_other_architectures_with_a_bpe_tokenizer(tmp_path, arch, bf16):
    """A tied-head Qwen2 and a GPT-NeoX with a byte-level BPE: the record equals the float64
    offline value (measured 7e-9 / 4e-8 in fp32, 1.4e-3 / 3e-5 in bf16)."""
    import transformers as tf

    tok = _bpe_tokenizer()
    V = len(tok)
    torch.manual_seed(0)
    if arch == "qwen2-tied":
        cfg = tf.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             tie_word_embeddings=True, eos_token_id=1, pad_token_id=2)
        model = tf.Qwen2ForCausalLM(cfg)
    else:
        cfg = tf.GPTNeoXConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, eos_token_id=1,
                               pad_token_id=2)
        model = tf.GPTNeoXForCausalLM(cfg)
    ds = datasets.Dataset.from_dict({"prompt": ["<sort>3,1,2", "<add>1+2=", "<sort>2,2,1",
                                                "<sum>4:"] * 4})
    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8,
                          num_generations=4, max_completion_length=6, max_steps=1,
                          learning_rate=1e-3, report_to=[], save_strategy="no", use_cpu=True,
                          seed=0, bf16=bf16, loss_type="grpo", disable_tqdm=True)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=ds,
                              processing_class=tok)
    cb = VarbenchCallback(every=1, measures=("counts", "variance", "proxy_seq"))
    keep = _Keep(cb.attach(trainer))
    trainer.train()
    rec = {r["metric"]: r["value"] for r in cb.records}
    ref = type(model)(cfg).double()  # built anew: a copy of the trained model keeps TRL's patch
    ref.load_state_dict({k: v.double() for k, v in keep.weights.items()}, strict=False)
    ref.tie_weights()
    want = _offline_variance(ref, keep.out, "grpo")
    assert want > 0 and "proxy_seq_spearman" in rec
    assert abs(rec["grad_var_split"] - want) <= (1e-2 if bf16 else 1e-5) * want
