"""The validation grid's pre-registration (issue 31): a TOML file written before the run that
states the design (the validate case's keys: tasks, schemes, G, seeds, arms, claims, margins,
the collapse threshold, ...) and the analysis (interval, level, multiplicity procedure, the
collapse rule, the verdict rules). The report hashes the file (SHA-256 of its bytes) and lists
every difference between what ran and what was registered as a *deviation*, beside the
deviations the file itself discloses (known before it was written).

File layout (``suites/prereg/otb-claims.toml``)::

    [registration]          # who/what/when: suite, case, registered (a date), note
    [design]                # ValidateConfig fields, as the suite's validate case writes them
    [analysis]              # analysis_plan(): level, interval, multiplicity, collapse, rules
    [[disclosed]]           # deviations known at registration: {grid, change, text}

Fields the ``[design]`` table leaves out are registered at their defaults (as a suite case
leaves them), so a later change to one is a deviation too. The runs' device (``base.device``,
set by the command line) and the path of the file itself are placement, not design.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from varbench._util.checks import UsageError
from varbench._util.io import text_sha256
from varbench.analysis import validate_stats as vs

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

SECTIONS = ("registration", "design", "analysis", "disclosed")
REGISTRATION_KEYS = ("suite", "case", "registered", "note")
DISCLOSED_KEYS = ("grid", "change", "text")
# not part of the design: where the runs compute, and the registration's own path
PLACEMENT = ("preregistration", "base.device")
# design keys whose change has a name of its own in the deviation text
_NAMED = {"seeds": "seed list", "task_seeds": "per-task seeds",
          "equivalence_margin": "equivalence margin (proxy claims)",
          "collapse_acc_frac": "collapse definition (final accuracy below this fraction of the "
                               "warm start's)",
          "threshold_frac": "threshold (fraction of the gap to 1)", "budgets": "token budgets"}


def analysis_plan(estimands: Iterable[str] = ()) -> dict[str, Any]:
    """The analysis the report applies, as the ``[analysis]`` table registers it; its verdict
    rules are those of the claims' ``estimands`` (:func:`validate_stats.verdict_rules`)."""
    return {"level": vs.LEVEL, "interval": vs.REPORT_INTERVAL, "multiplicity": "holm",
            "multiplicity_family": vs.HOLM_FAMILY, "collapse": vs.COLLAPSE_RULE,
            "stability_measures": ["collapse"], "verdict_rules": vs.verdict_rules(estimands)}


def load_preregistration(path: str | Path) -> tuple[dict[str, Any], str]:
    """``(tables, sha256)`` of the pre-registration file ``path`` (relative paths: to the
    working directory, as data files in a suite), its sections and keys checked."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"preregistration={str(path)!r}: no such file (a relative path is "
                         "relative to the working directory, e.g. "
                         "suites/prereg/otb-claims.toml run from the repository root)")
    text = p.read_bytes().decode("utf-8")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"preregistration {str(path)!r}: not valid TOML: {err}") from None
    _check_keys(path, "top level", data, SECTIONS)
    for sec in ("registration", "design", "analysis"):
        if not isinstance(data.get(sec), dict):
            raise UsageError(f"preregistration {str(path)!r}: missing [{sec}] table")
    _check_keys(path, "[registration]", data["registration"], REGISTRATION_KEYS)
    _check_keys(path, "[analysis]", data["analysis"], tuple(analysis_plan()))
    disclosed = data.get("disclosed", [])
    if not isinstance(disclosed, list) or not all(isinstance(d, dict) for d in disclosed):
        raise UsageError(f"preregistration {str(path)!r}: disclosed must be [[disclosed]] "
                         "tables")
    for d in disclosed:
        _check_keys(path, "[[disclosed]]", d, DISCLOSED_KEYS)
        if not isinstance(d.get("text"), str) or not d["text"]:
            raise UsageError(f"preregistration {str(path)!r}: a [[disclosed]] entry needs "
                             "text = \"...\"")
    return data, text_sha256(text)


def _check_keys(path: Any, at: str, table: dict, valid: tuple[str, ...]) -> None:
    bad = sorted(set(table) - set(valid))
    if bad:
        raise UsageError(f"preregistration {str(path)!r}: {at} key {bad[0]!r} is not valid; "
                         f"valid keys: {list(valid)}")


def _canon(v: Any) -> str:
    return json.dumps(v, sort_keys=True)


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    """Nested tables as ``a.b`` keys, except lists and the tables under arms/claims."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and k in ("base", "verdict_rules"):
            out.update(_flat(v, key + "."))
        else:
            out[key] = v
    return out


