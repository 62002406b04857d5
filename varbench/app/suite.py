"""Suite files: TOML data validated up front, before any case runs.

    [suite]                 # name (required), title, description, seed
    name = "quickstart"
    seed = 0

    [defaults]              # keys applied to every case whose kind accepts them
    policy = "tiny"

    [[cases]]               # one table per case: name, kind, then the kind's keys
    name = "variance"
    kind = "variance"
    schemes = ["centered", "otb"]

A suite file is data: nothing in it is evaluated, and it reaches no code unless the command
line allows it. Code a suite can name: a ``MODULE:ATTR`` anywhere in ``[defaults]`` or a case
(a task or factory, a scheme or estimator, a verifier knob), and ``trust_remote_code = true``
(a checkpoint's own code). A suite naming any of them is refused, with the list of entries,
unless ``varbench run --allow-code`` (``load_suite(..., allow_code=True)``) is given; then
validation imports each reference and checks its type, and calls none of them (a case calls
its code when it runs). Installed packages (a ``varbench.tasks`` entry point, a built-in
verifier's dependency) are the environment's, not the file's, and need no flag. Every error
names the file, the key and the valid choices.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from varbench._util.checks import UsageError, UsageFileNotFoundError
from varbench._util.imports import is_reference
from varbench._util.io import safe_name
from varbench.app.executors import KINDS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SUITE_KEYS = {"name": str, "title": str, "description": str, "seed": int}
TOP_KEYS = ("suite", "defaults", "cases")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
_MAX_CASE_NAME = 96  # a case key adds "-<16 hex>" and ".json": one path component


@dataclass(frozen=True)
class Case:
    """One validated case: ``params`` are the kind's keyword arguments (defaults applied)."""

    index: int
    name: str
    kind: str
    params: dict[str, Any]
    inputs: tuple[str, ...] = ()  # fingerprints of the tasks (a data file's content hash)

    def config(self) -> dict[str, Any]:
        """What identifies the case's result (with the varbench version: the cache key)."""
        from varbench._util.version import VERSION as __version__

        out = {"name": self.name, "kind": self.kind, "params": self.params,
               "varbench_version": __version__}
        if self.inputs:  # only when a task reads data: older cache keys stay valid
            out["inputs"] = list(self.inputs)
        out["placement"] = KINDS[self.kind].placement(self.params)  # CPU and CUDA never mix
        return out

    @property
    def key(self) -> str:
        """Hash of :meth:`config`: a changed setting or version never reuses a result."""
        return case_key(self.config())


def case_key(config: dict[str, Any]) -> str:
    """``<name>-<16 hex of the SHA-256 of the config's canonical JSON>`` (tuples and lists
    hash alike, so a config read back from a case file gives the same key)."""
    blob = json.dumps(config, sort_keys=True).encode()
    return f"{config.get('name')}-{hashlib.sha256(blob).hexdigest()[:16]}"


@dataclass(frozen=True)
class Suite:
    """A validated suite file."""

    path: Path
    name: str
    title: str
    description: str
    seed: int
    cases: tuple[Case, ...]

    @property
    def digest(self) -> str:
        """Hash of every case key: shards of the same suite agree on it."""
        return hashlib.sha256("\n".join(c.key for c in self.cases).encode()).hexdigest()[:16]


class SuiteError(UsageError):
    """An invalid suite file (message names the file and the key)."""


def load_suite(path: str | Path, *, device: str | None = None,
               allow_code: bool = False) -> Suite:
    """Read and validate a suite file; raises :class:`SuiteError` (a ValueError).

    ``device`` (``varbench run --device``): the device of every case that names none itself
    (it takes the place of ``[defaults] device``). ``allow_code`` (``varbench run
    --allow-code``): let the suite name code (:func:`code_entries`); without it such a suite is
    refused before anything is imported, the error listing every entry."""
    path = Path(path)
    if not path.is_file():
        raise UsageFileNotFoundError(f"suite file {str(path)!r} does not exist")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise SuiteError(f"{path}: not valid TOML: {err}") from None
    return parse_suite(data, path, device=device, allow_code=allow_code)


