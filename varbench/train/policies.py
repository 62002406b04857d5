"""The one place a policy is built from its description: a preset (random init or warm-started
on a task) or a local checkpoint directory.

The application layer (``varbench.app.specs``) parses what a user typed and calls
:func:`build_policy`; library code that starts from a config (the trainer, the validation
experiment) calls it too, so every route builds a given description the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch

from varbench._util.checks import UsageError, check_device
from varbench._util.config import resolve_dtype
from varbench.models import Policy, build_preset, load_policy, presets
from varbench.models.presets import not_a_policy
from varbench.tasks import Task


def is_checkpoint_dir(spec: str | Path) -> bool:
    """Whether ``spec`` names a local Hugging Face checkpoint directory (has config.json)."""
    p = Path(spec).expanduser()
    return p.is_dir() and (p / "config.json").is_file()


def check_policy_spec(spec: str | Path, arg: str = "policy") -> str:
    """``spec`` as a string if it names a preset or a local checkpoint directory, else a
    UsageError naming the argument ``arg`` (``"--policy"`` for a flag), the value and the
    presets: the one home of that refusal for the library, the CLI and the warm start."""
    name = str(spec)
    if name not in presets() and not is_checkpoint_dir(name):
        raise not_a_policy(arg, name)
    return name


def _text_config(spec: str | Path, trust_remote_code: bool):
    """The (text) model config of the policy ``spec`` names, from its config alone."""
    name = check_policy_spec(spec)
    if name in presets():
        from varbench.models.presets import preset_config

        return preset_config(name)
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(str(Path(name).expanduser()), local_files_only=True,
                                         trust_remote_code=bool(trust_remote_code))
    except Exception as err:  # noqa: BLE001 - any unreadable config is the user's file
        first = " ".join(str(err).split())[:300]
        raise UsageError(f"cannot read the config of {name!r}: {first}") from err
    return cfg


def vocab_size_of(spec: str | Path, *, trust_remote_code: bool = False) -> int:
    """Output vocabulary of the policy ``spec`` names, from its config alone (no weights read):
    what a plan needs (the variance analysis enumerates ``V**T`` responses when small)."""
    cfg = _text_config(spec, trust_remote_code)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n = getattr(text, "vocab_size", None)
    if not isinstance(n, int) or n < 1:
        raise UsageError(f"the config of {spec!r} has no vocab_size")
    return n


def model_shape_of(spec: str | Path, dtype: str | torch.dtype | None = None, *,
                   trust_remote_code: bool = False):
    """The :class:`~varbench.models.memplan.ModelShape` of the policy ``spec`` names in
    ``dtype`` (None / "auto": the checkpoint's stored dtype, float32 for a preset), from its
    config alone: what a plan's chunk sizes read."""
    from varbench.models.memplan import ModelShape

    cfg = _text_config(spec, trust_remote_code)
    want = resolve_dtype(dtype)
    if want is None:
        stored = getattr(cfg, "torch_dtype", None) if str(spec) not in presets() else None
        want = (resolve_dtype(stored, "stored dtype") if isinstance(stored, str)
                else stored if isinstance(stored, torch.dtype) else torch.float32)
    return ModelShape.from_config(cfg, want)


def prepare_for_task(policy: Policy, task: Task | None, *, add_task_tokens: bool = False
                     ) -> Policy:
    """Check (or, with ``add_task_tokens``, make) every symbol of ``task``'s alphabet one token
    of the policy's tokenizer, then bind the task to the tokenizer (a dataset task's chat
    template). Added tokens resize the embeddings in place and are recorded in
    ``policy.meta["added_tokens"]``; a message on stderr says so."""
    import sys

    from varbench.models.tokenizer import add_task_tokens as add_tokens
    from varbench.models.tokenizer import check_tokenizer_covers

    if task is None:
        return policy
    if add_task_tokens:
        added = add_tokens(policy.tokenizer, policy.model, task.alphabet)
        if added:
            policy.meta["added_tokens"] = [*policy.meta.get("added_tokens", []), *added]
            print(f"varbench: added {len(added)} task token(s) {added} to the tokenizer of "
                  f"{policy.name!r} and resized its embeddings to {len(policy.tokenizer)}",
                  file=sys.stderr)
    check_tokenizer_covers(policy.tokenizer, task.alphabet, what=f"task {task.name!r}")
    task.bind(policy.tokenizer)
    return policy


def build_policy(
    spec: str | Path,
    *,
    task: Task | None = None,
    warm: bool = False,
    seed: int = 0,
    warm_seed: int | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
    trust_remote_code: bool = False,
    add_task_tokens: bool = False,
    progress: bool | None = None,
    tie_embeddings: bool = False,
) -> Policy:
    """The policy ``spec`` names: a preset name or a local checkpoint directory (the one policy
    builder: the CLI, suites, the trainer and the warm start all build through it).

    A preset is built at random initialisation from ``seed`` (``tie_embeddings``: input and
    output embeddings shared); a checkpoint directory is loaded
    (its stored dtype unless ``dtype`` is given). With ``warm=True`` either is warm-started on
    ``task``'s demonstrations from ``warm_seed`` (default ``seed``; cached, see
    :func:`varbench.train.warm_start`); a task without demonstrations is refused. With a
    ``task``, its alphabet is checked to be single tokens (``add_task_tokens``: added, embeddings
    resized) and the task is bound to the tokenizer. Raises UsageError naming the spec and the
    presets when ``spec`` is neither a preset nor a checkpoint directory.
    """
    name = str(spec)
    check_device("device", "cpu" if device is None else device, dtype=dtype)
    check_policy_spec(name)
    if warm:
        if task is None:
            raise UsageError(f"warm-starting policy {name!r} needs a task")
        if not task.has_demonstrations:
            raise UsageError(f"warm start of {name!r} on task {task.name!r} needs "
                             "demonstrations; this task has none (a dataset task: set --knob "
                             "solution_key=COLUMN), so pass the policy without warm start")
        from varbench.train.warmstart import warm_start

        policy = warm_start(name, task, seed=seed if warm_seed is None else warm_seed,
                            add_task_tokens=add_task_tokens, trust_remote_code=trust_remote_code,
                            progress=progress)
        stored = policy.meta.get("stored_dtype")
        if dtype is None and stored is not None:
            dtype = resolve_dtype(stored, "stored dtype")  # "auto": the checkpoint's own
    elif name in presets():
        policy = build_preset(name, seed=seed, tie_embeddings=tie_embeddings)
    else:
        # with the device: a checkpoint larger than it is refused before any weight is read
        policy = load_policy(name, dtype=dtype, device=device,
                             trust_remote_code=trust_remote_code)
    if dtype is not None or device is not None:
        policy.model.to(device=device, dtype=dtype)
    return prepare_for_task(policy, task, add_task_tokens=add_task_tokens)
