"""The text each token adds to a stream whose text so far ends at a whole character, where that text does not depend on
the tokens before it: streaming detokenization then looks most tokens up instead of decoding the stream's last tokens
again for every token.

Only byte-level BPE decoders (GPT-2's, Llama 3's, Qwen's, SmolLM's) join tokens by concatenating their bytes, so only
their tokens have such a text; a token whose bytes are not whole UTF-8 characters has none (its text depends on its
neighbours), nor has every token of another decoder (SentencePiece's, WordPiece's), which the stream decodes in context.
"""

from __future__ import annotations

from tokenizers.decoders import ByteLevel

# A token whose text is one plain letter decodes before each token, so that every token is decoded after some text.
_ANCHOR_TEXT = "a"


class TokenTexts:
    def __init__(self, tokenizer) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._tables: dict[bool, list[str | None] | None] = {}

    def table(self, skip_special_tokens: bool) -> list[str | None] | None:
        """Per token id: its text after whole characters ("" for a skipped special token), or None where it depends on
        the tokens before it. None instead of a table for a decoder that does not concatenate tokens' bytes."""
        if skip_special_tokens not in self._tables:
            self._tables[skip_special_tokens] = self._build(skip_special_tokens)
        return self._tables[skip_special_tokens]

    def _build(self, skip_special_tokens: bool) -> list[str | None] | None:
        backend = self._backend
        if not isinstance(backend.decoder, ByteLevel):
            return None
        anchor_ids = backend.encode(_ANCHOR_TEXT, add_special_tokens=False).ids
        if len(anchor_ids) != 1:
            return None
        anchor = anchor_ids[0]
        anchor_text = backend.decode([anchor], skip_special_tokens=skip_special_tokens)
        pairs = backend.decode_batch([[anchor, token_id] for token_id in range(backend.get_vocab_size(with_added_tokens=True))],
                                     skip_special_tokens=skip_special_tokens)
        return [text[len(anchor_text):] if text.startswith(anchor_text) and "\ufffd" not in text else None for text in pairs]
