"""The output processor's C path (engine/plain_outputs.py) takes the plainest outputs and gives what its Python path
gives, output for output, over steps that mix every kind of request and output; it keeps no references it should not;
without a compiler the Python path does all of it."""

import os
import random
import subprocess
import sys

import msgspec
import pytest

from pagedserve import SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.core.contracts import EngineCoreOutput
from pagedserve.engine import plain_outputs
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.engine.tokenizer import load_tokenizer
from pagedserve.executor.abstract import Executor
from pagedserve.outputs import LogprobsLists
from pagedserve.sampling_params import RequestOutputKind

# Words that tokenize into whole-character tokens, and text whose tokens split characters (decoded in context).
TEXT = (" The quick brown fox jumps over the lazy dog. naïve café — 世界 🙂 and emoji 👩‍💻 done; "
        "stop here, then go on <|im_end|> after the end")


def default_tokenizer():
    return load_tokenizer(Executor.model_dir(EngineConfig()))


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


def random_params(rng: random.Random) -> SamplingParams:
    """Plain requests most often, as a server's are; the rest ask for what only the Python path does."""
    extras = rng.choice(["plain", "plain", "plain", "n", "logprobs", "prompt_logprobs", "stop", "specials"])
    return SamplingParams(
        max_tokens=64,
        output_kind=rng.choice(list(RequestOutputKind)),
        n=2 if extras == "n" else 1,
        logprobs=2 if extras == "logprobs" else None,
        prompt_logprobs=1 if extras == "prompt_logprobs" else None,
        stop=["then go"] if extras == "stop" else [],
        skip_special_tokens=extras != "specials",
    )


def new_logprobs(rng: random.Random, tokens: list[int]) -> LogprobsLists:
    return LogprobsLists([[token, rng.randrange(1000), rng.randrange(1000)] for token in tokens],
                         [[-rng.random(), -1.0, -2.0] for _ in tokens], [rng.randrange(1, 5) for _ in tokens])


def scenario(tokenizer, seed: int, num_steps: int = 60):
    """Each step's outputs for a running mix of requests (some aborted in the front end, some finishing), as pairs of
    (what to do, its arguments); the same list drives both processors."""
    rng = random.Random(seed)
    text_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    events, running, next_id = [], {}, 0  # running: engine id -> [params, request id, tokens given, prompt length, start]
    for _ in range(num_steps):
        for _ in range(rng.randrange(3)):
            params, request_id = random_params(rng), f"request-{next_id}"
            next_id += 1
            engine_ids = [f"{request_id}-{index}" for index in range(params.n)] if params.n > 1 else [request_id]
            prompt_ids = [rng.randrange(100, tokenizer.vocab_size) for _ in range(rng.randrange(1, 12))]
            events.append(("add", (request_id, rng.choice([None, "a prompt"]), prompt_ids, params, engine_ids)))
            for engine_id in engine_ids:
                running[engine_id] = [params, request_id, 0, len(prompt_ids), rng.randrange(len(text_ids))]
        if running and rng.random() < 0.05:
            victim = rng.choice(list(running.values()))[1]
            events.append(("abort", (victim,)))
        outputs = []
        for engine_id, entry in list(running.items()):
            params, request_id, given, num_prompt, start = entry
            if rng.random() < 0.15:
                continue  # not scheduled this step
            count = rng.choice([1, 1, 1, 2, 3])  # speculative steps bring several
            tokens = [text_ids[(start + given + offset) % len(text_ids)] for offset in range(count)]
            entry[2] += count
            finish = rng.choice([None] * 12 + ["length", "stop"])
            output = EngineCoreOutput(engine_id, tokens, num_cached_tokens=rng.choice([0, 0, 16]),
                                      kv_transfer_params={"step": given} if rng.random() < 0.05 else None)
            if params.logprobs is not None:
                output.new_logprobs = new_logprobs(rng, tokens)
            if params.prompt_logprobs is not None and given == 0:
                output.new_prompt_logprobs = new_logprobs(rng, [1] * (num_prompt - 1))
            if finish is not None:
                output.finish_reason = finish
                output.stop_reason = tokens[-1] if finish == "stop" else None
                output.kv_transfer_params = {"remote": engine_id} if rng.random() < 0.3 else output.kv_transfer_params
                del running[engine_id]
            outputs.append(output)
        rng.shuffle(outputs)
        if rng.random() < 0.1:
            outputs.append(EngineCoreOutput("request-unknown", [text_ids[0]]))
        events.append(("step", (outputs,)))
    return events


