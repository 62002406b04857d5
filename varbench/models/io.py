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
from varbench.models.presets import Policy, not_a_policy

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                    "spiece.model", "vocab.txt")


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
                _check_safetensors(f)
            else:
                import zipfile

                if zipfile.is_zipfile(f):  # the central directory sits at the end: truncation
                    zipfile.ZipFile(f).close()
                else:  # a legacy pickle: no layout to check without reading it
                    torch.load(f, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any failure here means the file is bad
            raise UsageError(f"corrupt or truncated checkpoint file {str(f)!r}: {err}") from err


def _check_safetensors(f: Path) -> None:
    """The file's header parses and its tensors' byte ranges end exactly at the file's end: a
    truncated or padded payload is caught without reading the weights (transformers reads
    them once, afterwards)."""
    size = f.stat().st_size
    with f.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than a safetensors header")
        n = int.from_bytes(raw, "little")
        if n <= 0 or 8 + n > size:
            raise ValueError(f"header length {n} does not fit a file of {size} bytes")
        header = json.loads(fh.read(n))
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    if 8 + n + max(ends, default=0) != size:
        raise ValueError(f"tensor data ends at byte {8 + n + max(ends, default=0)}, the file "
                         f"has {size}")
    with safe_open(str(f), framework="pt") as h:  # the header's dtypes and shapes agree
        list(h.keys())


def check_policy(model, tokenizer, name: str) -> None:
    """Refuse a checkpoint whose embedding has fewer rows than the tokenizer has tokens (an
    id past the table is an IndexError deep inside sampling)."""
    emb = model.get_input_embeddings()
    rows = getattr(emb, "num_embeddings", None)
    if rows is not None and rows < len(tokenizer):
        raise UsageError(
            f"policy {name!r}: the model's vocabulary has {rows} rows but the tokenizer has "
            f"{len(tokenizer)} tokens; ids >= {rows} would index past the embedding: resize "
            "the embeddings (model.resize_token_embeddings(len(tokenizer))) and save again")


def check_fits(path: Path, dtype: torch.dtype | None, device: str | torch.device, *,
               trust_remote_code: bool = False) -> None:
    """Refuse, before any weight is read, a checkpoint that does not fit ``device``.

    From ``config.json`` alone (:func:`varbench.models.memplan.plan_before_load`, the one
    check): the parameters must fit the device's free memory and one sampled row of one
    position (the least any command does with a policy) beside them its budget; each path's
    own plan checks its chunks when it runs. No placement across devices is attempted (a
    model larger than one device is refused, with the bytes it needs and the device's).
    Devices without a measured free memory (the CPU) pass.
    """
    from transformers import AutoConfig

    from varbench.models import memplan

    free = memplan.free_device_bytes(device)
    if free is None:  # nothing to check against (the CPU): the config is not even read
        return
    try:
        with _quiet_hf():
            cfg = AutoConfig.from_pretrained(str(path), local_files_only=True,
                                             trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - the model load below reports an unreadable config
        return
    want = dtype or getattr(cfg, "dtype", None) or getattr(cfg, "torch_dtype", None)
    if isinstance(want, str):
        want = getattr(torch, want, None)
    if not isinstance(want, torch.dtype):
        want = torch.float32  # what transformers loads without a dtype in the config
    memplan.plan_before_load(cfg, want, device, 1, 1, ("sampling",),
                             what=f"policy {str(path)!r}", free=free)


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
        raise not_a_policy("policy", path)
    _validate_weights(p)
    kwargs = dict(local_files_only=True, trust_remote_code=bool(trust_remote_code))
    if not any((p / x).is_file() for x in _TOKENIZER_FILES):
        raise UsageError(f"policy={str(path)!r} has no tokenizer (none of "
                         f"{list(_TOKENIZER_FILES)}); save the tokenizer into the directory "
                         "(tokenizer.save_pretrained(DIR))")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(p), **kwargs)
    except Exception as err:  # noqa: BLE001
        first = " ".join(str(err).split())[:300]
        raise UsageError(f"cannot load the tokenizer from {str(p)!r}: {first}") from err
    if device is not None:
        check_fits(p, dtype, device, trust_remote_code=bool(trust_remote_code))
    try:
        with _quiet_hf():
            model = AutoModelForCausalLM.from_pretrained(
                str(p), dtype=dtype if dtype is not None else "auto", **kwargs
            )
    except Exception as err:  # noqa: BLE001
        first = " ".join(str(err).split())[:300]  # one line, like the tokenizer's
        if "trust_remote_code" in str(err) and not kwargs.get("trust_remote_code"):
            first = ("its config.json asks for the checkpoint's own code (auto_map), which "
                     "runs only with --trust-remote-code (trust_remote_code=True) when you trust "
                     "it")
        raise UsageError(f"cannot load the model from {str(p)!r}: {first}") from err
    check_policy(model, tokenizer, str(path))
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
