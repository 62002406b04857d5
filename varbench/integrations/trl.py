"""varbench inside TRL's ``GRPOTrainer``: a ``TrainerCallback`` and the advantage hook.

    from varbench.integrations.trl import VarbenchCallback
    cb = VarbenchCallback(every=10)
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., callbacks=[cb])
    cb.attach(trainer)          # lets the callback see each batch the trainer generates
    trainer.train()             # varbench/* metrics reach TRL's console, wandb, tensorboard
    write_report([cb.result()], "reports/trl_run")

Every ``every``-th generation batch of the training run is measured right after TRL
generated and scored it, on the trainer's own model (no copy: TRL patches ``model.forward``
on the instance), with the weights that produced it, in the precision TRL trains in, through
TRL's own ``_compute_loss`` (its ``loss_type`` normaliser, temperature, importance ratio,
beta). Gradients are taken with :func:`torch.autograd.grad` of the trainable parameters only
(a PEFT/LoRA model: its adapters), so nothing touches ``.grad``, the optimizer or TRL's logged
metrics. One record set per generation batch, tagged ``generation``; the batch's later reuses
(``steps_per_generation`` > gradient accumulation, ``num_iterations`` > 1) are not counted
again. Records go into ``records`` and, with ``log=True``, into TRL's metrics as
``varbench/<metric>`` (so ``trainer.log`` sends them wherever TRL logs).

TRL 1.16.0 has no public advantage hook: advantages are computed inside
``GRPOTrainer._generate_and_score_completions``. :func:`with_varbench_advantages` returns a
subclass that replaces them, after TRL computed its own, by a varbench scheme's ``[B, T]``
advantages (TRL's loss accepts ``[B, T]`` advantages).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any

import torch

from varbench._util.checks import UsageError
from varbench.estimators import advantages as scheme_advantages
from varbench.estimators import to_flat
from varbench.estimators.adapters import outcome_to_token_rewards
from varbench.integrations.measure import (
    measure_groups,
    proxy_record,
    proxy_sequence_rows,
    records_result,
    sequence_records,
)

__all__ = ["VarbenchCallback", "with_varbench_advantages", "trl_rewards", "split_variance",
           "MEASURES", "DEFAULT_MEASURES"]

try:  # TRL's callbacks derive from transformers' TrainerCallback (transformers is a dependency)
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - transformers is always installed with varbench
    TrainerCallback = object

MEASURES = ("counts", "cancellation", "variance", "proxy_seq", "proxy")
"""What the callback can measure (``measures=``); the default leaves out ``proxy`` (exact
per-token norms: about one backward per completion token, too dear to leave on)."""
DEFAULT_MEASURES = ("counts", "cancellation", "variance", "proxy_seq")

# How TRL 1.16.0's _compute_loss normalises one micro-batch, per loss_type: "mean" divides by
# a per-row count of the slice (so the batch loss is the mean of two halves' losses), "tokens"
# by the slice's own token count (bnpo: halves weighted by their tokens), "sum" by the
# generation batch's num_items_in_batch (the batch loss is the sum of the halves' losses).
_NORMALISER = {"grpo": "mean", "sapo": "mean", "luspo": "mean", "dr_grpo": "mean",
               "bnpo": "tokens", "dapo": "sum", "cispo": "sum", "vespo": "sum"}
_STATE = ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")


def trl_rewards(trainer: Any, rewards_per_func: torch.Tensor) -> torch.Tensor:
    """``[B]`` rewards as TRL sums them: the weighted ``nansum`` over reward functions, NaN for
    an unscorable completion (every reward function returned None), as TRL marks it."""
    w = trainer.reward_weights.to(rewards_per_func.device)
    R = (rewards_per_func * w.unsqueeze(0)).nansum(dim=1)
    return R.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


def _slice(inputs: dict[str, Any], rows: slice, B: int) -> dict[str, Any]:
    """The rows ``rows`` of every per-row entry of TRL's batch dict (others kept as they are)."""
    out = {}
    for key, value in inputs.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == B:
            out[key] = value[rows]
        elif isinstance(value, list) and len(value) == B:
            out[key] = value[rows]
        else:
            out[key] = value
    return out


