"""Execute a suite: every case once, cached, resumable, shardable; then one report.

    run_suite("suites/quickstart.toml", out_dir="reports/quickstart")
    run_suite(path, out_dir="out/shard1", shard=(1, 4))   # cases 0, 4, 8, ... (1-based I/N)
    merge_outputs(["out/shard1", ..., "out/shard4"], "out/all")

Output directory: ``cases/`` (one file per finished case, see :mod:`varbench.app.cache`),
``work/<case key>/`` (a case's scratch: analysis cells, training checkpoints, so even a case
interrupted halfway resumes from its last finished cell), ``suite.json`` (the suite's digest and
case list) and, for a full run or a merge, the report (summary.json, report.md, report.html).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from varbench._util.checks import UsageError, UsageFileNotFoundError
from varbench._util.guard import UserCodeExit, user_code
from varbench._util.io import IntegrityError, atomic_write, check_path, inside, safe_name
from varbench._util.locks import dir_lock
from varbench._util.progress import show_progress
from varbench.app.cache import CaseCache, load_file, read_payload
from varbench.app.suite import Case, Suite, load_suite
from varbench.report.result import AnalysisResult

MANIFEST = "suite.json"


@dataclass
class RunSummary:
    """What a run did: which cases it computed, which it found cached, where the report is."""

    out_dir: Path
    computed: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # check cases whose verdict is FAILED
    report: Path | None = None
    wall_time_s: float = 0.0


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N) with 1 <= I <= N; ValueError naming the value otherwise."""
    try:
        i, n = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise UsageError(f"--shard={text!r} is not valid; expected I/N, e.g. 1/4") from None
    if not 1 <= i <= n:
        raise UsageError(f"--shard={text!r} is not valid; need 1 <= I <= N (shards are 1-based)")
    return i, n


def shard_cases(cases: Sequence[Case], shard: tuple[int, int] | None) -> list[Case]:
    """Shard I of N: the cases at positions I-1, I-1+N, ... (deterministic, balanced); a
    shard that is not two integers with 1 <= I <= N is a UsageError naming it."""
    if shard is None:
        return list(cases)
    try:
        i, n = shard
    except (TypeError, ValueError):
        i = n = None
    if not (type(i) is int and type(n) is int and 1 <= i <= n):
        raise UsageError(f"shard={shard!r} is not valid; need (I, N) with 1 <= I <= N (shards "
                         "are 1-based)")
    return [c for c in cases if c.index % n == i - 1]


# reports/ directories that hold published results, never a suite's default output: the
# golden baseline the tests compare against and the published claims
RESERVED_OUT = ("baselines", "claims")


def default_out_dir(suite: Suite) -> Path:
    """``reports/<suite name>``; the name is one safe path component (checked again here for
    a Suite built by hand) and not one of :data:`RESERVED_OUT` (any case)."""
    name = safe_name("suite name", suite.name)
    if name.lower() in RESERVED_OUT:
        raise UsageError(f"suite name {name!r} is reserved: reports/{name.lower()} holds "
                         f"published results ({', '.join(RESERVED_OUT)}); rename the suite or "
                         "pass --out DIR")
    return inside(Path("reports"), name, what="output directory")


def run_suite(
    suite: Suite | str | Path,
    out_dir: str | Path | None = None,
    *,
    shard: tuple[int, int] | None = None,
    progress: bool | None = None,
    log: Callable[[str], None] | None = None,
    device: str | None = None,
    allow_code: bool = False,
) -> RunSummary:
    """Run every (selected) case not already cached, then render the report.

    Interruption (Ctrl-C, a kill) loses at most the case in progress; finished cases are never
    recomputed or corrupted. A sharded run writes its cases and ``suite.json`` but no report:
    combine shards with :func:`merge_outputs`. ``device`` and ``allow_code`` (let the file name
    code): see :func:`load_suite` (a path only).
    """
    if isinstance(suite, Suite) and (device or allow_code):
        raise UsageError("device= and allow_code= apply to a suite file; a Suite object was "
                         "loaded with its own")
    suite = suite if isinstance(suite, Suite) else load_suite(suite, device=device,
                                                             allow_code=allow_code)
    out = check_path("out_dir", out_dir) if out_dir is not None else default_out_dir(suite)
    prepare_out_dir(out)
    check_out_subdirs(out)
    # one writer per output directory, or per shard of it (shard_lock)
    with dir_lock(out, what="output directory", lock_file=shard_lock(out, shard)):
        return _run_locked(suite, out, shard, show_progress(progress), log)


