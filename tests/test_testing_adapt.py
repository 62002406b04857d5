"""varbench.testing.adapt: loading an estimator (scheme name, MODULE:FUNCTION, callable) and
the shape it is called in."""

from __future__ import annotations

import _fixtures_testing as fx
import pytest
import torch

from varbench.estimators import advantages
from varbench.testing import EstimatorInputError
from varbench.testing.adapt import import_function, load


def test_load_reports_the_shape_of_each_input():
    # Shape detection itself is tested with the adapter (tests/test_estimators_adapters.py).
    assert load(fx.verl_rloo).shape == "verl"
    assert load(fx.centered_by_hand).shape == "keywords"
    assert load(lambda r, m, o: r.unsqueeze(-1) * m).shape == "scheme"
    assert load("topk", {"k": 2}).shape == "scheme"
    assert load("_fixtures_testing:centered_by_hand").name == "_fixtures_testing:centered_by_hand"


def test_loaded_estimators_compute_what_they_name():
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(2, 3, generator=g, dtype=torch.float64)
    mask = torch.ones(2, 3, 4)
    want = advantages("centered", rewards, mask)
    for est in (load("centered"), load(fx.centered_by_hand),
                load("_fixtures_testing:centered_by_hand")):
        torch.testing.assert_close(est.call(rewards, mask), want, rtol=1e-12, atol=0)
    torch.testing.assert_close(load("topk", {"k": 1}).call(rewards, mask),
                               advantages("topk", rewards, mask, k=1), rtol=0, atol=0)


def test_import_function_and_load_refusals():
    assert import_function("_fixtures_testing:verl_rloo") is fx.verl_rloo
    with pytest.raises(EstimatorInputError, match=r"module not found: 'no_such_module_xyz'.*"
                                                  r"PYTHONPATH"):
        import_function("no_such_module_xyz:fn")
    with pytest.raises(EstimatorInputError, match=r"is a int, not a function"):
        import_function("_fixtures_testing:not_a_function")
    with pytest.raises(EstimatorInputError, match="expected MODULE:ATTR"):
        import_function("no colon:")
    with pytest.raises(EstimatorInputError, match=r"estimator=3 is not valid"):
        load(3)
    with pytest.raises(EstimatorInputError, match=r"estimator_options=\['q'\] is not valid for "
                                                  r"scheme 'topk'"):
        load("topk", {"q": 1})
