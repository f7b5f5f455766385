"""Model runner: keeps the requests' token state, runs the model on one flat batch, samples."""

from __future__ import annotations

import logging
import time

import torch

from pagedserve.core.contracts import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from pagedserve.distributed.parallel_state import expert_groups, rank_info, receive_from_previous_stage, send_to_next_stage
from pagedserve.executor.input_batch import ModelInputs, RunnerRequests, RunnerRequestState, dummy_layout, prepare_inputs
from pagedserve.executor.lora_manager import LoRAManager
from pagedserve.executor.pooler import StepPooler
from pagedserve.executor.sampling_inputs import SamplingInputs
from pagedserve.host_memory import FRESH_PAGES_ABOVE_BYTES
from pagedserve.kv_transfer.base import KVConnectorWorker
from pagedserve.layers.attention import AttentionBackend
from pagedserve.layers.fused_moe import FusedMoE
from pagedserve.layers.lora import StepAdapters, adapters_for_step
from pagedserve.layers.sampler import Sampler, apply_token_bitmask_, gather_logprobs
from pagedserve.layers.sampling_rule import DrawKeys
from pagedserve.outputs import LogprobsLists
from pagedserve.pooling import PoolerConfig
from pagedserve.sampling_params import SamplingParams
from pagedserve.spec_decode.draft_model import DraftModelProposer
from pagedserve.spec_decode.proposer import DraftInput, Proposer
from pagedserve.spec_decode.rejection_sampler import verify

logger = logging.getLogger(__name__)