def shard_lock(out: Path, shard: tuple[int, int] | None) -> Path | None:
    """The lock file of ``shard`` of a run into ``out`` (None: the directory's own lock).

    Shards of one suite (or validation grid) may run at once into one directory (torchrun's
    ranks, or one process per core): they share no case, each case's work directory has its
    own lock and case files are written atomically, so only the same shard twice is refused.
    """
    return None if shard is None else out / f".varbench-shard-{shard[0]}-of-{shard[1]}.lock"


def run_suite_ranks(
    suite: Suite | str | Path,
    out_dir: str | Path | None = None,
    *,
    progress: bool | None = None,
    log: Callable[[str], None] | None = None,
    device: str | None = None,
    allow_code: bool = False,
) -> RunSummary:
    """:func:`run_suite` split over a joined torchrun group, into one ``out_dir``.

    Rank r runs shard (r+1, W) of the cases alone (``distributed.solo``: no collectives
    inside a case); once every rank has finished, rank 0 renders the report from every rank's
    cases, as one process would. Every rank returns the cases of all ranks (computed, cached,
    failed); ``report`` is set on rank 0 only. One process: :func:`run_suite`.
    """
    from varbench._util.distributed import each_rank_alone, rank_world, solo

    kw = {"device": device, "allow_code": allow_code}
    rank, world = rank_world()
    if world == 1:
        return run_suite(suite, out_dir, progress=progress, log=log, **kw)
    start = time.perf_counter()
    parts = each_rank_alone(lambda r, w: run_suite(suite, out_dir, shard=(r + 1, w),
                                                   progress=progress, log=log, **kw))
    summary = RunSummary(parts[0].out_dir)
    for part in parts:
        summary.computed += part.computed
        summary.cached += part.cached
        summary.failed += part.failed
    if rank == 0:
        with solo():  # every case is cached now: this renders the report, nothing more
            summary.report = run_suite(suite, out_dir, progress=False, **kw).report
    summary.wall_time_s = time.perf_counter() - start
    return summary


def plan_suite(suite: Suite | str | Path, *, device: str | None = None,
               allow_code: bool = False) -> list[str]:
    """One line per case: what an analysis case will spend (the notice it prints when it
    runs, :func:`~varbench.app.executors.analysis_plan`); other kinds say they have no cost
    plan. Nothing is sampled and no policy is built; cached cases are not looked up."""
    from varbench.app.executors import KINDS, analysis_plan, planned

    suite = suite if isinstance(suite, Suite) else load_suite(suite, device=device,
                                                             allow_code=allow_code)
    preflight(suite.cases)
    lines = []
    for case in suite.cases:
        if case.kind not in planned():
            lines.append(f"{case.name}: {case.kind} case, no cost plan (kinds with one: "
                         f"{', '.join(planned())})")
            continue
        try:
            with user_code(f"user code in case {case.name!r}"):
                plan, label = analysis_plan(KINDS[case.kind], case.params)
        except UsageError as err:
            raise UsageError(f"case {case.name!r}: {err}") from None
        lines.append(f"{case.name}: {plan.text(label=label)}")
    return lines


