"""The messages between the multi-process executor and its ranks. To the ranks, encoded once for all of them: a
step is its SchedulerOutput as typed msgpack (msgspec: compact, and decoded straight into the contract's classes,
no pickle of Python objects on the path every step takes); a call (a worker method or a module-level function, and
its arguments: start-up, utilities) is pickled, since it may carry any object; shutdown is one byte. Back: a step's
ModelRunnerOutput as typed msgpack too (alone on its ring); anything else ((kind, rank, value): ready, a call's
result, an error) pickled.

The maps a step is keyed by request id (the step's scheduled tokens, the tokens sampled back) travel as columns: the
request ids only when they differ from the previous message's, and the tokens scheduled only when those differ too.
A run of decode steps names the same requests in the same order with one token each, and decoding hundreds of
strings and building a map of them each step was most of what a message cost; so the ends keep the previous
message's columns (each side's codec is stateful, and reads every message of its ring, in order). The executor's end
hands the sampled tokens on as those columns (SampledTokens), since the scheduler only walks them.
"""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterator, Mapping

import msgspec

from pagedserve.core.contracts import ModelRunnerOutput, SchedulerOutput

_STEP, _CALL, _SHUTDOWN = b"S", b"C", b"X"
SHUTDOWN = _SHUTDOWN
_REPLY = b"P"


class _Scheduled(msgspec.Struct, array_like=True, gc=False):
    """A step's num_scheduled_tokens: None for a column that is the previous step's."""

    request_ids: list[str] | None
    num_tokens: list[int] | None


class _StepWire(msgspec.Struct, array_like=True, gc=False):
    scheduled: _Scheduled
    step: SchedulerOutput  # its num_scheduled_tokens empty: they travel as `scheduled`


class _Sampled(msgspec.Struct, array_like=True, gc=False):
    """A step's sampled_token_ids: request_ids None when they are the previous output's."""

    request_ids: list[str] | None
    token_ids: list[int]


class _OutputWire(msgspec.Struct, array_like=True, gc=False):
    sampled: _Sampled
    output: ModelRunnerOutput  # its sampled_token_ids empty: they travel as `sampled`


_encoder = msgspec.msgpack.Encoder()
_step_decoder = msgspec.msgpack.Decoder(_StepWire)
_output_decoder = msgspec.msgpack.Decoder(_OutputWire)


class _Column:
    """One column of a keyed map as its sender last sent it."""

    def __init__(self) -> None:
        self.previous: list = []

    def outgoing(self, values: list) -> list | None:
        """values, or None when they equal what went last."""
        if values == self.previous:
            return None
        self.previous = values
        return values

    def incoming(self, values: list | None) -> list:
        if values is not None:
            self.previous = values
        return self.previous


class SampledTokens(Mapping):
    """A step's sampled tokens as the executor's end receives them: a read-only map over the two columns they travel
    in. The scheduler's path for plain steps only iterates items(), which reads the columns side by side, so a run of
    decode steps builds no map; a lookup builds it once, and `get` is then the map's own."""

    __slots__ = ("_request_ids", "_token_ids", "_by_id")

    def __init__(self, request_ids: list[str], token_ids: list[int]) -> None:
        self._request_ids, self._token_ids = request_ids, token_ids
        self._by_id: dict[str, int] | None = None

    def items(self) -> Iterator[tuple[str, int]]:
        return zip(self._request_ids, self._token_ids)

    def __iter__(self) -> Iterator[str]:
        return iter(self._request_ids)

    def __len__(self) -> int:
        return len(self._request_ids)

    def __getitem__(self, request_id: str) -> int:
        return self._map()[request_id]

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._map()

    @property
    def get(self):
        """The map's own get (a lookup per request in the scheduler's loop, hoisted once)."""
        return self._map().get

    def _map(self) -> dict[str, int]:
        if self._by_id is None:
            self._by_id = dict(zip(self._request_ids, self._token_ids))
        return self._by_id

    def __repr__(self) -> str:
        return f"SampledTokens({dict(self.items())!r})"


class ExecutorCodec:
    """The executor's end: it encodes steps and decodes their outputs."""

    def __init__(self) -> None:
        self._scheduled_ids, self._scheduled_tokens, self._sampled_ids = _Column(), _Column(), _Column()

    def encode_step(self, scheduler_output: SchedulerOutput) -> bytes:
        scheduled = scheduler_output.num_scheduled_tokens
        columns = _Scheduled(self._scheduled_ids.outgoing(list(scheduled)), self._scheduled_tokens.outgoing(list(scheduled.values())))
        rest = copy.copy(scheduler_output)
        rest.num_scheduled_tokens = {}
        return _STEP + _encoder.encode(_StepWire(columns, rest))

    def decode_step_output(self, frame: bytes) -> ModelRunnerOutput:
        wire = _output_decoder.decode(frame)
        output = wire.output
        output.sampled_token_ids = SampledTokens(self._sampled_ids.incoming(wire.sampled.request_ids), wire.sampled.token_ids)
        return output


class RankCodec:
    """A rank's end: it decodes what the executor sends, and (the output rank) encodes its steps' outputs."""

    def __init__(self) -> None:
        self._scheduled_ids, self._scheduled_tokens, self._sampled_ids = _Column(), _Column(), _Column()
        self._scheduled: dict[str, int] = {}  # the previous step's map, shared by a step with the same columns

    def decode(self, frame: bytes) -> tuple[str, object]:
        """("step", SchedulerOutput), ("call", (method, args)) or ("shutdown", None)."""
        kind, body = frame[:1], memoryview(frame)[1:]
        if kind == _STEP:
            return "step", self._decode_step(body)
        if kind == _CALL:
            return "call", pickle.loads(body)
        if kind == _SHUTDOWN:
            return "shutdown", None
        raise ValueError(f"unknown message kind {bytes(kind)!r}")

    def _decode_step(self, body: memoryview) -> SchedulerOutput:
        wire = _step_decoder.decode(body)
        columns = wire.scheduled
        if columns.request_ids is not None or columns.num_tokens is not None:  # else: read only, so shared
            self._scheduled = dict(zip(self._scheduled_ids.incoming(columns.request_ids),
                                       self._scheduled_tokens.incoming(columns.num_tokens)))
        wire.step.num_scheduled_tokens = self._scheduled
        return wire.step

    def encode_step_output(self, output: ModelRunnerOutput) -> bytes:
        sampled = output.sampled_token_ids
        columns = _Sampled(self._sampled_ids.outgoing(list(sampled)), list(sampled.values()))
        rest = copy.copy(output)
        rest.sampled_token_ids = {}
        return _encoder.encode(_OutputWire(columns, rest))


def encode_call(method, args: tuple) -> bytes:
    return _CALL + pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)


def encode_reply(kind: str, rank: int, value) -> bytes:
    return _REPLY + pickle.dumps((kind, rank, value), protocol=pickle.HIGHEST_PROTOCOL)


def decode_reply(frame: bytes) -> tuple[str, int, object]:
    """(kind, rank, value), as encode_reply sent them."""
    kind, body = frame[:1], memoryview(frame)[1:]
    if kind == _REPLY:
        return pickle.loads(body)
    raise ValueError(f"unknown reply kind {bytes(kind)!r}")
