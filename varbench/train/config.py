"""TrainConfig: every knob of the GRPO/PPO loop (docs/science.md §7), frozen, loadable from TOML.

A config is data: ``TrainConfig.from_toml(path)`` reads a flat table whose keys are the field
names below (``task_options`` and ``scheme_options`` are sub-tables); unknown keys, wrong types
and invalid choices raise ValueError/TypeError naming the file, the key and the valid choices.
Scheme and aggregation-mode names are validated against the estimator registry when a run
starts (``varbench.train.loop.train``), so user-registered schemes are accepted.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from varbench._util.bounds import KNOBS, check_knob
from varbench._util.checks import UsageError, UsageFileNotFoundError, UsageTypeError
from varbench._util.config import DTYPES
from varbench._util.config import field_docs as config_field_docs
from varbench.estimators.coefficients import TRANSFORMS
from varbench.estimators.kl import KL_KINDS
from varbench.estimators.loss import RATIO_KINDS
from varbench.estimators.registry import weighted_schemes

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

LR_SCHEDULES = ("constant", "linear", "cosine")
# training takes every model dtype but float16 (it would need loss scaling)
TRAIN_DTYPES = tuple(d for d in DTYPES if d != "float16")


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Defaults train the ``tiny`` preset on ``sort`` with 3 numbers."""

    # --- what is trained on what ---
    task: str = "sort"
    """Task spec: a registered name (``varbench tasks`` lists them), MODULE:ATTR (a Task subclass
    or factory), or a data file (.jsonl, .json, .csv, .parquet) or datasets directory."""
    task_options: Mapping[str, Any] = field(default_factory=dict)
    """Task knobs (e.g. ``n`` for sort); empty: the task's defaults (sort: n = 3)."""
    reward: str | None = None
    """Reward the policy is trained on (None: the task's exact-match reward). Held-out accuracy
    is always the exact-match reward, so a proxy reward can be checked against it."""
    policy: str = "tiny"
    """Model preset name ('tiny', 'small') or a local checkpoint directory."""
    warm_start: bool = True
    """For a preset: start from the cached supervised warm start on this task (else random init).
    A checkpoint directory is used as is unless ``warm_start_dir`` is true."""
    warm_start_dir: bool = False
    """Warm-start a checkpoint directory too (needs a task with demonstrations)."""
    trust_remote_code: bool = False
    """Allow a checkpoint directory's own Python code to run when loading it."""
    add_task_tokens: bool = False
    """Add a toy task's symbols as tokens (resizing the embeddings) when the tokenizer splits
    them; otherwise such a tokenizer is an error."""
    warm_start_seed: int = 0
    """Seed of the warm start (shared by every run that should start from the same policy)."""

    # --- estimator ---
    scheme: str = "centered"
    """Registered advantage scheme (``varbench.schemes()``)."""
    scheme_options: Mapping[str, Any] = field(default_factory=dict)
    """Keyword options of the scheme (e.g. ``k`` for topk, ``eps`` for normalized)."""
    agg: str = "token-mean"
    """Loss aggregation mode (docs/science.md section 3)."""
    transform: str = "none"
    """Exchangeability transform of the per-sample weights
    (``varbench.estimators.coefficients.TRANSFORMS``)."""
    token_weights: str = "proxy"
    """Token weights w_t of the OTB-type schemes (otb, otb_loo): ``proxy`` (the forward-only
    Logit-Gradient Proxy from the sampler's statistics) or ``exact`` (the exact per-token
    gradient norms ||grad log pi(y_t)||^2 of the sampled responses: one exact-harness pass per
    step, several times the cost of an update; the analyses' ``otb_exact``)."""
    dynamic_filter: bool = False
    """Drop groups whose rewards all agree before the update (DAPO's dynamic sampling, without
    resampling: the step trains on the remaining groups; a step with none left is skipped)."""

    # --- sampling ---
    G: int = 8
    """Group size: responses sampled per prompt."""
    prompts_per_step: int = 8
    """Training prompts per step (P); a step samples P * G responses."""
    temperature: float = 1.0
    """Sampling temperature (1: the policy gradient's on-policy assumption)."""

    # --- optimisation ---
    steps: int = 100
    """Maximum number of training steps."""
    token_budget: int = 0
    """Stop once cumulative sampled (policy-generated) tokens reach this (0: no budget)."""
    epochs: int = 1
    """Inner epochs over the same sampled responses (PPO); logp_old is fixed per step."""
    minibatches: int = 1
    """Minibatches per epoch; the unit is a whole group, so it must be <= prompts_per_step."""
    clip_low: float = 0.2
    """Lower clip epsilon: ratios below 1 - clip_low are clipped."""
    clip_high: float = 0.2
    """Upper clip epsilon: ratios above 1 + clip_high are clipped (DAPO: clip_high > clip_low)."""
    ratio: str = "token"
    """Importance ratio: 'token' (PPO) or 'sequence' (GSPO, length-normalised)."""
    kl_coef: float = 0.0
    """beta of the KL penalty to the frozen initial policy (0: no reference model)."""
    kl_kind: str = "k3"
    """KL estimator: k1 (log r), k2 (0.5 log^2 r) or k3 (exp(-x) + x - 1)."""
    lr: float = 3e-4
    """Adam learning rate (peak of the schedule)."""
    lr_schedule: str = "constant"
    """Learning-rate schedule after warmup: constant, linear (to 0) or cosine (to 0)."""
    warmup_steps: int = 0
    """Linear warmup steps from 0 to ``lr``."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0: no clipping; the norm is still recorded)."""
    update_forward: str = "teacher-forced"
    """Where the update's log-probs come from: ``teacher-forced`` (a forward over the sampled
    responses, in train mode) or ``sampler`` (backpropagate through the sampler's own model
    calls, one forward fewer per step: the same gradient up to rounding, taken in eval mode,
    i.e. without dropout; needs epochs = minibatches = 1 and a model whose every layer is plain
    full attention). Worth it for responses of a few tokens only: on sort (3 tokens) 1.07x /
    1.00x / 1.26x / 1.15x the teacher-forced loop's throughput (tiny G = 4 / tiny G = 32 /
    small G = 4 / small G = 32), on toolsum (~19 tokens, tool output included) 0.62x / 0.79x
    (tiny G = 4 / 32): decoding with autograd on costs more than the forward it saves
    (benchmarks/bench_train.py)."""

    # --- evaluation, records, checkpoints ---
    eval_every: int = 10
    """Held-out evaluation every n steps (and at step 0, the starting policy)."""
    eval_prompts: int = 64
    """Number of fixed held-out prompts."""
    eval_samples: int = 4
    """Sampled responses per held-out prompt for the sampled accuracy (greedy uses one)."""
    eval_seed: int = 0
    """Seed of the held-out prompt set and of evaluation sampling. Independent of ``seed`` so
    that runs with different training seeds are judged on the same prompts and random stream."""
    checkpoint_every: int = 0
    """Save a resumable checkpoint every n steps (0: never)."""
    keep_checkpoints: int = 2
    """How many most recent checkpoints to keep."""

    # --- collapse detection ---
    surge_factor: float = 5.0
    """Flag a gradient-norm surge when the norm exceeds this multiple of the running median."""
    surge_window: int = 20
    """Number of previous steps in the running median of the gradient norm."""
    entropy_floor: float = 0.1
    """Flag entropy collapse when the mean token entropy falls below this fraction of its
    value at the first step."""

    seed: int = 0
    """One seed for everything (prompt order, sampling, minibatch order, evaluation)."""
    dtype: str = "float32"
    """Parameter dtype: float32 (default), float64, bfloat16 (float32 master weights and
    AdamW states: each update is computed in float32 and rounded into the bfloat16 model) or
    auto (the policy's own dtype). float16 is refused (it would need loss scaling)."""
    device: str = "cpu"
    """torch device string."""

    def __post_init__(self) -> None:
        _validate(self)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict of every field."""
        out = dataclasses.asdict(self)
        out["task_options"] = dict(self.task_options)
        out["scheme_options"] = dict(self.scheme_options)
        return out

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): the identity of a run's configuration."""
        return json.dumps(self.to_dict(), sort_keys=True)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "config") -> TrainConfig:
        """Build from a mapping of field names; ``source`` names the origin in error messages."""
        if not isinstance(data, Mapping):
            raise UsageTypeError(
                f"{source}: expected a table of settings, got {type(data).__name__}")
        names = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in names:
                raise UsageError(
                    f"{source}: unknown key {key!r}; valid keys are {sorted(names)}"
                )
            kwargs[key] = _coerce(source, key, value, names[key])
        try:
            return cls(**kwargs)
        except (ValueError, TypeError) as err:
            raise type(err)(f"{source}: {err}") from None

    @classmethod
    def from_toml(cls, path: str | Path, *, section: str | None = None) -> TrainConfig:
        """Load from a TOML file (optionally from one ``[section]`` of it)."""
        path = Path(path)
        if path.is_dir():
            raise UsageError(f"config file {str(path)!r} is a directory, not a TOML file")
        if not path.is_file():
            raise UsageFileNotFoundError(f"config file {str(path)!r} does not exist")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise UsageError(f"{path}: not valid TOML: {err}") from None
        if section is not None:
            if section not in data:
                raise UsageError(
                    f"{path}: no section [{section}]; sections present: {sorted(data)}"
                )
            data = data[section]
            source = f"{path} [{section}]"
        else:
            source = str(path)
        return cls.from_dict(data, source=source)


