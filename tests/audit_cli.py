"""Bad-input audit of the command line and the API: every case is run and classified.

    python tests/audit_cli.py          # prints the table (and one line per case with -v)

A case is a command line (run in process through ``varbench.app.cli.main``) or an API call,
with the exit code (or exception) it should produce and a word its message must contain (the
offending key, value or path). Each outcome is one of

- ``clear``: the expected exit code (2 bad input, 1 a failed check's verdict) or a UsageError,
  one line, naming what was wrong;
- ``unclear``: refused, but the message does not name it (or a different exit code);
- ``traceback``: an exception other than a user error escaped (a crash);
- ``accepted``: nothing was refused (the work would have started, or the call returned).

Work that a refused case must never reach is replaced by a tripwire (``_Accepted``): a suite
case executing, a training loop starting, a warm start being built. So an accepted case costs
nothing and is counted, not run. The test ``tests/test_audit_cli.py`` requires zero tracebacks,
zero unclear and zero accepted cases.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

OUTCOMES = ("clear", "unclear", "traceback", "accepted")


class _Accepted(Exception):
    """Raised by a tripwire: the bad input got through to the work."""


@dataclass
class Case:
    name: str
    argv: list[str] | None = None  # a command line, or
    call: Callable[[], Any] | None = None  # an API call
    token: str = ""  # a word the message must contain
    code: int = 2  # expected exit code of a command line
    verdict: Callable[[Any], bool] | None = None  # API: a returned result that is right
    category: str = ""  # one of CATEGORIES; "" reads it from the case (category_of)
    context: Callable[[], Any] | None = None  # a context manager the case runs inside


# the independent audit's categories (issue 32), each counted in the table
CATEGORIES = ("flags", "data files", "suite TOML", "merge", "OS errors", "resume", "API",
              "hostile checkpoints")
_OS_WORDS = ("is a file", "under a file", "held by", "300-char", "full disk", "NUL")


def category_of(case: Case) -> str:
    """The case's category: as given, else from its command and name."""
    if case.category:
        return case.category
    name = case.name
    if any(w in name for w in ("checkpoint", "model vocab")):
        return "hostile checkpoints"
    if "resume" in name or "holds a run" in name:
        return "resume"
    if case.argv is None:
        return "API"
    if any(w in name for w in _OS_WORDS):
        return "OS errors"
    if "UTF-8" in name or "answer" in name:
        return "data files"
    if case.argv[0] == "merge":
        return "merge"
    if case.argv[0] == "run" and not any(a.startswith("--") for a in case.argv[2:]):
        return "suite TOML"
    return "flags"


ONE_CASE = """
[suite]
name = {name}

[[cases]]
name = {case}
kind = "check"
estimator = "centered"
num_steps = 10
baselines = []
{extra}
"""

CHECK_OK = """
[suite]
name = "okay"

[[cases]]
name = "c"
kind = "check"
estimator = "centered"
num_steps = 10
baselines = []
"""


def _suite(root: Path, label: str, name: str = '"s"', case: str = '"c"', extra: str = "",
           body: str | None = None) -> str:
    path = root / f"{label}.toml"
    path.write_text(body if body is not None else ONE_CASE.format(name=name, case=case,
                                                                  extra=extra))
    return str(path)


def _second(kind_body: str) -> str:
    return (f'\n[[cases]]\nname = "second"\n{kind_body}\n')


