"""The step contracts: what the scheduler hands the model runner, what the runner returns, and what
the scheduler reports per request after each step.

The last of these (EngineCoreOutput, SchedulerStats) is also what the engine core sends its front
end: the scheduler builds one EngineCoreOutput per request per step, and the wire message
(engine/wire.py) carries them as they are, so they live here where the scheduler can build them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from pagedserve.core.step_time import StepShape
from pagedserve.lora_request import LoRARequest
from pagedserve.outputs import LogprobsLists
from pagedserve.sampling_params import SamplingParams

# ---- scheduler -> runner -------------------------------------------------------------------


@dataclass
class NewRequestData:
    """A request the runner has not seen (or must rebuild after preemption): everything it needs."""

    request_id: str
    token_ids: list[int]  # prompt + any outputs generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # Prompt logprobs already reported (for prompt tokens 1..start): a recompute after preemption skips them.
    prompt_logprobs_start: int = 0
    lora_request: LoRARequest | None = None  # the adapter it runs with


class RunningRequestData(msgspec.Struct, array_like=True, gc=False):
    """New blocks of a running request the runner already holds. The runner advances each request's
    num_computed_tokens itself by the tokens it ran, so unchanged decodes cost nothing here. A msgspec struct: a step
    carries one for each request that crossed into a new block, and the executor's ranks decode them every step."""

    request_id: str
    new_block_ids: list[int]
    # The runner keeps this many of its block ids before appending the new ones: fewer than it holds once the
    # scheduler gave back blocks that only rejected draft tokens used.
    num_kept_blocks: int = -1


@dataclass
class GrammarBitmask:
    """Structured outputs: which tokens each constrained request may take at each position it samples in this step. A
    request has 1 + (its drafts to verify) rows, one after each known token; rows are bitmasks over the vocabulary (bit
    j of 32-bit word j // 32 set: token j allowed), int32 in native byte order, in request_ids' order."""

    request_ids: list[str]
    rows: bytes
    words_per_row: int


@dataclass
class KVPull:
    """A prompt's KV one decode instance's workers pull from a prefill instance that holds it: each rank from the rank
    of the same place there (its port: port + 1 + rank), remote_block_ids into block_ids, in order. token: what the
    prefill instance gave the request's holder (it serves a hold's blocks to no one else). Each rank tells
    notify_address when it is done."""

    request_id: str
    host: str
    port: int
    remote_request_id: str
    token: str
    remote_block_ids: list[int]
    block_ids: list[int]
    notify_address: str


@dataclass
class KVConnectorMetadata:
    """What the workers' KV connector does around a step's forward pass: load the KV of blocks found outside the
    engine before it, save the KV of blocks it fills after it. Each block by its id in the cache and its key (the
    connector's name for a block's content: its prompt prefix, the adapter it ran under). A connector that moves KV
    between instances also has the workers serve held blocks to the instance that pulls them (holds: request id,
    token, block ids), stop serving them (releases), and pull KV from other instances (pulls)."""

    loads: list[tuple[int, str]] = field(default_factory=list)
    saves: list[tuple[int, str]] = field(default_factory=list)
    load_from: str = ""  # where the connector put what the loads read, where it is not where the saves write
    holds: list[tuple[str, str, list[int]]] = field(default_factory=list)
    releases: list[str] = field(default_factory=list)
    pulls: list[KVPull] = field(default_factory=list)

    @property
    def acts_before_forward(self) -> bool:
        return bool(self.loads or self.holds or self.releases or self.pulls)


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_running_reqs: list[RunningRequestData]  # only running requests that got new blocks
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must forget: those that finished or were aborted since the last step, and those preempted
    # (they come back as new requests, rebuilt from their tokens).
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    shape: StepShape = field(default_factory=StepShape)  # what the step carries, for the step-time model
    # Pipeline parallelism: each decoding request's last token, (its index, its id), for the stages that did
    # not sample it. Empty otherwise.
    last_token_ids: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Speculative decoding: the draft tokens each request verifies in this step (its scheduled tokens are its
    # last token and these), and the requests to propose new drafts for once this step has run.
    drafts_to_verify: dict[str, list[int]] = field(default_factory=dict)
    propose_for: set[str] = field(default_factory=set)
    grammar_bitmask: GrammarBitmask | None = None
    # What the step's prompt work was: each chunk as (request id, its first token's position, its tokens, the request's
    # known tokens), and the seconds the step was planned within (max_decode_stall; None where nothing bounded it).
    prompt_chunks: list[tuple[str, int, int, int]] = field(default_factory=list)
    stall_limit_s: float | None = None
    kv_connector_metadata: KVConnectorMetadata | None = None  # with a KV connector

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def needs_runner(self) -> bool:
        """Tokens to run, requests the runner must forget, or a KV connector's work for the workers (holds to serve or
        drop, KV to pull)."""
        return bool(self.total_num_scheduled_tokens or self.finished_req_ids or self.preempted_req_ids
                    or self.kv_connector_metadata is not None and self.kv_connector_metadata.acts_before_forward)


# ---- runner -> scheduler -------------------------------------------------------------------


@dataclass
class ModelRunnerOutput:
    # Only requests that reached the end of their known tokens. The runner fills a dict; the multi-process executor
    # hands on the columns they travelled in (rank_messages.SampledTokens), which the scheduler only reads.
    sampled_token_ids: Mapping[str, int]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)  # one position per token the request gained
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Speculative decoding: the draft tokens each request's verification accepted, which come before its sampled
    # token; and the drafts proposed for the next step.
    accepted_token_ids: dict[str, list[int]] = field(default_factory=dict)
    proposed_drafts: dict[str, list[int]] = field(default_factory=dict)
    # Seconds of the step spent waiting for other data-parallel cores' passes (expert parallelism over them): not
    # this core's own cost, which its step-time model learns.
    waited_for_other_cores_s: float = 0.0
    # Runner pooling: the vector of each request whose prompt ended in this step (float32 values, native byte order).
    pooled: dict[str, bytes] = field(default_factory=dict)


