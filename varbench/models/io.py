"""Saving and loading policies as local Hugging Face checkpoint directories (safetensors).

``load_policy`` goes through ``AutoModelForCausalLM`` / ``AutoTokenizer``, so a user's own
checkpoint (a Qwen, a GPT-2) takes the same path as the embedded presets. Nothing is fetched
from a hub, code shipped with a checkpoint never runs unless ``trust_remote_code=True`` is passed,
and every weight file is validated before loading: a corrupt or truncated file is a ValueError
naming it, never a silent fallback.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from varbench._util.checks import UsageError
from varbench.models.presets import Policy, presets


def save_policy(policy: Policy, path: str | Path) -> Path:
    """Write ``policy`` (model config + safetensors weights + tokenizer) to directory ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with _quiet_hf():
        policy.model.save_pretrained(path, safe_serialization=True)
    policy.tokenizer.save_pretrained(path)
    if policy.meta:
        (path / "varbench_meta.json").write_text(json.dumps(policy.meta, indent=1, default=str))
    return path


@contextmanager
def _quiet_hf():
    """Silence transformers' per-shard progress bars for checkpoints of a few kilobytes."""
    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def _weight_files(path: Path) -> list[Path]:
    st = sorted(path.glob("*.safetensors"))
    if st:
        return st
    return sorted(path.glob("pytorch_model*.bin"))


def _validate_weights(path: Path) -> None:
    """Open every weight file once so corruption is reported with the file's name."""
    files = _weight_files(path)
    if not files:
        raise UsageError(
            f"policy path {str(path)!r} holds no weights (*.safetensors or pytorch_model*.bin)"
        )
    for f in files:
        try:
            if f.suffix == ".safetensors":
                with safe_open(str(f), framework="pt") as h:
                    for k in h.keys():  # reading each tensor catches truncated payloads
                        h.get_tensor(k)
            else:
                torch.load(f, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any failure here means the file is bad
            raise UsageError(f"corrupt or truncated checkpoint file {str(f)!r}: {err}") from err


def load_policy(
    path: str | Path,
    *,
    trust_remote_code: bool = False,
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> Policy:
    """Load a local checkpoint directory (model + tokenizer) as a Policy.

    ``path`` must be an existing directory with ``config.json``; hub names are refused so nothing
    is ever downloaded. ``dtype=None`` keeps the checkpoint's dtype.
    """
    p = Path(path).expanduser()
    if not p.is_dir() or not (p / "config.json").is_file():
        raise UsageError(
            f"policy={str(path)!r} is not valid; choose a preset {presets()} or a local "
            "checkpoint directory containing config.json"
        )
    _validate_weights(p)
    kwargs = dict(local_files_only=True, trust_remote_code=bool(trust_remote_code))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(p), **kwargs)
    except Exception as err:  # noqa: BLE001
        raise UsageError(f"cannot load the tokenizer from {str(p)!r}: {err}") from err
    try:
        with _quiet_hf():
            model = AutoModelForCausalLM.from_pretrained(
                str(p), dtype=dtype if dtype is not None else "auto", **kwargs
            )
    except Exception as err:  # noqa: BLE001
        raise UsageError(f"cannot load the model from {str(p)!r}: {err}") from err
    if tokenizer.pad_token_id is None:
        # Batched sampling needs a pad id; reusing eos (the usual convention) changes nothing
        # because padded positions are masked out.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    if device is not None:
        model = model.to(device)
    model.eval()
    meta = {}
    mf = p / "varbench_meta.json"
    if mf.is_file():
        try:
            meta = json.loads(mf.read_text())
        except json.JSONDecodeError as err:
            raise UsageError(f"corrupt metadata file {str(mf)!r}: {err}") from err
    return Policy(model=model, tokenizer=tokenizer, name=str(path), meta=meta)
