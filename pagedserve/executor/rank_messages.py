"""The messages between the multi-process executor and its ranks. To the ranks, encoded once for all of them: a
step is its SchedulerOutput as typed msgpack (msgspec: compact, and decoded straight into the contract's classes,
no pickle of Python objects on the path every step takes); a call (a worker method or a module-level function, and
its arguments: start-up, utilities) is pickled, since it may carry any object; shutdown is one byte. Back: a step's
ModelRunnerOutput as typed msgpack too (alone on its ring); anything else ((kind, rank, value): ready, a call's
result, an error) pickled."""

from __future__ import annotations

import pickle

import msgspec

from pagedserve.core.contracts import ModelRunnerOutput, SchedulerOutput

_STEP, _CALL, _SHUTDOWN = b"S", b"C", b"X"
SHUTDOWN = _SHUTDOWN
_REPLY = b"P"

_encoder = msgspec.msgpack.Encoder()
_step_decoder = msgspec.msgpack.Decoder(SchedulerOutput)
_step_output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)


def encode_step(scheduler_output: SchedulerOutput) -> bytes:
    return _STEP + _encoder.encode(scheduler_output)


def encode_call(method, args: tuple) -> bytes:
    return _CALL + pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)


def decode(frame: bytes) -> tuple[str, object]:
    """("step", SchedulerOutput), ("call", (method, args)) or ("shutdown", None)."""
    kind, body = frame[:1], memoryview(frame)[1:]
    if kind == _STEP:
        return "step", _step_decoder.decode(body)
    if kind == _CALL:
        return "call", pickle.loads(body)
    if kind == _SHUTDOWN:
        return "shutdown", None
    raise ValueError(f"unknown message kind {bytes(kind)!r}")


def encode_step_output(output: ModelRunnerOutput) -> bytes:
    return _encoder.encode(output)


def decode_step_output(frame: bytes) -> ModelRunnerOutput:
    return _step_output_decoder.decode(frame)


def encode_reply(kind: str, rank: int, value) -> bytes:
    return _REPLY + pickle.dumps((kind, rank, value), protocol=pickle.HIGHEST_PROTOCOL)


def decode_reply(frame: bytes) -> tuple[str, int, object]:
    """(kind, rank, value), as encode_reply sent them."""
    kind, body = frame[:1], memoryview(frame)[1:]
    if kind == _REPLY:
        return pickle.loads(body)
    raise ValueError(f"unknown reply kind {bytes(kind)!r}")
