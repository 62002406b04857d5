"""The character-level tokenizer shared by every embedded policy and task.

Built locally with the ``tokenizers`` library (no hub), wrapped as a transformers fast tokenizer.
One vocabulary serves every task so a single policy can be trained on all of them: each
character of ``CHARS`` is one token, each markup tag of ``MARKUP`` is one token, and the special
tokens are pad / bos / eos / unk. Encoding prepends ``<bos>``; decoding concatenates tokens.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from varbench._util.checks import UsageError

SPECIALS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<unk>")
# Task markup: one token per tag so tiny models need not spell them out.
MARKUP: tuple[str, ...] = (
    "<sort>", "<add>", "<sum>", "<call>", "</call>", "<out>", "</out>", "<ans>",
)
CHARS: str = "0123456789+-=,:;? "


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Return the char-level fast tokenizer (ids fixed: pad 0, bos 1, eos 2, unk 3)."""
    vocab = {t: i for i, t in enumerate([*SPECIALS, *MARKUP, *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # Oniguruma's (?m) makes '.' match every character, newline included.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP])
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
    )


def check_tokenizer_covers(tokenizer, alphabet: str | tuple[str, ...], *, what: str) -> None:
    """Raise ValueError if some symbol of ``alphabet`` does not survive encode -> decode.

    ``alphabet`` is a string of characters or a tuple of symbols (markup tags count as one).
    Works for any Hugging Face tokenizer, not only the embedded one.
    """
    symbols = list(alphabet) if isinstance(alphabet, str) else list(alphabet)
    unk = getattr(tokenizer, "unk_token_id", None)
    missing = []
    for s in symbols:
        ids = tokenizer(s, add_special_tokens=False)["input_ids"]
        back = tokenizer.decode(ids, skip_special_tokens=False)
        if not ids or (unk is not None and unk in ids) or back != s:
            missing.append(s)
    if missing:
        raise UsageError(
            f"tokenizer cannot represent {missing!r} needed by {what}; "
            "use a tokenizer whose vocabulary covers the task's alphabet"
        )
