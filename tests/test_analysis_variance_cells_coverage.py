"""The quickstart's headline intervals cover at the quickstart's own settings (issue 30 point 5).

The settings are read from suites/quickstart.toml's variance case (its Gs, the groups per G
that the floor gives them, its sketch K, prompts, bootstrap draws and level), so the test follows
the suite when it changes; the harness is tests/_coverage.py (the truth unsketched, a fresh
CountSketch per replicate, the cells computed as ``estimator_variance`` computes them, Monte
Carlo like the quickstart's, pooled over the prompts through ``_pool``).
"""

from __future__ import annotations

from pathlib import Path

import _coverage as C
import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
REPS = 200
SCHEMES = ["centered", "otb", "otb_exact"]
PAIRS = [("otb", "centered"), ("otb_exact", "centered"), ("otb", "otb_exact")]


def quickstart_settings() -> dict:
    """The quickstart's variance case: its knobs and the groups per prompt at each of its Gs."""
    from varbench.analysis.variance import variance_plan
    from varbench.tasks import get_task

    suite = tomllib.loads((ROOT / "suites" / "quickstart.toml").read_text())
    case = next(c for c in suite["cases"] if c["kind"] == "variance")
    knobs = {k: case[k] for k in ("schemes", "Gs", "M") if k in case}
    plan = variance_plan(get_task(case["task"]), vocab_size=30, **knobs)
    return {"groups": plan.groups, "K": case["sketch_dim"], "n_prompts": case["n_prompts"],
            "n_boot": case.get("n_boot", 1000), "level": case.get("level", 0.95),
            "schemes": case["schemes"]}


def test_quickstart_settings_are_read():
    """The quickstart's own sizes (a smaller quickstart must still be what the slow test runs):
    every G gets at least the floor's 1024 groups, and the headline labels are in the suite."""
    s = quickstart_settings()
    assert s["groups"] and all(m >= 1024 for m in s["groups"].values()), s
    assert set(SCHEMES) <= set(s["schemes"]) and s["K"] and s["n_prompts"] >= 1


@pytest.mark.slow
@pytest.mark.parametrize("G", [2, 4])
def test_quickstart_headlines_cover_at_its_settings_slow(G):
    """At the quickstart's groups, K, prompts (pooled), n_boot and level, on the heavier `tiny`
    setup: centered / OTB / OTB-exact variance, MSE, projection and the paired ratios cover the
    flat truth within 2 points of nominal plus two binomial SEs of REPS replicates."""
    s = quickstart_settings()
    assert s["level"] == 0.95, "the harness's intervals are at the default level 0.95"
    if G not in s["groups"]:
        pytest.skip(f"the quickstart has no G = {G}")
    setups = C.build_setups("tiny", s["n_prompts"])
    truths = [C.add_ratios(C.truth(x, G, SCHEMES), PAIRS) for x in setups]
    cov = C.coverage(setups, G, s["groups"][G], REPS, truths, SCHEMES, K=s["K"],
                     n_boot=s["n_boot"])
    se = (s["level"] * (1 - s["level"]) / REPS) ** 0.5
    print({k: round(h / n, 3) for k, (h, n, _) in sorted(cov.items())})
    assert all(abs(h / n - s["level"]) <= 0.02 + 2 * se for h, n, _ in cov.values()), cov