def parse_suite(data: dict[str, Any], path: Path, *, device: str | None = None,
                allow_code: bool = False) -> Suite:
    """Validate the parsed TOML ``data`` of the file ``path`` (``allow_code``: see
    :func:`load_suite`)."""
    _keys(path, "top level", data, TOP_KEYS)
    refuse_code(path, code_entries(data), allow_code=allow_code, what="suite",
                how="--allow-code (varbench run, varbench validate --suite) or "
                    "allow_code=True (load_suite / run_suite)",
                error=SuiteError)
    head = data.get("suite")
    if not isinstance(head, dict):
        raise SuiteError(f"{path}: missing [suite] table (with at least name = \"...\")")
    _keys(path, "[suite]", head, SUITE_KEYS)
    for key, typ in SUITE_KEYS.items():
        if key in head and (not isinstance(head[key], typ) or isinstance(head[key], bool)):
            raise SuiteError(f"{path}: [suite] key {key!r} must be a {typ.__name__}, "
                             f"got {head[key]!r}")
    if "name" not in head:
        raise SuiteError(f"{path}: [suite] needs name = \"...\"")
    try:  # the name becomes reports/<name>: one safe path component, never a path
        safe_name("[suite] name", head["name"])
    except UsageError as err:
        raise SuiteError(f"{path}: {err}") from None
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise SuiteError(f"{path}: [defaults] must be a table")
    if device:
        defaults = {**defaults, "device": device}
    raw_cases = data.get("cases")
    if not isinstance(raw_cases, list) or not raw_cases:
        raise SuiteError(f"{path}: no cases; add at least one [[cases]] table with name and kind")
    params_of: dict[str, dict[str, inspect.Parameter]] = {}
    cases, seen = [], set()
    for i, raw in enumerate(raw_cases):
        case = parse_case(raw, index=i, where=str(path), defaults=defaults,
                          seed=head.get("seed"), params_of=params_of)
        if case.name in seen:
            raise SuiteError(f"{path}: cases[{i}] ({case.name!r}): duplicate case name "
                             f"{case.name!r}")
        seen.add(case.name)
        cases.append(case)
    unused = [k for k in defaults if not any(k in p for p in params_of.values())]
    if unused:
        allowed = sorted({k for p in params_of.values() for k in p})
        raise SuiteError(f"{path}: [defaults] key(s) {unused} apply to no case; valid keys for "
                         f"this suite's kinds: {allowed}")
    return Suite(path, head["name"], head.get("title", head["name"]),
                 head.get("description", ""), head.get("seed", 0), tuple(cases))


def code_entries(data: dict[str, Any]) -> list[str]:
    """Every place the parsed suite ``data`` names code, as ``"cases[i] ('name') key 'k' =
    value"``: a ``MODULE:ATTR`` string anywhere under ``[defaults]`` or a case (any key, any
    depth: tasks, schemes, estimators, verifier knobs, a validate case's base config), and a
    ``trust_remote_code`` that is not false. Nothing is imported to find them."""
    out = code_refs("[defaults]", data.get("defaults"))
    cases = data.get("cases")
    for i, raw in enumerate(cases if isinstance(cases, list) else []):
        name = raw.get("name") if isinstance(raw, dict) else None
        out += code_refs(f"cases[{i}]" + (f" ({name!r})" if isinstance(name, str) else ""), raw)
    return out


