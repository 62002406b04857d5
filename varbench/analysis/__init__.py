"""varbench.analysis: proxy correlation, estimator variance, token gradient cancellation, the
planner.

Each analysis returns an :class:`AnalysisResult` (tidy pandas records + headline figures with
standard errors + provenance) that ``varbench.report.write_report`` renders.
"""

from varbench.analysis.cancellation import CancellationConfig, cancellation
from varbench.analysis.kinds import ANALYSES, AnalysisKind, register_analysis
from varbench.analysis.oracle import ExactDistribution, enumerate_distribution
from varbench.analysis.planner import PlannerConfig, predict_arms
from varbench.analysis.proxy import ProxyConfig, proxy_correlation
from varbench.analysis.trie import prefix_node_ids, shared_steps, token_net_weight
from varbench.analysis.variance import DEFAULT_SCHEMES, VarianceConfig, estimator_variance
from varbench.grads.vectors import TokenVectors, token_vectors
from varbench.report.result import AnalysisResult, Headline
from varbench.stats.estimates import correlations, paired_compare, variance_stats

__all__ = [
    "ANALYSES",
    "DEFAULT_SCHEMES",
    "AnalysisKind",
    "AnalysisResult",
    "CancellationConfig",
    "ExactDistribution",
    "Headline",
    "PlannerConfig",
    "ProxyConfig",
    "TokenVectors",
    "VarianceConfig",
    "cancellation",
    "correlations",
    "enumerate_distribution",
    "estimator_variance",
    "paired_compare",
    "predict_arms",
    "prefix_node_ids",
    "proxy_correlation",
    "register_analysis",
    "shared_steps",
    "token_net_weight",
    "token_vectors",
    "variance_stats",
]