# (sequences, new tokens each, context): decodes of a few batch sizes and a short prompt's prefill, the steps a server
# meets first; and, for the step-time model only, a long context's decodes (so that it can tell attention from
# per-token costs) and a longer prefill. Their times seed the scheduler's model of step times.
WARM_UP_FIRST_SHAPES = ((1, 1, 0), (8, 1, 64), (32, 1, 64), (1, 64, 0))
WARM_UP_FIT_SHAPES = ((8, 1, 1024), (2, 128, 0))
# Timed passes of each shape, of which the fastest is kept: the warm-up runs while the rest of the server starts, a pass
# that shares the cores with that (or with any other process) is slower than the steps after it, and the stored timings
# seed every later start.
WARM_UP_TIMED_PASSES = 3


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int, device: torch.device, seed: int,
                 attn_backend: AttentionBackend, cpu_kernels=None, proposer: Proposer | None = None,
                 pooler: PoolerConfig | None = None) -> None:
        """pooler: the engine serves embeddings (runner pooling): each prompt's vector (a classification model's logits
        of it) instead of sampled tokens."""
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.attn_backend = attn_backend
        self.model_dtype = next(model.parameters()).dtype
        self.sampler = Sampler(cpu_kernels if device.type == "cpu" else None)
        self.draw_keys = DrawKeys(seed)
        self.sampling_inputs = SamplingInputs(device, self.draw_keys)
        self.requests = RunnerRequests()
        self.lora_manager: LoRAManager | None = None  # set by the worker where LoRA adapters are enabled
        self.kv_connector: KVConnectorWorker | None = None  # set by the worker where a KV connector is configured
        self.proposer = proposer  # speculative decoding: drafts tokens after each step
        self.pooler = None
        if pooler is not None:
            self.pooler = StepPooler(pooler, model.classify if getattr(model, "score", None) is not None else None)
        # Expert parallelism over data-parallel cores: the mixture layers, which join the other cores' steps even in a
        # step without tokens here.
        self.steps_with_other_cores: list[FusedMoE] = []
        # A draft model's distributions behind each request's pending drafts (sampled requests only).
        self._draft_probabilities: dict[str, torch.Tensor] = {}
        self._logits_buffer: torch.Tensor | None = None  # see _logits_out

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        transfers = scheduler_output.kv_connector_metadata if self.kv_connector is not None else None
        if transfers is not None and transfers.acts_before_forward:  # in a step without tokens too: holds, releases, pulls
            self.kv_connector.start_load_kv(transfers)
        if scheduler_output.is_empty:
            if self.steps_with_other_cores:
                expert_groups().begin_pass(0)
                for layer in self.steps_with_other_cores:
                    layer.join_without_tokens()
            return ModelRunnerOutput(sampled_token_ids={})
        lora_manager = self.lora_manager
        inputs = prepare_inputs(self.requests, scheduler_output.num_scheduled_tokens, self.block_size, self.attn_backend, self.device,
                                with_adapters=lora_manager is not None)
        step_adapters = None
        if inputs.adapters:
            lora_manager.prepare_step(inputs.adapters)
            step_adapters = StepAdapters.of(inputs.adapter_segments)
        groups = expert_groups()
        waited_before = groups.waited_s if groups is not None else 0.0
        with adapters_for_step(step_adapters):
            hidden_states = self._forward(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        if transfers is not None and transfers.saves:
            self.kv_connector.wait_for_save(transfers)
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.follow(inputs.input_ids, inputs.positions, inputs.attn_metadata)
        output = ModelRunnerOutput(sampled_token_ids={})
        if groups is not None:
            output.waited_for_other_cores_s = groups.waited_s - waited_before
        if hidden_states is not None and self.pooler is not None:
            output.pooled = self.pooler.pool(inputs, hidden_states, lambda request_id: self.requests[request_id].num_prompt_tokens)
        elif hidden_states is not None and inputs.sampling_req_ids:
            self._sample(inputs, hidden_states, output, scheduler_output.grammar_bitmask)
        if hidden_states is not None and inputs.prompt_logprobs:
            self._prompt_logprobs(inputs, hidden_states, output)
        self.requests.advance(scheduler_output.num_scheduled_tokens)
        for request_id in scheduler_output.drafts_to_verify:  # K/V stands for the verified tokens only
            self.requests.set_num_computed(request_id, len(self.requests[request_id].token_ids) - 1)
        if scheduler_output.propose_for and self.proposer is not None:
            self._propose(scheduler_output.propose_for, output)
        return output

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor | None:
        """This stage's part of the forward pass: the final hidden states on the last (or only) stage; on the
        others None, their output having gone to the next stage."""
        stage = rank_info()
        groups = expert_groups()
        if groups is not None:  # expert parallelism over data-parallel cores: the cores' token counts, once a pass
            groups.begin_pass(input_ids.shape[0])
        intermediate = None
        if not stage.is_first_stage:  # the previous stage's hidden states and residual, for these tokens
            shape = (input_ids.shape[0], self.model.config.hidden_size)
            intermediate = tuple(receive_from_previous_stage([shape, shape], self.model_dtype, self.device))
        hidden_states = self.model(input_ids, positions, self.kv_caches, meta, intermediate)
        if stage.is_last_stage:
            return hidden_states
        send_to_next_stage(list(hidden_states))
        return None

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in (*scheduler_output.finished_req_ids, *scheduler_output.preempted_req_ids):
            self.requests.remove(request_id)
            self._draft_probabilities.pop(request_id, None)
            if self.pooler is not None:
                self.pooler.forget(request_id)
        for new in scheduler_output.scheduled_new_reqs:
            self.requests.add(RunnerRequestState(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                prompt_logprobs_start=new.prompt_logprobs_start,
                lora_request=new.lora_request,
            ), new.num_computed_tokens)
        for running in scheduler_output.scheduled_running_reqs:
            # Fewer kept blocks than held: the scheduler took back blocks that only rejected drafts used.
            self.requests.add_blocks(running.request_id, running.new_block_ids, running.num_kept_blocks)
        for request_id, drafts in scheduler_output.drafts_to_verify.items():
            state = self.requests[request_id]
            self.requests.extend_tokens(state, drafts)
            state.num_drafts = len(drafts)
        # Tokens sampled on another pipeline stage, which this stage's runner did not sample itself.
        for request_id, (index, token_id) in scheduler_output.last_token_ids.items():
            state = self.requests[request_id]
            if len(state.token_ids) == index:
                self.requests.extend_tokens(state, [token_id])

    @torch.inference_mode()
    def warm_up(self, max_model_len: int, timed: bool = True) -> list[tuple[int, int, int, float]]:
        """Run the first shapes a server meets and both sampling paths, so the first requests do not pay one-time
        costs (kernel set-up for new GEMM shapes, first touches of buffers). Timed: every shape once more than
        WARM_UP_TIMED_PASSES (the first run pays those costs), and (sequences, new tokens each, context, seconds) of the
        fastest of the others returned.
        K/V land in the first blocks, which hold nothing yet."""
        timings = []
        num_blocks = self.kv_caches[0].shape[1]
        for num_seqs, seq_len, context in WARM_UP_FIRST_SHAPES + (WARM_UP_FIT_SHAPES if timed else ()):
            if num_seqs * -(-(context + seq_len) // self.block_size) > num_blocks or context + seq_len > max_model_len:
                continue  # a cache or a context too small for this shape (tests shrink them)
            seconds = self.time_forward_passes(num_seqs, seq_len, 1 + WARM_UP_TIMED_PASSES if timed else 1, context)
            timings.append((num_seqs, seq_len, context, min(seconds[1:], default=seconds[0])))
        hidden = self._forward(*self._dummy_inputs(2, 1, 0),
                               self.attn_backend.build_metadata(dummy_layout(2, 1, 0, self.block_size), self.device))
        if hidden is not None and self.model.lm_head is not None:
            params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=0)]
            states = [RunnerRequestState(f"warm-up-{i}", [1], 1, p, [0]) for i, p in enumerate(params)]
            self.sampler(self.model.compute_logits(hidden), self.sampling_inputs.metadata(states))
        return timings if timed else []

    def _dummy_inputs(self, num_seqs: int, seq_len: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
        # The same ids on every rank: tensor-parallel ranks each embed their share of them.
        ids = torch.randint(0, min(1000, self.model.config.vocab_size), (num_seqs * seq_len,), generator=torch.Generator().manual_seed(0))
        input_ids = ids.to(self.device)
        positions = (context + torch.arange(seq_len, device=self.device)).repeat(num_seqs)
        return input_ids, positions

    @torch.inference_mode()
    def time_forward_passes(self, num_seqs: int, seq_len: int, passes: int, context: int = 0) -> list[float]:
        """Seconds of each of `passes` bare forward passes (no scheduler, no sampling) over num_seqs
        sequences of seq_len new tokens after `context` tokens, logits at each sequence's last token.
        seq_len 1 runs as decodes run, longer ones as prefill chunks, through this engine's attention
        backend. It writes K/V into blocks from 0 up: the caller makes sure no request holds them."""
        meta = self.attn_backend.build_metadata(dummy_layout(num_seqs, seq_len, context, self.block_size), self.device)
        input_ids, positions = self._dummy_inputs(num_seqs, seq_len, context)
        seconds = []
        for _ in range(passes):
            start = time.perf_counter()
            hidden = self._forward(input_ids, positions, meta)
            if hidden is not None and self.model.lm_head is not None:
                self.model.compute_logits(hidden[seq_len - 1 :: seq_len])
            seconds.append(time.perf_counter() - start)
        return seconds

    def _sample(self, inputs: ModelInputs, hidden_states: torch.Tensor, output: ModelRunnerOutput,
                grammar_bitmask: GrammarBitmask | None = None) -> None:
        states = self.requests.of(inputs.sampling_req_ids)
        logits = self.model.compute_logits(hidden_states[inputs.logits_indices], self._logits_out(len(inputs.logits_indices)))
        if grammar_bitmask is not None:
            self._apply_grammar_bitmask(states, logits, grammar_bitmask)
        if not any(state.num_drafts for state in states):
            self._sample_rows(states, logits, output, request_ids=inputs.sampling_req_ids)
            return
        plain_states, plain_rows, row = [], [], 0
        for state in states:
            num_rows = state.num_drafts + 1
            if state.num_drafts:
                self._verify(state, logits[row : row + num_rows], output)
            else:
                plain_states.append(state)
                plain_rows.append(row)
            row += num_rows
        if plain_states:
            self._sample_rows(plain_states, logits[plain_rows], output)

    def _logits_out(self, rows: int) -> torch.Tensor | None:
        """Where a step's logits of this many rows go: on CPU, logits too large for the memory the allocator keeps
        (FRESH_PAGES_ABOVE_BYTES) go into one tensor kept across steps, made anew only for more rows than it holds;
        others, and the tensor-parallel ranks' (gathered into a new tensor), into a new one. Nothing reads a step's
        logits once it has sampled."""
        width = self.model.config.vocab_size
        if self.device.type != "cpu" or rank_info().tp_size > 1 or rows * width * 4 <= FRESH_PAGES_ABOVE_BYTES:
            return None
        if self._logits_buffer is None or self._logits_buffer.shape[0] < rows:
            self._logits_buffer = torch.empty(rows, width, dtype=torch.float32, device=self.device)
        return self._logits_buffer[:rows]

    def _apply_grammar_bitmask(self, states: list[RunnerRequestState], logits: torch.Tensor, grammar_bitmask: GrammarBitmask) -> None:
        """Structured outputs: the tokens its grammar forbids at each position a constrained request samples (its last
        known token's and each draft's) get -inf, before penalties, verification and sampling see the logits."""
        first_row, row = {}, 0
        for state in states:  # a request's logits rows: one, or one per draft and one after them
            first_row[state.request_id] = row
            row += state.num_drafts + 1
        rows = [first_row[request_id] + offset for request_id in grammar_bitmask.request_ids
                for offset in range(self.requests[request_id].num_drafts + 1)]
        bitmask = torch.frombuffer(bytearray(grammar_bitmask.rows), dtype=torch.int32).view(len(rows), grammar_bitmask.words_per_row)
        apply_token_bitmask_(logits, bitmask, torch.tensor(rows, dtype=torch.long), self.sampler.cpu_kernels)

    def _verify(self, state: RunnerRequestState, logits: torch.Tensor, output: ModelRunnerOutput) -> None:
        """Accept a prefix of the request's drafts and draw the token after it, from the target's logits after
        the last known token and after each draft (rejection_sampler.py)."""
        num_drafts, params = state.num_drafts, state.sampling_params
        drafts = state.token_ids[-num_drafts:]
        self.requests.truncate_tokens(state, len(state.token_ids) - num_drafts)
        state.num_drafts = 0
        processed = logits.float()
        if params.edits_logits or state.num_output_tokens < params.min_tokens:
            # Row i is scored as if drafts[:i] had been sampled: penalties and min_tokens see them.
            rows = [RunnerRequestState(state.request_id, state.token_ids + drafts[:i], state.num_prompt_tokens, params, [])
                    for i in range(num_drafts + 1)]
            # On a copy: the penalties act in place, and the logprobs below are the raw logits'.
            processed = self.sampler.process_logits(processed.clone(), self.sampling_inputs.metadata(rows, for_draws=False))
        draft_probabilities = self._draft_probabilities.pop(state.request_id, None)
        if draft_probabilities is not None:
            draft_probabilities = draft_probabilities[:num_drafts]
        keys = self.draw_keys.of(params.seed, state.num_output_tokens, num_drafts + 1)
        result = verify(processed, drafts, params, keys, draft_probabilities, self.sampler.cpu_kernels)
        emitted = [*result.accepted, result.token_id]
        if params.logprobs is not None:
            raw_logprobs = torch.log_softmax(logits[: len(emitted)].float(), dim=-1)
            chosen = torch.tensor(emitted, dtype=torch.long, device=raw_logprobs.device)
            rows = gather_logprobs(raw_logprobs, chosen, [params.logprobs] * len(emitted))
            output.logprobs[state.request_id] = LogprobsLists.concat(rows)
        self.requests.extend_tokens(state, emitted)
        output.sampled_token_ids[state.request_id] = result.token_id
        output.accepted_token_ids[state.request_id] = result.accepted

    def _propose(self, request_ids: set[str], output: ModelRunnerOutput) -> None:
        """Drafts for the next step, for the requests that sampled now and may speculate."""
        states = [self.requests[rid] for rid in request_ids if rid in output.sampled_token_ids]
        if not states:
            return
        inputs = [DraftInput(s.token_ids, s.block_ids, s.sampling_params,
                             self.draw_keys.of(s.sampling_params.seed, s.num_output_tokens, self.proposer.k)) for s in states]
        for state, proposal in zip(states, self.proposer.propose(inputs)):
            if proposal.token_ids:
                output.proposed_drafts[state.request_id] = proposal.token_ids
                if proposal.probabilities is not None:
                    self._draft_probabilities[state.request_id] = proposal.probabilities

    def _sample_rows(self, states: list[RunnerRequestState], logits: torch.Tensor, output: ModelRunnerOutput,
                     request_ids: list[str] | None = None) -> None:
        """request_ids: the states' ids, where the caller has them as a list (a run of steps with the same list then
        reuses the batch's sampling columns and rows)."""
        requests = self.requests
        batch_key = (requests.version, tuple(request_ids)) if request_ids is not None else None
        metadata = self.sampling_inputs.metadata(states, batch_key=batch_key)
        sampled, raw_logprobs = self.sampler(logits, metadata)
        sampled_list = sampled.tolist()
        requests.append_sampled(states, sampled_list, requests.rows_of(request_ids) if request_ids is not None else None)
        output.sampled_token_ids.update(zip(request_ids if request_ids is not None else [s.request_id for s in states], sampled_list))
        if raw_logprobs is not None:
            rows = [i for i, s in enumerate(states) if s.sampling_params.logprobs is not None]
            row_index = torch.tensor(rows, dtype=torch.long, device=self.device)
            lists = gather_logprobs(
                raw_logprobs[row_index], sampled[row_index], [states[i].sampling_params.logprobs for i in rows]
            )
            for i, entry in zip(rows, lists):
                output.logprobs[states[i].request_id] = entry

    def _prompt_logprobs(self, inputs: ModelInputs, hidden_states: torch.Tensor, output: ModelRunnerOutput) -> None:
        for prompt_slice in inputs.prompt_logprobs:
            state = self.requests[prompt_slice.request_id]
            index = torch.tensor(prompt_slice.flat_indices, dtype=torch.long, device=self.device)
            logprobs = torch.log_softmax(self.model.compute_logits(hidden_states[index]).float(), dim=-1)
            targets = torch.tensor(prompt_slice.target_token_ids, dtype=torch.long, device=self.device)
            rows = gather_logprobs(logprobs, targets, [state.sampling_params.prompt_logprobs] * len(targets))
            output.prompt_logprobs[state.request_id] = LogprobsLists.concat(rows)
