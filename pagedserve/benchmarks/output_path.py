"""What one step's outputs cost on their way to the clients, timed without an engine (for `bench sched`): the engine
core encodes the step's message; the front end decodes it, records the metrics and turns each output into its
request's output (detokenization, stop strings), as a server streaming every request does."""

from __future__ import annotations

import random
import time

from pagedserve.config import EngineConfig
from pagedserve.core.contracts import EngineCoreOutput
from pagedserve.engine.metrics import EngineMetrics
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.tokenizer import load_tokenizer
from pagedserve.engine.wire import EngineCoreOutputs, decode_output, encode_output
from pagedserve.executor.abstract import Executor
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

# Each stage's name in the record, and what it times.
STAGES = {"encode": "the core encodes", "decode": "the front end decodes", "metrics": "metrics",
          "output_processor": "detokenized into request outputs"}

# Text the requests "generate", token by token, each from its own offset: real tokens of the model's vocabulary.
_TEXT = ("The quick brown fox jumps over the lazy dog, then runs into the forest to look for food; "
         "meanwhile the dog sleeps in the sun until the evening comes. ") * 20


def time_output_path(model: str, num_requests: int, steps: int, seed: int = 0) -> dict[str, list[float]]:
    """Seconds each stage takes, each of steps times, for a step that brings one new token to each of num_requests
    streaming requests; the model's tokenizer detokenizes."""
    tokenizer = load_tokenizer(Executor.model_dir(EngineConfig(model=model)))
    rng = random.Random(seed)
    processor, metrics = OutputProcessor(tokenizer), EngineMetrics(model)
    params = SamplingParams(max_tokens=steps + 1, output_kind=RequestOutputKind.DELTA)
    request_ids = [f"request-{index}" for index in range(num_requests)]
    for request_id in request_ids:
        processor.add_request(request_id, None, [rng.randrange(100, tokenizer.vocab_size) for _ in range(128)], params, [request_id])
        metrics.request_added(request_id, time.monotonic(), 128)
    text_ids = tokenizer.encode(_TEXT)
    durations: dict[str, list[float]] = {stage: [] for stage in STAGES}
    for step in range(steps):
        message = EngineCoreOutputs([EngineCoreOutput(request_id, [text_ids[(step + index) % len(text_ids)]])
                                     for index, request_id in enumerate(request_ids)])
        start = time.perf_counter()
        frame = encode_output(message)
        encoded = time.perf_counter()
        outputs = decode_output(frame).outputs
        decoded = time.perf_counter()
        metrics.record_outputs(outputs, None, time.monotonic())
        recorded = time.perf_counter()
        processor.process_outputs(outputs)
        done = time.perf_counter()
        for stage, seconds in zip(STAGES, (encoded - start, decoded - encoded, recorded - decoded, done - recorded)):
            durations[stage].append(seconds)
    return durations
