"""varbench.integrations: measurements inside other libraries' training runs.

- :mod:`varbench.integrations.trl`: a ``TrainerCallback`` for TRL's ``GRPOTrainer`` (and the
  subclass hook that puts varbench's advantages into it);
- :mod:`varbench.integrations.verl`: the same measurements as a function over a verl batch
  (``DataProto.batch`` as a dict of tensors).

Both write varbench records (:func:`measure_groups`) that :func:`varbench.report.write_report`
renders through :func:`records_result`. Neither module imports its peer at import time.
"""

from varbench.integrations.measure import measure_groups, records_result

__all__ = ["measure_groups", "records_result"]