def build_cases(root: Path) -> list[Case]:
    """Every audited case; files they need are written under ``root``."""
    import torch

    blocker = root / "a_file"
    blocker.write_text("x")
    victim = root / "victim.json"
    victim.write_text('{"keep": true}')
    shard = root / "shard"
    _run_suite(_suite(root, "okay", body=CHECK_OK), str(shard))
    manifest = json.loads((shard / "suite.json").read_text())

    def hostile_shard(label: str, change: Callable[[dict], None]) -> str:
        d = root / label
        shutil.copytree(shard, d)
        m = json.loads(json.dumps(manifest))
        change(m)
        (d / "suite.json").write_text(json.dumps(m))
        return str(d)

    symlinked = hostile_shard("sym", lambda m: None)
    (Path(symlinked) / "cases" / "evil.json").symlink_to(victim)
    other = hostile_shard("other", lambda m: m.update(digest="0" * 16))
    nomani = root / "nomanifest"
    nomani.mkdir()
    corrupt = hostile_shard("corrupt", lambda m: None)
    (Path(corrupt) / "suite.json").write_text("{not json")
    summ = root / "summaries"
    summ.mkdir()

    def summary(label: str, data: Any, raw: str | None = None) -> str:
        d = summ / label
        d.mkdir()
        (d / "summary.json").write_text(raw if raw is not None else json.dumps(data))
        return str(d)

    good = summary("good", {"schema": "varbench.report/1", "analyses": [
        {"name": "a", "headlines": [{"key": "x", "value": 1.0, "se": 0.1}]}]})
    (root / "zero_est.py").write_text(
        "import torch\ndef zeros(rewards, mask, **kw):\n"
        "    return torch.zeros(mask.shape, dtype=rewards.dtype)\n")
    locked = root / "locked"
    s = _suite(root, "plain")
    r, m = torch.rand(2, 4), torch.ones(2, 4, 3)

    def adv(**kw):
        import varbench as vb

        args = {"logprobs": -torch.rand(2, 4, 3), "sum_pi_sq": torch.rand(2, 4, 3), **kw}
        rewards = args.pop("rewards", r)
        return vb.advantages(args.pop("scheme", "otb"), rewards, args.pop("mask", m), **args)

    def nan_at(t: torch.Tensor, v: float = float("nan")) -> torch.Tensor:
        t = t.clone()
        t[0, 1, 2] = v
        return t

    def api(name, call, token, verdict=None):
        return Case(name, call=call, token=token, verdict=verdict)

    def checkpoint_flipped():
        from varbench.train.checkpoint import load_checkpoint, save_checkpoint

        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters())
        ck = save_checkpoint(root / "ck", 1, model, opt, {}, {})
        data = bytearray((ck / "model.safetensors").read_bytes())
        data[-2] ^= 1
        (ck / "model.safetensors").write_bytes(bytes(data))
        return load_checkpoint(ck, model, opt, {})

    def records_gap():
        from varbench.train.records import RecordWriter

        w = RecordWriter(root / "rec.csv")
        for step in (0, 1, 3):
            w.write({"step": step})
        return RecordWriter(root / "rec.csv", resume_step=3)

    def import_order():
        # In this process varbench.train (the package) is imported by now: the order that
        # used to bind the name to the module. tests/test_api_imports.py tries fresh orders.
        import types

        ns: dict = {}
        exec("from varbench import TrainConfig, train", ns)
        return "module" if isinstance(ns["train"], types.ModuleType) else "function"

    from varbench._util.checks import check_device

    cases = [
        # ---- run: the suite file
        Case("run: missing suite file", ["run", str(root / "nope.toml")], "does not exist"),
        Case("run: not TOML", ["run", _suite(root, "nottoml", body="[suite\nname=")],
             "not valid TOML"),
        Case("run: no [suite]", ["run", _suite(root, "nosuite", body="[[cases]]\nname='c'\n")],
             "[suite]"),
        Case("run: suite name absolute", ["run", _suite(root, "abs", name='"/tmp/x"')],
             "not a safe name"),
        Case("run: suite name ../", ["run", _suite(root, "dotdot", name='"../../x"')],
             "not a safe name"),
        Case("run: suite name baselines/quickstart",
             ["run", _suite(root, "golden", name='"baselines/quickstart"')], "not a safe name"),
        Case("run: suite name NUL", ["run", _suite(root, "nul", name='"a\\u0000b"')],
             "not a safe name"),
        Case("run: suite name 300 chars", ["run", _suite(root, "long", name='"' + "x" * 300 + '"')],
             "not a safe name"),
        Case("run: suite name not a string", ["run", _suite(root, "nstr", name="3")], "'name'"),
        Case("run: case name ../", ["run", _suite(root, "cdot", case='"../c"')], "'name'"),
        Case("run: case name absolute", ["run", _suite(root, "cabs", case='"/c"')], "'name'"),
        Case("run: duplicate case names",
             ["run", _suite(root, "dup", extra=_second('kind = "check"\nestimator = "rloo"')
                            .replace('"second"', '"c"'))], "duplicate"),
        Case("run: unknown kind", ["run", _suite(root, "kind", extra=_second('kind = "nope"'))],
             "'kind'"),
        Case("run: unknown key", ["run", _suite(root, "ukey", extra="bogus = 1")],
             "unknown key 'bogus'"),
        Case("run: wrong type", ["run", _suite(root, "type", extra='G = "four"')], "'G'"),
        Case("run: case 2 G = 0",
             ["run", _suite(root, "g0", extra=_second('kind = "check"\nestimator = "rloo"\n'
                                                      "G = 0"))], "cases[1] ('second') key 'G'"),
        Case("run: G = -3", ["run", _suite(root, "gneg", extra="G = -3")], "'G'"),
        Case("run: num_steps = 1", ["run", _suite(root, "steps1", body=ONE_CASE.format(
            name='"s"', case='"c"', extra="").replace("num_steps = 10", "num_steps = 1"))],
             "'num_steps'"),
        Case("run: alpha = inf", ["run", _suite(root, "ainf", extra="alpha = inf")], "'alpha'"),
        Case("run: alpha = nan", ["run", _suite(root, "anan", extra="alpha = nan")], "'alpha'"),
        Case("run: tolerance = inf", ["run", _suite(root, "tinf", extra="tolerance = inf")],
             "'tolerance'"),
        Case("run: variance Gs = []", ["run", _suite(root, "gs", extra=_second(
            'kind = "variance"\nGs = []'))], "'Gs'"),
        Case("run: variance schemes = []", ["run", _suite(root, "sch", extra=_second(
            'kind = "variance"\nschemes = []'))], "'schemes'"),
        Case("run: variance Gs = [2, 0]", ["run", _suite(root, "gs0", extra=_second(
            'kind = "variance"\nGs = [2, 0]'))], "'Gs'"),
        Case("run: variance sketch_dim = -1", ["run", _suite(root, "sk", extra=_second(
            'kind = "variance"\nsketch_dim = -1'))], "'sketch_dim'"),
        Case("run: variance M huge", ["run", _suite(root, "m", extra=_second(
            'kind = "variance"\nM = 3200000000'))], "'M'"),
        Case("run: variance n_ref = 0", ["run", _suite(root, "nref", extra=_second(
            'kind = "variance"\nn_ref = 0'))], "'n_ref'"),
        Case("run: variance unknown scheme", ["run", _suite(root, "usch", extra=_second(
            'kind = "variance"\nschemes = ["nope"]'))], "'nope'"),
        Case("run: variance unknown task", ["run", _suite(root, "utask", extra=_second(
            'kind = "variance"\ntask = "nope"'))], "'nope'"),
        Case("run: variance unknown preset", ["run", _suite(root, "upre", extra=_second(
            'kind = "variance"\npreset = "nope"'))], "'nope'"),
        Case("run: variance missing checkpoint", ["run", _suite(root, "uck", extra=_second(
            'kind = "variance"\ncheckpoint = "/no/such/dir"'))], "checkpoint"),
        Case("run: train lr = inf", ["run", _suite(root, "lr", extra=_second(
            'kind = "train"\nlr = inf'))], "'lr'"),
        Case("run: train lr = -1", ["run", _suite(root, "lrn", extra=_second(
            'kind = "train"\nlr = -1.0'))], "lr"),
        Case("run: train device bogus", ["run", _suite(root, "dev", extra=_second(
            'kind = "train"\ndevice = "bogus"'))], "'device'"),
        Case("run: train device cuda:97", ["run", _suite(root, "dev97", extra=_second(
            'kind = "train"\ndevice = "cuda:97"'))], "'device'"),
        Case("run: train steps = 0", ["run", _suite(root, "st0", extra=_second(
            'kind = "train"\nsteps = 0'))], "steps"),
        Case("run: train unknown scheme", ["run", _suite(root, "tsch", extra=_second(
            'kind = "train"\nscheme = "nope"'))], "'nope'"),
        Case("run: estimator module missing", ["run", _suite(root, "est", extra=_second(
            'kind = "check"\nestimator = "no_such_mod_xyz:f"'))], "no_such_mod_xyz"),
        # ---- issue 32: a suite file reaches no code; names; reserved outputs
        Case("run: factory runs shell (no --allow-code)", ["run", _suite(root, "shell", extra=(
            _second('kind = "train"\ntask = "subprocess:getoutput"\n'
                    'task_options = { cmd = "touch ran" }'))), "--shard", "1/2"],
             "subprocess:getoutput"),
        Case("run: trust_remote_code (no --allow-code)", ["run", _suite(root, "trc", extra=(
            _second('kind = "variance"\ntrust_remote_code = true')))], "--allow-code"),
        Case("run: suite name with trailing newline", ["run", _suite(
            root, "nl", name='"quickstart\\n"')], "not a safe name"),
        Case("run: suite named baselines", ["run", _suite(root, "resv", name='"baselines"')],
             "reserved"),
        Case("compare: new SE 1e300 hides a change", ["compare", good, summary("bse", {
            "schema": "varbench.report/1", "analyses": [
                {"name": "a", "headlines": [{"key": "x", "value": 99.0, "se": 1e300}]}]})],
             "undefined", code=1),
        Case("run: --shard 0/3", ["run", s, "--shard", "0/3"], "--shard"),
        Case("run: --shard x", ["run", s, "--shard", "x"], "--shard"),
        Case("run: --out is a file", ["run", s, "--out", str(blocker)], str(blocker)),
        Case("run: --out under a file", ["run", s, "--out", str(blocker / "sub")], str(blocker)),
        Case("run: --out 300-char name", ["run", s, "--out", str(root / ("y" * 300))],
             "not a valid path"),
        Case("run: --out held by another run", ["run", s, "--out", str(locked)],
             "in use by process"),
        # ---- merge
        Case("merge: not a run output", ["merge", str(nomani), "--out", str(root / "m1")],
             "suite.json"),
        Case("merge: corrupt suite.json", ["merge", corrupt, "--out", str(root / "m2")],
             "is corrupt"),
        Case("merge: absolute case key", ["merge", hostile_shard(
            "abskey", lambda m: m["cases"].append(str(victim.with_suffix("")))), "--out",
            str(root / "m3")], "not a safe name"),
        Case("merge: ../ case key", ["merge", hostile_shard(
            "dotkey", lambda m: m["cases"].append("../../victim")), "--out", str(root / "m4")],
             "not a safe name"),
        Case("merge: NUL case key", ["merge", hostile_shard(
            "nulkey", lambda m: m["cases"].append("a\x00b")), "--out", str(root / "m5")],
             "not a safe name"),
        Case("merge: case key not a string", ["merge", hostile_shard(
            "intkey", lambda m: m["cases"].append(7)), "--out", str(root / "m6")],
             "not a safe name"),
        Case("merge: cases not a list", ["merge", hostile_shard(
            "dictcases", lambda m: m.update(cases={"a": 1})), "--out", str(root / "m7")],
             "'cases'"),
        Case("merge: symlink to a file outside", ["merge", symlinked, "--out",
                                                  str(root / "m8")], "outside"),
        Case("merge: shards of different suites", ["merge", str(shard), other, "--out",
                                                   str(root / "m9")], "different suites"),
        Case("merge: missing cases", ["merge", hostile_shard(
            "missing", lambda m: m["cases"].append("ghost-0123456789abcdef")), "--out",
            str(root / "m10")], "missing"),
        Case("merge: --out is a file", ["merge", str(shard), "--out", str(blocker)],
             str(blocker)),
        # ---- compare
        Case("compare: no summary.json", ["compare", str(root / "nope"), good], "summary.json"),
        Case("compare: not JSON", ["compare", summary("nj", None, "{x"), good],
             "not a varbench summary"),
        Case("compare: other schema", ["compare", summary("sch", {
            "schema": "varbench.report/99", "analyses": []}), good], "schema"),
        Case("compare: no schema", ["compare", summary("nosch", {"analyses": []}), good],
             "schema"),
        Case("compare: analyses not a list", ["compare", summary("al", {
            "schema": "varbench.report/1", "analyses": 3}), good], "'analyses'"),
        Case("compare: value a string", ["compare", summary("vs", {
            "schema": "varbench.report/1", "analyses": [
                {"name": "a", "headlines": [{"key": "x", "value": "1"}]}]}), good],
             "not a number"),
        Case("compare: negative SE", ["compare", summary("nse", {
            "schema": "varbench.report/1", "analyses": [
                {"name": "a", "headlines": [{"key": "x", "value": 1.0, "se": -1}]}]}), good],
             "se="),
        Case("compare: inf SE hides a change", ["compare", good, summary("ise", None, json.dumps(
            {"schema": "varbench.report/1", "analyses": [
                {"name": "a", "headlines": [{"key": "x", "value": 99.0,
                                             "se": float("inf")}]}]}))], "undefined", code=1),
        Case("compare: huge integer value", ["compare", good, summary("hv", None, (
            '{"schema": "varbench.report/1", "analyses": [{"name": "a", "headlines": '
            '[{"key": "x", "value": 1' + "0" * 400 + ', "se": 0.1}]}]}'))], "undefined",
             code=1),
        Case("compare: huge SEs", ["compare", good, summary("hse", {
            "schema": "varbench.report/1", "analyses": [
                {"name": "a", "headlines": [{"key": "x", "value": 1e308, "se": 1e300}]}]})],
             "regression", code=1),
        Case("compare: --tolerance inf", ["compare", good, good, "--tolerance", "inf"],
             "tolerance"),
        Case("compare: --tolerance nan", ["compare", good, good, "--tolerance", "nan"],
             "tolerance"),
        Case("compare: --rel-tolerance -1", ["compare", good, good, "--rel-tolerance", "-1"],
             "rel_tolerance"),
        Case("compare: path is a file", ["compare", str(blocker), good], str(blocker)),
        # ---- check
        Case("check: module not found", ["check", "no_such_mod_xyz:f"], "no_such_mod_xyz"),
        Case("check: unknown scheme", ["check", "nope_scheme"], "nope_scheme"),
        Case("check: -G 0", ["check", "centered", "-G", "0"], "G=0"),
        Case("check: --steps 1", ["check", "centered", "--steps", "1"], "num_steps"),
        Case("check: --alpha 2", ["check", "centered", "--alpha", "2"], "alpha"),
        Case("check: --alpha nan", ["check", "centered", "--alpha", "nan"], "alpha"),
        Case("check: --tolerance inf", ["check", "centered", "--tolerance", "inf"], "tolerance"),
        Case("check: --max-variance-ratio -1", ["check", "centered",
                                               "--max-variance-ratio", "-1"],
             "max_variance_ratio"),
        Case("check: unknown baseline", ["check", "centered", "--baselines", "nope"], "nope"),
        Case("check: all-zero estimator", ["check", "zero_est:zeros", "--steps", "30",
                                           "--baselines", ""], "no gradient signal", code=1),
        Case("check: centered -G 1", ["check", "centered", "-G", "1", "--steps", "30",
                                      "--baselines", ""], "G=1", code=1),
        # ---- train
        Case("train: --out is a file", ["train", "--out", str(blocker), "--policy", "micro",
                                        "--no-warm-start"], str(blocker)),
        Case("train: --lr inf", ["train", "--out", str(root / "t1"), "--lr", "inf"], "lr"),
        Case("train: --lr nan", ["train", "--out", str(root / "t2"), "--lr", "nan"], "lr"),
        Case("train: --device bogus", ["train", "--out", str(root / "t3"), "--device",
                                       "bogus"], "device"),
        Case("train: --device cuda:97", ["train", "--out", str(root / "t4"), "--device",
                                         "cuda:97"], "device"),
        Case("train: --steps 0", ["train", "--out", str(root / "t5"), "--steps", "0"], "steps"),
        Case("train: -G 0", ["train", "--out", str(root / "t6"), "-G", "0"], "G"),
        Case("train: unknown scheme", ["train", "--out", str(root / "t7"), "--scheme", "nope"],
             "nope"),
        Case("train: unknown task", ["train", "--out", str(root / "t8"), "--task", "nope"],
             "nope"),
        Case("train: missing --config", ["train", "--out", str(root / "t9"), "--config",
                                         str(root / "none.toml")], "does not exist"),
        # ---- analyses
        Case("variance: --n-ref 0", ["variance", "--out", str(root / "v1"), "--n-ref", "0"],
             "n_ref"),
        Case("variance: -M 0", ["variance", "--out", str(root / "v2"), "-M", "0"], "'M'"),
        Case("variance: -M huge", ["variance", "--out", str(root / "v3"), "-M", "3200000000"],
             "'M'"),
        Case("variance: -G 0", ["variance", "--out", str(root / "v4"), "-G", "0"], "'Gs'"),
        Case("variance: --sketch-dim -1", ["variance", "--out", str(root / "v5"),
                                           "--sketch-dim", "-1"], "sketch_dim"),
        Case("variance: unknown scheme", ["variance", "--out", str(root / "v6"), "--schemes",
                                          "nope"], "nope"),
        Case("variance: --out is a file", ["variance", "--out", str(blocker)], str(blocker)),
        Case("cancellation: --inner-steps -1", ["cancellation", "--out", str(root / "c1"),
                                                "--inner-steps", "-1"], "inner_steps"),
        Case("cancellation: -G 0", ["cancellation", "--out", str(root / "c2"), "-G", "0"],
             "'G'"),
        Case("proxy: --prompts 0", ["proxy", "--out", str(root / "p1"), "--prompts", "0"],
             "n_prompts"),
        # ---- foundation
        Case("warmstart: unknown preset", ["warmstart", "--preset", "nope"], "nope"),
        Case("warmstart: unknown task", ["warmstart", "--task", "nope"], "nope"),
        Case("warmstart: --cache-dir is a file", ["warmstart", "--preset", "micro",
                                                  "--cache-dir", str(blocker)], str(blocker)),
        # ---- API entry points
        api("advantages: NaN logprobs", lambda: adv(logprobs=nan_at(-torch.rand(2, 4, 3))),
            "logprobs"),
        api("advantages: inf token_weights", lambda: adv(token_weights=nan_at(
            torch.ones(2, 4, 3), float("inf"))), "token_weights"),
        api("advantages: NaN importance_weights", lambda: adv(importance_weights=nan_at(
            torch.ones(2, 4, 3))), "importance_weights"),
        api("advantages: NaN sum_pi_sq", lambda: adv(sum_pi_sq=nan_at(torch.rand(2, 4, 3))),
            "sum_pi_sq"),
        api("advantages: rewards +/-3e38", lambda: adv(scheme="centered", rewards=torch.tensor(
            [[3e38, -3e38, 0.0, 1.0], [0.0, 1.0, 0.0, 1.0]])), "rewards"),
        api("advantages: NaN reward", lambda: adv(scheme="centered", rewards=torch.tensor(
            [[float("nan"), 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 1.0]])), "rewards"),
        api("advantages: all-zero mask", lambda: adv(scheme="centered",
                                                     mask=torch.zeros(2, 4, 3)), "mask"),
        api("advantages: unknown scheme", lambda: adv(scheme="nope"), "nope"),
        api("advantages: unknown option", lambda: adv(scheme="centered", bogus=1), "bogus"),
        api("TrainConfig(lr=inf)", lambda: _train_config(lr=float("inf")), "lr"),
        api("TrainConfig(lr=nan)", lambda: _train_config(lr=float("nan")), "lr"),
        api("TrainConfig(kl_coef=inf)", lambda: _train_config(kl_coef=float("inf")), "kl_coef"),
        api("train(device='bogus')", lambda: _train_call(device="bogus"), "device"),
        api("check_device('cuda:97')", lambda: check_device("device", "cuda:97"), "cuda:97"),
        api("check_estimator(tolerance=inf)", lambda: _check_estimator(tolerance=float("inf")),
            "tolerance"),
        api("check_estimator(G=1) verdict", lambda: _check_estimator(G=1, num_steps=30,
                                                                     baselines=()),
            "", verdict=lambda res: not res.passed),
        api("compare_reports(NUL path)", lambda: _compare("a\x00b", good), "not a valid path"),
        api("run_suite(out_dir with NUL)", lambda: _run_suite(s, str(root / "a\x00b")),
            "not a valid path"),
        api("CaseCache.path('../x')", lambda: _case_path(root, "../x"), "not a safe name"),
        api("CaseCache.path('/abs')", lambda: _case_path(root, "/abs"), "not a safe name"),
        api("load_checkpoint: flipped bit", checkpoint_flipped, "content hash"),
        api("resume over a gapped records.csv", records_gap, "missing steps"),
        api("from varbench import TrainConfig, train", import_order, "",
            verdict=lambda got: got == "function"),
    ]
    cases += _issue29_cases(root)
    cases += _issue32_cases(root, manifest_of=manifest, shard=shard)
    return cases