def prepare_out_dir(out: Path) -> None:
    """Create ``out``; an OSError (a file in the way, no permission) as a UsageError naming
    the path and the reason."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"cannot create output directory {str(out)!r}: "
                         f"{err.strerror or err}") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise UsageError(f"output directory {str(out)!r} is not writable (permission denied)")


def _run_locked(suite: Suite, out: Path, shard: tuple[int, int] | None, show: bool,
                log: Callable[[str], None] | None, *, grid: dict | None = None) -> RunSummary:
    """Run the cases; ``grid``: they are a validation grid's runs (its config and jobs go into
    the manifest, and the caller builds the validation report instead of the suite's)."""
    say = log or (lambda msg: None)
    start = time.perf_counter()
    cache = CaseCache(out / "cases")
    cache.clean_stale_tmp()
    current = shard is None and _report_current(out, suite)
    _write_manifest(out, suite, shard, grid=grid)
    selected = shard_cases(suite.cases, shard)
    preflight(selected)
    summary = RunSummary(out)
    bar = tqdm(selected, desc=f"suite {suite.name}", unit="case", disable=not show)
    for case in bar:
        bar.set_postfix_str(case.name)
        if cache.has(case):
            try:
                _note_failed(summary, case, cache.load(case))
                summary.cached.append(case.name)
                say(f"[cached]  {case.name}")
                continue
            except IntegrityError as err:  # never a permission error: that one is raised
                say(f"[corrupt] {case.name}: {err}; recomputing it")
        t0 = time.perf_counter()
        # created by the kinds that need scratch space
        work = inside(out / "work", safe_name("case key", case.key), what="work directory")
        from varbench.app.executors import KINDS

        try:  # a user's code in the case (estimator, task, verifier) cannot end the process
            with user_code(f"user code in case {case.name!r}"):
                results = KINDS[case.kind].execute(case.name, case.params, work, show)
        except UserCodeExit as err:
            raise UsageError(f"case {case.name!r} ended without a result: {err}; nothing was "
                             "cached for it") from None
        cache.store(case, results, time.perf_counter() - t0)
        _note_failed(summary, case, results)
        summary.computed.append(case.name)
        say(f"[done]    {case.name} ({time.perf_counter() - t0:.1f} s)")
    if shard is None and grid is None:
        summary.report = out / "report.html"
        if summary.computed or not current:
            results = [r for c in suite.cases for r in cache.load(c)]
            render(results, out, suite.title)
            _write_manifest(out, suite, shard, rendered=True)
    summary.wall_time_s = time.perf_counter() - start
    return summary


def preflight(cases: Sequence[Case]) -> None:
    """Import every ``MODULE:FUNCTION`` the cases name (estimators, schemes) before the first
    case runs, so a missing module or a wrong signature in case 5 is an error now (naming the
    case), not after cases 1-4 ran. These imports would happen anyway when the cases run."""
    from varbench._util.imports import is_reference
    from varbench.app.executors import register_estimators
    from varbench.testing.adapt import load

    for case in cases:
        try:
            register_estimators(case.params)
            est = case.params.get("estimator") if case.kind == "check" else None
            if isinstance(est, str) and is_reference(est):
                load(est)
        except UsageError as err:
            raise UsageError(f"case {case.name!r}: {err}") from None


def _note_failed(summary: RunSummary, case: Case, results: list[AnalysisResult]) -> None:
    if case.kind == "check" and any(r.summary.get("passed") is False for r in results):
        summary.failed.append(case.name)


def render(results: list[AnalysisResult], out: Path, title: str) -> Path:
    """One report for the suite (the report layer renders; nothing is computed here)."""
    from varbench.report import write_report

    write_report(results, out, title=title)
    return out / "report.html"


def merge_outputs(dirs: Sequence[str | Path], out_dir: str | Path) -> RunSummary:
    """Combine shard output directories into ``out_dir`` and render the suite's report.

    Every directory must come from the same suite (same digest in ``suite.json``); the union of
    their cases must cover the suite. Case files are copied atomically; nothing is recomputed.
    """
    if not dirs:
        raise UsageError("merge needs at least one shard output directory")
    dirs = [check_path("shard directory", d) for d in dirs]
    out = check_path("out_dir", out_dir)
    manifests = [read_manifest(d) for d in dirs]
    digests = {m["digest"] for m in manifests}
    if len(digests) != 1:
        raise UsageError(f"shard outputs come from different suites (digests {sorted(digests)}); "
                         "merge only shards of one suite file and varbench version")
    head = manifests[0]
    prepare_out_dir(out)
    check_out_subdirs(out)
    with dir_lock(out, what="output directory"):
        return _merge_locked(dirs, out, head)


