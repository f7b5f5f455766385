"""How one rank's KV blocks move between instances: a prefill instance's rank serves the blocks it holds for a
request (BlockServer, a ZMQ ROUTER socket in a thread of its own), and the decode instance's rank of the same place
pulls them into its own blocks (pull_blocks) over TCP.

A pull names the request, the token the prefill instance gave its hold, and the blocks it wants: the server answers
only for a hold it knows whose token matches and whose blocks include them, so a reader cannot take another request's
blocks, nor blocks given back since. A hold the server has not heard of yet (its step is still on its way) is answered
"retry". The data of a block is every local layer's K and V for it, as the cache holds them; the header says their
shape and dtype, which the puller checks against its own cache before writing anything.
"""

from __future__ import annotations

import threading
import time
import warnings

import msgspec
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

_BLOCKS_PER_MESSAGE = 32  # bounds a message's size; a long prompt moves in several
# How long a puller asks again for a hold the server does not know: the prefill instance tells its ranks of a hold with
# its next step, which follows the request's end at once unless a long step was already running.
UNKNOWN_HOLD_WAIT_S = 10.0
_POLL_MS = 100  # how often the server looks whether it is closing
# What a puller's connection events say of the prefill instance: either, and it is gone.
_GONE_EVENTS = {zmq.EVENT_CONNECT_RETRIED: "refused", zmq.EVENT_DISCONNECTED: "dropped"}


class _Ask(msgspec.Struct, array_like=True):
    request_id: str
    token: str
    block_ids: list[int]


class _Answer(msgspec.Struct, array_like=True):
    status: str  # "ok", "retry" (the hold is not known yet) or "refused"
    shape: list[int] = []
    dtype: str = ""
    detail: str = ""


class TransferError(Exception):
    """A pull that cannot complete: the server refused it, did not answer in time, or sent KV of another layout."""


def bind(socket: zmq.Socket, address: str) -> None:
    """Bind, or say which setting names an address that cannot be had."""
    try:
        socket.bind(address)
    except zmq.ZMQError as exc:
        socket.close(linger=0)
        raise ValueError(f"kv_transfer_config.kv_connector_extra_config: cannot listen on {address} ({exc}); choose another "
                         "kv_host or kv_port (an engine uses kv_port, and each of its ranks the ports after it)") from None


class BlockServer:
    """Serves this rank's held blocks to pulling ranks until close()."""

    def __init__(self, kv_caches: list[torch.Tensor], address: str) -> None:
        self.kv_caches = kv_caches
        self._holds: dict[str, tuple[str, frozenset[int]]] = {}  # request id -> (token, its blocks)
        # Taken while a reply's blocks are copied and while holds change: a released hold's blocks are never read once
        # release() returns, so the engine may write them in its next forward pass.
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        bind(self._socket, address)
        self._thread = threading.Thread(target=self._serve, name="kv-block-server", daemon=True)
        self._thread.start()

    def hold(self, request_id: str, token: str, block_ids: list[int]) -> None:
        with self._lock:
            self._holds[request_id] = (token, frozenset(block_ids))

    def release(self, request_id: str) -> None:
        with self._lock:
            self._holds.pop(request_id, None)

    def close(self) -> None:
        self._closing.set()
        self._thread.join()
        self._socket.close()

    def _serve(self) -> None:
        decoder, encoder = msgspec.msgpack.Decoder(_Ask), msgspec.msgpack.Encoder()
        while not self._closing.is_set():
            if not self._socket.poll(_POLL_MS):
                continue
            identity, frame = self._socket.recv_multipart()
            try:
                ask = decoder.decode(frame)
            except msgspec.DecodeError:
                self._socket.send_multipart([identity, encoder.encode(_Answer("refused", detail="not a block request"))])
                continue
            answer, data = self._answer(ask)
            self._socket.send_multipart([identity, encoder.encode(answer), data], copy=False)

    def _answer(self, ask: _Ask) -> tuple[_Answer, memoryview | bytes]:
        with self._lock:
            hold = self._holds.get(ask.request_id)
            if hold is None:
                return _Answer("retry"), b""
            token, blocks = hold
            if token != ask.token or not blocks.issuperset(ask.block_ids):
                return _Answer("refused", detail="not this request's blocks"), b""
            index = torch.tensor(ask.block_ids, dtype=torch.long)
            data = torch.stack([cache.index_select(1, index) for cache in self.kv_caches])
        return _Answer("ok", list(data.shape), str(data.dtype).removeprefix("torch.")), data.view(torch.uint8).numpy().data


