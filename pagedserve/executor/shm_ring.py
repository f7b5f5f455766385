"""One writer, several readers: messages written once into a ring of slots in POSIX shared memory, which every
reader reads in order. The executor hands each step to its ranks this way (as vLLM's shared-memory message queue
does): one copy, whatever the number of ranks, and no socket on the way; and the output rank hands each step's
output back the same way, through a ring of one reader.

Layout (all words uint64, each reader's counter on a cache line of its own):
  slot_seq[num_slots]          the number (1-based) of the message a slot holds; written last, after its bytes
  reader[num_readers] * 8      [0]: messages the reader has consumed; [1]: 1 while it sleeps (see below)
  slots[num_slots]             [length word][up to max_bytes of message]

The writer puts message m into slot m % num_slots once every reader has consumed message m - num_slots (the slot's
last); a reader takes its next message once its slot holds that number. A message longer than max_bytes goes by
the side channel (each reader's socket), its slot saying so.

Waiting: a reader spins (yielding the core) for a short while, then sleeps on its socket after raising its sleep
flag and checking once more; the writer, having published a message, wakes the readers whose flag is up. So an
idle engine's ranks burn no CPU, and a busy one's hand-off costs no system call. On x86 a store is seen after the
stores before it; elsewhere _fence() orders them (a lock round trip is a full barrier).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory

_WORD = 8
_READER_WORDS = 8  # one 64-byte line per reader: no false sharing between their counters
_OVERFLOW = 2**64 - 1  # a slot's length word when the message went by the side channel
_WAKE = b""  # a wake-up on a reader's socket (messages that travel there are never empty)
_fence_lock = threading.Lock()


def _fence() -> None:
    with _fence_lock:
        pass


class _Layout:
    """The ring's words as views of the shared buffer (memoryviews of uint64: reading or writing one word is an index,
    with none of an array library's per-call cost, and every message passes through several)."""

    def __init__(self, buffer, num_slots: int, num_readers: int, max_bytes: int) -> None:
        self.num_slots, self.num_readers, self.max_bytes = num_slots, num_readers, max_bytes
        header_words = num_slots + num_readers * _READER_WORDS
        self.slot_bytes = _WORD + max_bytes
        self.slots_offset = header_words * _WORD
        self.buffer = buffer
        self.slot_seq = buffer[: num_slots * _WORD].cast("Q")
        self.reader_words = buffer[num_slots * _WORD : self.slots_offset].cast("Q")  # reader r's at r * _READER_WORDS
        self.length_words = [buffer[start : start + _WORD].cast("Q") for start in
                             range(self.slots_offset, self.slots_offset + num_slots * self.slot_bytes, self.slot_bytes)]

    @staticmethod
    def size(num_slots: int, num_readers: int, max_bytes: int) -> int:
        return (num_slots + num_readers * _READER_WORDS) * _WORD + num_slots * (_WORD + max_bytes)

    def consumed(self, reader: int) -> int:
        return self.reader_words[reader * _READER_WORDS]

    def set_consumed(self, reader: int, count: int) -> None:
        self.reader_words[reader * _READER_WORDS] = count

    def sleeping(self, reader: int) -> bool:
        return self.reader_words[reader * _READER_WORDS + 1] == 1

    def set_sleeping(self, reader: int, flag: bool) -> None:
        self.reader_words[reader * _READER_WORDS + 1] = int(flag)

    def clear(self) -> None:
        self.buffer[: self.slots_offset] = bytes(self.slots_offset)

    def data(self, slot: int, length: int) -> memoryview:
        start = self.slots_offset + slot * self.slot_bytes + _WORD
        return self.buffer[start : start + length]

    def release(self) -> None:
        """Let go of the views, which must go before the buffer can close."""
        for view in (self.slot_seq, self.reader_words, *self.length_words):
            view.release()


@dataclass(frozen=True)
class RingSpec:
    """What a reader needs to attach (picklable: it travels to the worker processes)."""

    name: str
    num_slots: int
    num_readers: int
    max_bytes: int


def create_ring(num_readers: int, num_slots: int = 4, max_bytes: int = 1 << 20) -> tuple[shared_memory.SharedMemory, RingSpec]:
    """A new, empty ring: its memory (the creator unlinks it when done, close_ring) and what attaches to it."""
    shm = shared_memory.SharedMemory(create=True, size=_Layout.size(num_slots, num_readers, max_bytes))
    layout = _Layout(shm.buf, num_slots, num_readers, max_bytes)
    layout.clear()
    layout.release()
    return shm, RingSpec(shm.name, num_slots, num_readers, max_bytes)


def close_ring(shm: shared_memory.SharedMemory) -> None:
    shm.close()
    shm.unlink()