def _merge_locked(dirs: Sequence[Path], out: Path, head: dict) -> RunSummary:
    cases = CaseCache(out / "cases")
    found: dict[str, Path] = {}
    for d in dirs:
        for f in CaseCache(Path(d) / "cases").files():
            key = read_payload(f).get("key")
            if isinstance(key, str) and key in head["cases"] and key not in found:
                load_file(f, expect_key=key)  # refuse corrupt shards before copying
                found[key] = f
    missing = [k for k in head["cases"] if k not in found]
    if missing:
        raise UsageError(f"merge is missing {len(missing)} case(s): {missing}; run the "
                         "remaining shards (or `varbench run` into one of the directories)")
    summary = RunSummary(out)
    for key, f in found.items():
        dest = cases.path(key)  # a safe name inside OUT/cases (checked by read_manifest too)
        if f.resolve() != dest.resolve():
            atomic_write(dest, f.read_bytes())
        summary.cached.append(key)
    _write_manifest_raw(out, {**head, "shard": None, "report_digest": None})
    if isinstance(head.get("validate"), dict):  # a validation grid: its own report
        from varbench.app.validation import grid_report

        grid_report(out, head)
        summary.report = out / "report.html"
        return summary
    results = [r for key in head["cases"] for r in load_file(found[key], expect_key=key)]
    summary.report = render(results, out, head["title"])
    _write_manifest_raw(out, {**head, "shard": None, "report_digest": head["digest"]})
    return summary


_MANIFEST_TYPES = {"suite": str, "title": str, "digest": str, "cases": list}


def read_manifest(d: Path) -> dict:
    """The ``suite.json`` of output directory ``d``, validated: every case key is a safe file
    name (a shard from elsewhere is data, never a path), the types are the ones varbench
    writes. UsageError naming the file and the bad value otherwise."""
    path = d / MANIFEST
    if not path.is_file():
        raise UsageFileNotFoundError(f"{str(d)!r} has no {MANIFEST}: not a `varbench run` output")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise UsageError(f"cannot read {str(path)!r}: {err.strerror or err}") from None
    except ValueError as err:
        raise UsageError(f"{str(path)!r} is corrupt ({err})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{str(path)!r} is not a varbench manifest (not a JSON object)")
    for key, typ in _MANIFEST_TYPES.items():
        if not isinstance(data.get(key), typ):
            raise UsageError(f"{str(path)!r}: key {key!r} must be a {typ.__name__}, got "
                             f"{data.get(key)!r}")
    for k in data["cases"]:
        try:
            safe_name("case key", k)
        except UsageError as err:
            raise UsageError(f"{str(path)!r}: {err}") from None
    twice = sorted({k for k in data["cases"] if data["cases"].count(k) > 1})
    if twice:
        raise UsageError(f"{str(path)!r}: case key(s) listed more than once: {twice} (varbench "
                         "writes each once)")
    return data


_OUT_SUBDIRS = ("cases", "tables", "figures", "work")


def check_out_subdirs(out: Path) -> None:
    """Refuse an output directory whose ``cases/``, ``tables/``, ``figures/`` or ``work/`` is a
    symlink: a write there would land wherever it points (outside ``out``)."""
    for sub in _OUT_SUBDIRS:
        if (out / sub).is_symlink():
            raise UsageError(f"{str(out / sub)!r} is a symlink (to {os.readlink(out / sub)!r}); "
                             "varbench writes only inside the output directory: remove it or "
                             "choose another --out")


def _write_manifest(out: Path, suite: Suite, shard: tuple[int, int] | None,
                    rendered: bool = False, grid: dict | None = None) -> None:
    _write_manifest_raw(out, {**(grid or {}),
        "suite": suite.name, "title": suite.title, "file": str(suite.path),
        "digest": suite.digest, "cases": [c.key for c in suite.cases],
        "shard": None if shard is None else f"{shard[0]}/{shard[1]}",
        "report_digest": suite.digest if rendered else None,
    })


def _report_current(out: Path, suite: Suite) -> bool:
    """True when the report on disk was rendered from exactly these cases (nothing to redo)."""
    try:
        old = json.loads((out / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    files = ("summary.json", "report.md", "report.html")
    return old.get("report_digest") == suite.digest and all((out / f).is_file() for f in files)


def _write_manifest_raw(out: Path, data: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / MANIFEST, json.dumps(data, indent=2) + "\n")