def _issue29_cases(root: Path) -> list[Case]:
    """Issue 29: a user's own checkpoint and data (non-UTF-8 rows, empty answers, a model
    vocabulary smaller than its tokenizer, a missing tokenizer, an existing run directory)."""
    from varbench.models import build_preset, save_policy

    d = root / "i29"
    d.mkdir()
    (d / "latin.jsonl").write_bytes(b'{"question": "a", "answer": "1"}\n'
                                    b'{"question": "caf\xe9", "answer": "2"}\n')
    (d / "latin.csv").write_bytes(b"question,answer\na,1\ncaf\xe9,2\n")
    (d / "empty.csv").write_text("question,answer\na,1\nb,\nc,3\n")
    (d / "blank.jsonl").write_text('{"question": "a", "answer": "1"}\n'
                                   '{"question": "b", "answer": ""}\n')
    (d / "ok.jsonl").write_text("".join(f'{{"question": "q{i}", "answer": "{i}"}}\n'
                                        for i in range(4)))
    small = save_policy(build_preset("micro", seed=0), d / "small")
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(str(small))
    m.resize_token_embeddings(m.get_input_embeddings().num_embeddings - 3)
    m.save_pretrained(small, safe_serialization=True)
    notok = save_policy(build_preset("micro", seed=0), d / "notok")
    for f in list(notok.glob("tokenizer*")) + list(notok.glob("special_tokens_map.json")):
        f.unlink()
    run = d / "run"
    run.mkdir()
    (run / "records.csv").write_text("step\n0\n")
    (run / "config.json").write_text("{}")
    trap = _suite(root, "trap", body='[suite]\nname = "trap"\n[defaults]\npolicy = "micro"\n'
                  '[[cases]]\nname = "p"\nkind = "proxy"\nstates = ["random"]\n')
    return [
        Case("run: [defaults] policy beside a proxy case (it reads preset/checkpoint)",
             ["run", trap, "--out", str(d / "trap_out")], "does not apply to a 'proxy' case"),
        Case("sample: non-UTF-8 .jsonl", ["sample", "--task", str(d / "latin.jsonl")],
             "line 2 is not UTF-8"),
        Case("sample: non-UTF-8 .csv", ["sample", "--task", str(d / "latin.csv")],
             "line 3 is not UTF-8"),
        Case("sample: empty CSV answer cell", ["sample", "--task", str(d / "empty.csv")],
             "row 2 has no answer"),
        Case("sample: empty JSONL answer", ["sample", "--task", str(d / "blank.jsonl")],
             "row 2 has no answer"),
        Case("sample: model vocab < tokenizer", ["sample", "--policy", str(small), "--task",
                                                 str(d / "ok.jsonl")], "vocabulary has"),
        Case("sample: checkpoint without tokenizer", ["sample", "--policy", str(notok),
                                                      "--task", str(d / "ok.jsonl")],
             "has no tokenizer"),
        Case("train: --out holds a run", ["train", "--out", str(run)], "already holds a run"),
        Case("train: --resume --overwrite", ["train", "--resume", "--overwrite", "--out",
                                             str(run)], "exclusive"),
        *_issue29_point6_cases(d),
    ]


