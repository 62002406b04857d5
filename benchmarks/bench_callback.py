"""Overhead of VarbenchCallback on a real TRL GRPOTrainer run on the CPU (issue 28 point 6).

    python benchmarks/bench_callback.py [--rounds 3] [--steps 20] [--threads 1]

For the ``tiny`` (98k parameters) and ``small`` (1.78M) presets, runs GRPOTrainer on the
``sort`` task's prompts (completions up to ``--length`` tokens) with no callback, with
``VarbenchCallback()`` at its default cadence (every 10th generation batch) and with
``every=1``, the arms alternating within each round in one process (same prompts, seed,
settings; fp32, one torch thread). Prints per model and arm
the median ``train_runtime`` (TRL's own clock) and process CPU time over the rounds, and the
ratio to the no-callback arm. Memory: the callback holds two gradients of the trainable
parameters (printed as bytes); it makes no float64 copy of the model.
Targets (issue 28): <= 1.10x at the default cadence, <= 1.5x at every=1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(preset: str, arm: str, steps: int, length: int, seed: int = 0) -> tuple[float, float]:
    """(train_runtime, CPU seconds) of one GRPOTrainer run with the arm's callback."""
    import trl
    from datasets import Dataset
    from transformers.trainer_callback import PrinterCallback

    from varbench.integrations.trl import VarbenchCallback
    from varbench.models import build_preset
    from varbench.tasks import get_task

    task = get_task("sort")
    prompts = task.prompts(2 * steps, split="train", seed=0)
    ds = Dataset.from_list([{"prompt": p.text} for p in prompts])
    policy = build_preset(preset, seed=seed)

    def reward(completions, **kw):
        return [float(len(c) % 3) for c in completions]

    with tempfile.TemporaryDirectory() as tmp:
        args = trl.GRPOConfig(
            output_dir=tmp, per_device_train_batch_size=8, num_generations=4,
            max_completion_length=length, max_steps=steps, learning_rate=1e-4,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=seed,
            bf16=False, temperature=1.0, dataloader_num_workers=0, disable_tqdm=True,
        )
        trainer = trl.GRPOTrainer(model=policy.model, reward_funcs=reward, args=args,
                                  train_dataset=ds, processing_class=policy.tokenizer)
        trainer.remove_callback(PrinterCallback)  # the same work, without a dict per step
        if arm != "none":
            VarbenchCallback(every=10 if arm == "default" else 1).attach(trainer)
        c0 = time.process_time()
        out = trainer.train()
        return float(out.metrics["train_runtime"]), time.process_time() - c0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--length", type=int, default=32, help="max_completion_length")
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    a = ap.parse_args()
    import torch
    import transformers

    torch.set_num_threads(a.threads)
    transformers.logging.set_verbosity_error()
    from varbench.models import build_preset

    arms = ("none", "default", "every=1")
    print(f"VarbenchCallback overhead: {a.steps} steps, {a.rounds} rounds, "
          f"{a.threads} thread(s), fp32, G=4, 2 prompts/step, max_completion_length "
          f"{a.length}")
    print(f"{'model':<7} {'params':>9} {'arm':<9} {'runtime s':>10} {'cpu s':>8} "
          f"{'x runtime':>10} {'x cpu':>7} {'grad bytes':>11}")
    for preset in a.presets:
        times: dict[str, list[tuple[float, float]]] = {arm: [] for arm in arms}
        for r in range(a.rounds):
            order = arms if r % 2 == 0 else arms[::-1]
            for arm in order:
                times[arm].append(run(preset, arm, a.steps, a.length))
        n = sum(p.numel() for p in build_preset(preset, seed=0).model.parameters())
        base_w = statistics.median(t[0] for t in times["none"])
        base_c = statistics.median(t[1] for t in times["none"])
        for arm in arms:
            w = statistics.median(t[0] for t in times[arm])
            c = statistics.median(t[1] for t in times[arm])
            gb = 0 if arm == "none" else 2 * 4 * n
            print(f"{preset:<7} {n:>9} {arm:<9} {w:>10.2f} {c:>8.2f} {w / base_w:>10.2f} "
                  f"{c / base_c:>7.2f} {gb:>11}")


if __name__ == "__main__":
    main()