def code_refs(at: str, value: Any) -> list[str]:
    """Every place the parsed TOML ``value`` (a table, at any depth) names code, as ``"<at>
    key 'k' = value"``: a ``MODULE:ATTR`` string under any key and a ``trust_remote_code``
    that is not false. Nothing is imported to find them. The one walker of a suite's cases and
    of ``varbench train --config``'s file."""
    out: list[str] = []

    def walk(key: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, item in v.items():
                walk(f"{key}.{k}" if key else str(k), item)
        elif isinstance(v, list):
            for item in v:
                walk(key, item)
        elif key.rsplit(".", 1)[-1] == "trust_remote_code" and v is not False:
            out.append(f"{at} key {key!r} = {v!r} (a checkpoint's own code)")
        elif is_reference(v):
            out.append(f"{at} key {key!r} = {v!r}")

    walk("", value)
    return out


def refuse_code(path: Path | str, entries: list[str], *, allow_code: bool, what: str,
                how: str, error: type[UsageError] = UsageError) -> None:
    """Raise ``error`` listing ``entries`` (:func:`code_refs`) unless ``allow_code``: a file is
    data, and runs code only when the command line says so (``how``: the opt-in's spelling)."""
    if entries and not allow_code:
        raise error(
            f"{path}: this {what} names code that would run on this machine: "
            f"{'; '.join(entries)}. A {what} file is data: it runs code only when the command "
            f"line says so; if you trust this file, pass {how}")


SPELLINGS: dict[str, tuple[str, ...]] = {
    "policy": ("preset", "checkpoint"), "preset": ("policy",), "checkpoint": ("policy",),
    "task_options": ("knobs",), "knobs": ("task_options",),
    "steps": ("num_steps",), "num_steps": ("steps",),
}
"""The concepts the case kinds spell differently: the model (``train``: ``policy``; the
analyses: ``preset`` or ``checkpoint``), the task's knobs (``task_options`` / ``knobs``) and the
number of steps (``steps`` / ``check``'s ``num_steps``). The CLI spells them ``--policy``,
``--knob`` and ``--steps`` everywhere (README: "Suites")."""


def _check_spellings(where: str, at: str, kind: str, defaults: dict[str, Any],
                     body: dict[str, Any], valid: dict[str, inspect.Parameter]) -> None:
    """A ``[defaults]`` key that this case's kind spells another way is an error, not a silent
    fallback to the kind's own default (``[defaults] policy = "ckA"`` used to leave the
    analysis cases on the built-in ``tiny``)."""
    for key in defaults:
        if key in valid:
            continue
        theirs = [k for k in SPELLINGS.get(key, ()) if k in valid]
        if theirs and not any(k in body or k in defaults for k in theirs):
            raise SuiteError(
                f"{where}: {at}: [defaults] key {key!r} does not apply to a {kind!r} case, "
                f"which spells it {' or '.join(map(repr, theirs))}: set that key in "
                f"[defaults] or in the case (otherwise the case would run on the kind's own "
                "default)")


def parse_case(raw: Any, *, index: int = 0, where: str = "command line",
               defaults: dict[str, Any] | None = None, seed: int | None = None,
               params_of: dict[str, dict[str, inspect.Parameter]] | None = None) -> Case:
    """Validate one case table ``raw`` (name, kind and the kind's keys) into a :class:`Case`.

    The suite loader and the analysis subcommands both build their cases here, so a flag and a
    suite key are checked by the same rules. ``where`` names the source in errors (a file, or
    "command line"); ``defaults`` apply where the kind accepts them; ``seed`` is the suite's.
    """
    defaults = defaults or {}
    params_of = {} if params_of is None else params_of
    at = f"cases[{index}]"
    if not isinstance(raw, dict):
        raise SuiteError(f"{where}: {at} must be a table ([[cases]])")
    name, kind = raw.get("name"), raw.get("kind")
    if (not isinstance(name, str) or not _NAME.fullmatch(name) or len(name) > _MAX_CASE_NAME
            or ".." in name):
        raise SuiteError(f"{where}: {at} key 'name' must be a string of 1-{_MAX_CASE_NAME} "
                         f"ASCII letters, digits, '_', '-', '.' (got {name!r})")
    at = f"{at} ({name!r})"
    if kind not in KINDS:
        raise SuiteError(f"{where}: {at} key 'kind' = {kind!r} is not valid; "
                         f"choose one of {sorted(KINDS)}")
    if kind not in params_of:
        params_of[kind] = _kind_params(where, kind)
    valid = params_of[kind]
    body = {k: v for k, v in raw.items() if k not in ("name", "kind")}
    _keys(where, at, body, sorted(valid))
    _check_spellings(where, at, kind, defaults, body, valid)
    merged = {k: v for k, v in defaults.items() if k in valid}
    merged.update(body)
    if "seed" in valid and "seed" not in merged and seed is not None:
        merged["seed"] = seed
    for key, value in merged.items():
        _check_value(where, at, kind, key, value, valid[key])
        _check_range(f"{where}: {at} key {key!r}", key, value)
    missing = [k for k, p in valid.items()
               if p.default is inspect.Parameter.empty and k not in merged]
    if missing:
        raise SuiteError(f"{where}: {at}: kind {kind!r} needs key(s) {missing}")
    if kind == "train":
        from varbench.train.config import TrainConfig

        TrainConfig.from_dict(merged, source=f"{where}: {at}")  # validates types
    if KINDS[kind].analysis is not None:  # the kind's config and the policy spec: as the run
        from varbench.app.executors import split_case

        try:
            split_case(KINDS[kind], merged)
        except UsageError as err:
            msg = str(err).replace(f"case {kind!r}", f"{where}: {at}", 1)
            raise SuiteError(msg) from None
    inputs = _check_tasks(where, at, kind, merged)
    return Case(index, name, kind, merged, inputs)


def _check_tasks(where: str, at: str, kind: str, merged: dict[str, Any]) -> tuple[str, ...]:
    """Check the case's task spec(s) with their knobs now, so a missing file, a missing
    column or a MODULE:ATTR that is not a Task fails before any case runs, without calling a
    user's code (:func:`~varbench.app.specs.check_task_spec`); returns the fingerprints of
    dataset tasks (their data's hash) and of ``MODULE:ATTR`` tasks (the reference and the hash
    of its module's source): part of the case's cache key."""
    from varbench._util.imports import is_reference
    from varbench.app.specs import check_task_spec
    from varbench.tasks import DatasetTask

    if kind == "train":
        specs, knobs = [merged.get("task", "sort")], merged.get("task_options") or {}
    elif KINDS[kind].analysis is not None:
        default = KINDS[kind].parameters()
        raw = merged.get("tasks", merged.get("task", None))
        if raw is None:
            key = "tasks" if "tasks" in default else "task"
            raw = default[key].default
        specs, knobs = (raw if isinstance(raw, list) else [raw]), merged.get("knobs") or {}
    else:
        return ()
    out = []
    for spec in specs:
        try:
            task = check_task_spec(spec, knobs)
        except UsageError as err:
            raise SuiteError(f"{where}: {at} key 'task' = {spec!r}: {err}") from None
        if task is not None and merged.get("reward") is not None and kind != "train":
            try:  # the task's own reward names, as the analysis checks them
                task.check_reward(merged["reward"])
            except UsageError as err:
                raise SuiteError(f"{where}: {at} key 'reward': {err}") from None
        if isinstance(task, DatasetTask):
            out.append(task.fingerprint())
        elif task is None and is_reference(spec):
            out.append(f"code:{spec}:{_source_digest(spec)}")
    return tuple(out)


def _source_digest(ref: str) -> str:
    """16 hex of the SHA-256 of the source file of ``ref``'s module (imported by now), so an
    edited task module never reuses a cached result; "-" when it has no readable file."""
    module = sys.modules.get(ref.partition(":")[0])
    try:
        return hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()[:16]
    except (AttributeError, TypeError, OSError):
        return "-"


def _kind_params(path: Path | str, kind: str) -> dict[str, inspect.Parameter]:
    try:
        return KINDS[kind].parameters()
    except ValueError as err:
        raise SuiteError(f"{path}: {err}") from None


def _keys(path: Path, where: str, table: dict, valid) -> None:
    bad = [k for k in table if k not in valid]
    if bad:
        raise SuiteError(f"{path}: {where}: unknown key {bad[0]!r}; valid keys: {sorted(valid)}")


def _is_type(value: Any, want: type) -> bool:
    """Whether a TOML value has the Python type ``want`` (bool is not an int here)."""
    return (
        isinstance(value, bool) if want is bool
        else (isinstance(value, int) and not isinstance(value, bool)) if want is int
        else (isinstance(value, (int, float)) and not isinstance(value, bool))
        if want is float
        else isinstance(value, str) if want is str
        else isinstance(value, list) if want in (list, tuple)
        else True
    )


_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}


