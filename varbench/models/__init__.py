"""varbench.models: embedded Llama presets, the char-level tokenizer, loading and saving.

``forward_logits`` (forward.py) is the one way to run a model forward.
"""

from varbench.models.forward import forward_logits, position_ids_from_mask
from varbench.models.io import load_policy, save_policy
from varbench.models.presets import Policy, build_preset, preset_config, presets
from varbench.models.tokenizer import MARKUP, SPECIALS, build_tokenizer, check_tokenizer_covers

__all__ = [
    "MARKUP",
    "SPECIALS",
    "Policy",
    "build_preset",
    "build_tokenizer",
    "check_tokenizer_covers",
    "forward_logits",
    "load_policy",
    "position_ids_from_mask",
    "preset_config",
    "presets",
    "save_policy",
]
