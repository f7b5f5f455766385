"""The shared-memory ring that carries each step to the ranks: every reader gets every message, in order and
intact, through wrap-around, long messages (the side channel), slow readers and sleeping ones; a dead reader
is reported rather than waited for forever."""

from __future__ import annotations

import multiprocessing
import os
import random
import tempfile
import time

import pytest
import zmq

from pagedserve.executor.shm_ring import RingReader, RingWriter


def _connect(address, results_address):
    """A reader process's sockets: its side channel and the test's results."""
    context = zmq.Context()
    socket_ = context.socket(zmq.PULL)
    socket_.connect(address)
    results = context.socket(zmq.PUSH)
    results.connect(results_address)
    return context, socket_, results


def _reader_process(spec, index, address, results_address, delay_s):
    context, socket_, results = _connect(address, results_address)
    reader = RingReader(spec, index, socket_, spin_s=0.001)
    while True:
        message = reader.recv()
        if message == b"stop":
            break
        if delay_s:
            time.sleep(delay_s * random.random())
        results.send(index.to_bytes(1, "little") + message[:8] + len(message).to_bytes(8, "little"))
    reader.close()
    context.destroy(linger=5000)  # sends what is queued before it returns
    os._exit(0)


class Ring:
    """A writer in this process and readers in child processes, each with its side-channel socket."""

    def __init__(self, num_readers, delays=None, max_bytes=256, num_slots=4, target=_reader_process):
        self.dir = tempfile.mkdtemp()
        self.context = zmq.Context()
        self.results = self.context.socket(zmq.PULL)
        results_address = f"ipc://{self.dir}/results"
        self.results.bind(results_address)
        addresses = [f"ipc://{self.dir}/reader{i}" for i in range(num_readers)]
        self.sockets = []
        for address in addresses:
            socket_ = self.context.socket(zmq.PUSH)
            socket_.bind(address)
            self.sockets.append(socket_)
        self.processes = []

        def alive():
            for process in self.processes:
                if not process.is_alive():
                    raise RuntimeError(f"reader {process.name} is gone")

        self.writer = RingWriter(num_readers, num_slots=num_slots, max_bytes=max_bytes, readers_alive=alive)
        self.writer.side_channels = self.sockets
        spawn = multiprocessing.get_context("spawn")
        delays = delays or [0.0] * num_readers
        self.processes = [spawn.Process(target=target, name=f"reader{i}",
                                        args=(self.writer.spec, i, addresses[i], results_address, delays[i]))
                          for i in range(num_readers)]
        for process in self.processes:
            process.start()

    def close(self):
        for process in self.processes:
            process.join(30)
            if process.is_alive():
                process.kill()
        self.writer.close()
        self.context.destroy(linger=0)


def message(number: int, length: int) -> bytes:
    head = number.to_bytes(8, "little")
    return head + bytes((number + i) % 251 for i in range(length - 8))


@pytest.mark.parametrize("delays", [[0.0, 0.0, 0.0], [0.002, 0.0, 0.0005]])
def test_every_reader_gets_every_message_in_order_through_wrap_around_and_long_messages(delays):
    ring = Ring(3, delays)
    rng = random.Random(0)
    lengths = [rng.choice([8, 100, 256, 257, 5000]) for _ in range(60)]  # 257 and 5000 exceed a slot
    try:
        for number, length in enumerate(lengths):
            ring.writer.send(message(number, length))
            if number % 20 == 0:
                time.sleep(0.05)  # long enough that the readers go to sleep on their sockets
        ring.writer.send(b"stop")
        seen = {index: [] for index in range(3)}
        for _ in range(3 * len(lengths)):
            assert ring.results.poll(30_000), "a reader stopped answering"
            reply = ring.results.recv()
            seen[reply[0]].append((int.from_bytes(reply[1:9], "little"), int.from_bytes(reply[9:17], "little")))
    finally:
        ring.close()
    expected = list(enumerate(lengths))
    assert seen == {index: expected for index in range(3)}


def _check_every_byte(spec, index, address, results_address, delay_s):
    context, socket_, results = _connect(address, results_address)
    reader = RingReader(spec, index, socket_)
    number = 0
    while (received := reader.recv()) != b"stop":
        results.send(b"ok" if received == message(number, len(received)) else b"corrupt")
        number += 1
    context.destroy(linger=5000)
    os._exit(0)


def test_messages_arrive_intact_when_the_writer_runs_ahead():
    ring = Ring(2, target=_check_every_byte, max_bytes=4096, num_slots=2)
    try:
        for number in range(200):
            ring.writer.send(message(number, 16 + (number * 37) % 4000))
        ring.writer.send(b"stop")
        verdicts = []
        for _ in range(400):
            assert ring.results.poll(30_000)
            verdicts.append(ring.results.recv())
    finally:
        ring.close()
    assert set(verdicts) == {b"ok"}


def _die_after_one(spec, index, address, results_address, delay_s):
    _, socket_, _ = _connect(address, results_address)
    RingReader(spec, index, socket_).recv()
    os._exit(3)


