"""Config dataclasses that are their own schema: each field declares its check once.

A config (:class:`~varbench.analysis.proxy.ProxyConfig` and its siblings, like
:class:`~varbench.train.TrainConfig`) is a frozen dataclass whose fields carry their checks in
their metadata (:func:`knob`, :func:`choice`, :func:`each`): a numeric field names its bound in
:data:`varbench._util.bounds.KNOBS`, a string field its choices. The library's keyword call,
the suite schema and the command line all build the config, so they accept and refuse the same
values. Each field's docstring (the string literal under it) is its help text.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import field, fields
from typing import Any

import torch

from varbench._util.bounds import KNOBS, check_knob
from varbench._util.checks import UsageError, UsageTypeError, check_choice

Choices = Sequence[str] | Callable[[], Sequence[str]]

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
"""Model dtypes a user may name (``auto``: the checkpoint's own): the one table of ``--dtype``,
a suite's ``dtype`` and TrainConfig's (which refuses float16: it would need loss scaling)."""


def resolve_dtype(name: str | torch.dtype | None, arg: str = "--dtype") -> torch.dtype | None:
    """The one parser of a :data:`DTYPES` name: ``"auto"``/None -> None (keep the stored
    dtype), a torch.dtype as it is, otherwise the torch dtype; UsageError naming ``arg``."""
    if isinstance(name, torch.dtype):
        return name
    if name is None or name == "auto":
        return None
    if name not in DTYPES:
        raise UsageError(f"{arg}={name!r} is not valid; choose one of {list(DTYPES)}")
    return getattr(torch, name)


def knob(default: Any, *, key: str | None = None, minimum: int | None = None,
         auto: bool = False, none: bool = False, zero_is_none: bool = False,
         flags: tuple[str, ...] = ()) -> Any:
    """A numeric field bounded by ``KNOBS[key]`` (default: the field's name), tightened to
    ``minimum``; ``auto``: the string ``"auto"`` is a value too; ``none``: None is a value
    (the library's keyword only: a suite or a flag cannot spell it); ``zero_is_none``: 0 is
    how a suite or a flag spells None (e.g. "no sketch"), normalised to None on construction,
    so the run reads one spelling. ``flags``: extra spellings on the command line (``-G``,
    ``--prompts``)."""
    return field(default=default, metadata={"knob": key, "minimum": minimum, "auto": auto,
                                            "none": none or zero_is_none,
                                            "zero_is_none": zero_is_none, "flags": flags})


def choice(default: Any, choices: Choices, *, none: bool = False,
           flags: tuple[str, ...] = ()) -> Any:
    """A string field that is one of ``choices`` (a sequence, or a function returning one when
    the choices are registered at run time); ``none``: None is a value too."""
    return field(default=default, metadata={"choices": choices, "none": none, "flags": flags})


def text(default: str | None = None, *, flags: tuple[str, ...] = ()) -> Any:
    """A free string field (None allowed), e.g. a task's reward name checked by the task."""
    return field(default=default, metadata={"text": True, "none": True, "flags": flags})


def each(default: Sequence[Any], *, key: str | None = None, choices: Choices | None = None,
         minimum: int | None = None, length: int | None = None,
         flags: tuple[str, ...] = ()) -> Any:
    """A non-empty list field whose every element is bounded by ``KNOBS[key]`` (tightened to
    ``minimum``), is one of ``choices``, or (neither given) is a string; ``length``: exactly
    that many elements."""
    return field(default=tuple(default), metadata={
        "each": True, "knob": key, "choices": choices, "minimum": minimum, "length": length,
        "flags": flags})


def _choices(spec: Choices) -> list[str]:
    return list(spec() if callable(spec) else spec)


class Config:
    """Base of the analyses' config dataclasses: every field checked by its declaration on
    construction, cross-field rules in :meth:`check_together`, ``from_dict`` for a suite case
    or a saved config."""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            object.__setattr__(self, f.name, type(self).check_field(f.name, getattr(self, f.name)))
        self.check_together()

    def check_together(self) -> None:
        """Rules between fields (a subclass overrides); UsageError naming them."""

    @classmethod
    def check_field(cls, name: str, value: Any, *, arg: str | None = None) -> Any:
        """``value`` checked against the declaration of field ``name`` (normalised: a list
        becomes a tuple); UsageError naming ``arg`` (default ``name``), the value and what is
        valid."""
        f = {f.name: f for f in fields(cls)}[name]  # type: ignore[arg-type]
        meta, arg = f.metadata, arg or name
        if value is None and meta.get("none"):
            return None
        if meta.get("each"):
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise UsageTypeError(f"{arg}={value!r} is not valid; expected a list")
            if not value:
                raise UsageError(f"{arg}=[] is empty; give at least one value (an empty list "
                                 "would run nothing and report nothing)")
            if meta["length"] is not None and len(value) != meta["length"]:
                raise UsageError(f"{arg}={list(value)!r} is not valid; expected "
                                 f"{meta['length']} values")
            return tuple(cls._element(meta, arg, v) for v in value)
        if meta.get("text"):
            if not isinstance(value, str):
                raise UsageTypeError(f"{arg}={value!r} is not valid; expected a string")
            return value
        if "knob" in meta:
            key = meta["knob"] or name
            if meta.get("auto") and isinstance(value, str):
                if value != "auto":
                    raise UsageTypeError(f"{arg}={value!r} is not valid; give "
                                         f"{_described(key, meta)} or 'auto'")
                return value
            value = check_knob(key, value, arg=arg, minimum=meta["minimum"])
            # the one place where 0 becomes None (a config normalises on construction)
            return None if meta.get("zero_is_none") and value == 0 else value
        if "choices" in meta:
            check_choice(arg, value, _choices(meta["choices"]))
        return value

    @staticmethod
    def _element(meta: Mapping[str, Any], arg: str, v: Any) -> Any:
        if meta["choices"] is not None:
            check_choice(arg, v, _choices(meta["choices"]))
            return v
        if meta["knob"] is None:  # names checked by the config's check_together
            if not isinstance(v, str):
                raise UsageTypeError(f"{arg}: element {v!r} is not valid; expected a string")
            return v
        return check_knob(meta["knob"], v, arg=arg, minimum=meta["minimum"])

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> Any:
        """Build from a mapping of field names; errors start with ``source`` and name the key."""
        if not isinstance(data, Mapping):
            raise UsageTypeError(
                f"{source}: expected a table of settings, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        for key, value in data.items():
            if key not in names:
                raise UsageError(f"{source}: unknown key {key!r}; valid keys are {sorted(names)}")
            try:
                cls.check_field(key, value)
            except UsageError as err:
                raise type(err)(f"{source} key {key!r}: {err}") from None
        try:
            return cls(**data)
        except UsageError as err:
            raise type(err)(f"{source}: {err}") from None

    def to_dict(self) -> dict[str, Any]:
        """Every field, lists for tuples (JSON / TOML shaped)."""
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in fields(self)}  # type: ignore[arg-type]


def _described(key: str, meta: Mapping[str, Any]) -> str:
    bound = KNOBS[key]
    if meta.get("minimum") is not None and (bound.lo is None or meta["minimum"] > bound.lo):
        bound = dataclasses.replace(bound, lo=meta["minimum"], lo_open=False)
    return bound.describe()


def flags_of(f: dataclasses.Field) -> list[str]:
    """The command-line spellings of a config field: ``--n-prompts`` and its declared ones."""
    return ["--" + f.name.replace("_", "-"), *f.metadata.get("flags", ())]


def field_docs(cls: type) -> dict[str, str]:
    """Each field's docstring (the string literal under it) of the dataclass ``cls``, read
    from its source: the command line's help text. A config that extends another inherits
    the docstrings of the fields it does not redeclare."""
    docs: dict[str, str] = {}
    for klass in reversed([k for k in cls.__mro__ if dataclasses.is_dataclass(k)]):
        tree = ast.parse(textwrap.dedent(inspect.getsource(sys.modules[klass.__module__])))
        node = next(n for n in ast.walk(tree)
                    if isinstance(n, ast.ClassDef) and n.name == klass.__name__)
        for item, nxt in zip(node.body, node.body[1:], strict=False):
            if (isinstance(item, ast.AnnAssign) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant)
                    and isinstance(item.target, ast.Name)):
                docs[item.target.id] = " ".join(str(nxt.value.value).split())
    return docs
