"""varbench: gradient variance and credit assignment in RL fine-tuning of language models.

The public API is listed in ``__all__`` (and nothing else is public). Names resolve lazily on
first access so that ``import varbench`` and the CLI start fast; ``from varbench import X`` works
as usual.

    import varbench as vb
    policy = vb.warm_start("tiny", vb.get_task("sort", n=3))
    batch = vb.sample(policy, vb.get_task("sort", n=3), prompts, G=8)
    adv = vb.advantages("otb", batch.rewards, batch.mask,
                        logprobs=batch.logprobs, sum_pi_sq=batch.sum_pi_sq)
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

from varbench._util.version import VERSION as __version__

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # rollouts and data layout
    "RolloutBatch": "varbench.rollout.batch",
    "FlatBatch": "varbench.rollout.batch",
    "sample": "varbench.rollout",
    # policies
    "Policy": "varbench.models",
    "presets": "varbench.models",
    "build_policy": "varbench.train.policies",
    "build_preset": "varbench.models",
    "build_tokenizer": "varbench.models",
    "load_policy": "varbench.models",
    "save_policy": "varbench.models",
    # tasks
    "Task": "varbench.tasks",
    "Prompt": "varbench.tasks",
    "get_task": "varbench.tasks",
    "task_names": "varbench.tasks",
    "register_task": "varbench.tasks",
    "DatasetTask": "varbench.tasks",
    # estimators
    "advantages": "varbench.estimators",
    "register_scheme": "varbench.estimators",
    "as_scheme": "varbench.estimators",
    "unregister_scheme": "varbench.estimators",
    "schemes": "varbench.estimators",
    "SchemeOptions": "varbench.estimators",
    "outcome_rewards": "varbench.estimators",
    "reward_to_go": "varbench.estimators",
    "otb_baseline": "varbench.estimators",
    "proxy_from_logprobs": "varbench.estimators",
    "cumulative_weights": "varbench.estimators",
    "AGGREGATION_MODES": "varbench.estimators",
    "aggregation_weights": "varbench.estimators",
    "RATIO_KINDS": "varbench.estimators",
    "policy_loss": "varbench.estimators",
    "token_coefficients": "varbench.estimators",
    "KL_KINDS": "varbench.estimators",
    "kl_penalty": "varbench.estimators",
    "min_replace": "varbench.estimators",
    "adv_orthogonal": "varbench.estimators",
    "from_flat": "varbench.estimators",
    "to_flat": "varbench.estimators",
    # gradient harness
    "sum_pi_sq": "varbench.models.logits",
    "logit_proxy": "varbench.models.logits",
    "forward_stats": "varbench.grads",
    "token_grad_norms": "varbench.grads",
    "tail_token_norms": "varbench.grads",
    "sketched_token_norms": "varbench.grads",
    "sequence_grads": "varbench.grads",
    "sequence_grad_norms": "varbench.grads",
    "group_gradients": "varbench.grads",
    "token_sketches": "varbench.grads",
    "exact_float64": "varbench.grads",
    # analyses and reports
    "proxy_correlation": "varbench.analysis",
    "estimator_variance": "varbench.analysis",
    "cancellation": "varbench.analysis",
    "AnalysisResult": "varbench.analysis",
    "write_report": "varbench.report",
    # training
    "TrainConfig": "varbench.train",
    "train": "varbench.train",
    "warm_start": "varbench.train",
    # suites and estimator regression tests
    "run_suite": "varbench.app",
    "load_suite": "varbench.app",
    "compare_reports": "varbench.app",
    "check_estimator": "varbench.testing",
}

__all__ = ["__version__", *_EXPORTS]


class _Package(types.ModuleType):
    """The ``varbench`` module: a public name wins over a subpackage of the same name.

    Importing ``varbench.train`` (the package) makes the import system bind it as the attribute
    ``train`` of ``varbench``, which would shadow the public function ``train`` depending on
    import order. Those bindings are dropped here; the package stays in ``sys.modules`` (so
    ``from varbench.train import TrainConfig``, ``from varbench.train import loop`` and
    ``import varbench.train.loop`` still work; ``import varbench.train.loop as m`` does not, as
    Python resolves it through the attribute ``varbench.train``, the function).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if (name in _EXPORTS and isinstance(value, types.ModuleType)
                and value.__name__ == f"{__name__}.{name}"):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'varbench' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