def _issue29_point6_cases(d: Path) -> list[Case]:
    """Issue 29 point 6: the cost plan checks like the run; check and validate on the user's
    task and checkpoint; validate's bounds and its suite's code."""
    code_suite = d / "validate_code.toml"
    code_suite.write_text('[suite]\nname = "vc"\n[[cases]]\nname = "grid"\nkind = "validate"\n'
                          'tasks = ["mine"]\nbudgets = { mine = 300 }\n'
                          'task_specs = { mine = { task = "mymod:make_task" } }\n')
    run_code = d / "run_code.toml"
    run_code.write_text('[suite]\nname = "rc"\n[[cases]]\nname = "v"\nkind = "variance"\n'
                        'task = "mymod:make_task"\n')
    out = str(d / "v6")
    return [
        Case("variance --plan: M below 3", ["variance", "--plan", "-M", "2"], "M=2"),
        Case("variance --plan: --n-ref 1 (sampled)", ["variance", "--plan", "--reference",
                                                      "sampled", "--n-ref", "1"], "n_ref=1"),
        Case("run --plan: suite names code", ["run", str(run_code), "--plan"], "--allow-code"),
        Case("check: --prompts without --policy/--task", ["check", "rloo", "--prompts", "3"],
             "applies to your policy and task"),
        Case("check: --task unknown", ["check", "rloo", "--task", "nosuch"], "nosuch"),
        Case("check: --policy not a checkpoint", ["check", "rloo", "--policy", str(d)],
             "checkpoint directory"),
        Case("validate: --threshold-frac 2", ["validate", "--threshold-frac", "2", "--out",
                                              out], "(0, 1]"),
        Case("validate: --threshold-frac nan", ["validate", "--threshold-frac", "nan", "--out",
                                                out], "(0, 1]"),
        Case("validate: --tasks a data file", ["validate", "--tasks", str(d / "ok.jsonl"),
                                               "--out", out], "--task LABEL=SPEC"),
        Case("validate: --task without demonstrations",
             ["validate", "--task", f"ok={d / 'ok.jsonl'}", "--out", out], "no demonstrations"),
        Case("validate: --task LABEL missing", ["validate", "--task", "ok", "--out", out],
             "LABEL=SPEC"),
        Case("validate: --suite names code", ["validate", "--suite", str(code_suite), "--out",
                                              out], "--allow-code"),
    ]