def pull_blocks(kv_caches: list[torch.Tensor], address: str, request_id: str, token: str, remote_block_ids: list[int],
                block_ids: list[int], timeout_s: float) -> int:
    """Copy the remote blocks into ours, in order; the bytes moved. Raises TransferError (timeout_s: for each answer;
    at once where the prefill instance's port refuses the connection or drops it: the instance is gone)."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    events = socket.get_monitor_socket(zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED)
    socket.connect(address)
    moved = 0
    try:
        for start in range(0, len(block_ids), _BLOCKS_PER_MESSAGE):
            remote, local = remote_block_ids[start:start + _BLOCKS_PER_MESSAGE], block_ids[start:start + _BLOCKS_PER_MESSAGE]
            answer, data = _ask(socket, events, _Ask(request_id, token, remote), timeout_s)
            _write(kv_caches, local, answer, data)
            moved += len(data)
    finally:
        socket.disable_monitor()
        events.close()
        socket.close()
    return moved


def _ask(socket, events, ask: _Ask, timeout_s: float) -> tuple[_Answer, zmq.Frame]:
    encoded = msgspec.msgpack.encode(ask)
    pause, unknown_until = 0.002, time.monotonic() + UNKNOWN_HOLD_WAIT_S
    while True:
        socket.send(encoded)
        _wait_for_answer(socket, events, ask.request_id, timeout_s)
        header, data = socket.recv_multipart(copy=False)
        answer = msgspec.msgpack.decode(header.bytes, type=_Answer)
        if answer.status == "ok":
            return answer, data
        if answer.status != "retry":
            raise TransferError(f"the prefill instance refused {ask.request_id}'s blocks: {answer.detail}")
        if time.monotonic() > unknown_until:
            raise TransferError(f"the prefill instance holds no blocks for {ask.request_id}")
        time.sleep(pause)  # its hold is on its way to the serving rank
        pause = min(pause * 2, 0.05)


def _wait_for_answer(socket, events, request_id: str, timeout_s: float) -> None:
    """Until the socket holds an answer; TransferError once timeout_s passed, or as soon as the connection to the
    prefill instance was refused or dropped (ZMQ would only try again: a killed instance never answers)."""
    poller = zmq.Poller()
    poller.register(socket, zmq.POLLIN)
    poller.register(events, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        ready = dict(poller.poll(int(left * 1000) + 1))
        if socket in ready:
            return
        if events in ready:
            event = recv_monitor_message(events)["event"]
            raise TransferError(f"the prefill instance's connection was {_GONE_EVENTS.get(event, 'lost')} while asking for {request_id}'s "
                                "blocks: the instance is gone")
    raise TransferError(f"the prefill instance did not answer for {request_id}'s blocks within {timeout_s:.0f} s")


def _write(kv_caches: list[torch.Tensor], block_ids: list[int], answer: _Answer, data: zmq.Frame) -> None:
    cache = kv_caches[0]
    expected = [len(kv_caches), cache.shape[0], len(block_ids), *cache.shape[2:]]
    dtype = str(cache.dtype).removeprefix("torch.")
    if answer.shape != expected or answer.dtype != dtype:
        raise TransferError(f"KV of shape {answer.shape} ({answer.dtype}) does not fit this instance's {expected} ({dtype}): "
                            "the two instances must run the same model with the same KV cache layout and parallel split")
    with warnings.catch_warnings():  # the message's buffer is read-only, and only read here
        warnings.simplefilter("ignore", UserWarning)
        blocks = torch.frombuffer(data.buffer, dtype=torch.uint8).view(cache.dtype).view(expected)
    index = torch.tensor(block_ids, dtype=torch.long)
    for layer, part in zip(kv_caches, blocks):
        layer.index_copy_(1, index, part)
