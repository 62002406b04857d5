"""varbench.estimators: advantage schemes (registry), aggregation modes, the clipped policy
loss and its exact per-token coefficients, exchangeability transforms, KL penalties, and
the estimator-shape adapters (``as_scheme``: keyword- and verl-shaped functions behind the one
scheme signature ``fn(rewards, mask, opts)``; ``to_flat``/``from_flat``: verl's flat layout).
Formulas: docs/science.md sections 2-4 and 7.
"""

# Import order fixes the order of schemes(): the group schemes first, then otb.
from varbench.estimators import schemes as _schemes  # noqa: F401  (registers the group schemes)

# isort: split
from varbench.estimators import otb as _otb  # noqa: F401  (registers otb, otb_loo)
from varbench.estimators.adapters import (
    as_scheme,
    from_flat,
    outcome_to_token_rewards,
    scheme_shape,
    to_flat,
)
from varbench.estimators.aggregation import AGGREGATION_MODES, aggregation_weights
from varbench.estimators.coefficients import token_coefficients
from varbench.estimators.kl import KL_KINDS, kl_penalty
from varbench.estimators.loss import RATIO_KINDS, policy_loss
from varbench.estimators.otb import cumulative_weights, otb_baseline, proxy_from_logprobs
from varbench.estimators.registry import (
    SchemeOptions,
    advantages,
    outcome_rewards,
    register_scheme,
    reward_to_go,
    scheme_info,
    schemes,
    unregister_scheme,
)
from varbench.estimators.transforms import adv_orthogonal, min_replace

__all__ = [
    "AGGREGATION_MODES",
    "KL_KINDS",
    "RATIO_KINDS",
    "SchemeOptions",
    "adv_orthogonal",
    "advantages",
    "as_scheme",
    "aggregation_weights",
    "cumulative_weights",
    "from_flat",
    "kl_penalty",
    "min_replace",
    "otb_baseline",
    "outcome_rewards",
    "outcome_to_token_rewards",
    "policy_loss",
    "proxy_from_logprobs",
    "register_scheme",
    "reward_to_go",
    "scheme_info",
    "scheme_shape",
    "schemes",
    "to_flat",
    "token_coefficients",
    "unregister_scheme",
]