def _annotation_types(param: inspect.Parameter) -> tuple[type, ...]:
    """The scalar types a parameter's annotation names (``int | str | None`` -> (int, str)),
    whether the annotation is a string (postponed evaluation) or a type."""
    ann = param.annotation
    if ann is inspect.Parameter.empty:
        return ()
    if isinstance(ann, str):
        names = [n.strip() for n in ann.split("|")]
    else:
        names = [getattr(a, "__name__", "") for a in (typing.get_args(ann) or (ann,))]
    return tuple(_SCALARS[n] for n in names if n in _SCALARS)


def _check_value(path: Path, where: str, kind: str, key: str, value: Any,
                 param: inspect.Parameter) -> None:
    """Types from the parameter's default; choices for names the library registers."""
    at = f"{path}: {where} key {key!r}"
    default = param.default
    if default is not inspect.Parameter.empty and default is not None:
        want = type(default)
        ok = _is_type(value, want)
        # a knob annotated with several scalar types (``sketch_dim: int | str | None``, e.g.
        # 1024 or "auto") takes any of them, not only its default's
        admitted = _annotation_types(param)
        if not ok and len(admitted) > 1:
            ok = any(_is_type(value, t) for t in admitted)
        if not ok:
            label = {list: "list", tuple: "list"}.get(want, want.__name__)
            if len(admitted) > 1:
                label = " or ".join(t.__name__ for t in admitted)
            raise SuiteError(f"{at} must be a {label} (like its default {default!r}), "
                             f"got {value!r}")
    choices = _choices(key, kind)
    if choices is not None:
        values = value if isinstance(value, list) else [value]
        for v in values:
            if key in ("scheme", "schemes", "baselines") and is_reference(v):
                _check_estimator_ref(at, v)  # imported and its signature read, never called
                continue
            if key in ("task", "tasks") and isinstance(v, str) and v not in choices:
                continue  # MODULE:ATTR or a data path: resolved with its knobs in parse_case
            if v not in choices and not (key == "policy" and isinstance(v, str)
                                         and Path(v).is_dir()):
                extra = " or an existing checkpoint directory" if key == "policy" else ""
                if key in ("scheme", "schemes"):
                    extra = " or MODULE:FUNCTION"
                raise SuiteError(f"{at}: {v!r} is not valid; choose one of "
                                 f"{sorted(map(str, choices))}{extra}")
    if key == "device" and isinstance(value, str) and value:
        from varbench.app.specs import resolve_device

        try:
            resolve_device(value)
        except UsageError as err:
            raise SuiteError(f"{at}: {err}") from None
    if key == "checkpoint" and value is not None and not Path(str(value)).is_dir():
        raise SuiteError(f"{at} = {value!r} is not an existing checkpoint directory")
    if key == "estimator":
        from varbench.estimators import schemes

        if not isinstance(value, str) or not (is_reference(value) or value in schemes()):
            raise SuiteError(f"{at} = {value!r} is not valid; give MODULE:FUNCTION (imported "
                             f"by name when the case runs) or a scheme in {schemes()}")
        if is_reference(value):
            _check_estimator_ref(at, value)


