"""varbench.app.executors: every case kind dispatches to the library."""

from __future__ import annotations

from varbench.app import executors as kinds
from varbench.app.suite import load_suite

KIND_CASES = """
[suite]
name = "kinds"
seed = 0
[defaults]
preset = "micro"
states = ["random"]
[[cases]]
name = "proxy"
kind = "proxy"
n_prompts = 1
G = 2
n_boot = 10
[[cases]]
name = "variance"
kind = "variance"
schemes = ["centered", "otb"]
Gs = [2]
M = 3
min_responses = 0
n_prompts = 1
knobs = { n = 2 }
[[cases]]
name = "cancel"
kind = "cancellation"
tasks = ["arith"]
n_prompts = 1
G = 2
inner_steps = [0]
sketch_dim = 0
[[cases]]
name = "train"
kind = "train"
policy = "micro"
warm_start = false
steps = 1
G = 2
prompts_per_step = 1
eval_every = 1
eval_prompts = 2
eval_samples = 1
[[cases]]
name = "validate"
kind = "validate"
reduced = true
tasks = ["sort"]
"""


def test_every_kind_dispatches_to_the_library(tmp_path):
    """Each analysis kind builds its Policy/Task from the suite's settings and returns results
    (micro preset at random init; `validate` is only validated, it trains for minutes)."""
    from varbench.report.result import AnalysisResult

    p = tmp_path / "kinds.toml"
    p.write_text(KIND_CASES)
    suite = load_suite(p)
    assert [c.kind for c in suite.cases] == ["proxy", "variance", "cancellation", "train",
                                            "validate"]
    for case in suite.cases[:4]:
        results = kinds.KINDS[case.kind].execute(case.name, case.params, tmp_path / case.name,
                                                 False)
        assert results and all(isinstance(r, AnalysisResult) for r in results)
        assert all(r.records and r.name == case.name for r in results), case.name
    assert (tmp_path / "train" / "run" / "records.csv").is_file()


def test_fused_attention_is_switched_and_said_in_the_result(tmp_path, monkeypatch):
    """An analysis on a model whose attention kernel has no batched backward (pretended here:
    CUDA's fused sdpa) runs it as math SDPA and says so in the result's notes; the model's own
    setting is back afterwards."""
    from varbench.grads import precision

    seen = []
    real = precision.fused_attention_kernel

    def pretend(model, device=None):
        seen.append(real(model, "cuda"))  # the same model, as it would be on a GPU
        return "sdpa (flash CUDA kernels)"

    monkeypatch.setattr(precision, "fused_attention_kernel", pretend)
    p = tmp_path / "kinds.toml"
    p.write_text(KIND_CASES)
    case = load_suite(p).cases[0]  # proxy
    (res,) = kinds.KINDS["proxy"].execute(case.name, case.params, tmp_path / "p", False)
    assert seen and seen[0] is not None and seen[0].startswith("sdpa (")
    assert any("math SDPA" in n for n in res.notes)
    assert res.provenance["attention_switch"] == [n for n in res.notes if "math SDPA" in n]
