"""Processor: turn user prompts and parameters into validated engine requests (front-end side)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from functools import cached_property

from pagedserve.engine.wire import EngineCoreRequest
from pagedserve.lora_request import LoRARequest
from pagedserve.model_info import ModelInfo
from pagedserve.sampling_params import SamplingParams

# A prompt is text, token ids, or a dict with "prompt" or "prompt_token_ids".
PromptType = str | list[int] | dict


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


def sample_request_id(request_id: str, index: int) -> str:
    """The engine's id for sample `index` of a request with n > 1 (the only place such ids are made)."""
    return f"{index}_{request_id}"


class Processor:
    def __init__(self, tokenizer, model_info: ModelInfo, pooling: bool = False) -> None:
        """pooling: the engine serves prompts' vectors (runner pooling): a request generates nothing, so its prompt may
        fill the context."""
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.max_model_len = model_info.max_model_len
        self.eos_token_ids = model_info.eos_token_ids
        self.vocab_size = model_info.vocab_size
        # At most this many tokens for a request that gives no max_tokens (None: up to the context). A cap, not a
        # demand: a long prompt gets what room is left, never an error for a length it did not ask for.
        self.default_max_tokens: int | None = None

    def tokenize_prompt(self, prompt: PromptType, truncate_prompt_tokens: int | None = None) -> ProcessedPrompt:
        """The prompt's text (None where it was given as token ids, or cut) and token ids: with truncate_prompt_tokens
        (SamplingParams'), only the last ones."""
        keep = self.tokens_kept(truncate_prompt_tokens)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return self._last_tokens(prompt.get("prompt"), list(prompt["prompt_token_ids"]), keep)
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            token_ids = self.tokenize_text(prompt, keep_last=keep)
            return ProcessedPrompt(prompt if keep is None or len(token_ids) < keep else None, token_ids)  # fewer: not cut
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return self._last_tokens(None, list(prompt), keep)
        raise TypeError(f"prompt must be a string, a list of token ids, or a dict; got {type(prompt).__name__}")

    def tokens_kept(self, truncate_prompt_tokens: int | None) -> int | None:
        """How many of a prompt's last tokens truncate_prompt_tokens keeps (None: all of them)."""
        if truncate_prompt_tokens is None:
            return None
        if truncate_prompt_tokens > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens must be <= max_model_len {self.max_model_len} (or -1), got {truncate_prompt_tokens}")
        return self.max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens

    @staticmethod
    def _last_tokens(text: str | None, token_ids: list[int], keep: int | None) -> ProcessedPrompt:
        """A prompt with only its last `keep` tokens; its text stays only where nothing was cut."""
        if keep is None or len(token_ids) <= keep:
            return ProcessedPrompt(text, token_ids)
        return ProcessedPrompt(None, token_ids[-keep:])

    def tokenize_text(self, text: str, add_special_tokens: bool = True, keep_last: int | None = None) -> list[int]:
        """Token ids of text, or with keep_last only the last ones. A text certainly longer than max_model_len is
        refused after tokenizing a bounded prefix of it, not the whole: a token covers at most max_token_chars
        characters, so a prefix of bound characters is more than max_model_len + margin tokens, and cutting the text
        can merge at most the margin's worth of tokens at the cut. For the same reason, the last tokens are those of
        a bounded suffix."""
        margin = 16
        if keep_last is not None:
            bound = (keep_last + margin + 1) * self.max_token_chars
            suffix = text[-bound:] if len(text) > bound else text
            return self.tokenizer(suffix, add_special_tokens=add_special_tokens).input_ids[-keep_last:]
        bound = (self.max_model_len + margin + 1) * self.max_token_chars
        if len(text) > bound:
            prefix_ids = self.tokenizer(text[:bound], add_special_tokens=add_special_tokens).input_ids
            if len(prefix_ids) > self.max_model_len + margin:
                raise ValueError(f"the prompt is longer than max_model_len {self.max_model_len}: its first {bound} characters "
                                 f"alone are {len(prefix_ids)} tokens (of {len(text)} characters)")
        return self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids

    def tokenize_pair(self, first: str, second: str, truncating: bool = False) -> list[int]:
        """Token ids of a text pair as the tokenizer joins a pair (its special tokens around and between the two, as
        a cross-encoder was trained on them). Unless truncating (only the last tokens are kept later), a pair
        certainly longer than max_model_len is refused untokenized: a token covers at most max_token_chars
        characters."""
        if not truncating and len(first) + len(second) > (self.max_model_len + 1) * self.max_token_chars:
            raise ValueError(f"the text pair is longer than max_model_len {self.max_model_len}: its {len(first) + len(second)} "
                             f"characters are more than {self.max_model_len} tokens")
        return self.tokenizer(first, second).input_ids

    @cached_property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: its vocabulary entry's length (a byte-level entry has a
        character per byte, and no text character takes less than a byte), plus one for a prefix space."""
        return max(len(token) for token in self.tokenizer.get_vocab()) + 1

    def process(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> tuple[SamplingParams, list[EngineCoreRequest]]:
        """Validate; returns the completed params and one engine request per sample (n)."""
        params = self.complete_params(prompt.prompt_token_ids, params)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        if params.n == 1:
            return params, [EngineCoreRequest(request_id, prompt.prompt_token_ids, params, arrival_time, priority,
                                              lora_request=lora_request)]
        children = []
        for index in range(params.n):
            seed = None if params.seed is None else params.seed + index
            child_params = dataclasses.replace(params, n=1, seed=seed)
            children.append(
                EngineCoreRequest(
                    sample_request_id(request_id, index), prompt.prompt_token_ids, child_params, arrival_time, priority, request_id,
                    lora_request,
                )
            )
        return params, children

    def complete_params(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        self.validate_prompt(prompt_token_ids)
        if self.pooling:  # the scheduler's one token beyond the prompt is never generated: the request ends with its vector
            return dataclasses.replace(params, max_tokens=1, eos_token_ids=list(self.eos_token_ids))
        prompt_len = len(prompt_token_ids)
        max_tokens = params.max_tokens
        if max_tokens is None:
            max_tokens = self.max_model_len - prompt_len
            if max_tokens < 1:
                raise ValueError(
                    f"the prompt ({prompt_len} tokens) leaves no room to generate within max_model_len {self.max_model_len}"
                )
            if self.default_max_tokens is not None:
                max_tokens = min(max_tokens, self.default_max_tokens)
        elif prompt_len + max_tokens > self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the output); "
                "reduce the prompt or the output's token limit"
            )
        named_ids = (("stop_token_ids", params.stop_token_ids, ""), ("logit_bias", params.logit_bias or (), "keyed by token ids "),
                     ("allowed_token_ids", params.allowed_token_ids or (), "token ids "))
        for name, token_ids, what in named_ids:
            out_of_range = [t for t in token_ids if t >= self.vocab_size]
            if out_of_range:
                raise ValueError(f"{name} must be {what}< vocab size {self.vocab_size}, got {out_of_range[:5]}")
        return dataclasses.replace(params, max_tokens=max_tokens, eos_token_ids=list(self.eos_token_ids))

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(
                f"the prompt is {len(prompt_token_ids)} tokens long, more than max_model_len {self.max_model_len}"
            )
        out_of_range = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if out_of_range:
            raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {out_of_range[:5]}")
