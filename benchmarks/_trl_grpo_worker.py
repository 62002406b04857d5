"""trl's GRPOTrainer on a varbench policy and task (run by bench_train.py in trl's own venv).

    python _trl_grpo_worker.py POLICY_DIR G P STEPS LR THREADS

Prints one JSON line: wall and CPU seconds of steps 2..STEPS (trainer callbacks' clocks at the
end of step 1 and of the last step), the completion tokens generated in those steps, their mean
length and the process's peak resident memory. Runs in a separate virtual environment (trl must
not touch the project's .venv); varbench is imported from the source tree on PYTHONPATH only for
the task's prompts and reward program. The settings that make the work the same as varbench's
are listed in bench_train.py's docstring.
"""

from __future__ import annotations

import json
import resource
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
    T = task.max_new_tokens  # sort always samples exactly T tokens in varbench
    prompts = task.prompts(P * steps, split="train", seed=0)
    # the prompt text alone: the tokenizer adds the one BOS (as varbench's sampler does)
    ds = Dataset.from_list([{"prompt": p.text, "data": list(p.data)} for p in prompts])

    def exact(prompts, completions, data, **kw):
        return [task.score(task._make_prompt(tuple(d)), c, "exact")
                for c, d in zip(completions, data, strict=True)]

    tok = AutoTokenizer.from_pretrained(policy_dir)
    first = tok(prompts[0].text)["input_ids"]  # what GRPOTrainer's tokenisation gives
    if first[0] != tok.bos_token_id or first[1] == tok.bos_token_id:
        raise SystemExit(f"expected exactly one leading BOS, got ids {first}")
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    lengths: dict[int, float] = {}
    clocks: dict[int, tuple[float, float]] = {}

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            clocks[state.global_step] = (time.perf_counter(), time.process_time())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                lengths[state.global_step] = float(logs["completions/mean_length"])

    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(
            output_dir=out, per_device_train_batch_size=P * G, num_generations=G,
            gradient_accumulation_steps=1, steps_per_generation=1, num_iterations=1,
            max_completion_length=T, temperature=1.0, top_p=1.0, top_k=0,
            generation_kwargs={"min_new_tokens": T},  # fixed-length completions, as varbench
            beta=0.0, epsilon=0.2, learning_rate=lr, lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
            max_grad_norm=1.0, optim="adamw_torch_fused", gradient_checkpointing=False,
            max_steps=steps, logging_steps=1, report_to="none", use_cpu=True,
            save_strategy="no", bf16=False, fp16=False, seed=0, dataloader_num_workers=0,
            disable_tqdm=True, loss_type="grpo", scale_rewards="group",
        )
        trainer = GRPOTrainer(model=model, reward_funcs=[exact], args=cfg, train_dataset=ds,
                              processing_class=tok, callbacks=[Clock()])
        trainer.train()
    (w1, c1), (wn, cn) = clocks[1], clocks[steps]
    body = [lengths[s] for s in range(2, steps + 1) if s in lengths]
    mean_len = sum(body) / len(body) if body else float("nan")
    print(json.dumps({"wall_s": wn - w1, "cpu_s": cn - c1, "tokens": mean_len * P * G * (steps - 1),
                      "mean_length": mean_len, "logged_steps": len(body),
                      "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main()