def run(tokenizer, events, plain_path: bool):
    """What the processor returns for each event; and how many outputs its Python path took."""
    processor = OutputProcessor(tokenizer, plain_path=plain_path)
    python_path = processor._process
    taken = []

    def counted(*args):
        taken.append(args[2].request_id)
        return python_path(*args)

    processor._process = counted
    results = []
    for kind, args in events:
        if kind == "add":
            processor.add_request(*args)
        elif kind == "abort":
            results.append(processor.abort_request(*args))
        else:
            results.append(processor.process_outputs([msgspec.structs.replace(output) for output in args[0]]))
    return results, len(taken)


def test_the_c_path_is_built_where_a_compiler_is():
    assert plain_outputs.process is not None


@pytest.mark.parametrize("seed", range(6))
def test_the_c_path_gives_what_the_python_path_gives(tokenizer, seed):
    events = scenario(tokenizer, seed)
    expected, python_took = run(tokenizer, events, plain_path=False)
    actual, c_path_left = run(tokenizer, events, plain_path=True)
    assert actual == expected
    assert 0 < c_path_left < python_took  # outputs took both paths


def test_the_c_path_keeps_no_reference_to_what_it_read_or_made(tokenizer):
    token = int(str(tokenizer.encode(" fox", add_special_tokens=False)[0]))  # an int object of its own
    request_id, prompt_ids = "request-" + "leak", [11, 12, 13]
    before = sys.getrefcount(token), sys.getrefcount(request_id), sys.getrefcount(prompt_ids)
    processor = OutputProcessor(tokenizer, plain_path=True)
    python_path, python_took = processor._process, []
    processor._process = lambda *args: python_took.append(args[2]) or python_path(*args)
    params = SamplingParams(max_tokens=400, output_kind=RequestOutputKind.DELTA)
    processor.add_request(request_id, None, prompt_ids, params, [request_id])
    for _ in range(300):
        processed = processor.process_outputs([EngineCoreOutput(request_id, [token, token])])
        assert processed.request_outputs[0].outputs[0].token_ids == [token, token]
    processed = processor.process_outputs([EngineCoreOutput(request_id, [token], finish_reason="length")])
    assert processed.request_outputs[0].finished and not processor.has_unfinished_requests()
    # The first output (decoded after the prompt's last tokens) and the last (which finishes): the rest took the C path.
    assert len(python_took) == 2
    python_took.clear()
    del processed, processor
    assert (sys.getrefcount(token), sys.getrefcount(request_id), sys.getrefcount(prompt_ids)) == before


def test_without_a_compiler_the_python_path_gives_the_same_outputs(tokenizer):
    events = scenario(tokenizer, seed=0, num_steps=20)
    expected, _ = run(tokenizer, events, plain_path=True)
    program = ("import sys, msgspec; from tests import test_output_processor as t; from pagedserve.engine import plain_outputs\n"
               "assert plain_outputs.process is None\n"
               "tokenizer = t.default_tokenizer()\n"
               "results, _ = t.run(tokenizer, t.scenario(tokenizer, seed=0, num_steps=20), plain_path=True)\n"
               "sys.stdout.buffer.write(msgspec.json.encode(results))\n")
    env = {**os.environ, "CC": "false"}  # a compiler that fails every build: the build is keyed by its compiler
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, env=env, cwd=os.getcwd(), timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert "the output processor's C path unavailable" in done.stderr.decode()
    assert done.stdout == msgspec.json.encode(expected)
