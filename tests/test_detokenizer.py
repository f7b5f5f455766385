"""Incremental detokenization: multi-byte characters, streaming deltas, stop strings."""

from pagedserve import SamplingParams
from pagedserve.engine.detokenizer import IncrementalDetokenizer

TEXT = " naïve café — 世界 🙂 and emoji 👩‍💻 done"


def test_token_by_token_equals_batch_decode(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], SamplingParams())
    deltas = []
    for token_id in ids:
        assert detok.update([token_id], stop_terminated=False) is None
        deltas.append(detok.next_text(finished=False, delta=True))
    assert detok.output_text == tokenizer.decode(ids)
    assert "".join(deltas) == TEXT
    assert all("\ufffd" not in d for d in deltas)  # no half characters leak into a stream


def test_stop_string_is_found_across_tokens_and_held_back_while_streaming(tokenizer):
    ids = tokenizer(" one two three four five", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["e fo"]))
    streamed = ""
    for token_id in ids:
        matched = detok.update([token_id], stop_terminated=False)
        streamed += detok.next_text(finished=matched is not None, delta=True)
        if matched:
            break
    assert matched == "e fo"
    assert detok.output_text == streamed == " one two thre"


def test_stop_token_is_not_in_the_text_unless_asked(tokenizer):
    ids = tokenizer(" hello world", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detok.update(ids, stop_terminated=True)
    assert detok.output_text == tokenizer.decode(ids[:-1]) and detok.token_ids == ids
    keep = IncrementalDetokenizer(tokenizer, [], SamplingParams(include_stop_str_in_output=True))
    keep.update(ids, stop_terminated=True)
    assert keep.output_text == tokenizer.decode(ids)