def _issue32_cases(root: Path, *, manifest_of: dict, shard: Path) -> list[Case]:
    """Issue 32: bounds from one declaration (flags, suite keys, the library), a memory
    estimate, the API's NaN and shape gaps, full disks, merge's subdirectories and sealed but
    malformed results, a damaged run config, hostile checkpoints, a --config naming code."""
    import errno
    import struct

    import torch

    import varbench as vb
    from varbench.models import build_preset, save_policy

    d = root / "i32"
    d.mkdir()
    out = str(d / "out")
    base = save_policy(build_preset("micro", seed=0), d / "ckpt")

    def ckpt(label: str, change: Callable[[Path], None]) -> str:
        c = d / label
        shutil.copytree(base, c)
        change(c)
        return str(c)

    def lie(c: Path) -> None:  # the header claims more bytes than the file holds
        f = c / "model.safetensors"
        b = f.read_bytes()
        n = struct.unpack("<Q", b[:8])[0]
        h = json.loads(b[8:8 + n])
        k = next(k for k in h if k != "__metadata__")
        h[k]["data_offsets"][1] += 10**6
        hb = json.dumps(h).encode()
        hb += b" " * ((8 - len(hb) % 8) % 8)
        f.write_bytes(struct.pack("<Q", len(hb)) + hb + b[8 + n:])

    marker = d / "remote_code_ran"

    def auto_map(model_type: str | None) -> Callable[[Path], None]:
        def change(c: Path) -> None:
            cfg = json.loads((c / "config.json").read_text())
            cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig",
                               "AutoModelForCausalLM": "evil.Evil"}
            if model_type:
                cfg["model_type"] = model_type
            (c / "config.json").write_text(json.dumps(cfg))
            (c / "evil.py").write_text(f"open({str(marker)!r}, 'w')\n")
        return change

    garbage = ckpt("garbage", lambda c: (c / "config.json").write_text("{not json"))
    lies = ckpt("lies", lie)
    nocfg = ckpt("nocfg", lambda c: (c / "config.json").unlink())
    native = ckpt("automap", auto_map(None))
    foreign = ckpt("automap_foreign", auto_map("evil_arch"))

    def no_remote_code_ran() -> tuple[int, bool]:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from varbench.app.cli import main

            code = main(["sample", "--policy", native, "--task", "sort", "-G", "2",
                         "--prompts", "1"])
        return code, marker.exists()

    def hostile_shard(label: str, change: Callable[[Path], None]) -> str:
        s = d / label
        shutil.copytree(shard, s)
        change(s)
        return str(s)

    def twice(s: Path) -> None:
        m = json.loads(json.dumps(manifest_of))
        m["cases"] = m["cases"] * 2
        (s / "suite.json").write_text(json.dumps(m))

    def malformed(s: Path) -> None:
        from varbench._util.io import seal_json

        (f,) = (s / "cases").glob("*.json")
        payload = json.loads(f.read_text())
        payload["results"][0]["headlines"] = "not a list"
        f.write_text(json.dumps(seal_json(payload)))

    def out_with_link(label: str, sub: str) -> str:
        o = d / label
        o.mkdir()
        (d / f"{label}_elsewhere").mkdir()
        (o / sub).symlink_to(d / f"{label}_elsewhere")
        return str(o)

    @contextlib.contextmanager
    def full_disk():
        from varbench._util import io as vio

        real = vio.os.fdopen

        class Full:
            def __init__(self, fh):
                self.fh = fh

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                self.fh.close()

            def write(self, data):
                raise OSError(errno.ENOSPC, "No space left on device")

            def __getattr__(self, name):
                return getattr(self.fh, name)

        vio.os.fdopen = lambda *a, **k: Full(real(*a, **k))
        try:
            yield
        finally:
            vio.os.fdopen = real

    def checkpoint_full_disk():
        from varbench.train import checkpoint

        real = checkpoint.save_model

        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device")

        checkpoint.save_model = full
        model = torch.nn.Linear(3, 2)
        try:
            checkpoint.save_checkpoint(d / "ckfull", 1, model, torch.optim.AdamW(
                model.parameters()), {}, {})
        except OSError as err:
            return err
        finally:
            checkpoint.save_model = real
        return None

    run = d / "damaged"
    run.mkdir()
    (run / "records.csv").write_text("step\n0\n")
    (run / "config.json").write_text("{garbage")
    code_cfg = d / "code.toml"
    code_cfg.write_text('scheme = "os:system"\n[task_options]\nverifier = "evil:fn"\n')
    (d / "bad.toml").write_text("steps = \n")
    pol, task = build_preset("micro", seed=0), vb.get_task("sort", n=2)
    P, G, T = 2, 4, 3
    m, lp = torch.ones(P, G, T), -torch.rand(P, G, T)
    nan = float("nan")

    def nan_at(t, v=nan):
        t = t.clone()
        t.view(-1)[1] = v
        return t

    def api(name, call, token, verdict=None):
        return Case(name, call=call, token=token, verdict=verdict)

    suite = ONE_CASE.format(name='"s"', case='"c"', extra="{extra}")

    def suite_with(label: str, extra: str) -> str:
        return _suite(d, label, body=suite.format(extra=extra))

    return [
        # ---- flags: one declaration of the bounds, refused before work
        Case("sample: -G 10000000", ["sample", "-G", "10000000"], "-G=10000000 is too large"),
        Case("sample: --temperature inf", ["sample", "--temperature", "inf"],
             "--temperature=inf"),
        Case("sample: --seed -1", ["sample", "--seed", "-1"], "--seed=-1"),
        Case("sample: --device meta", ["sample", "--device", "meta"], "'meta'"),
        Case("sample: --prompts 0", ["sample", "--prompts", "0"], "--prompts=0"),
        Case("sample: P x G beyond this machine's memory", ["sample", "-G", "65536",
                                                            "--prompts", "20000"],
             "more than this machine's RAM"),
        Case("check: --steps 10**12", ["check", "centered", "--steps", str(10**12)],
             "--steps=1000000000000 is too large"),
        Case("check: --seed -1", ["check", "centered", "--seed", "-1"], "--seed=-1"),
        Case("train: -G 10**9", ["train", "-G", str(10**9), "--out", out], "-G=1000000000"),
        Case("train: --temperature inf", ["train", "--temperature", "inf", "--out", out],
             "--temperature=inf"),
        Case("train: --seed -1", ["train", "--seed", "-1", "--out", out], "--seed=-1"),
        Case("train: --device meta", ["train", "--device", "meta", "--out", out], "'meta'"),
        Case("train: --clip-low 1", ["train", "--clip-low", "1", "--out", out], "--clip-low=1"),
        Case("warmstart: --max-steps 0", ["warmstart", "--max-steps", "0"], "--max-steps=0"),
        Case("compare: --abs-tolerance nan", ["compare", "a", "b", "--abs-tolerance", "nan"],
             "--abs-tolerance=nan"),
        # ---- suite TOML: the same declaration
        Case("run: check seed = -1", ["run", suite_with("seedneg", "seed = -1")], "'seed'"),
        Case("run: check G = 10**9", ["run", suite_with("gbig", "G = 1000000000")],
             "too large"),
        Case("run: train temperature = inf", ["run", _suite(d, "tinf", extra=_second(
            'kind = "train"\ntemperature = inf'))], "'temperature'"),
        Case("run: variance M = 10**12", ["run", _suite(d, "mbig", extra=_second(
            'kind = "variance"\nM = 1000000000000'))], "too large"),
        Case("run: device = meta", ["run", suite_with("meta", 'device = "meta"')], "'meta'"),
        # ---- data files: a --config file is data like a suite
        Case("train: --config names code without --allow-code",
             ["train", "--config", str(code_cfg), "--out", out], "this config names code",
             category="data files"),
        Case("train: --config not TOML", ["train", "--config", str(d / "bad.toml"), "--out",
                                          out], "not valid TOML", category="data files"),
        # ---- merge
        Case("merge: --out/cases is a symlink", ["merge", str(shard), "--out",
                                                 out_with_link("lc", "cases")], "is a symlink"),
        Case("merge: --out/tables is a symlink", ["merge", str(shard), "--out",
                                                  out_with_link("lt", "tables")],
             "is a symlink"),
        Case("merge: a manifest key listed twice", ["merge", hostile_shard("twice", twice),
                                                    "--out", str(d / "m1")], "more than once"),
        Case("merge: sealed but malformed result", ["merge", hostile_shard("bad", malformed),
                                                    "--out", str(d / "m2")], "corrupt"),
        # ---- OS errors
        Case("run: full disk during a JSON write", ["run", _suite(d, "full"), "--out",
                                                    str(d / "fullout")],
             "No space left on device", context=full_disk),
        api("full disk during a checkpoint", checkpoint_full_disk, "",
            verdict=lambda e: isinstance(e, OSError) and e.errno == errno.ENOSPC
            and "step_000001" in str(e.filename)),
        Case("train: --config is a directory", ["train", "--config", str(d), "--out", out],
             "is a directory", category="OS errors"),
        # ---- resume
        Case("train: --resume over a garbage config.json", ["train", "--resume", "--out",
                                                            str(run)], "not valid JSON"),
        # ---- API
        api("TrainConfig(G=10**12)", lambda: _train_config(G=10**12), "G=1000000000000"),
        api("TrainConfig(temperature=inf)", lambda: _train_config(temperature=float("inf")),
            "temperature"),
        api("TrainConfig(seed=-1)", lambda: _train_config(seed=-1), "seed=-1"),
        api("estimator_variance(M=10**12)", lambda: vb.estimator_variance(pol, task, M=10**12),
            "M=1000000000000 is too large"),
        api("estimator_variance(level=nan)", lambda: vb.estimator_variance(pol, task,
                                                                           level=nan), "level"),
        api("sample(temperature=inf)", lambda: vb.sample(pol, task, task.prompts(1), 2,
                                                         temperature=float("inf")),
            "temperature"),
        api("check_estimator(num_steps=10**12)", lambda: _check_estimator(num_steps=10**12),
            "num_steps"),
        api("outcome_rewards: NaN reward", lambda: vb.outcome_rewards(
            nan_at(torch.rand(P, G)), m), "rewards"),
        api("outcome_rewards: [P, G+1] rewards", lambda: vb.outcome_rewards(
            torch.rand(P, G + 1), m), "rewards has shape"),
        api("reward_to_go: float mask", lambda: vb.reward_to_go(torch.rand(P, G), m * 0.5),
            "mask"),
        api("proxy_from_logprobs: shapes differ", lambda: vb.proxy_from_logprobs(
            lp, torch.rand(P, G, 2)), "sum_pi_sq has shape"),
        api("cumulative_weights: NaN logprobs", lambda: vb.cumulative_weights(
            m, vb.SchemeOptions(logprobs=nan_at(lp), sum_pi_sq=torch.rand(P, G, T))),
            "logprobs"),
        api("policy_loss: NaN advantage", lambda: vb.policy_loss(
            lp, lp, nan_at(torch.rand(P, G, T)), m), "adv"),
        api("min_replace: NaN weight", lambda: vb.min_replace(nan_at(lp), m), "weights"),
        api("adv_orthogonal: inf advantage", lambda: vb.adv_orthogonal(
            lp, nan_at(torch.rand(P, G, T), float("inf")), m), "adv"),
        api("sum_pi_sq: 0-d logits", lambda: vb.sum_pi_sq(torch.tensor(1.0)), "logits"),
        api("logit_proxy: NaN logits", lambda: vb.logit_proxy(
            nan_at(torch.randn(2, 3, 5)), torch.zeros(2, 3, dtype=torch.long)), "logits"),
        api("logit_proxy: id outside the vocabulary", lambda: vb.logit_proxy(
            torch.randn(2, 3, 5), torch.full((2, 3), 8)), "outside the vocabulary"),
        # ---- hostile checkpoints
        Case("sample: checkpoint config.json is garbage", ["sample", "--policy", garbage],
             "config"),
        Case("sample: checkpoint safetensors header lies", ["sample", "--policy", lies],
             "corrupt or truncated"),
        Case("sample: checkpoint without config.json", ["sample", "--policy", nocfg],
             "config.json"),
        Case("sample: checkpoint auto_map of an unknown arch, no --trust-remote-code",
             ["sample", "--policy", foreign], "--trust-remote-code"),
        api("checkpoint auto_map of a known arch runs none of its code", no_remote_code_ran,
            "", verdict=lambda got: got == (0, False)),
    ]


