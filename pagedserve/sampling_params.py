"""SamplingParams: what a request asks of the sampler, validated with messages that name the field."""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field

# Below this a temperature means greedy: dividing logits by ~0 only amplifies noise.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class Bounds:
    """A number's allowed range: what SamplingParams checks, and what the server's request schema declares."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None

    def allows(self, value) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
                and (self.le is None or value <= self.le))

    def describe(self) -> str:
        closed = self.ge is not None
        low = self.ge if closed else self.gt
        if self.le is None:
            return f"{'>=' if closed else '>'} {low:g}"
        return f"in {'[' if closed else '('}{low:g}, {self.le:g}]"

    def constraints(self) -> dict:
        """As pydantic's Field arguments."""
        return {name: value for name, value in vars(self).items() if value is not None}


# The ranges of SamplingParams' numbers (OpenAI's, where OpenAI has the field).
FIELD_BOUNDS = {
    "temperature": Bounds(ge=0.0),
    "top_p": Bounds(gt=0.0, le=1.0),
    "min_p": Bounds(ge=0.0, le=1.0),
    "presence_penalty": Bounds(ge=-2.0, le=2.0),
    "frequency_penalty": Bounds(ge=-2.0, le=2.0),
    "repetition_penalty": Bounds(gt=0.0, le=2.0),
    "logprobs": Bounds(ge=0, le=MAX_LOGPROBS),
    "logit_bias": Bounds(ge=-100.0, le=100.0),  # each token's bias
}


STRUCTURE_KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """The one structure a request's output must follow (vLLM's StructuredOutputsParams): a JSON schema (json, a dict
    or its text), any JSON object (json_object), a regular expression, a choice among strings, or an EBNF grammar
    (GBNF's notation). Exactly one is set. disable_any_whitespace: JSON without whitespace between its tokens (else
    any whitespace is allowed, as JSON allows)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json must be a JSON schema, got text that is not JSON ({exc})") from None
        if self.json is not None:
            _check(isinstance(self.json, dict), "structured_outputs.json", "a JSON schema (an object)", self.json)
            # One text per schema: compiled grammars are cached by it.
            self.json = json.dumps(self.json, sort_keys=True, ensure_ascii=False)
        if self.json_object is False:
            self.json_object = None
        given = [name for name in STRUCTURE_KINDS if getattr(self, name) is not None]
        _check(len(given) == 1, "structured_outputs", f"exactly one of {', '.join(STRUCTURE_KINDS)}",
               ", ".join(given) or "none")
        if self.choice is not None:
            _check(isinstance(self.choice, list) and self.choice and all(isinstance(c, str) and c for c in self.choice),
                   "structured_outputs.choice", "a non-empty list of non-empty strings", self.choice)
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                _check(isinstance(value, str) and value.strip(), f"structured_outputs.{name}", "a non-empty string", value)

    @property
    def kind(self) -> str:
        return next(name for name in STRUCTURE_KINDS if getattr(self, name) is not None)


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries everything so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # token id -> a number added to its logit before penalties, temperature and the filters (OpenAI's logit_bias:
    # -100 bans a token in effect, 100 all but forces it).
    logit_bias: dict[int, float] | None = None
    # The only tokens the output may hold (vLLM's allowed_token_ids): every other token's logit is -inf.
    allowed_token_ids: list[int] | None = None
    # Only the prompt's last this many tokens are kept (-1: max_model_len of them); None keeps it whole, and a prompt
    # beyond max_model_len is refused.
    truncate_prompt_tokens: int | None = None
    # With a P2pConnector: what a prefill instance and a decode instance say to each other about the request's KV
    # (vLLM's fields: do_remote_decode, do_remote_prefill, remote_engine_id, remote_block_ids, remote_host, ...).
    kv_transfer_params: dict | None = None
    # Filled by the engine: the model's EOS ids, checked unless ignore_eos.
    eos_token_ids: list[int] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if not self.logit_bias:
            self.logit_bias = None
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def edits_logits(self) -> bool:
        """Whether the logits sampling sees are other than the model's whatever the step (min_tokens bans aside):
        penalties, biases, allowed tokens."""
        return self.has_penalties or self.logit_bias is not None or self.allowed_token_ids is not None

    def all_stop_token_ids(self) -> set[int]:
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(self.eos_token_ids)
        return ids

    def validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", "an integer >= 1", self.n)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            bounds = FIELD_BOUNDS[name]
            _check(bounds.allows(getattr(self, name)), name, bounds.describe(), getattr(self, name))
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", "0 or -1 (off) or a positive integer", self.top_k)
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1", self.max_tokens)
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0, "min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check(isinstance(value, int) and FIELD_BOUNDS["logprobs"].allows(value), name,
                       f"an integer {FIELD_BOUNDS['logprobs'].describe()}", value)
        if self.seed is not None:
            _check(isinstance(self.seed, int), "seed", "an integer", self.seed)
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings", self.stop)
        _check(all(map(_is_token_id, self.stop_token_ids)), "stop_token_ids", "non-negative token ids", self.stop_token_ids)
        if self.logit_bias is not None:
            self._validate_logit_bias()
        if self.truncate_prompt_tokens is not None:
            keep = self.truncate_prompt_tokens
            _check(isinstance(keep, int) and not isinstance(keep, bool) and (keep >= 1 or keep == -1), "truncate_prompt_tokens",
                   "an integer >= 1, or -1 (max_model_len)", keep)
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            _check(isinstance(allowed, list) and allowed and all(map(_is_token_id, allowed)), "allowed_token_ids",
                   "a non-empty list of non-negative token ids", allowed)
        _check(self.kv_transfer_params is None or isinstance(self.kv_transfer_params, dict), "kv_transfer_params", "a JSON object",
               self.kv_transfer_params)
        if self.structured_outputs is not None:
            # The grammar decides where the output ends (it allows only EOS there): nothing may overrule that.
            _check(self.min_tokens == 0, "min_tokens", "0 with structured_outputs (the structure decides where the output ends)",
                   self.min_tokens)
            _check(not self.ignore_eos, "ignore_eos", "false with structured_outputs (the structure ends with EOS)", self.ignore_eos)

    def _validate_logit_bias(self) -> None:
        bias, bounds = self.logit_bias, FIELD_BOUNDS["logit_bias"]
        _check(isinstance(bias, dict), "logit_bias", "a mapping of token ids to numbers", bias)
        for token_id, value in bias.items():
            _check(_is_token_id(token_id), "logit_bias", "keyed by non-negative token ids", token_id)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool) and bounds.allows(value),
                   "logit_bias", f"a number {bounds.describe()} for each token", {token_id: value})


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check(ok: bool, name: str, allowed: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
