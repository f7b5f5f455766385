"""OutputReader: the engine core's messages as the front end's event loop reads them, and the core's exit."""

import asyncio
import multiprocessing
import time

import pytest
import uvloop
import zmq

from pagedserve.engine.output_reader import OutputReader


def _send_then_exit(address: str, messages: list[bytes], pause_s: float, exit_when=None) -> None:
    socket = zmq.Context().socket(zmq.PUSH)
    socket.connect(address)
    for message in messages:
        socket.send(message)
        time.sleep(pause_s)
    socket.close(linger=-1)  # every message delivered before the process ends
    if exit_when is not None:
        exit_when.wait()


@pytest.fixture
def pull_socket(tmp_path):
    context = zmq.Context()
    socket = context.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/out"
    socket.bind(address)
    yield socket, address
    socket.close(linger=0)
    context.term()


def _start_sender(address: str, messages: list[bytes], pause_s: float, exit_when=None):
    process = multiprocessing.get_context("spawn").Process(target=_send_then_exit, args=(address, messages, pause_s, exit_when))
    process.start()
    return process


async def _read_all(reader: OutputReader) -> list[bytes]:
    frames = []
    while (frame := await reader.next_frame()) is not None:
        frames.append(frame)
    return frames


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop], ids=["asyncio", "uvloop"])
def test_every_message_in_order_then_the_exit(pull_socket, loop_factory):
    """Messages queued before the loop watches the socket come first, in order, while the sender still runs; then its
    exit (None), and the exit again for any later wait."""
    socket, address = pull_socket
    messages = [f"step {i}".encode() for i in range(40)]
    exit_now = multiprocessing.get_context("spawn").Event()
    process = _start_sender(address, messages, pause_s=0, exit_when=exit_now)
    reader = OutputReader(socket, process.sentinel)
    # The start-up's wait for the core's first message reads the socket's state: the messages queued meanwhile are no
    # longer announced by its descriptor.
    assert socket.poll(10_000, zmq.POLLIN)
    time.sleep(0.2)

    async def read_then_exit():
        frames = [await asyncio.wait_for(reader.next_frame(), timeout=10) for _ in messages]
        exit_now.set()
        return frames, await reader.next_frame(), await reader.next_frame()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        assert runner.run(read_then_exit()) == (messages, None, None)
    reader.stop()
    process.join()


def test_a_later_event_loop_takes_the_watch_over(pull_socket):
    """An engine client outlives one asyncio.run: the next loop's waits get the next messages."""
    socket, address = pull_socket
    messages = [b"first", b"second", b"third"]
    process = _start_sender(address, messages, pause_s=0.2)
    reader = OutputReader(socket, process.sentinel)
    assert asyncio.run(reader.next_frame()) == b"first"
    assert asyncio.run(_read_all(reader)) == messages[1:]
    reader.stop()
    process.join()


def test_a_cancelled_wait_loses_nothing(pull_socket):
    """A wait cancelled before a message came (a request's handler going away) leaves the message for the next wait."""
    socket, address = pull_socket
    process = _start_sender(address, [b"late"], pause_s=0)
    reader = OutputReader(socket, process.sentinel)

    async def main():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.next_frame(), timeout=0.0)
        return await _read_all(reader)

    assert asyncio.run(main()) == [b"late"]
    reader.stop()
    process.join()