# ---- scheduler -> engine core (and on to the front end) -------------------------------------


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """One request's news from one step. Built for every running request every step, so a msgspec struct: it builds
    faster than a dataclass and travels to the front end as a plain array (it holds no cycles, so the garbage
    collector need not track it)."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: dict | None = None  # with a KV connector, on a finished request's last output
    pooled: bytes | None = None  # runner pooling: the prompt's vector (float32 values, native byte order), on its one output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class StepRecord(msgspec.Struct, array_like=True, gc=False):
    """One step as it ran: when it ended (seconds since the epoch), how long it took, what it carried (decode and prompt
    tokens, and the prompt chunks as SchedulerOutput.prompt_chunks has them), and the time it was planned within."""

    ended_at: float
    seconds: float
    decode_tokens: int
    prefill_tokens: int
    stall_limit_s: float | None
    prompt_chunks: list[tuple[str, int, int, int]]

    @classmethod
    def of(cls, scheduler_output: SchedulerOutput, seconds: float, ended_at: float) -> StepRecord:
        shape = scheduler_output.shape
        return cls(ended_at, seconds, shape.decode_tokens, shape.prefill_tokens, scheduler_output.stall_limit_s,
                   scheduler_output.prompt_chunks)


@dataclass
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # cumulative
    prefix_cache_hits: int = 0  # cumulative
    num_preemptions: int = 0  # cumulative
    spec: SpecDecodingStats | None = None  # cumulative; None without speculative decoding
    # LoRA adapter name -> its requests running, and waiting (adapters with none left out; empty without LoRA).
    lora_running: dict[str, int] = field(default_factory=dict)
    lora_waiting: dict[str, int] = field(default_factory=dict)
    # With a KV connector, cumulative: prompt tokens whose KV was loaded from outside, and saved for others.
    kv_received_tokens: int = 0
    kv_sent_tokens: int = 0
    kv_received_bytes: int = 0
    kv_sent_bytes: int = 0
    kv_load_failures: int = 0  # prompts whose KV could not be loaded from outside (computed here instead, or ended)
    # Seconds of each load from another instance that ended since the previous stats (a histogram's observations).
    kv_transfer_seconds: list[float] = field(default_factory=list)

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Prompt tokens found in the prefix cache per token looked up; None before any lookup."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else None


@dataclass
class SpecDecodingStats:
    num_drafts: int = 0  # verifications of a request's drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts whose i-th token was accepted

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft_tokens:
            self.accepted_per_position.extend([0] * (num_draft_tokens - len(self.accepted_per_position)))
        for position in range(num_accepted):
            self.accepted_per_position[position] += 1
