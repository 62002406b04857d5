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


def _symbols(alphabet: str | tuple[str, ...]) -> list[str]:
    return list(dict.fromkeys(alphabet))


def uncovered_symbols(tokenizer, alphabet: str | tuple[str, ...]) -> list[str]:
    """Symbols of ``alphabet`` that are not exactly one token of ``tokenizer`` in context.

    A symbol is covered when it encodes alone to exactly one id (not unk), decodes back to
    itself, and every ordered pair of symbols encodes to the two single ids: so no merge rule
    joins symbols (a byte-level BPE turns ``12`` or ``<sort>`` into other tokens). Pairs
    suffice for BPE: a merge of longer runs needs a merge of two adjacent symbols first.
    """
    symbols = _symbols(alphabet)
    if not symbols:
        return []
    unk = getattr(tokenizer, "unk_token_id", None)
    alone = tokenizer(symbols, add_special_tokens=False)["input_ids"]
    bad, single = [], {}
    for s, ids in zip(symbols, alone, strict=True):
        if len(ids) != 1 or (unk is not None and ids[0] == unk) or \
                tokenizer.decode(ids, skip_special_tokens=False) != s:
            bad.append(s)
        else:
            single[s] = ids[0]
    ok = list(single)
    pairs = [(a, b) for a in ok for b in ok]
    if pairs:
        enc = tokenizer([a + b for a, b in pairs], add_special_tokens=False)["input_ids"]
        for (a, b), ids in zip(pairs, enc, strict=True):
            if ids != [single[a], single[b]]:
                bad += [x for x in (a, b) if x not in bad]
    return [s for s in symbols if s in bad]


def check_tokenizer_covers(tokenizer, alphabet: str | tuple[str, ...], *, what: str) -> None:
    """Raise UsageError unless every symbol of ``alphabet`` is exactly one token in context.

    ``alphabet`` is a string of characters or a tuple of symbols (markup tags count as one);
    see :func:`uncovered_symbols`. Works for any Hugging Face tokenizer. The message names the
    symbols and the two ways out: a dataset task (free text, any tokenizer), or
    ``--add-task-tokens`` (:func:`add_task_tokens`).
    """
    missing = uncovered_symbols(tokenizer, alphabet)
    if missing:
        raise UsageError(
            f"the tokenizer does not make each symbol of {what} exactly one token: "
            f"{missing!r} (a toy task counts responses in tokens and needs one token per "
            "symbol); either use a dataset task (--task data.jsonl: free text, any tokenizer), "
            "or pass --add-task-tokens to add these symbols as tokens and resize the model's "
            "embeddings"
        )


def add_task_tokens(tokenizer, model, alphabet: str | tuple[str, ...]) -> list[str]:
    """Add the symbols of ``alphabet`` that are not single tokens to ``tokenizer`` (as added
    tokens, matched before the tokenizer's own model so they never merge), resize ``model``'s
    embeddings to the new vocabulary (new rows from transformers' mean-of-old initialisation);
    returns the symbols added (``[]``: nothing changed). Both are changed in place.
    """
    from tokenizers import AddedToken

    missing = uncovered_symbols(tokenizer, alphabet)
    if not missing:
        return []
    # Digits and punctuation already in the vocabulary become added tokens too: that stops
    # merges like "12" without growing the vocabulary for them.
    tokenizer.add_tokens([AddedToken(s, normalized=False, single_word=False) for s in
                          _symbols(alphabet)])
    old = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > old:
        model.resize_token_embeddings(len(tokenizer))
    still = uncovered_symbols(tokenizer, alphabet)
    if still:
        raise UsageError(f"adding task tokens {missing!r} left {still!r} split; this tokenizer "
                         "cannot represent them as single tokens: use a dataset task")
    return missing