def _label(entry: dict, kind: str) -> str:
    if kind == "arms":
        name = f"{entry.get('scheme')}/{entry.get('G')}" + (
            f"/{entry['variant']}" if entry.get("variant") else "")
        return f"{entry.get('task')} {name}"
    def side(s: Any) -> str:
        return "+".join(s) if isinstance(s, list) else str(s)

    where = entry.get("task") or ",".join(entry.get("tasks", [])) or "all tasks"
    extra = f" [measure {entry['measure']}]" if "measure" in entry else ""  # not a margin:
    # a changed margin is the same claim, changed
    return (f"{entry.get('kind')} {where}: {side(entry.get('a'))} vs {side(entry.get('b'))}"
            + extra)


def _list_deviations(key: str, reg: list, ran: list) -> list[str]:
    """Arms and claims: each added, dropped or changed entry, by its label."""
    rl = {_label(e, key): e for e in reg}
    nl = {_label(e, key): e for e in ran}
    what = key[:-1]
    out = [f"{what} added: {k} {_canon(nl[k])}" for k in nl if k not in rl]
    out += [f"{what} dropped: {k}" for k in rl if k not in nl]
    out += [f"{what} changed: {k}: registered {_canon(rl[k])}, ran {_canon(nl[k])}"
            for k in rl if k in nl and _canon(rl[k]) != _canon(nl[k])]
    return out


def deviations(registered: dict[str, Any], ran: dict[str, Any],
               analysis_registered: dict[str, Any], analysis_ran: dict[str, Any]) -> list[str]:
    """Every difference between the registered design/analysis and what ran, one sentence each.

    ``registered``, ``ran``: the design as plain config data (every field, defaults filled in,
    as :func:`varbench.analysis.validate.config_dict` writes it); ``analysis_*``: the
    ``[analysis]`` table and :func:`analysis_plan`. Arms and claims are compared entry by entry
    (added / dropped / changed); a seed list by its count and values."""
    out: list[str] = []
    reg, new = _flat(registered), _flat(ran)
    for key in sorted(set(reg) | set(new)):
        if key in PLACEMENT or _canon(reg.get(key)) == _canon(new.get(key)):
            continue
        if key in ("arms", "claims"):
            out += _list_deviations(key, list(reg.get(key) or []), list(new.get(key) or []))
            continue
        r, n = reg.get(key, "(not registered)"), new.get(key, "(absent)")
        name = _NAMED.get(key, key)
        if key == "seeds":
            out.append(f"{name}: registered {len(r)} seeds {r}, ran {len(n)} seeds {n}")
        else:
            out.append(f"{name}: registered {_canon(r)}, ran {_canon(n)}")
    areg, aran = _flat(analysis_registered), _flat(analysis_ran)
    for key in sorted(set(areg) | set(aran)):
        if _canon(areg.get(key)) != _canon(aran.get(key)):
            out.append(f"analysis {key}: registered {_canon(areg.get(key, '(absent)'))}, "
                       f"ran {_canon(aran.get(key, '(absent)'))}")
    return out


def report_block(path: str | Path, ran: dict[str, Any],
                 normalise: Callable[[dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
    """What the report records of the pre-registration ``path`` against the config that ran
    (``ran``: plain config data): its SHA-256, date, deviations and disclosed deviations.
    ``normalise``: the ``[design]`` table -> plain config data with defaults filled in."""
    data, sha = load_preregistration(path)
    reg = data["registration"]
    try:
        registered = normalise(dict(data["design"]))
    except UsageError as err:
        raise UsageError(f"preregistration {str(path)!r} [design]: {err}") from None
    return {"file": str(path), "sha256": sha, "registered": str(reg.get("registered", "")),
            "suite": reg.get("suite", ""), "case": reg.get("case", ""),
            "deviations": deviations(registered, ran, data["analysis"], analysis_plan(
                [vs.estimand_of(c) for c in ran.get("claims") or []])),
            "disclosed": [f"{d.get('grid', 'earlier grid')}: {d.get('change', 'change')}: "
                          f"{d['text']}" for d in data.get("disclosed", [])]}


def headline_text(block: dict[str, Any] | None) -> str:
    """The report's one sentence on the pre-registration (``None``: there is none)."""
    if block is None:
        return ("This grid was not pre-registered (no preregistration file in its validate "
                "case): its design and analysis were not fixed before the runs.")
    devs = block["deviations"]
    return (f"Pre-registration {block['file']} (registered {block['registered'] or 'undated'}, "
            f"sha256 {block['sha256']}): "
            + (f"{len(devs)} deviation(s) of the run from it: " + "; ".join(devs) if devs
               else "the run follows it (no deviation)")
            + (f". Disclosed at registration: {len(block['disclosed'])} earlier deviation(s)"
               " (listed in the notes)." if block["disclosed"] else "."))


def notes_of(block: dict[str, Any] | None) -> list[str]:
    """One report note per deviation and per disclosed deviation."""
    if block is None:
        return []
    return ([f"Deviation from the pre-registration: {d}" for d in block["deviations"]]
            + [f"Disclosed deviation (before the pre-registration): {d}"
               for d in block["disclosed"]])
