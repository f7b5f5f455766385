"""Incremental detokenization: multi-byte characters, streaming deltas, stop strings, token texts looked up."""

import random

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from tokenizers import decoders as tokenizer_decoders
from transformers import PreTrainedTokenizerFast

from pagedserve import SamplingParams
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.token_texts import TokenTexts

TEXT = " naïve café — 世界 🙂 and emoji 👩‍💻 done"


@pytest.fixture(scope="module")
def token_texts(tokenizer):
    return TokenTexts(tokenizer).table(skip_special_tokens=True)


def test_token_by_token_equals_batch_decode(tokenizer, token_texts):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], SamplingParams(), token_texts)
    deltas = []
    for token_id in ids:
        assert detok.update([token_id], stop_terminated=False) is None
        deltas.append(detok.next_text(finished=False, delta=True))
    assert detok.output_text == tokenizer.decode(ids)
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)  # no half characters leak into a stream


def test_stop_string_is_found_across_tokens_and_held_back_while_streaming(tokenizer, token_texts):
    ids = tokenizer(" one two three four five", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["e fo"]), token_texts)
    streamed = ""
    for token_id in ids:
        matched = detok.update([token_id], stop_terminated=False)
        streamed += detok.next_text(finished=matched is not None, delta=True)
        if matched:
            break
    assert matched == "e fo"
    assert detok.output_text == streamed == " one two thre"


def test_stop_token_is_not_in_the_text_unless_asked(tokenizer, token_texts):
    ids = tokenizer(" hello world", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(), token_texts)
    detok.update(ids, stop_terminated=True)
    assert detok.output_text == tokenizer.decode(ids[:-1]) and detok.token_ids == ids
    keep = IncrementalDetokenizer(tokenizer, [], SamplingParams(include_stop_str_in_output=True), token_texts)
    keep.update(ids, stop_terminated=True)
    assert keep.output_text == tokenizer.decode(ids)


def streamed_chunks(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    chunks = []
    for token_id in ids:
        detok.update([token_id], stop_terminated=False)
        chunks.append(detok.next_text(finished=False, delta=True))
    return chunks


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_looked_up_token_texts_stream_what_decoding_in_context_streams(tokenizer, skip_special_tokens):
    """Random token sequences (whole words, the bytes of characters split across tokens, special tokens, any token of
    the vocabulary) stream the same chunks with the table as when every token is decoded in context."""
    table = TokenTexts(tokenizer).table(skip_special_tokens)
    words = tokenizer(TEXT + " 日本語のテキスト, ₿, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ok", add_special_tokens=False).input_ids
    assert table[tokenizer.convert_tokens_to_ids("Ġworld")] == " world"  # most tokens are looked up...
    assert sum(text is None for text in table) > 0  # ...not those that are parts of characters
    rng = random.Random(0)
    vocabulary = range(len(table))
    for trial in range(60):
        pool = words + tokenizer.all_special_ids if trial % 2 else list(vocabulary)
        ids = [rng.choice(pool) for _ in range(rng.randrange(1, 40))]
        prompt = [rng.choice(words) for _ in range(rng.randrange(0, 8))]
        params = SamplingParams(skip_special_tokens=skip_special_tokens)
        looked_up = IncrementalDetokenizer(tokenizer, prompt, params, table)
        in_context = IncrementalDetokenizer(tokenizer, prompt, params, None)
        assert streamed_chunks(looked_up, ids) == streamed_chunks(in_context, ids)
        assert looked_up.output_text == in_context.output_text


def test_tokens_of_a_decoder_that_does_not_join_bytes_are_decoded_in_context():
    vocab = {"[UNK]": 0, "play": 1, "##ing": 2, "##ed": 3, "now": 4}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = tokenizer_decoders.WordPiece()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    assert TokenTexts(tokenizer).table(skip_special_tokens=True) is None  # "##ing" joins the word before it
    detok = IncrementalDetokenizer(tokenizer, [4], SamplingParams(), None)
    assert "".join(streamed_chunks(detok, [1, 2, 4, 1, 3])) == " playing now played"
