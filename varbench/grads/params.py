"""Which parameters a gradient is taken over, and how they group for a per-group breakdown.

Default selection: every trainable parameter (``requires_grad``), tied weights counted once
(``named_parameters`` de-duplicates a shared tensor; its gradient collects both uses).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch

from varbench._util.checks import UsageError, UsageTypeError
from varbench.models.arch import ATTN_WORDS, BLOCK_RE, MLP_WORDS

ParamFilter = str | Sequence[torch.nn.Module] | Sequence[str] | None
GroupSpec = bool | Callable[[str], str]


def select_params(
    model: torch.nn.Module, params: ParamFilter = None
) -> list[tuple[str, torch.nn.Parameter]]:
    """Resolve a parameter filter into ``[(name, parameter)]`` in ``named_parameters`` order.

    ``params``: None (all trainable), a regex searched in each name, a list of names, or a list
    of modules of ``model`` (their parameters). Raises ValueError when nothing is selected.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if params is None:
        chosen = named
    elif isinstance(params, str):
        pattern = re.compile(params)
        chosen = [(n, p) for n, p in named if pattern.search(n)]
    elif isinstance(params, Sequence) and all(isinstance(x, str) for x in params):
        known = dict(named)
        missing = [x for x in params if x not in known]
        if missing:
            raise UsageError(f"params names {missing} are not trainable parameters of the model")
        chosen = [(n, p) for n, p in named if n in set(params)]
    elif isinstance(params, Sequence) and all(isinstance(x, torch.nn.Module) for x in params):
        ids = {id(p) for m in params for p in m.parameters()}
        chosen = [(n, p) for n, p in named if id(p) in ids]
    else:
        raise UsageTypeError(
            f"params must be None, a regex string, a list of names or a list of modules; "
            f"got {type(params).__name__}"
        )
    if not chosen:
        raise UsageError(f"params={params!r} selects no trainable parameter")
    return chosen


def default_group(name: str, *, head_name: str | None = None) -> str:
    """Group of a parameter name: 'embed', 'block{i}.attn', 'block{i}.mlp', 'block{i}.other',
    'norm', 'head' or 'other' (naming of the architectures in varbench.models.arch; pass a
    callable otherwise)."""
    if head_name is not None and name == head_name:
        return "head"
    m = BLOCK_RE.search(name)
    if m:
        rest = name[m.end() :]
        # MLP words first: Llama's pre-MLP norm is "post_attention_layernorm"
        if any(w in rest for w in MLP_WORDS):
            return f"block{m.group(1)}.mlp"
        if any(w in rest for w in ATTN_WORDS):
            return f"block{m.group(1)}.attn"
        return f"block{m.group(1)}.other"
    if "embed" in name or name.endswith(("wte.weight", "wpe.weight")):
        return "embed"
    if "norm" in name or ".ln_f." in name:
        return "norm"
    if "lm_head" in name:
        return "head"
    return "other"


def group_index(
    model: torch.nn.Module, names: list[str], groups: GroupSpec
) -> tuple[list[str], list[int]]:
    """``(group_names, index)`` with ``index[i]`` the group of ``names[i]``; groups in first-seen
    order. ``groups=True`` uses :func:`default_group`; a callable maps a name to a group."""
    if groups is True:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        head_name = None
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        emb_ids = {id(p) for p in emb.parameters()} if emb is not None else set()
        if head is not None:
            # a tied head is the embedding tensor itself: it stays in 'embed'
            head_ids = {id(p) for p in head.parameters()} - emb_ids
            head_name = next((n for n, p in model.named_parameters() if id(p) in head_ids), None)

        def fn(n: str) -> str:
            return default_group(n, head_name=head_name)
    elif callable(groups):
        fn = groups
    else:
        raise UsageTypeError(f"groups must be a bool or a callable name -> group, got {groups!r}")
    group_names: list[str] = []
    index = []
    for n in names:
        g = fn(n)
        if g not in group_names:
            group_names.append(g)
        index.append(group_names.index(g))
    return group_names, index
