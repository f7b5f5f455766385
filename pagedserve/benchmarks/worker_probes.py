"""What the benchmarks run on every rank of an engine through its collective_rpc utility: functions of a Worker,
defined at module level so that they travel to worker processes by reference."""

from __future__ import annotations


def time_forward_passes(worker, num_seqs: int, seq_len: int, passes: int, context: int = 0) -> list[float]:
    """Seconds of each of `passes` bare forward passes on this rank (ModelRunner.time_forward_passes)."""
    return worker.model_runner.time_forward_passes(num_seqs, seq_len, passes, context)


def echo_step_output(worker, scheduler_output, reply):
    """A step's messages without the model: every rank receives the step, the output rank sends back its reply."""
    return reply if worker.is_output_rank else None
