"""The validation grid run as a suite: every (task, scheme, G, seed) run of
:func:`varbench.analysis.validate.jobs_of` is an ordinary ``train`` case, run by the suite runner
(:mod:`varbench.app.runner`) with its shards, case cache, resume and manifest; the statistics
on the finished runs are :func:`varbench.analysis.validate.report`.

    run_validation(cfg, "work/v", shard=(1, 2))   # runs 0, 2, 4, ... (1-based I/N)
    run_validation(cfg, "work/v", shard=(2, 2))
    run_validation(cfg, "work/v", report_only=True, report_dir="reports/claims")
    merge_outputs(["work/s1", "work/s2"], "work/all")   # shards from elsewhere: same report

Output directory: as for a suite (``cases/``, ``work/<case key>/run`` with each run's
checkpoints, so an interrupted run resumes from its last one, ``suite.json``, which also holds
the grid's config and each case's job), plus ``prediction/`` (the prediction check's cells).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

from varbench._util.checks import UsageError
from varbench._util.io import check_path
from varbench._util.locks import dir_lock
from varbench._util.progress import show_progress
from varbench.analysis.validate import (
    Job,
    ValidateConfig,
    check_grid,
    config_dict,
    job_config,
    jobs_of,
    report,
)
from varbench.app.cache import CaseCache, load_file, read_payload
from varbench.app.runner import (
    MANIFEST,
    _run_locked,
    check_out_subdirs,
    prepare_out_dir,
    read_manifest,
    shard_cases,
    shard_lock,
)
from varbench.app.suite import Case, Suite

TITLE = "varbench validation: the papers' claims, decided"


def grid_cases(cfg: ValidateConfig) -> list[Case]:
    """Every run of the grid as a ``train`` case, in :func:`jobs_of` order (its params: the
    run's TrainConfig, so its cache key changes with any setting of the run)."""
    return [Case(i, case_name(job), "train", job_config(cfg, job).to_dict())
            for i, job in enumerate(jobs_of(cfg))]


def case_name(job: Job) -> str:
    """``sort.otb_G4_s0``, ``arith.normalized_G4_gspo_s1``, ``hacking.positional_s0``: a case
    name (letters, digits, ``_.-``) saying which run it is."""
    def part(x: object) -> str:  # a scheme or task label may hold other characters
        return re.sub(r"[^A-Za-z0-9_\-]+", "-", str(x))

    if job.reward is not None:
        return f"hacking.{part(job.reward)}_s{job.seed}"[:96]
    variant = f"_{part(job.variant)}" if job.variant else ""
    return f"{part(job.task)}.{part(job.scheme)}_G{job.G}{variant}_s{job.seed}"[:96]


def _grid_suite(cfg: ValidateConfig) -> tuple[Suite, dict[str, Any]]:
    """The grid as a Suite, and what its manifest holds beyond a suite's (config, jobs)."""
    cases = grid_cases(cfg)
    suite = Suite(path=Path("<validate>"), name="validate", title=TITLE, description="",
                  seed=0, cases=tuple(cases))
    jobs = {c.key: _job_dict(j) for c, j in zip(cases, jobs_of(cfg), strict=True)}
    return suite, {"validate": config_dict(cfg), "jobs": jobs}


def _job_dict(job: Job) -> dict[str, Any]:
    return {"task": job.task, "scheme": job.scheme, "G": job.G, "seed": job.seed,
            "variant": job.variant, "reward": job.reward}


def run_validation(cfg: ValidateConfig, out: str | Path, *, progress: bool | None = None,
                   shard: tuple[int, int] | None = None, report_only: bool = False,
                   report_dir: str | Path | None = None) -> str:
    """Run the experiment into ``out``; returns the markdown summary (also written there).

    The grid is checked before anything is written. ``shard``: run only that shard's runs
    (``shard_cases``, as for a suite) and write no report. ``report_only``: train nothing;
    every run must be finished already (else a UsageError says how many are missing).
    ``report_dir``: where the report goes (default ``out``). A rerun reuses every finished
    run (its case file) and resumes an interrupted one from its last checkpoint.
    """
    check_grid(cfg)
    t_start = time.perf_counter()
    out = check_path("out", out)
    suite, grid = _grid_suite(cfg)
    mine = shard_cases(suite.cases, shard)  # the same rule as suites: a bad shard is refused
    if report_only:
        cache = CaseCache(out / "cases")
        missing = [c for c in suite.cases if not cache.has(c)]
        if missing:
            raise UsageError(
                f"--report-only: {len(missing)} of {len(suite.cases)} runs are not finished in "
                f"{str(out)!r} (first: {missing[0].name}); run the missing shards first")
    prepare_out_dir(out)
    check_out_subdirs(out)
    # shards of one grid may run at once into one directory (README: two cores, one shard
    # each; torchrun's ranks): each holds its own lock (runner.shard_lock)
    with dir_lock(out, what="output directory", lock_file=shard_lock(out, shard)):
        t_phase = time.perf_counter()
        if not report_only:
            _run_locked(suite, out, shard, show_progress(progress), None, grid=grid)
        phases = {"runs": time.perf_counter() - t_phase, "prediction": 0.0}
        if shard is not None:
            return (f"shard {shard[0]}/{shard[1]}: {len(mine)} of {len(suite.cases)} runs "
                    f"finished in {phases['runs'] / 60:.1f} min under {out / 'cases'}; build "
                    "the report with --report-only (or `varbench merge` of the shard "
                    "directories) once every shard is there.\n")
        cache = CaseCache(out / "cases")
        frames = {j: cache.load(c)[0].records["steps"]
                  for c, j in zip(suite.cases, jobs_of(cfg), strict=True)}
        return report(cfg, out, frames, phases, t_start,
                      report_dir=Path(report_dir) if report_dir is not None else None)


def grid_report(out: Path, manifest: dict) -> str:
    """The validation report of a merged grid (``varbench merge``): from the manifest's config
    and the case files in ``out``; returns the markdown summary."""
    cfg = ValidateConfig.from_params(manifest["validate"])
    t_start = time.perf_counter()
    frames = {j: df for j, df, _ in _runs_of(out, manifest)}
    return report(cfg, out, frames, {"runs": 0.0, "prediction": 0.0}, t_start, report_dir=None)


def finished_runs(out: str | Path) -> list[tuple[Job, Any, float | None]]:
    """``(job, records, seconds)`` of every finished run in a grid's output directory ``out``
    (any grid: the jobs are read from its manifest), for :mod:`varbench.analysis.validate_plan`.
    """
    out = check_path("out", out)
    if not (out / MANIFEST).is_file():  # nothing ran there yet: no measured runs
        return []
    manifest = read_manifest(out)
    if not isinstance(manifest.get("jobs"), dict):
        raise UsageError(f"{str(out / MANIFEST)!r} is not a validation grid's manifest (no "
                         "jobs); give the --out of a `varbench validate` run")
    return _runs_of(out, manifest, missing_ok=True)


def _runs_of(out: Path, manifest: dict, *, missing_ok: bool = False
             ) -> list[tuple[Job, Any, float | None]]:
    """The finished runs of ``manifest``'s jobs in ``out/cases``, in manifest order."""
    cache = CaseCache(out / "cases")
    runs = []
    for key, j in manifest["jobs"].items():
        path = cache.path(key)
        if not path.is_file():
            if missing_ok:
                continue
            raise UsageError(f"run {key!r} is not finished in {str(out)!r}")
        job = Job(str(j["task"]), str(j["scheme"]), int(j["G"]), int(j["seed"]),
                  str(j.get("variant") or ""), reward=j.get("reward"))
        records = load_file(path, expect_key=key)[0].records["steps"]
        wall = read_payload(path).get("wall_time_s")
        runs.append((job, records, float(wall) if isinstance(wall, (int, float)) else None))
    return runs
