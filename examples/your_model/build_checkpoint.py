"""Build a Qwen2-architecture checkpoint with a locally trained byte-level BPE tokenizer and a
ChatML chat template: the kind of model a user brings, made here from a config (no hub).

    python examples/your_model/build_checkpoint.py runs/my-qwen --data problems.jsonl \\
        --dtype bfloat16

The tokenizer is trained with the ``tokenizers`` package on the data's questions and
solutions (byte-level BPE, so every string round-trips but digits and markup merge into
multi-character tokens). The weights are a seeded random initialisation, saved in ``--dtype``
(bfloat16 by default, as most released checkpoints are).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts`` (ChatML specials, eos <|im_end|>)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", padding_side="left")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(out: str | Path, data: str | Path, *, hidden: int = 64, layers: int = 2,
          vocab_size: int = 512, dtype: str = "bfloat16", seed: int = 0) -> Path:
    """Write the checkpoint directory ``out`` (config, safetensors weights, tokenizer)."""
    rows = [json.loads(line) for line in Path(data).read_text(encoding="utf-8").splitlines()
            if line.strip()]
    texts = [r.get("question", "") for r in rows] + [r.get("solution", "") for r in rows]
    tok = train_tokenizer(texts, vocab_size)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=512, tie_word_embeddings=True,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                      bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    model.to(getattr(torch, dtype))
    out = Path(out)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="checkpoint directory to write")
    ap.add_argument("--data", required=True, help="JSONL with question/solution columns")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    out = build(a.out, a.data, hidden=a.hidden, layers=a.layers, vocab_size=a.vocab_size,
                dtype=a.dtype, seed=a.seed)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