def _loss_mask(inputs: dict[str, Any]) -> torch.Tensor:
    m = inputs["completion_mask"]
    return m * inputs["tool_mask"] if inputs.get("tool_mask") is not None else m


def _trl_loss(trainer: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """TRL's ``_compute_loss`` on ``inputs`` with TRL's bookkeeping (logged metrics, the adaptive
    entropy controller) restored afterwards, so measuring leaves the run as it was."""
    lengths = {mode: {k: len(v) for k, v in d.items()} for mode, d in trainer._metrics.items()}
    state = {k: getattr(trainer, k) for k in _STATE if hasattr(trainer, k)}
    try:
        return trainer._compute_loss(trainer.model, inputs)
    finally:
        for mode, d in trainer._metrics.items():
            for k in list(d):
                if k not in lengths[mode]:
                    del d[k]
                else:
                    del d[k][lengths[mode][k]:]
        for k, v in state.items():
            setattr(trainer, k, v)


def _all_reduce_(tensors: list[torch.Tensor], accelerator: Any) -> None:
    """Sum ``tensors`` in place over the trainer's processes (no-op in one process)."""
    if accelerator.num_processes > 1:
        for t in tensors:
            torch.distributed.all_reduce(t)


def split_variance(trainer: Any, inputs: dict[str, Any], G: int) -> dict[str, float] | None:
    """Split-half variance of the gradient of TRL's loss on one generation batch.

    ``inputs``: the dict ``_generate_and_score_completions`` returned on this process, ``B =
    P * G`` rows with groups contiguous. The first ``2 * (P // 2)`` groups are split in two
    halves of whole groups; ``g_h`` is the gradient (trainable parameters) of TRL's loss on
    half ``h``, undone of gradient accumulation, so that the batch's gradient is ``g = w_1 g_1 +
    w_2 g_2`` (``w`` = 1/2 for per-row normalisers, token shares for bnpo, 1 for the
    num_items_in_batch ones). The halves are independent given the weights, so ``||w_1 g_1 -
    w_2 g_2||^2`` estimates ``tr Cov(g)`` without bias (bnpo: up to its random token shares).
    Under several processes each rank splits its own groups and the two halves' gradients are
    averaged over ranks as DDP averages the training gradient (one all-reduce of a gradient),
    so the estimate is that of the global batch. Returns ``{"var", "sq", "groups",
    "params"}`` (``sq`` = ``||g||^2``; ``groups`` over all ranks) or None with fewer than 2
    groups on a rank. Memory: two gradients of the trainable parameters in their own dtype;
    sums in float64. Each half runs ``per_device_train_batch_size`` rows at a time, as TRL's
    own micro-batches do.
    """
    acc = trainer.accelerator
    mask = inputs["completion_mask"]
    B = mask.shape[0]
    P = B // G
    K = acc.num_processes
    if P < 2:
        return None
    kind = _NORMALISER[trainer.loss_type]
    n = (P // 2) * G
    used = _slice(inputs, slice(0, 2 * n), B)
    lm = _loss_mask(used)
    items = lm.sum().reshape(1).to(torch.float64)
    _all_reduce_([items], acc)
    used["num_items_in_batch"] = items[0].to(lm.dtype)  # the used rows of every rank
    k_acc = getattr(trainer, "current_gradient_accumulation_steps",
                    trainer.args.gradient_accumulation_steps)
    # TRL divides a micro-batch's loss by k_acc ("mean"/"tokens") or by num_items * k_acc / spg
    undo = k_acc if kind != "sum" else k_acc / trainer.args.steps_per_generation
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    tokens = [float(lm[:n].sum()), float(lm[n:].sum())]
    weights = {"mean": [0.5, 0.5], "sum": [1.0, 1.0],
               "tokens": [t / max(sum(tokens), 1.0) for t in tokens]}[kind]
    # fp16 on an accelerator: the loss scale TRL's backward uses, so small gradients survive
    scaler = getattr(acc, "scaler", None)
    scale = float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0
    # a half runs in chunks of the rows TRL itself puts through one forward+backward (the
    # generation batch can be steps_per_generation times larger); a chunk's loss weighs in by
    # its share of the half (rows for the per-row means, tokens for bnpo, 1 for the sums)
    step = max(1, int(trainer.args.per_device_train_batch_size))
    grads = []
    with torch.enable_grad():
        for h in range(2):
            acc_h = [torch.zeros_like(p) for p in params]
            for s in range(h * n, (h + 1) * n, step):
                rows = slice(s, min(s + step, (h + 1) * n))
                share = {"mean": (rows.stop - rows.start) / n, "sum": 1.0,
                         "tokens": float(lm[rows].sum()) / max(tokens[h], 1.0)}[kind]
                loss = _trl_loss(trainer, _slice(used, rows, 2 * n)) * (
                    undo * weights[h] * share / K)
                for a, g in zip(acc_h, torch.autograd.grad(loss * scale, params,
                                                           allow_unused=True), strict=True):
                    if g is not None:
                        a.add_(g, alpha=1 / scale)
            grads.append(acc_h)
    diff = [a - b for a, b in zip(*grads, strict=True)]
    total = [a + b for a, b in zip(*grads, strict=True)]
    del grads
    _all_reduce_(diff + total, acc)  # DDP's average: the 1/K is in the loss above
    var = sum(float(d.double().pow(2).sum()) for d in diff)
    sq = sum(float(t.double().pow(2).sum()) for t in total)
    if not (math.isfinite(var) and math.isfinite(sq)):
        warnings.warn(f"VarbenchCallback: the split-half gradients are not finite (loss scale "
                      f"{scale:g}); no variance recorded for this batch", stacklevel=2)
        return None
    return {"var": var, "sq": sq, "groups": 2 * (P // 2) * K,
            "params": sum(p.numel() for p in params)}


_SUMMED = ("groups", "responses", "all_agree_groups", "nonzero_raw", "nonzero_centered")
_AVERAGED = ("cancellation_residual", "proxy_exact_corr")


def _reduce_records(recs: list[dict[str, Any]], accelerator: Any, step: int
                    ) -> list[dict[str, Any]]:
    """The rank-local count and average records combined over processes: counts summed,
    averages weighted by their ``n`` (every rank reduces the same fixed list, in step)."""
    if accelerator.num_processes == 1:
        return recs
    by = {r["metric"]: r for r in recs}
    names = _SUMMED + _AVERAGED
    dev = accelerator.device
    t = torch.zeros(len(names), 2, dtype=torch.float64, device=dev)
    for i, name in enumerate(names):
        if name in by:
            v, n = float(by[name]["value"]), float(by[name]["n"])
            t[i] = torch.tensor([v if name in _SUMMED else v * n, n], dtype=torch.float64)
    _all_reduce_([t], accelerator)
    out = []
    for i, name in enumerate(names):
        v, n = float(t[i, 0]), float(t[i, 1])
        if n > 0:
            out.append({"step": step, "metric": name,
                        "value": v if name in _SUMMED else v / n, "n": int(n)})
    return out + [r for r in recs if r["metric"] not in names]


@contextlib.contextmanager
def _class_forward(model: torch.nn.Module):
    """The live model with its class's ``forward`` (accelerate's mixed-precision wrapper, set
    on the instance, lifted for the duration): the exact per-token norms run their own
    float32-or-better statistics on the same parameters, no copy."""
    patched = model.__dict__.pop("forward", None)
    try:
        yield model
    finally:
        if patched is not None:
            model.forward = patched


class VarbenchCallback(TrainerCallback):
    """Records varbench measurements of every ``every``-th generation batch of a
    ``GRPOTrainer`` run (the first included).

    ``measures``: a subset of :data:`MEASURES` (default :data:`DEFAULT_MEASURES`);
    ``proxy_rows`` completions for the per-token proxy-vs-exact correlation (``"proxy"``);
    ``log``: also put each value into TRL's metrics as ``varbench/<metric>`` (averaged over
    the logging window like TRL's own). ``records``:
    the list of record dicts (``step`` is the first optimizer step that uses the batch).
    Under several processes (torchrun / accelerate) each rank measures its own groups with its
    own rewards and the records are combined over ranks (counts summed, the variance that of
    the global batch, the per-sequence proxy over every row); each rank must hold whole groups
    (refused at :meth:`attach` otherwise).
    """

    def __init__(self, every: int = 10, *, measures: tuple[str, ...] = DEFAULT_MEASURES,
                 proxy_rows: int = 4, seed: int = 0, log: bool = True):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise UsageError(f"every={every!r} is not valid; expected an integer >= 1")
        bad = [m for m in measures if m not in MEASURES]
        if isinstance(measures, str) or bad or not measures:
            raise UsageError(f"measures={measures!r} is not valid; choose a non-empty subset "
                             f"of {list(MEASURES)}")
        if isinstance(proxy_rows, bool) or not isinstance(proxy_rows, int) or proxy_rows < 1:
            raise UsageError(f"proxy_rows={proxy_rows!r} is not valid; expected an integer >= 1")
        self.every, self.measures, self.proxy_rows = every, tuple(measures), proxy_rows
        self.seed, self.log = seed, bool(log)
        self.records: list[dict[str, Any]] = []
        self.generations = 0
        self._trainer: Any = None
        self._last: dict[str, Any] | None = None

    def attach(self, trainer: Any) -> VarbenchCallback:
        """Wrap ``trainer``'s generation and reward steps to measure each batch; returns self."""
        local = trainer.args.per_device_train_batch_size * trainer.args.steps_per_generation
        if trainer.accelerator.num_processes > 1 and local % trainer.num_generations:
            raise UsageError(
                f"VarbenchCallback needs whole groups on each of the "
                f"{trainer.accelerator.num_processes} processes: per_device_train_batch_size x "
                f"steps_per_generation = {local} is not a multiple of num_generations = "
                f"{trainer.num_generations} (TRL then splits a group across ranks)")
        if "variance" in self.measures and trainer.loss_type not in _NORMALISER:
            raise UsageError(f"loss_type={trainer.loss_type!r} is not one VarbenchCallback "
                             f"knows how TRL normalises; known: {sorted(_NORMALISER)}")
        self._trainer = trainer
        generate = trainer._generate_and_score_completions
        rewards = trainer._calculate_rewards
        box: dict[str, Any] = {}

        def calculate_rewards(*args, **kwargs):
            out = rewards(*args, **kwargs)
            box["rewards"] = trl_rewards(trainer, out).detach()
            return out

        def generate_and_score(*args, **kwargs):
            out = generate(*args, **kwargs)
            if trainer.model.training:
                self.generations += 1
                self._last = {k: out[k].detach() for k in
                              ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                               "advantages")}
                self._last["rewards"] = box.get("rewards")
                if (self.generations - 1) % self.every == 0:
                    self._measure(out)
            return out

        trainer._calculate_rewards = calculate_rewards
        trainer._generate_and_score_completions = generate_and_score
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        if self._trainer is None:
            raise UsageError("VarbenchCallback.attach(trainer) was not called before train()")
        return control

    def _measure(self, out: dict[str, Any]) -> None:
        tr, b = self._trainer, self._last
        G = tr.num_generations
        B = b["completion_ids"].shape[0]
        step = tr.state.global_step + 1
        k = tr.accelerator.process_index
        rewards = b["rewards"][k * B:(k + 1) * B]  # TRL gathers every process's rewards
        scored = torch.nan_to_num(rewards, nan=0.0)
        recs = measure_groups(
            step=step, rewards=scored, completion_ids=b["completion_ids"],
            completion_mask=b["completion_mask"], advantages=b["advantages"], G=G,
            measures=[m for m in self.measures if m in ("counts", "cancellation")])
        recs = _reduce_records(recs, tr.accelerator, step)
        dtype = str(next(p for p in tr.model.parameters() if p.requires_grad).dtype)
        if "variance" in self.measures:
            v = split_variance(tr, out, G)
            if v is not None:
                extra = {"params": v["params"], "dtype": dtype, "loss_type": tr.loss_type}
                recs += [{"step": step, "metric": "grad_var_split", "value": v["var"],
                          "n": v["groups"], **extra},
                         {"step": step, "metric": "grad_sq_batch", "value": v["sq"],
                          "n": v["groups"], **extra}]
        with _class_forward(tr.model):
            if "proxy_seq" in self.measures:
                recs += self._proxy_seq(tr, b, step)
            if "proxy" in self.measures:
                local = proxy_record(tr.model, b["prompt_ids"], b["prompt_mask"],
                                     b["completion_ids"], b["completion_mask"], step,
                                     n_sub=self.proxy_rows, seed=self.seed + self.generations)
                recs += _reduce_records(local, tr.accelerator, step)
        for r in recs:
            r["generation"] = self.generations
        self.records += recs
        if self.log:
            for r in recs:
                tr._metrics["train"][f"varbench/{r['metric']}"].append(float(r["value"]))

    @staticmethod
    def _proxy_seq(tr: Any, b: dict[str, Any], step: int) -> list[dict[str, Any]]:
        """proxy_seq records over the rows of every process (gathered, NaN for empty rows)."""
        proxy, exact = proxy_sequence_rows(tr.model, b["prompt_ids"], b["prompt_mask"],
                                           b["completion_ids"], b["completion_mask"])
        if tr.accelerator.num_processes > 1:
            both = tr.accelerator.gather(torch.stack([proxy, exact], 1).to(tr.accelerator.device))
            proxy, exact = both[:, 0].cpu(), both[:, 1].cpu()
        return sequence_records(proxy, exact, step)

    def result(self, name: str = "trl run"):
        """The records as an AnalysisResult for :func:`varbench.report.write_report`."""
        config = {"every": self.every, "measures": list(self.measures),
                  "proxy_rows": self.proxy_rows, "generations": self.generations}
        tr = self._trainer
        if tr is not None:
            import trl

            model = tr.accelerator.unwrap_model(tr.model)
            config.update({
                "trl": trl.__version__, "loss_type": tr.loss_type,
                "num_generations": tr.num_generations, "temperature": tr.temperature,
                "beta": tr.beta, "processes": tr.accelerator.num_processes,
                "model": type(model).__name__,
                "name_or_path": getattr(getattr(model, "config", None), "_name_or_path", None),
                "trainable_params": sum(p.numel() for p in tr.model.parameters()
                                        if p.requires_grad),
                "bf16": bool(tr.args.bf16), "fp16": bool(tr.args.fp16),
            })
        return records_result(self.records, name=name, source="trl.GRPOTrainer", config=config)


def _needs_token_stats(scheme: str, options: dict[str, Any]) -> bool:
    """Whether ``scheme`` refuses a batch without per-token statistics (OTB-type schemes)."""
    R = torch.tensor([[1.0, 0.0]])
    mask = torch.ones(1, 2, 2, dtype=torch.bool)
    try:
        scheme_advantages(scheme, R, mask, **options)
    except UsageError:
        stats = {"logprobs": torch.full((1, 2, 2), -0.5), "sum_pi_sq": torch.full((1, 2, 2), 0.5)}
        scheme_advantages(scheme, R, mask, **options, **stats)  # a different error: raise it
        return True
    return False


def with_varbench_advantages(trainer_cls: type, scheme: str, **options: Any) -> type:
    """A subclass of TRL's ``trainer_cls`` whose advantages are varbench's ``scheme``.

    After TRL's ``_generate_and_score_completions`` the completions are regrouped (TRL keeps
    the ``num_generations`` completions of a prompt contiguous), the rewards recomputed as TRL
    sums them, and ``advantages`` replaced by the scheme's ``[B, T]`` advantages. Unscorable
    completions (every reward function returned None) are left out of their group's baseline
    and get advantage 0, as TRL treats them. Schemes that read per-token statistics (OTB) get
    ``logprobs`` and ``sum_pi_sq`` from one no-grad forward of the trainer's model on the batch;
    they need ``temperature=1`` (the statistics describe the sampling policy), refused when the
    trainer is built otherwise. Unknown options are refused here. Single process only.
    """
    from varbench.grads.stats import forward_stats

    to_flat(scheme, conventions="trl", **options)  # unknown options are refused now
    needs_stats = _needs_token_stats(scheme, options)

    class VarbenchAdvantages(trainer_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if needs_stats and float(self.temperature) != 1.0:
                raise UsageError(
                    f"with_varbench_advantages({scheme!r}) reads the sampling policy's token "
                    f"statistics, which varbench takes at temperature 1; this trainer samples at "
                    f"temperature={self.temperature!r}: set GRPOConfig(temperature=1.0) or use a "
                    "sequence-level scheme")
            if self.accelerator.num_processes != 1:
                raise UsageError("with_varbench_advantages supports one process only (the "
                                 "rewards of other processes are not in this one)")

        def _calculate_rewards(self, *args, **kwargs):
            out = super()._calculate_rewards(*args, **kwargs)
            self._varbench_rewards = trl_rewards(self, out)
            return out

        def _generate_and_score_completions(self, *args, **kwargs):
            out = super()._generate_and_score_completions(*args, **kwargs)
            mask = out["completion_mask"]
            B, T = mask.shape
            G = self.num_generations if self.model.training else self.num_generations_eval
            R = self._varbench_rewards.to(mask.device)[:B]
            stats: dict[str, torch.Tensor] = {}
            if needs_stats:
                ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
                attn = torch.cat([out["prompt_mask"], mask], 1)
                resp = torch.cat([torch.zeros_like(out["prompt_mask"]), mask], 1)
                with _class_forward(self.model):
                    st = forward_stats(self.model, ids, resp, attn)
                Lp = out["prompt_ids"].shape[1]
                stats = {"logprobs": st.logp[:, Lp:], "sum_pi_sq": st.sum_pi_sq[:, Lp:]}
            A = torch.zeros(B, T, dtype=torch.float32, device=mask.device)
            keep = ~torch.isnan(R)
            if bool(keep.any()):
                if bool(keep.all()):
                    m = mask.reshape(B // G, G, T) != 0
                    A = scheme_advantages(
                        scheme, R.reshape(B // G, G).float(), m, **options,
                        **{k: v.reshape(B // G, G, T).float() for k, v in stats.items()},
                    ).reshape(B, T)
                else:  # whole groups minus the unscorable rows: groups of unequal sizes
                    rows = keep.nonzero()[:, 0]
                    verl_names = {"logprobs": "old_log_probs", "sum_pi_sq": "sum_pi_squared"}
                    flat = to_flat(scheme, conventions="trl", **options)
                    tok = outcome_to_token_rewards(R[rows].float()[None], mask[rows][None] != 0)
                    A[rows], _ = flat(tok[0], mask[rows].float(), rows // G,
                                      **{verl_names[k]: v[rows].float() for k, v in stats.items()})
            out["advantages"] = A.to(out["advantages"].dtype)
            return out

    VarbenchAdvantages.__name__ = f"{trainer_cls.__name__}With_{scheme}"
    VarbenchAdvantages.__qualname__ = VarbenchAdvantages.__name__
    return VarbenchAdvantages