def _train_config(**kw):
    from varbench.train.config import TrainConfig

    return TrainConfig(**kw)


def _train_call(**kw):
    from varbench.train.config import TrainConfig
    from varbench.train.loop import train

    return train(TrainConfig(**kw), progress=False)


def _check_estimator(**kw):
    from varbench.testing.check import check_estimator

    return check_estimator("centered", **kw)


def _compare(a, b):
    from varbench.app.compare import compare_reports

    return compare_reports(a, b)


def _run_suite(suite, out):
    from varbench.app.runner import run_suite

    return run_suite(suite, out)


def _case_path(root: Path, key: str):
    from varbench.app.cache import CaseCache

    return CaseCache(root / "cc").path(key)


@contextlib.contextmanager
def _tripwires():
    """Replace the work a refused input must never reach with :class:`_Accepted`."""
    import varbench.app.executors as ex
    from varbench.train import loop
    from varbench.train import warmstart as ws

    def trip(*a, **k):
        raise _Accepted

    saved = (dict(ex._EXECUTORS), loop._train, ws._build)
    real_check = ex._EXECUTORS["check"]

    def check_or_trip(kind, name, params, *rest):
        # `check` cases of the audit's own valid suites are cheap: let them run (they must),
        # but a case named "second" only exists in suites that must be refused.
        if name == "second":
            raise _Accepted
        return real_check(kind, name, params, *rest)

    for k in ex._EXECUTORS:
        ex._EXECUTORS[k] = check_or_trip if k == "check" else trip
    loop._train = trip
    ws._build = trip
    try:
        yield
    finally:
        ex._EXECUTORS.clear()
        ex._EXECUTORS.update(saved[0])
        loop._train, ws._build = saved[1], saved[2]


