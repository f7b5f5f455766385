"""What users get back: RequestOutput with one CompletionOutput per sample; from an embedding model (runner pooling),
EmbeddingRequestOutput.

They are msgspec Structs (attributes, equality and repr as dataclasses have) because the front end makes one of each for
every request's every step, and a Struct is made in C. RequestOutput and CompletionOutput are not tracked by the garbage
collector (gc=False): they hold no cycles, and tracking two objects a request a step made the collector run each step."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import msgspec


class Logprob(msgspec.Struct):
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the sampled/actual token plus the top-N).
PositionLogprobs = dict[int, Logprob]


@dataclass
class LogprobsLists:
    """Logprobs as the sampler computes them, per position: (token ids, logprobs, rank); index 0 of each
    position is the sampled (or actual prompt) token, then the top-N. Plain lists, cheap to send."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    @classmethod
    def concat(cls, parts: list[LogprobsLists]) -> LogprobsLists:
        return cls([ids for part in parts for ids in part.token_ids], [values for part in parts for values in part.logprobs],
                   [rank for part in parts for rank in part.ranks])

    def head(self, num_positions: int) -> LogprobsLists:
        return LogprobsLists(self.token_ids[:num_positions], self.logprobs[:num_positions], self.ranks[:num_positions])


class CompletionOutput(msgspec.Struct, gc=False):
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


class RequestOutput(msgspec.Struct, gc=False):
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None  # with a KV connector: what the request's KV transfer tells the client


class EmbeddingOutput(msgspec.Struct):
    data: bytes  # the vector's float32 values, native byte order

    @property
    def embedding(self) -> list[float]:
        return array("f", self.data).tolist()


class EmbeddingRequestOutput(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    num_cached_tokens: int = 0


class ClassificationOutput(msgspec.Struct):
    probs: list[float]  # each label's probability (its logit, where the activation was turned off)


class ClassificationRequestOutput(msgspec.Struct):
    request_id: str
    prompt_token_ids: list[int]
    outputs: ClassificationOutput
    finished: bool = True
    num_cached_tokens: int = 0


class ScoringOutput(msgspec.Struct):
    score: float


class ScoringRequestOutput(msgspec.Struct):
    """One scored pair: its score, and the token ids of both texts."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
