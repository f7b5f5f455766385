"""The time bound on a step's prompt work while streams decode (max_decode_stall; stall-free scheduling, after
Sarathi-Serve): two models of step times, fit to the steps the engine runs, say how many prompt tokens fit in a
step before the streams it carries wait longer than the limit allows."""

from __future__ import annotations

from pagedserve.config import DecodeStallLimit
from pagedserve.core.step_time import ExpertRouting, ShapeTally, StepShape, StepTimeModel
from pagedserve.request import Request

# The share of a step's time limit that is planned: the step-time model's prediction of one step errs either way,
# and a plan at the limit overshoots it about half the time.
PLANNING_MARGIN = 0.9
# Decode-only steps seen before their own model is the yardstick (until then, the model over all steps).
_MIN_DECODE_ONLY_STEPS = 3


class PrefillAllowance:
    """The seconds of prompt work a step may still take on while streams decode. The first chunk of a step
    always gets min_tokens, so prompts progress however tight the limit."""

    def __init__(self, model: StepTimeModel, seconds: float, min_tokens: int, limit_seconds: float = float("inf"),
                 step_tokens: int = 0) -> None:
        self.model = model
        self.limit_seconds = limit_seconds  # the step's whole time limit, decodes included (seconds: what is left of it)
        self.seconds = seconds
        self.min_tokens = min_tokens
        self.step_tokens = step_tokens  # the tokens the step carries so far: its decodes, then the chunks granted
        self.granted = False

    def take(self, num_tokens: int, context_len: int) -> int:
        """How many of num_tokens prompt tokens after context_len fit; they are then spent."""
        allowed = self.model.max_chunk(self.seconds, context_len, num_tokens, self.step_tokens)
        if allowed == 0 and not self.granted:
            allowed = min(num_tokens, self.min_tokens)
        if allowed:
            self.seconds -= self.model.prefill_cost(allowed, context_len, self.step_tokens)
            self.step_tokens += allowed
            self.granted = True
        return allowed


class DecodeStallBound:
    """Two step-time models: one over all steps, which prices prompt chunks, and one over decode-only steps, the
    yardstick a stall is measured against (the fit over all steps is dominated by the steps with prompts)."""

    def __init__(self, limit: DecodeStallLimit | None, min_chunk_tokens: int, experts: ExpertRouting | None = None) -> None:
        self.limit = limit
        self.min_chunk_tokens = min_chunk_tokens
        self.step_time = StepTimeModel(experts=experts)
        self.decode_step_time = StepTimeModel(experts=experts)
        self._num_steps = 0  # steps planned so far (step_planned)
        # The latest came_after_step a request got: whether the streams decoding flowed before the newest prompts came
        # (the bound keeps those steady) or came in one burst with them. The engine takes its input between steps, so
        # a request that came after step N was planned came while N ran: a stream whose prompt N finished had no
        # token out yet when it came.
        self._newest_came_after_step = 0
        # Whether a running request may have prompt tokens left: after a step that reached every running request,
        # only one whose chunk stopped short of its known tokens has (a decode gains one token for the one computed;
        # a request that waited comes through the waiting queue). Spares every step of a busy engine the scan.
        self._prompt_may_be_left = True

    def came_to_wait(self, request: Request) -> None:
        """A request waits from now on (it arrived, or was preempted), after the steps planned so far."""
        request.came_after_step = self._newest_came_after_step = self._num_steps

    def step_planned(self, prompt_chunks: list[tuple[str, int, int, int]], requests: dict[str, Request],
                     reached_every_running: bool) -> None:
        """A step was planned with these prompt chunks (SchedulerOutput.prompt_chunks): a request whose known tokens
        one of them finishes decodes after it. reached_every_running: every running request has a part in it."""
        self._num_steps += 1
        prompt_may_be_left = not reached_every_running
        for request_id, start, num_tokens, num_tokens_known in prompt_chunks:
            if start + num_tokens == num_tokens_known:
                requests[request_id].prompt_done_step = self._num_steps
            else:
                prompt_may_be_left = True
        self._prompt_may_be_left = prompt_may_be_left

    def observe(self, shape: StepShape, seconds: float) -> None:
        """How long a step of this shape took."""
        if shape.decode_tokens or shape.prefill_tokens:
            self.step_time.observe(shape, seconds)
        if shape.decode_tokens and not shape.prefill_tokens:
            self.decode_step_time.observe(shape, seconds)

    def allowance(self, running: list[Request], num_waiting: int, max_num_seqs: int) -> PrefillAllowance | None:
        """What bounds the next step's prompt work in time: None when nothing does (no limit set, the model not yet
        fit, no request decoding, so that no stream waits for the prompts, no prompt to bound, or a burst: at least as
        many requests waiting to join as streams that flowed before the newest of them came, a token of theirs out by then;
        streams whose prompts went in the same burst's steps are not kept steady against it)."""
        if self.limit is None or not self.step_time.ready:
            return None
        # Prompt work: a waiting request that may join, or a running one with prompt tokens left. Most steps of a
        # busy engine have none, and they pay only for this look.
        num_running = len(running)
        if not (num_waiting > 0 and num_running < max_num_seqs) and not (self._prompt_may_be_left and _any_prompt_left(running)):
            return None
        num_decoding, num_flowing_before, sum_of_context_lens = 0, 0, 0
        newest_came_after_step = self._newest_came_after_step
        for request in running:
            num_computed_tokens = request.num_computed_tokens
            if len(request.all_token_ids) - num_computed_tokens == 1:
                num_decoding += 1
                sum_of_context_lens += num_computed_tokens
                if request.prompt_done_step < newest_came_after_step:
                    num_flowing_before += 1
        # In a burst, one long step stalls the few streams decoding once and spares as many or more prompts a wait of
        # many bounded steps (each stream's single long gap stays out of its gaps' tail); the bound keeps streams
        # steady against the prompts that trickle in while they decode. Streams that arrived with the prompts (their
        # own prompts went first) are the burst's too: bounding for them would make the burst's last prompts wait
        # through many bounded steps for the sake of its first (they take one long gap instead of several shorter ones).
        if not num_decoding or min(num_waiting, max_num_seqs - num_running) >= num_flowing_before:
            return None
        decoding = ShapeTally()
        decoding.add_decodes(num_decoding, sum_of_context_lens)
        decode_only = self._decode_only_seconds(decoding.shape())
        # The decode-only step of the batch these prompts are joining, not of the few streams that may be
        # decoding when they arrive: the waiting requests decode too, as soon as their prompts are in.
        batch = min(num_running + num_waiting, max_num_seqs)
        joined = StepShape(batch, 0, decoding.attention_pairs * batch / decoding.decode_tokens)
        target = self.limit.limit(self._decode_only_seconds(joined))
        return PrefillAllowance(self.step_time, PLANNING_MARGIN * target - decode_only, self.min_chunk_tokens, target,
                                decoding.decode_tokens)

    def _decode_only_seconds(self, shape: StepShape) -> float:
        enough = self.decode_step_time.num_observations >= _MIN_DECODE_ONLY_STEPS
        return (self.decode_step_time if enough else self.step_time).predict(shape)


def _any_prompt_left(running: list[Request]) -> bool:
    for request in running:
        if len(request.all_token_ids) - request.num_computed_tokens > 1:
            return True
    return False
