"""OutputProcessor: engine-core outputs -> RequestOutputs (text, stop strings, logprobs, n samples), or an embedding
model's EmbeddingRequestOutputs."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedserve.core.contracts import EngineCoreOutput
from pagedserve.engine import plain_outputs
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.plain_outputs import RequestFields, SampleFields
from pagedserve.engine.token_texts import TokenTexts
from pagedserve.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    LogprobsLists,
    PositionLogprobs,
    RequestOutput,
)
from pagedserve.sampling_params import RequestOutputKind, SamplingParams

# Read for every output of every step: an enum member's attribute lookup costs more than a module global's.
_FINAL_ONLY, _DELTA = RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA


class SampleState(SampleFields):  # the fields the C path reads as C fields: plain_outputs.py
    def __init__(self, index: int, detokenizer: IncrementalDetokenizer, logprobs: list[PositionLogprobs] | None,
                 cumulative_logprob: float | None, plain_mode: int) -> None:
        self.index = index
        self.detokenizer = detokenizer
        self.logprobs = logprobs
        self.cumulative_logprob = cumulative_logprob
        self.plain_mode = plain_mode  # plain_outputs.plain_mode: whether (and how) its outputs may take the C path
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.sent_tokens = 0
        self.sent_logprobs = 0


class RequestState(RequestFields):  # the fields the C path reads as C fields: plain_outputs.py
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                 samples: dict[str, SampleState], prompt_logprobs: list[PositionLogprobs | None] | None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.samples = samples  # engine request id -> sample
        self.prompt_logprobs = prompt_logprobs
        self.num_cached_tokens = 0
        self.prompt_logprobs_sent = False
        self.kv_transfer_params: dict | None = None  # with a KV connector: what the request's KV transfer tells the client
        self.pooled: bytes | None = None  # runner pooling: the prompt's vector

    @property
    def finished(self) -> bool:
        for sample in self.samples.values():  # a loop, not all() over a generator: asked of every output of every step
            if sample.finish_reason is None:
                return False
        return True


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput | EmbeddingRequestOutput]
    reqs_to_abort: list[str]  # engine requests that hit a stop string: the core must stop them


class OutputProcessor:
    def __init__(self, tokenizer, plain_path: bool = True) -> None:
        """plain_path: the plainest outputs on the C path where it is built (plain_outputs.py); False: all on Python's."""
        self.tokenizer = tokenizer
        self.plain_path = plain_outputs.process if plain_path else None
        self.token_texts = TokenTexts(tokenizer)
        self.token_texts.table(skip_special_tokens=SamplingParams.skip_special_tokens)  # the default's, made before any request waits on it
        self.request_states: dict[str, RequestState] = {}
        # engine request id -> its request and sample: one lookup for each output of each step
        self.engine_samples: dict[str, tuple[RequestState, SampleState]] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    engine_ids: list[str]) -> None:
        """engine_ids: the engine requests of its samples, in sample order."""
        if request_id in self.request_states:
            raise ValueError(f"request_id {request_id!r} is already in use by a running request")
        table = self.token_texts.table(params.skip_special_tokens)
        # The C path knows one sample's text and tokens, with no logprobs or stop strings, its tokens' texts looked up.
        plain = (len(engine_ids) == 1 and params.logprobs is None and params.prompt_logprobs is None and not params.stop
                 and table is not None)
        samples = {
            engine_id: SampleState(
                index=index,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params, table),
                logprobs=[] if params.logprobs is not None else None,
                cumulative_logprob=0.0 if params.logprobs is not None else None,
                plain_mode=plain_outputs.plain_mode(params.output_kind, plain),
            )
            for index, engine_id in enumerate(engine_ids)
        }
        state = self.request_states[request_id] = RequestState(
            request_id, prompt, prompt_token_ids, params, samples,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        for engine_id, sample in samples.items():
            self.engine_samples[engine_id] = (state, sample)

    def engine_ids(self, request_id: str) -> list[str]:
        state = self.request_states.get(request_id)
        return list(state.samples) if state else []

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Mark every unfinished sample aborted; returns the final output, or None if unknown."""
        state = self.request_states.get(request_id)
        if state is None:
            return None
        for sample in state.samples.values():
            if sample.finish_reason is None:
                sample.finish_reason = "abort"
        output = self._make_output(state, True, state.samples.values())
        self._forget(state)
        return output

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        request_outputs: list[RequestOutput | EmbeddingRequestOutput] = []
        reqs_to_abort: list[str] = []
        gathered: dict[str, RequestState] = {}  # requests of several samples: one output with all their samples' news
        if self.plain_path is not None:
            self.plain_path(outputs, self.engine_samples, request_outputs, self._process, reqs_to_abort, gathered)
        else:
            engine_samples, process = self.engine_samples, self._process
            for output in outputs:
                entry = engine_samples.get(output.request_id)
                if entry is not None:  # else aborted in the front end while the step ran
                    process(entry[0], entry[1], output, request_outputs, reqs_to_abort, gathered)
        for state in gathered.values():
            self._report(state, state.finished, state.samples.values(), request_outputs)
        return ProcessedOutputs(request_outputs, reqs_to_abort)

    def _process(self, state: RequestState, sample: SampleState, output: EngineCoreOutput,
                 request_outputs: list[RequestOutput | EmbeddingRequestOutput], reqs_to_abort: list[str],
                 gathered: dict[str, RequestState]) -> None:
        """One output, on the Python path."""
        if self._apply(state, sample, output):
            reqs_to_abort.append(output.request_id)
        if len(state.samples) == 1:
            self._report(state, sample.finish_reason is not None, (sample,), request_outputs)
        else:
            gathered[state.request_id] = state

    def _report(self, state: RequestState, finished: bool, samples: Iterable[SampleState],
                request_outputs: list[RequestOutput | EmbeddingRequestOutput]) -> None:
        """Add the request's output of these samples if its kind reports one now; forget the request once finished."""
        result = self._make_output(state, finished, samples)
        if result is not None:
            request_outputs.append(result)
        if finished:
            self._forget(state)

    def _apply(self, state: RequestState, sample: SampleState, output: EngineCoreOutput) -> bool:
        """Fold one engine output into the sample; True if a stop string ended it here."""
        state.num_cached_tokens = output.num_cached_tokens
        if output.kv_transfer_params is not None:
            state.kv_transfer_params = output.kv_transfer_params
        if output.pooled is not None:
            state.pooled = output.pooled
        if output.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
            state.prompt_logprobs.extend(self._to_position_logprobs(output.new_prompt_logprobs))
        if output.new_logprobs is not None and sample.logprobs is not None:
            positions = self._to_position_logprobs(output.new_logprobs)
            sample.logprobs.extend(positions)
            sample.cumulative_logprob += sum(output.new_logprobs.logprobs[i][0] for i in range(len(positions)))
        stop_terminated = output.finish_reason == "stop" and not isinstance(output.stop_reason, str)
        stop_string = sample.detokenizer.update(output.new_token_ids, stop_terminated)
        if stop_string is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop_string
            if sample.logprobs is not None:  # positions after the stop string (tokens of one step) are not output
                dropped = sample.logprobs[len(sample.detokenizer.token_ids):]
                sample.cumulative_logprob -= sum(next(iter(position.values())).logprob for position in dropped)
                del sample.logprobs[len(sample.detokenizer.token_ids):]
            return output.finish_reason is None
        if output.finish_reason is not None:
            sample.finish_reason, sample.stop_reason = output.finish_reason, output.stop_reason
        return False

    def _to_position_logprobs(self, lists: LogprobsLists) -> list[PositionLogprobs]:
        positions = []
        for token_ids, logprobs, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
            entry: PositionLogprobs = {}
            for order, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
                if token_id in entry:
                    continue
                token_rank = rank if order == 0 else order
                entry[token_id] = Logprob(logprob, token_rank, self.tokenizer.convert_ids_to_tokens(token_id))
            positions.append(entry)
        return positions

    def _make_output(self, state: RequestState, finished: bool,
                     samples: Iterable[SampleState]) -> RequestOutput | EmbeddingRequestOutput | None:
        """samples: all the request's, in index order, or the one whose output came (of a request of one sample)."""
        if state.pooled is not None:
            return EmbeddingRequestOutput(state.request_id, state.prompt_token_ids, EmbeddingOutput(state.pooled),
                                          num_cached_tokens=state.num_cached_tokens)
        kind = state.params.output_kind
        if kind is _FINAL_ONLY and not finished:
            return None
        delta = kind is _DELTA
        completions = []
        for sample in samples:  # a loop, not a comprehension: one frame fewer for every output of every step
            completions.append(self._completion(sample, delta))
        prompt_logprobs = state.prompt_logprobs
        if delta and prompt_logprobs is not None:
            prompt_logprobs = None if state.prompt_logprobs_sent else prompt_logprobs
            state.prompt_logprobs_sent = state.prompt_logprobs_sent or len(state.prompt_logprobs) == len(state.prompt_token_ids)
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=completions,  # samples are kept in index order
            finished=finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            kv_transfer_params=state.kv_transfer_params,
        )

    def _completion(self, sample: SampleState, delta: bool) -> CompletionOutput:
        finished = sample.finish_reason is not None
        detok = sample.detokenizer
        text = detok.next_text(finished, delta)
        logprobs = sample.logprobs
        if delta:  # slices: copies already
            token_ids = detok.token_ids[sample.sent_tokens:]
            sample.sent_tokens = len(detok.token_ids)
            if logprobs is not None:
                logprobs = logprobs[sample.sent_logprobs:]
                sample.sent_logprobs = len(sample.logprobs)
        else:
            token_ids = list(detok.token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
        return CompletionOutput(
            index=sample.index,
            text=text,
            token_ids=token_ids,
            logprobs=logprobs,
            cumulative_logprob=sample.cumulative_logprob,
            finish_reason=sample.finish_reason,
            stop_reason=sample.stop_reason,
        )

    def _forget(self, state: RequestState) -> None:
        self.request_states.pop(state.request_id, None)
        for engine_id in state.samples:
            self.engine_samples.pop(engine_id, None)
