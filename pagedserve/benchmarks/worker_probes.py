"""What the benchmarks run on every rank of an engine through its collective_rpc utility: functions of a Worker,
defined at module level so that they travel to worker processes by reference."""

from __future__ import annotations


def time_forward_passes(worker, num_seqs: int, seq_len: int, passes: int, context: int = 0) -> list[float]:
    """Seconds of each of `passes` bare forward passes on this rank (ModelRunner.time_forward_passes)."""
    return worker.model_runner.time_forward_passes(num_seqs, seq_len, passes, context)


def answer_steps_with(worker, reply) -> None:
    """Until run_steps_on_the_model: this rank's steps skip the model, and each returns `reply` (what the output rank
    sends back), so that a step's messages are timed alone."""
    worker.execute_model = lambda scheduler_output: reply


def run_steps_on_the_model(worker) -> None:
    worker.__dict__.pop("execute_model", None)
