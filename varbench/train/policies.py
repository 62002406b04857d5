"""The one place a policy is built from its description: a preset (random init or warm-started
on a task) or a local checkpoint directory.

The application layer (``varbench.app.specs``) parses what a user typed and calls
:func:`build_policy`; library code that starts from a config (the trainer, the validation
experiment) calls it too, so every route builds a given description the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch

from varbench._util.checks import UsageError
from varbench.models import Policy, load_policy, presets
from varbench.models import build_policy as build_preset
from varbench.tasks import Task


def is_checkpoint_dir(spec: str | Path) -> bool:
    """Whether ``spec`` names a local Hugging Face checkpoint directory (has config.json)."""
    p = Path(spec).expanduser()
    return p.is_dir() and (p / "config.json").is_file()


def check_policy_spec(spec: str | Path) -> str:
    """``spec`` as a string if it names a preset or a local checkpoint directory, else a
    UsageError naming it and the presets."""
    name = str(spec)
    if name not in presets() and not is_checkpoint_dir(name):
        raise UsageError(f"policy={name!r} is not valid; choose a preset {presets()} or a local "
                         "checkpoint directory containing config.json")
    return name


def vocab_size_of(spec: str | Path, *, trust_remote_code: bool = False) -> int:
    """Output vocabulary of the policy ``spec`` names, from its config alone (no weights read):
    what a plan needs (the variance analysis enumerates ``V**T`` responses when small)."""
    name = check_policy_spec(spec)
    if name in presets():
        from varbench.models.presets import preset_config

        return int(preset_config(name).vocab_size)
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(str(Path(name).expanduser()), local_files_only=True,
                                         trust_remote_code=bool(trust_remote_code))
    except Exception as err:  # noqa: BLE001 - any unreadable config is the user's file
        first = " ".join(str(err).split())[:300]
        raise UsageError(f"cannot read the config of {name!r}: {first}") from err
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    n = getattr(text, "vocab_size", None)
    if not isinstance(n, int) or n < 1:
        raise UsageError(f"the config of {name!r} has no vocab_size")
    return n


def check_dtype_on_device(dtype: torch.dtype | None, device: str | torch.device | None) -> None:
    """UsageError unless ``device`` can hold and compute in ``dtype`` (bfloat16 needs a GPU with
    bf16 support, or the CPU; float16 on the CPU runs but slowly and is allowed)."""
    if dtype is None:
        return
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dtype == torch.bfloat16 and dev.type == "cuda" and not torch.cuda.is_bf16_supported(
            including_emulation=False):
        raise UsageError(f"--dtype=bfloat16 is not supported on --device={str(dev)!r} (this GPU "
                         "has no bfloat16 arithmetic); choose one of ['float16', 'float32']")
    if dtype in (torch.bfloat16, torch.float16) and dev.type == "mps":
        try:
            (torch.ones(2, 2, dtype=dtype, device=dev) @ torch.ones(2, 2, dtype=dtype,
                                                                    device=dev)).cpu()
        except (RuntimeError, TypeError) as err:
            raise UsageError(f"--dtype={str(dtype).removeprefix('torch.')} is not supported on "
                             f"--device={str(dev)!r} ({err}); use --dtype float32") from None
    if dtype == torch.float64 and dev.type == "mps":
        raise UsageError("--dtype=float64 is not supported on --device='mps'; use float32")


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
) -> Policy:
    """The policy ``spec`` names: a preset name or a local checkpoint directory.

    A preset is built at random initialisation from ``seed``; a checkpoint directory is loaded
    (its stored dtype unless ``dtype`` is given). With ``warm=True`` either is warm-started on
    ``task``'s demonstrations from ``warm_seed`` (default ``seed``; cached, see
    :func:`varbench.train.warm_start`); a task without demonstrations is refused. With a
    ``task``, its alphabet is checked to be single tokens (``add_task_tokens``: added, embeddings
    resized) and the task is bound to the tokenizer. Raises UsageError naming the spec and the
    presets when ``spec`` is neither a preset nor a checkpoint directory.
    """
    name = str(spec)
    check_dtype_on_device(dtype, device)
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
            dtype = getattr(torch, stored)  # "auto": the checkpoint's own dtype
    elif name in presets():
        policy = build_preset(name, seed=seed)
    else:
        # with the device: a checkpoint larger than it is refused before any weight is read
        policy = load_policy(name, dtype=dtype, device=device,
                             trust_remote_code=trust_remote_code)
    if dtype is not None or device is not None:
        policy.model.to(device=device, dtype=dtype)
    return prepare_for_task(policy, task, add_task_tokens=add_task_tokens)
