"""What travels between the front end and the engine core, and its encoding (msgpack via msgspec).

Front end -> core: ADD (an EngineCoreRequest), ABORT (request ids), UTILITY (a named call), SHUTDOWN.
Core -> front end: EngineReady or EngineFailed once, then EngineCoreOutputs per step and
UtilityResults. The in-process client passes the same objects without encoding them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec

from pagedserve.core.contracts import EngineCoreOutput, SchedulerStats, StepRecord
from pagedserve.lora_request import LoRARequest
from pagedserve.model_info import ModelInfo
from pagedserve.sampling_params import SamplingParams


@dataclass
class EngineCoreRequest:
    """A tokenized, validated request for one sample (a request with n > 1 becomes n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    group_id: str | None = None  # the user's request id when it asked for n > 1 samples
    lora_request: LoRARequest | None = None  # the adapter it runs with; None: the base model


@dataclass
class EngineCoreOutputs:
    """One message from the engine core: the step's outputs and the scheduler's state after it."""

    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats | None = None
    step: StepRecord | None = None  # the step these outputs came from (for the web console's step timeline)
    engine_index: int = 0  # which data-parallel core (set by the front end's client as the message arrives)


class RequestType(enum.Enum):
    ADD = "add"
    ABORT = "abort"
    UTILITY = "utility"
    SHUTDOWN = "shutdown"
    WAKE = "wake"  # nothing to do: a core stepping with others learns that one of them got work (engine/core_proc.py)


@dataclass
class ModelLocated:
    """Sent as soon as the core has found the model's files, before it loads anything: the front end reads the
    tokenizer meanwhile."""

    model_dir: str


@dataclass
class EngineReady:
    """First message of a healthy engine core: what the front end needs to validate requests."""

    model_info: ModelInfo


@dataclass
class EngineFailed:
    error: str


@dataclass
class UtilityResult:
    call_id: int
    result: object = None
    error: str | None = None
    bad_input: bool = False  # the error is the caller's (a ValueError: its message names the bad argument)


# Outputs channel: the start-up handshake (located, then ready or failed), then step outputs and utility replies.
_OUTPUT_TYPES = {cls.__name__: cls for cls in (ModelLocated, EngineReady, EngineFailed, EngineCoreOutputs, UtilityResult)}

_encoder = msgspec.msgpack.Encoder()
_output_envelope = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_output_decoders = {name: msgspec.msgpack.Decoder(cls) for name, cls in _OUTPUT_TYPES.items()}


def encode_request(kind: RequestType, payload) -> bytes:
    return _encoder.encode((kind.value, payload))


def decode_request(frame: bytes):
    kind, payload = msgspec.msgpack.decode(frame)
    kind = RequestType(kind)
    if kind == RequestType.ADD:
        payload = msgspec.convert(payload, EngineCoreRequest)
    return kind, payload


def encode_output(message) -> bytes:
    return _encoder.encode((type(message).__name__, message))


def decode_output(frame: bytes):
    # The name first, the payload left as raw bytes, then decoded straight into its type: one pass over the step's
    # outputs, not a decode into plain objects and a conversion of those.
    name, payload = _output_envelope.decode(frame)
    return _output_decoders[name].decode(payload)