def classify(case: Case) -> tuple[str, str]:
    """``(outcome, message)`` of one case."""
    from varbench._util.checks import UsageError
    from varbench.app.cli import main

    if case.argv is not None:
        err, out = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out), (
                    case.context() if case.context else contextlib.nullcontext()):
                code = main(case.argv)
        except _Accepted:
            return "accepted", "reached the work"
        except SystemExit as e:  # argparse: a bad flag value, exit 2 with its usage line
            code = e.code
        except BaseException as e:  # noqa: BLE001 - the audit counts crashes
            return "traceback", f"{type(e).__name__}: {e}"
        text = err.getvalue() + out.getvalue()
        msg = err.getvalue().strip().splitlines()[-1:] or out.getvalue().strip().splitlines()[-1:]
        msg = msg[0] if msg else ""
        if code == 0:
            return "accepted", f"exit 0: {msg}"
        if "Traceback" in text:
            return "traceback", msg
        if code == case.code and case.token in text:
            if code == 2 and len(err.getvalue().strip().splitlines()) > 3:
                return "unclear", f"exit 2 but a long message: {msg}"
            return "clear", msg
        return "unclear", f"exit {code}: {msg}"
    try:
        with case.context() if case.context else contextlib.nullcontext():
            got = case.call()
    except _Accepted:
        return "accepted", "reached the work"
    except UsageError as e:
        if case.verdict is None and case.token in str(e):
            return "clear", str(e)
        return "unclear", str(e)
    except Exception as e:  # noqa: BLE001 - the audit counts crashes
        return "traceback", f"{type(e).__name__}: {e}"
    if case.verdict is not None:
        return ("clear", "right result") if case.verdict(got) else ("accepted", repr(got))
    return "accepted", f"returned {type(got).__name__}"


