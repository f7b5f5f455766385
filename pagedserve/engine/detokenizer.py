"""Incremental detokenization with stop strings.

tokenizers' DecodeStream buffers partial UTF-8 sequences, so multi-byte characters split across
tokens come out whole. Stop strings are searched only in the newly decoded tail (plus the length
of the longest stop string), so a stop string spanning several tokens is still found.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from pagedserve.sampling_params import SamplingParams

# Prompt tokens fed to the stream first, so the first output token decodes in context (leading spaces).
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(ids=prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:], skip_special_tokens=params.skip_special_tokens)
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
        token_ids, stream, backend = self.token_ids, self._stream, self._backend
        for token_id in new_token_ids:
            token_ids.append(token_id)
            chunk = stream.step(backend, token_id)
            if not chunk:
                continue
            text_before = len(self.output_text)
            self.output_text += chunk
            matched = self._check_stop_strings(text_before) if self.stop else None
            if matched is not None:
                return matched
        if skipped_stop_token is not None:
            self.token_ids.append(skipped_stop_token)
        return None

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
        visible = len(self.output_text) if finished else max(len(self.output_text) - self.stop_buffer_length, self._sent_chars)
        if not delta:
            return self.output_text[:visible]
        text = self.output_text[self._sent_chars:visible]
        self._sent_chars = visible
        return text