def with_defaults(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A saved ``to_dict()`` with the fields it predates filled in with their defaults (a new
    field's default keeps the behaviour of the code that saved it), for comparing runs."""
    defaults = {f.name: (f.default_factory() if f.default_factory is not dataclasses.MISSING
                         else f.default) for f in fields(TrainConfig)}
    return {**defaults, **dict(saved)}


def field_docs() -> dict[str, str]:
    """Each TrainConfig field's docstring (the CLI's help text), read from this module's source."""
    return config_field_docs(TrainConfig)


def _coerce(source: str, key: str, value: Any, f: dataclasses.Field) -> Any:
    """Check a TOML value against the field's declared type (ints accepted for floats)."""
    kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    where = f"{source}: key {key!r}"
    if kind == "bool":
        if not isinstance(value, bool):
            raise UsageTypeError(f"{where} must be true or false, got {value!r}")
    elif kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise UsageTypeError(f"{where} must be an integer, got {value!r}")
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UsageTypeError(f"{where} must be a number, got {value!r}")
        value = float(value)
    elif kind == "str":
        if not isinstance(value, str):
            raise UsageTypeError(f"{where} must be a string, got {value!r}")
    elif kind == "str | None":
        if value is not None and not isinstance(value, str):
            raise UsageTypeError(f"{where} must be a string, got {value!r}")
    elif kind.startswith("Mapping"):
        if not isinstance(value, Mapping):
            raise UsageTypeError(f"{where} must be a table, e.g. [{key}], got {value!r}")
        value = dict(value)
    return value


TOKEN_WEIGHTS = ("proxy", "exact")
UPDATE_FORWARDS = ("teacher-forced", "sampler")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UsageError(f"{name}={value!r} is not valid; choose one of {list(choices)}")


def _validate(c: TrainConfig) -> None:
    # every numeric field by its one declaration (varbench._util.bounds), as a suite's keys
    for f in dataclasses.fields(c):
        if f.name in KNOBS:
            check_knob(f.name, getattr(c, f.name))
    if c.minibatches > c.prompts_per_step:
        raise UsageError(
            f"minibatches={c.minibatches} is not valid; a minibatch holds whole groups, so it "
            f"must be <= prompts_per_step={c.prompts_per_step}"
        )
    _choice("lr_schedule", c.lr_schedule, LR_SCHEDULES)
    _choice("ratio", c.ratio, RATIO_KINDS)
    _choice("kl_kind", c.kl_kind, KL_KINDS)
    _choice("transform", c.transform, TRANSFORMS)
    _choice("token_weights", c.token_weights, TOKEN_WEIGHTS)
    _choice("update_forward", c.update_forward, UPDATE_FORWARDS)
    if c.update_forward == "sampler" and (c.epochs, c.minibatches) != (1, 1):
        raise UsageError(
            f"update_forward='sampler' is not valid with epochs={c.epochs}, "
            f"minibatches={c.minibatches}: the sampler's graph serves one update per step; "
            f"use epochs=1 and minibatches=1, or update_forward='teacher-forced'")
    if c.token_weights == "exact" and c.scheme not in weighted_schemes():
        # declared by the scheme (register_scheme(..., reads=("token_weights", ...)))
        raise UsageError(f"token_weights='exact' is not valid with scheme={c.scheme!r}: only "
                         f"the schemes that read token weights take it ({weighted_schemes()})")
    if c.dtype == "float16":
        raise UsageError("dtype='float16' is not valid for training (it needs loss scaling); "
                         f"choose one of {list(TRAIN_DTYPES)}")
    _choice("dtype", c.dtype, TRAIN_DTYPES)
    for name in ("task", "policy", "scheme", "agg", "device"):
        if not isinstance(getattr(c, name), str) or not getattr(c, name):
            raise UsageTypeError(f"{name} must be a non-empty string, got {getattr(c, name)!r}")
    for name in ("task_options", "scheme_options"):
        if not isinstance(getattr(c, name), Mapping):
            raise UsageTypeError(f"{name} must be a mapping, got {getattr(c, name)!r}")
