"""varbench.testing: regression checks for advantage estimators, and the pytest plugin.

``check_estimator(fn_or_name, **options) -> CheckResult`` runs the contract checks, the bias
tests against an exactly enumerable toy task and the variance comparison (see
:mod:`varbench.testing.check`).
"""

from varbench.testing.adapt import EstimatorInputError
from varbench.testing.check import CheckResult, check_estimator
from varbench.testing.toy import ToyPolicy, ToyTask

__all__ = ["CheckResult", "EstimatorInputError", "ToyPolicy", "ToyTask", "check_estimator"]
