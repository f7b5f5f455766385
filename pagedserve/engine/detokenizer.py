"""Incremental detokenization with stop strings.

tokenizers' DecodeStream buffers partial UTF-8 sequences, so multi-byte characters split across tokens come out whole.
Where the text ends at a whole character, a token with a text of its own (token_texts.py) is looked up instead, and the
stream is made again from the last tokens when a token without one comes. Stop strings are searched only in the newly
decoded tail (plus the length of the longest stop string), so a stop string spanning several tokens is still found.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from pagedserve.engine.plain_outputs import TextFields
from pagedserve.sampling_params import SamplingParams

# Prompt tokens fed to the stream first, so the first output token decodes in context (leading spaces).
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer(TextFields):  # its text and tokens as C fields: plain_outputs.py
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams, token_texts: list[str | None] | None) -> None:
        """token_texts: TokenTexts.table for the params' skip_special_tokens (None: every token through the stream)."""
        self._backend = tokenizer.backend_tokenizer
        self._skip_special_tokens = params.skip_special_tokens
        self._token_texts = token_texts
        self._prompt_tail = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        # None while the text ends at a whole character and token_texts are looked up.
        self._stream: DecodeStream | None = self._stream_after([])
        self.stop = params.stop
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        # Characters held back from a stream: they could still become the start of a stop string.
        self.stop_buffer_length = self.max_stop_len - 1 if self.max_stop_len and not self.include_stop_str_in_output else 0
        self.output_text = ""
        self.token_ids: list[int] = []
        self._sent_chars = 0

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add tokens; returns the stop string if one now ends the text (the text is cut there)."""
        skipped_stop_token = None
        if stop_terminated and not self.include_stop_str_in_output and new_token_ids:
            skipped_stop_token, new_token_ids = new_token_ids[-1], new_token_ids[:-1]
        token_ids, texts, backend = self.token_ids, self._token_texts, self._backend
        for token_id in new_token_ids:
            stream = self._stream
            if stream is None:
                chunk = texts[token_id] if token_id < len(texts) else None
                if chunk is None:
                    stream = self._stream = self._stream_after(token_ids)
                    chunk = stream.step(backend, token_id)
            else:
                chunk = stream.step(backend, token_id)
            token_ids.append(token_id)
            if not chunk:
                continue
            if stream is not None and texts is not None:
                self._stream = None  # the text ends at a whole character again
            # The attribute lets go of the text first, so that CPython extends it in place rather than copying all of it
            # for every token (quadratic in the text's length).
            text, self.output_text = self.output_text, ""
            text_before = len(text)
            text += chunk
            self.output_text = text
            matched = self._check_stop_strings(text_before) if self.stop else None
            if matched is not None:
                return matched
        if skipped_stop_token is not None:
            self.token_ids.append(skipped_stop_token)
        return None

    def _stream_after(self, output_ids: list[int]) -> DecodeStream:
        """A stream that decodes the next token after the last few of the prompt and these output tokens."""
        context = (self._prompt_tail + output_ids[-_PROMPT_CONTEXT_TOKENS:])[-_PROMPT_CONTEXT_TOKENS:]
        return DecodeStream(ids=context, skip_special_tokens=self._skip_special_tokens)

    def _check_stop_strings(self, text_before: int) -> str | None:
        search_from = max(0, text_before - self.max_stop_len + 1)
        for stop in self.stop:
            position = self.output_text.find(stop, search_from)
            if position != -1:
                end = position + len(stop) if self.include_stop_str_in_output else position
                self.output_text = self.output_text[:end]
                return stop
        return None

    def next_text(self, finished: bool, delta: bool) -> str:
        """The text to report now: everything or only what is new, minus the stop-string buffer while unfinished."""
        output_text, sent = self.output_text, self._sent_chars
        visible = len(output_text)
        if not finished and self.stop_buffer_length:
            visible = max(visible - self.stop_buffer_length, sent)
        if not delta:
            return output_text[:visible]
        self._sent_chars = visible
        return output_text[sent:visible]