class RingWriter:
    """send(message) publishes to every reader. side_channels[r] is reader r's socket (a ZMQ PUSH socket), set
    before the first send: the ring is made before the readers' processes start, the sockets after."""

    def __init__(self, num_readers: int, num_slots: int = 4, max_bytes: int = 1 << 20,
                 readers_alive: Callable[[], None] = lambda: None, spec: RingSpec | None = None) -> None:
        """A new ring, which this writer owns; or, given spec, the writer of a ring another process made (and unlinks).
        readers_alive() raises when a reader is gone; the writer calls it while it waits for one."""
        self.owned = spec is None
        self.shm, self.spec = create_ring(num_readers, num_slots, max_bytes) if spec is None else (
            shared_memory.SharedMemory(name=spec.name), spec)
        self.layout = _Layout(self.shm.buf, self.spec.num_slots, self.spec.num_readers, self.spec.max_bytes)
        self.side_channels: list = []
        self.readers_alive = readers_alive
        self.sent = 0  # a ring has one writer, from its first message on

    def send(self, message: bytes) -> None:
        waiter = _Backoff()
        while not self._next_slot_free():
            if waiter.wait():
                self.readers_alive()
        self._publish(message)

    def try_send(self, message: bytes) -> bool:
        """Send only if no reader is behind by a whole ring (for shutdown, when a reader may be gone)."""
        if not self._next_slot_free():
            return False
        self._publish(message)
        return True

    def _next_slot_free(self) -> bool:
        """Whether every reader has consumed the next slot's previous message."""
        layout = self.layout
        oldest = self.sent - layout.num_slots + 1
        return all(layout.consumed(reader) >= oldest for reader in range(layout.num_readers))

    def _publish(self, message: bytes) -> None:
        layout = self.layout
        slot = self.sent % layout.num_slots
        length = layout.length_words[slot]
        if len(message) > layout.max_bytes:
            length[0] = _OVERFLOW
            for socket_ in self.side_channels:
                socket_.send(message, copy=False)
        else:
            length[0] = len(message)
            layout.data(slot, len(message))[:] = message
        _fence()
        self.sent += 1
        layout.slot_seq[slot] = self.sent
        _fence()
        for reader in range(layout.num_readers):
            if layout.sleeping(reader):
                layout.set_sleeping(reader, False)
                self.side_channels[reader].send(_WAKE)

    def close(self) -> None:
        self.layout.release()
        if self.owned:
            close_ring(self.shm)
        else:
            self.shm.close()


class RingReader:
    """recv() -> the next message, in order; socket is this reader's side channel (a ZMQ PULL socket)."""

    def __init__(self, spec: RingSpec, index: int, socket, spin_s: float = 0.005) -> None:
        # Attached, not owned: its creator unlinks it. The engine's processes share one resource tracker, so this
        # registration is the creator's own again, not a second claim.
        self.shm = shared_memory.SharedMemory(name=spec.name)
        self.layout = _Layout(self.shm.buf, spec.num_slots, spec.num_readers, spec.max_bytes)
        self.index = index
        self.socket = socket
        self.spin_s = spin_s
        self.received = self.layout.consumed(index)
        self.side_messages: deque[bytes] = deque()  # read off the socket while sleeping, before their slot

    def recv(self, timeout_s: float | None = None) -> bytes | None:
        """The next message; None if none came within timeout_s (None: wait as long as it takes)."""
        layout = self.layout
        slot = self.received % layout.num_slots
        if not self._wait_for(slot, self.received + 1, timeout_s):
            return None
        length = layout.length_words[slot][0]
        message = self._side_channel() if length == _OVERFLOW else bytes(layout.data(slot, length))
        _fence()
        self.received += 1
        layout.set_consumed(self.index, self.received)
        return message

    def _wait_for(self, slot: int, number: int, timeout_s: float | None) -> bool:
        seq = self.layout.slot_seq
        if seq[slot] == number:
            return True
        start = time.monotonic()
        spin_until = start + (self.spin_s if timeout_s is None else min(self.spin_s, timeout_s))
        while time.monotonic() < spin_until:
            os.sched_yield()
            if seq[slot] == number:
                return True
        deadline = None if timeout_s is None else start + timeout_s
        while seq[slot] != number:
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self._sleep_until_woken(slot, number, deadline)
        return True

    def _sleep_until_woken(self, slot: int, number: int, deadline: float | None) -> None:
        self.layout.set_sleeping(self.index, True)
        _fence()
        if self.layout.slot_seq[slot] != number:  # not published meanwhile: the writer will see the flag
            wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
            if self.socket.poll(wait_ms):
                frame = self.socket.recv()
                if frame != _WAKE:  # a long message, sent before its slot was published
                    self.side_messages.append(frame)
        self.layout.set_sleeping(self.index, False)

    def _side_channel(self) -> bytes:
        if self.side_messages:
            return self.side_messages.popleft()
        while (frame := self.socket.recv()) == _WAKE:  # a wake-up that crossed a message already seen
            continue
        return frame

    def close(self) -> None:
        self.layout.release()
        self.shm.close()


class _Backoff:
    """Spin (yielding the core) at first, then sleep longer and longer; wait() says when a second has gone by."""

    def __init__(self) -> None:
        self.start = self.checked = time.monotonic()
        self.pause = 0.0

    def wait(self) -> bool:
        if time.monotonic() - self.start < 0.001:
            os.sched_yield()
        else:
            self.pause = min(0.001, max(1e-5, self.pause * 2))
            time.sleep(self.pause)
        now = time.monotonic()
        if now - self.checked >= 1.0:
            self.checked = now
            return True
        return False
