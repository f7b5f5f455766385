"""The wire format between the front end and the engine-core process: msgpack via msgspec."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import msgspec

from pagedserve.core.interface import EngineCoreOutputs, EngineCoreRequest


class RequestType(enum.Enum):
    ADD = "add"
    ABORT = "abort"
    UTILITY = "utility"
    SHUTDOWN = "shutdown"


@dataclass
class EngineReady:
    """First message of a healthy engine core: what the front end needs to validate requests."""

    model_dir: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    num_blocks: int


@dataclass
class EngineFailed:
    error: str


@dataclass
class UtilityResult:
    call_id: int
    result: bool | int | float | str | None = None
    error: str | None = None


# Outputs channel: the ready/failed handshake, then step outputs and utility replies.
_OUTPUT_TYPES = {cls.__name__: cls for cls in (EngineReady, EngineFailed, EngineCoreOutputs, UtilityResult)}

_encoder = msgspec.msgpack.Encoder()


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
    name, payload = msgspec.msgpack.decode(frame)
    return msgspec.convert(payload, _OUTPUT_TYPES[name])
