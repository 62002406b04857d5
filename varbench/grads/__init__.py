"""varbench.grads: the gradient harness (docs/science.md sections 2.3, 5 and 6).

Forward statistics and the Logit-Gradient Proxy (``stats``), exact per-token / prefix norms
(``exact`` with the ghost-norm engine in ``ghost``), the one seeded sketch (``CountSketch``) and
the one "per-token vectors once, many coefficient sets" path (``token_vectors`` + ``combine``,
in ``vectors``), per-sequence gradients (``sequence``) and their norms from one backward
(``seqnorms``), coefficient-first per-response Kronecker sketches from one backward per
response and coefficient set (``projected``), tail-exact norms from one backward (``tail``),
forward-mode sketched norms (``sketch``), group-gradient estimates (``group``), parameter
filters and groups (``params``), float64-throughout models (``precision``). What varbench knows
about architectures lives in ``varbench.models.arch``.
"""

# the logits formulas live below rollout and grads; re-exported here for convenience
from varbench.grads.exact import TokenGradNorms, token_grad_norms
from varbench.grads.group import combine, group_gradients, token_sketches
from varbench.grads.params import default_group, select_params
from varbench.grads.precision import exact_float64
from varbench.grads.projected import (
    ResponseSketches,
    batch_sketches,
    projection_sd,
    response_sketches,
)
from varbench.grads.seqnorms import sequence_grad_norms
from varbench.grads.sequence import sequence_grads
from varbench.grads.sketch import SketchedNorms, sketched_token_norms
from varbench.grads.stats import ForwardStats, forward_stats
from varbench.grads.tail import default_tail_modules, tail_token_norms
from varbench.grads.vectors import CountSketch, TokenVectors, token_vectors
from varbench.models.logits import logit_proxy, sum_pi_sq, token_logprobs

__all__ = [
    "CountSketch",
    "ForwardStats",
    "SketchedNorms",
    "TokenGradNorms",
    "ResponseSketches",
    "TokenVectors",
    "batch_sketches",
    "combine",
    "default_group",
    "default_tail_modules",
    "exact_float64",
    "forward_stats",
    "group_gradients",
    "logit_proxy",
    "projection_sd",
    "response_sketches",
    "select_params",
    "sequence_grad_norms",
    "sequence_grads",
    "sketched_token_norms",
    "sum_pi_sq",
    "tail_token_norms",
    "token_grad_norms",
    "token_logprobs",
    "token_sketches",
    "token_vectors",
]