def audit(verbose: bool = False) -> dict[str, Any]:
    """Run every case; returns ``{"counts": {outcome: n}, "cases": [(name, outcome, msg)]}``."""
    import warnings

    from varbench._util.locks import dir_lock

    env = os.environ.get("VARBENCH_CACHE")
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        root = Path(tmp)
        sys.path.insert(0, str(root))
        os.environ["VARBENCH_CACHE"] = str(root / "vbcache")
        cases = build_cases(root)
        # another writer holds this output directory (a second lock in one process is
        # refused like one from another process)
        with dir_lock(root / "locked", what="output directory"):
            rows = []
            with _tripwires():
                for case in cases:
                    t0 = time.perf_counter()
                    outcome, msg = classify(case)
                    rows.append((case.name, outcome, msg, category_of(case)))
                    if verbose:
                        print(f"{outcome:9} {time.perf_counter() - t0:5.1f}s  {case.name}: "
                              f"{msg[:150]}", flush=True)
        sys.path.remove(str(root))
        if env is None:
            os.environ.pop("VARBENCH_CACHE", None)
        else:
            os.environ["VARBENCH_CACHE"] = env
    counts = {k: sum(1 for r in rows if r[1] == k) for k in OUTCOMES}
    by_category = {c: {k: sum(1 for r in rows if r[3] == c and r[1] == k) for k in OUTCOMES}
                   for c in CATEGORIES}
    return {"counts": counts, "cases": rows, "categories": by_category}


def table(result: dict[str, Any]) -> str:
    """The counts per category and in all, as a Markdown table."""
    lines = ["| category | cases tried | clear error | unclear | traceback | silently accepted |",
             "|---|---|---|---|---|---|"]
    rows = [(c, result["categories"][c]) for c in CATEGORIES] + [("all", result["counts"])]
    for name, c in rows:
        lines.append(f"| {name} | {sum(c.values())} | {c['clear']} | {c['unclear']} | "
                     f"{c['traceback']} | {c['accepted']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    res = audit(verbose="-v" in sys.argv)
    print(table(res))
    for name, outcome, msg, _ in res["cases"]:
        if outcome != "clear":
            print(f"  {outcome}: {name}: {msg[:200]}")
