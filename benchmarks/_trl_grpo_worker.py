"""trl's GRPOTrainer on a varbench policy and task (run by bench_train.py in trl's own venv).

    python _trl_grpo_worker.py POLICY_DIR G P STEPS LR THREADS

Prints one JSON line: wall seconds of ``trainer.train()`` and completion tokens generated.
Runs in a separate virtual environment (trl must not touch the project's .venv); varbench is
imported from the source tree on PYTHONPATH only for the task's prompts and reward program.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time


def main() -> None:
    policy_dir, G, P, steps, lr, threads = sys.argv[1:7]
    G, P, steps, lr, threads = int(G), int(P), int(steps), float(lr), int(threads)
    import torch

    torch.set_num_threads(threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from varbench.tasks import get_task

    task = get_task("sort")
    prompts = task.prompts(P * steps, split="train", seed=0)
    ds = Dataset.from_list([{"prompt": "<bos>" + p.text, "data": list(p.data)} for p in prompts])

    def exact(prompts, completions, data, **kw):
        return [task.score(task._make_prompt(tuple(d)), c) for c, d in zip(completions, data,
                                                                            strict=True)]

    tok = AutoTokenizer.from_pretrained(policy_dir)
    model = AutoModelForCausalLM.from_pretrained(policy_dir)
    lengths: list[float] = []

    class Lengths(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths.append(float(logs["completions/mean_length"]))

    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out, per_device_train_batch_size=P * G, num_generations=G,
            gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
            max_completion_length=task.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
            beta=0.0, learning_rate=lr, max_steps=steps, logging_steps=1, report_to="none",
            use_cpu=True, save_strategy="no", bf16=False, fp16=False, seed=0,
            dataloader_num_workers=0, disable_tqdm=True, loss_type="grpo",
            scale_rewards="group",
        )
        trainer = GRPOTrainer(model=model, reward_funcs=[exact], args=cfg, train_dataset=ds,
                              processing_class=tok, callbacks=[Lengths()])
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
    tokens = sum(lengths) * P * G if lengths else float("nan")
    print(json.dumps({"wall_s": wall, "tokens": tokens, "steps": steps,
                      "mean_length": sum(lengths) / max(len(lengths), 1)}))


if __name__ == "__main__":
    main()
