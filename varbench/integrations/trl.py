"""varbench inside TRL's ``GRPOTrainer``: a ``TrainerCallback`` and the advantage hook.

    from varbench.integrations.trl import VarbenchCallback
    cb = VarbenchCallback(every=10)
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=..., callbacks=[cb])
    cb.attach(trainer)          # lets the callback see the batch the trainer just used
    trainer.train()
    write_report([cb.result()], "reports/trl_run")

Every ``every`` optimizer steps (``on_step_end``) the callback measures the last generation
batch (prompt and completion ids, masks, per-completion rewards, TRL's advantages) with
:func:`varbench.integrations.measure.measure_groups` and keeps the records (also in
``state.log_history`` under ``varbench/<metric>``, beside TRL's own logs).

TRL 1.16.0 has no public advantage hook: advantages are computed inside
``GRPOTrainer._generate_and_score_completions``. :func:`with_varbench_advantages` returns a
subclass that replaces them, after TRL computed its own, by a varbench scheme's ``[B, T]``
advantages (TRL's loss accepts ``[B, T]`` advantages).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from varbench.estimators import advantages as scheme_advantages
from varbench.integrations.measure import measure_groups, records_result

__all__ = ["VarbenchCallback", "with_varbench_advantages", "trl_rewards"]

try:  # TRL's callbacks derive from transformers' TrainerCallback (transformers is a dependency)
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover - transformers is always installed with varbench
    TrainerCallback = object


def trl_rewards(trainer: Any, rewards_per_func: torch.Tensor) -> torch.Tensor:
    """``[B]`` rewards as TRL sums them: the weighted ``nansum`` over reward functions."""
    w = trainer.reward_weights.to(rewards_per_func.device)
    return (rewards_per_func * w.unsqueeze(0)).nansum(dim=1)


class VarbenchCallback(TrainerCallback):
    """Records varbench measurements every ``every`` steps of a ``GRPOTrainer`` run.

    ``sketch_dim`` Gaussian directions for the split-group gradient variance; ``proxy_rows``
    completions for the proxy-vs-exact correlation; ``measures``: a subset of ("counts",
    "cancellation", "variance", "proxy"). ``records``: the list of record dicts.
    """

    def __init__(self, every: int = 1, *, sketch_dim: int = 16, proxy_rows: int = 4,
                 seed: int = 0,
                 measures: tuple[str, ...] = ("counts", "cancellation", "variance", "proxy")):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"every={every!r} is not valid; expected an integer >= 1")
        self.every, self.sketch_dim, self.proxy_rows = every, sketch_dim, proxy_rows
        self.seed, self.measures = seed, tuple(measures)
        self.records: list[dict[str, Any]] = []
        self._trainer: Any = None
        self._last: dict[str, Any] | None = None

    def attach(self, trainer: Any) -> VarbenchCallback:
        """Wrap ``trainer``'s generation and reward steps to keep the last batch; returns self."""
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
                self._last = {k: out[k].detach() for k in
                              ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                               "advantages")}
                self._last["rewards"] = box.get("rewards")
            return out

        trainer._calculate_rewards = calculate_rewards
        trainer._generate_and_score_completions = generate_and_score
        if self not in trainer.callback_handler.callbacks:
            trainer.add_callback(self)
        return self

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self._trainer is None:
            raise RuntimeError("VarbenchCallback.attach(trainer) was not called")
        if state.global_step % self.every or self._last is None or self._last["rewards"] is None:
            return control
        b, tr = self._last, self._trainer
        B = b["completion_ids"].shape[0]
        rewards = b["rewards"][:B]  # one process: the local slice is the whole batch
        # Measure a float32 copy without accelerate's mixed-precision forward wrapper: the
        # statistics are float32 or better whatever the training precision (costs one copy of
        # the weights while measuring).
        net = copy.deepcopy(tr.accelerator.unwrap_model(tr.model))
        net = tr.accelerator.unwrap_model(net, keep_fp32_wrapper=False).float().eval()
        recs = measure_groups(
            step=state.global_step, rewards=rewards, completion_ids=b["completion_ids"],
            completion_mask=b["completion_mask"], advantages=b["advantages"],
            model=net, prompt_ids=b["prompt_ids"], prompt_mask=b["prompt_mask"],
            G=tr.num_generations, sketch_dim=self.sketch_dim, proxy_rows=self.proxy_rows,
            seed=self.seed + state.global_step, measures=self.measures,
        )
        del net
        self.records += recs
        state.log_history.append({"step": state.global_step,
                                  **{f"varbench/{r['metric']}": r["value"] for r in recs}})
        return control

    def result(self, name: str = "trl run"):
        """The records as an AnalysisResult for :func:`varbench.report.write_report`."""
        return records_result(self.records, name=name, source="trl.GRPOTrainer",
                              config={"every": self.every, "sketch_dim": self.sketch_dim,
                                      "proxy_rows": self.proxy_rows})


def with_varbench_advantages(trainer_cls: type, scheme: str, **options: Any) -> type:
    """A subclass of TRL's ``trainer_cls`` whose advantages are varbench's ``scheme``.

    After TRL's ``_generate_and_score_completions`` the completions are regrouped ``[P, G,
    T]`` (TRL keeps the ``num_generations`` completions of a prompt contiguous), the rewards
    recomputed as TRL sums them, and ``advantages`` replaced by ``advantages(scheme, R, mask,
    **options)`` ``[B, T]``. Single process only (the rewards of other processes are not here).
    """

    class VarbenchAdvantages(trainer_cls):
        def _calculate_rewards(self, *args, **kwargs):
            out = super()._calculate_rewards(*args, **kwargs)
            self._varbench_rewards = trl_rewards(self, out)
            return out

        def _generate_and_score_completions(self, *args, **kwargs):
            out = super()._generate_and_score_completions(*args, **kwargs)
            if self.accelerator.num_processes != 1:
                raise RuntimeError("with_varbench_advantages supports one process only")
            mask = out["completion_mask"]
            B, T = mask.shape
            G = self.num_generations if self.model.training else self.num_generations_eval
            R = torch.nan_to_num(self._varbench_rewards.to(mask.device), nan=0.0)
            m = mask.reshape(B // G, G, T)
            if not bool(m.any()):
                return out
            A = scheme_advantages(scheme, R.reshape(B // G, G), m, **options)
            out["advantages"] = A.reshape(B, T).to(out["advantages"].dtype)
            return out

    VarbenchAdvantages.__name__ = f"{trainer_cls.__name__}With_{scheme}"
    VarbenchAdvantages.__qualname__ = VarbenchAdvantages.__name__
    return VarbenchAdvantages