def _check_estimator_ref(at: str, ref: str) -> None:
    """Import the estimator ``ref`` and read its signature (one of the shapes
    ``register_scheme`` takes); it is not called. SuiteError naming the key otherwise."""
    from varbench.testing.adapt import load

    try:
        load(ref)
    except UsageError as err:
        raise SuiteError(f"{at}: {err}") from None


# Ranges of the numeric keys, by name, whatever the kind (suite keys and command-line flags):
# declared once in varbench._util.bounds and checked for every case before the first one runs.


def _check_range(at: str, key: str, value: Any) -> None:
    """Finite numbers everywhere, ranges by key (:data:`varbench._util.bounds.KNOBS`),
    non-empty lists, devices that exist."""
    from varbench._util.bounds import ELEMENT_OF, KNOBS, NONEMPTY

    _check_finite(at, value)
    bound = KNOBS.get(key)
    if (bound is not None and isinstance(value, (int, float)) and not isinstance(value, bool)
            and not (bound.kind is int and isinstance(value, float))):  # a type: _check_value
        _bounded(at, bound, value)
    if isinstance(value, list):
        if key in NONEMPTY and not value:
            raise SuiteError(f"{at} = [] is empty; give at least one value (an empty list "
                             "would run nothing and report nothing)")
        if key in ELEMENT_OF:
            element = KNOBS[ELEMENT_OF[key]]
            for v in value:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise SuiteError(f"{at}: element {v!r} must be an integer")
                _bounded(at, element, v, element=True)
    if key == "device" and value not in (None, "", "auto"):  # "" / auto: the default device
        from varbench._util.checks import check_device

        try:
            check_device(key, value)
        except UsageError as err:
            raise SuiteError(f"{at}: {err}") from None


def _bounded(at: str, bound, v: Any, element: bool = False) -> None:
    problem = bound.problem(v)
    if problem:
        raise SuiteError(f"{at}: element {v!r} {problem}" if element else f"{at} = {v!r} {problem}")


def _check_finite(at: str, value: Any) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise SuiteError(f"{at} = {value!r} is not valid; expected a finite number")
    if isinstance(value, list):
        for v in value:
            _check_finite(at, v)
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_finite(f"{at}.{k}", v)


def _choices(key: str, kind: str) -> list[Any] | None:
    if key in ("scheme", "schemes", "baselines"):
        from varbench.estimators import schemes
        from varbench.estimators.registry import exact_label, weighted_schemes

        names = schemes()
        if kind == "variance":  # labels may name the schemes reading token weights, exact
            names = names + [exact_label(n) for n in weighted_schemes()]
        return names
    if key in ("agg", "mode", "modes"):
        from varbench.estimators import AGGREGATION_MODES

        return list(AGGREGATION_MODES)
    if key in ("task", "tasks"):
        from varbench.tasks import task_names

        return task_names()
    if key in ("policy", "preset"):
        from varbench.models import presets

        return presets()
    if key == "states":
        from varbench.app.specs import STATES

        return list(STATES)
    return None
