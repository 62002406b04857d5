"""varbench.models.tokenizer: the char-level tokenizer (fixed ids, markup tags) and the coverage
check of any tokenizer (each symbol exactly one token in context; adding task tokens)."""

from __future__ import annotations

import pytest

from varbench._util.checks import UsageError
from varbench.models import MARKUP, build_tokenizer, check_tokenizer_covers
from varbench.models.tokenizer import add_task_tokens, uncovered_symbols
from varbench.tasks import get_task, task_names


def test_tokenizer_round_trip_and_fixed_ids():
    tok = build_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    text = "<sum>3+5=<call>3+5</call><out>8</out><ans>8"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    for m in MARKUP:  # markup tags are single tokens
        assert len(tok(m, add_special_tokens=False)["input_ids"]) == 1
    assert len(tok("12 3", add_special_tokens=False)["input_ids"]) == 4
    for name in task_names():  # one vocabulary serves every task
        check_tokenizer_covers(tok, get_task(name).alphabet, what=name)
    with pytest.raises(UsageError, match=r"exactly one token: \['x', 'Y'\].*dataset task.*"
                                         r"--add-task-tokens"):
        check_tokenizer_covers(tok, "1xY", what="test")


def _bpe(texts, vocab_size=300):
    """A byte-level BPE fast tokenizer trained on ``texts`` (merges digits and tags)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    t.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<eos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=t, eos_token="<eos>", pad_token="<eos>")


def test_byte_level_bpe_is_checked_in_context_not_by_round_trip():
    tok = _bpe(["<sort>12=12 <sort>21=12 12 21"] * 50)
    for s in ("1", "2", "<sort>", "12"):  # every string round-trips through byte-level BPE
        assert tok.decode(tok(s, add_special_tokens=False)["input_ids"]) == s
    assert len(tok("<sort>", add_special_tokens=False)["input_ids"]) > 1
    assert len(tok("12", add_special_tokens=False)["input_ids"]) == 1  # a merge of 2 symbols
    # "1" and "2" are single tokens alone, but "12" merges: both are reported
    assert uncovered_symbols(tok, ("<sort>", "=", "1", "2")) == ["<sort>", "1", "2"]
    with pytest.raises(UsageError, match=r"\['<sort>', '1', '2'\]"):
        check_tokenizer_covers(tok, ("<sort>", "=", "1", "2"), what="task 'sort'")


def test_add_task_tokens_adds_symbols_and_resizes_the_embeddings():
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _bpe(["<sort>12=12 <sort>21=12 12 21"] * 50)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16,
                                         intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    n0 = len(tok)
    alphabet = ("<sort>", "=", "1", "2")
    assert add_task_tokens(tok, model, alphabet) == ["<sort>", "1", "2"]
    assert len(tok) == n0 + 1  # only <sort> was new; "1" and "2" were already in the vocab
    assert model.get_input_embeddings().weight.shape[0] == len(tok)
    assert model.get_output_embeddings().weight.shape[0] == len(tok)
    check_tokenizer_covers(tok, alphabet, what="sort")  # now every symbol is one token
    assert len(tok("<sort>21=12", add_special_tokens=False)["input_ids"]) == 6
    assert add_task_tokens(tok, model, alphabet) == []  # idempotent