def test_a_writer_waiting_on_a_dead_reader_says_so():
    ring = Ring(1, target=_die_after_one, num_slots=2)
    try:
        ring.writer.send(b"one")
        ring.processes[0].join(30)
        ring.writer.send(b"two")  # into the free slot
        ring.writer.send(b"three")  # into the slot of "one", which the reader took
        start = time.monotonic()
        with pytest.raises(RuntimeError, match="reader0 is gone"):
            ring.writer.send(b"four")  # into the slot of "two", which nobody will take
        assert time.monotonic() - start < 5
    finally:
        ring.close()


def test_a_step_and_its_output_reach_the_ranks_and_come_back_unchanged():
    """Every field of the step contracts survives the executor's encoding (typed msgpack), so a rank runs the step the
    scheduler planned and the scheduler reads back what the rank produced."""
    from pagedserve.core.contracts import ModelRunnerOutput, NewRequestData, RunningRequestData, SchedulerOutput
    from pagedserve.core.step_time import StepShape
    from pagedserve.executor import rank_messages
    from pagedserve.outputs import LogprobsLists
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, seed=11, max_tokens=33, stop=["\n\n"],
                            logprobs=3, prompt_logprobs=2, repetition_penalty=1.1, n=1)
    step = SchedulerOutput(
        [NewRequestData("new", [1, 2, 3, 4], 3, params, [5, 6], 1, prompt_logprobs_start=1)],
        [RunningRequestData("old", [9], num_kept_blocks=2)], {"new": 3, "old": 1}, 4,
        finished_req_ids={"gone"}, preempted_req_ids={"bumped"}, shape=StepShape(1, 3, 17.5),
        last_token_ids={"old": (7, 42)}, drafts_to_verify={"old": [3, 4]}, propose_for={"old"},
    )
    executor, rank = rank_messages.ExecutorCodec(), rank_messages.RankCodec()
    assert rank.decode(executor.encode_step(step)) == ("step", step)
    output = ModelRunnerOutput({"old": 5}, logprobs={"old": LogprobsLists([[5, 6]], [[-0.25, -1.5]], [1])},
                               prompt_logprobs={"new": LogprobsLists([[2], [3]], [[-2.0], [-0.125]], [4, 1])},
                               accepted_token_ids={"old": [3]}, proposed_drafts={"old": [8, 9]})
    assert executor.decode_step_output(rank.encode_step_output(output)) == output
    assert rank_messages.decode_reply(rank_messages.encode_reply("call", 1, {"any": object.__name__})) == (
        "call", 1, {"any": "object"})
    assert rank.decode(rank_messages.SHUTDOWN) == ("shutdown", None)


def test_sampled_tokens_read_back_as_the_map_sent():
    """The executor's end hands on the tokens sampled back as their columns: walked, looked up, tested for membership
    and counted, they read as the runner's map did, in its order."""
    from pagedserve.core.contracts import ModelRunnerOutput
    from pagedserve.executor import rank_messages

    executor, rank = rank_messages.ExecutorCodec(), rank_messages.RankCodec()
    for sampled in ({"b": 7, "a": 5}, {"b": 8, "a": 6}, {"c": 1}):
        received = executor.decode_step_output(rank.encode_step_output(ModelRunnerOutput(dict(sampled)))).sampled_token_ids
        assert list(received.items()) == list(sampled.items()) and list(received) == list(sampled)
        assert len(received) == len(sampled) and list(received.values()) == list(sampled.values())
        for request_id, token_id in sampled.items():
            assert request_id in received and received[request_id] == token_id and received.get(request_id) == token_id
        assert "gone" not in received and received.get("gone") is None and received.get("gone", -1) == -1
        with pytest.raises(KeyError):
            received["gone"]
        assert received == sampled


def test_steps_that_repeat_their_requests_decode_as_sent():
    """A step's request ids and token counts travel only when they differ from the previous step's, and the tokens
    sampled back name their requests only when those differ from the previous output's: every step and output in a
    run of steps that keep, change, reorder, grow and shrink their requests (calls between them) decodes as it was."""
    from pagedserve.core.contracts import ModelRunnerOutput, SchedulerOutput
    from pagedserve.executor import rank_messages

    batches = [{"a": 1, "b": 1}, {"a": 1, "b": 1}, {"a": 1, "b": 4}, {"a": 1, "b": 4}, {"b": 1, "a": 1},
               {"b": 1, "a": 1, "c": 9}, {"c": 1}, {}, {"c": 1}, {"c": 1}]
    executor, rank = rank_messages.ExecutorCodec(), rank_messages.RankCodec()
    sizes = []
    for index, scheduled in enumerate(batches):
        step = SchedulerOutput([], [], dict(scheduled), sum(scheduled.values()))
        frame = executor.encode_step(step)
        sizes.append(len(frame))
        assert rank.decode(frame) == ("step", step)
        assert rank.decode(rank_messages.encode_call(len, ([index],))) == ("call", (len, ([index],)))
        output = ModelRunnerOutput({request_id: 100 + index for request_id in scheduled})
        assert executor.decode_step_output(rank.encode_step_output(output)) == output
    assert sizes[1] < sizes[0] and sizes[3] < sizes[2]  # the repeated steps did not carry their columns again
