"""The output processor's plain path in C (csrc/plain_outputs.c), and the bases of the state it reads.

Most outputs of most steps bring a request of one sample tokens with a text of their own, and its request asked for no
logprobs and no stop strings: the C path turns those into RequestOutputs without Python's cost per object, and passes
every other output to the output processor's Python path, which stays the reference. The state classes derive from
TextFields, SampleFields and RequestFields, which hold the fields the C path reads as C fields under the same names;
where no C compiler is here, they are plain classes and `process` is None.
"""

from __future__ import annotations

from pagedserve import c_extension
from pagedserve.core.contracts import EngineCoreOutput
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import RequestOutputKind

_native = c_extension.load("pagedserve_plain_outputs", "plain_outputs.c", "the output processor's C path")

if _native is not None:
    _native.configure(EngineCoreOutput, RequestOutput, CompletionOutput)
    TextFields, SampleFields, RequestFields = _native.TextFields, _native.SampleFields, _native.RequestFields
    process = _native.process
    NOT_PLAIN = _native.NOT_PLAIN
    _PLAIN_MODES = {RequestOutputKind.CUMULATIVE: _native.PLAIN_CUMULATIVE, RequestOutputKind.DELTA: _native.PLAIN_DELTA,
                    RequestOutputKind.FINAL_ONLY: _native.PLAIN_FINAL_ONLY}
else:
    class TextFields:
        """An IncrementalDetokenizer's fields, in its __dict__."""

    class SampleFields:
        """A SampleState's fields, in its __dict__."""

    class RequestFields:
        """A RequestState's fields, in its __dict__."""

    process = None
    NOT_PLAIN = -1
    _PLAIN_MODES = {}


def plain_mode(kind: RequestOutputKind, plain: bool) -> int:
    """What a sample's plain_mode says: how its outputs report on the C path, or NOT_PLAIN (never there)."""
    return _PLAIN_MODES.get(kind, NOT_PLAIN) if plain else NOT_PLAIN
