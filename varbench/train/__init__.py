"""varbench.train: the GRPO/PPO loop (docs/science.md section 7), its config, records, checkpoints,
collapse detection, the warm start, and the validation experiment (``varbench validate``).

    from varbench.train import TrainConfig, train
    result = train(TrainConfig(scheme="otb", G=4, steps=50), run_dir="runs/otb4")
    result.records  # one row per step: tokens, rewards, held-out accuracy, grad norm, ...
"""

from varbench.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from varbench.train.collapse import CollapseDetector
from varbench.train.config import TrainConfig
from varbench.train.loop import TrainResult, train
from varbench.train.records import FIELDS as RECORD_FIELDS
from varbench.train.records import read_records
from varbench.train.warmstart import warm_start

__all__ = [
    "RECORD_FIELDS",
    "CollapseDetector",
    "TrainConfig",
    "TrainResult",
    "latest_checkpoint",
    "load_checkpoint",
    "read_records",
    "save_checkpoint",
    "train",
    "warm_start",
]
