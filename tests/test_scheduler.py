"""Scheduler and KV cache manager behaviour, with a fake model."""

import random

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from scheduler_harness import check_block_accounting, fake_run, make_request, make_scheduler, step

from pagedserve.config import DecodeStallLimit, SpeculativeConfig
from pagedserve.core.contracts import ModelRunnerOutput
from pagedserve.outputs import LogprobsLists
from pagedserve.request import Request, RequestStatus
from pagedserve.sampling_params import SamplingParams


def test_decodes_go_first_and_the_prompt_gets_the_rest_of_the_budget():
    sched = make_scheduler(budget=16, block_size=4, num_blocks=128)
    for i in range(3):
        sched.add_request(make_request(f"d{i}", prompt_len=4, max_tokens=50))
    step(sched)  # all three prefilled (12 tokens)
    sched.add_request(make_request("long", prompt_len=100, max_tokens=4))
    for _ in range(5):
        output, _ = step(sched)
        assert all(output.num_scheduled_tokens[f"d{i}"] == 1 for i in range(3))
        assert output.num_scheduled_tokens["long"] == 13
        assert output.total_num_scheduled_tokens == 16


def test_long_prefill_threshold_caps_one_prompts_chunk():
    sched = make_scheduler(budget=64, threshold=10, num_blocks=128)
    sched.add_request(make_request("a", prompt_len=35))
    sched.add_request(make_request("b", prompt_len=35))
    output, _ = step(sched)
    assert output.num_scheduled_tokens == {"a": 10, "b": 10}


def test_max_num_seqs_limits_running_requests():
    sched = make_scheduler(max_num_seqs=2, num_blocks=128)
    for i in range(4):
        sched.add_request(make_request(str(i), prompt_len=3))
    output, _ = step(sched)
    assert set(output.num_scheduled_tokens) == {"0", "1"} and len(sched.waiting) == 2


def test_duplicate_request_id_is_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("x", prompt_len=3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("x", prompt_len=3))


def test_abort_returns_every_block_and_ends_with_abort():
    sched = make_scheduler()
    request = make_request("x", prompt_len=10, max_tokens=20)
    sched.add_request(request)
    sched.add_request(make_request("waiting", prompt_len=10))
    step(sched)
    sched.finish_requests(["x", "waiting", "unknown"])
    assert request.status == RequestStatus.FINISHED_ABORTED and request.status.finish_reason == "abort"
    assert sched.kv_cache_manager.num_free_blocks == sched.kv_cache_manager.num_blocks
    assert not sched.has_unfinished_requests()
    check_block_accounting(sched)


def test_fcfs_preempts_the_latest_arrival_and_it_recomputes_later():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    sched.add_request(make_request("early", prompt_len=8, max_tokens=8, arrival=1.0))
    sched.add_request(make_request("late", prompt_len=8, max_tokens=8, arrival=2.0))
    step(sched)  # 4 blocks used, 2 free
    for _ in range(6):
        step(sched)
    assert sched.num_preemptions >= 1
    late = sched.requests.get("late")
    assert late is None or late.num_preemptions >= 1
    finished = {}
    for _ in range(60):
        _, outputs = step(sched)
        finished.update({o.request_id: o.finish_reason for o in outputs if o.finished})
        if not sched.has_unfinished_requests():
            break
    assert not sched.has_unfinished_requests()
    check_block_accounting(sched)


def test_priority_policy_preempts_the_lowest_priority():
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, policy="priority")
    important = make_request("important", prompt_len=10, max_tokens=8, priority=0, arrival=2.0)
    background = make_request("background", prompt_len=10, max_tokens=8, priority=5, arrival=1.0)
    sched.add_request(background)
    sched.add_request(important)
    step(sched)
    while important.num_output_tokens < 4:
        step(sched)
    assert background.num_preemptions >= 1 and important.num_preemptions == 0


def test_priority_policy_admits_higher_priority_first():
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    sched.add_request(make_request("low", prompt_len=3, priority=10, arrival=1.0))
    sched.add_request(make_request("high", prompt_len=3, priority=-1, arrival=2.0))
    output, _ = step(sched)
    assert list(output.num_scheduled_tokens) == ["high"]


def test_prefix_hit_computes_only_the_new_tokens():
    sched = make_scheduler(block_size=4, num_blocks=64, budget=64)
    shared = list(range(200, 220))  # 5 full blocks
    sched.add_request(make_request("first", prompt=shared + [1, 2], max_tokens=2))
    while sched.has_unfinished_requests():
        step(sched)
    sched.add_request(make_request("second", prompt=shared + [3, 4, 5], max_tokens=2))
    output, _ = step(sched)
    assert output.num_scheduled_tokens["second"] == 3
    assert output.scheduled_new_reqs[0].num_computed_tokens == 20
    stats = sched.kv_cache_manager.prefix_cache_stats
    assert stats.hits == 20


def test_blocks_filled_by_decodes_are_cached_when_the_request_ends():
    """A follow-up turn (the prompt, the answer, then more) reuses the blocks the answer filled, as the first request's
    blocks were freed; a block a running request fills while it decodes is not offered to others until then."""
    sched = make_scheduler(block_size=4, num_blocks=64, budget=64)
    prompt = list(range(200, 206))  # one full block and two tokens
    sched.add_request(make_request("first", prompt=prompt, max_tokens=7))
    step(sched)
    for _ in range(3):
        step(sched)  # the answer's first tokens fill the second block
    first = sched.requests["first"]
    assert first.num_computed_tokens >= 8
    assert sched.kv_cache_manager.num_cached_blocks.get("first", 0) == 1
    while sched.has_unfinished_requests():
        step(sched)
    conversation = first.all_token_ids
    assert len(conversation) == 13
    sched.add_request(make_request("second", prompt=conversation + [9, 9, 9], max_tokens=1))
    output, _ = step(sched)
    # Known tokens with K/V: all but the last answer token, so three full blocks are reused.
    assert output.scheduled_new_reqs[0].num_computed_tokens == 12
    assert output.num_scheduled_tokens["second"] == 4


def test_full_prompt_hit_still_recomputes_the_last_token():
    sched = make_scheduler(block_size=4, budget=64)
    prompt = list(range(300, 316))  # exactly 4 blocks
    for name in ("a", "b"):
        sched.add_request(make_request(name, prompt=prompt, max_tokens=1))
        output, _ = step(sched)
    assert output.num_scheduled_tokens["b"] == 4  # the last block is recomputed (hit stops before the last token)


def test_eviction_takes_least_recently_freed_blocks_first():
    sched = make_scheduler(block_size=4, num_blocks=8, budget=64)
    sched.add_request(make_request("a", prompt=list(range(0, 12)), max_tokens=1))
    step(sched)
    sched.add_request(make_request("b", prompt=list(range(50, 62)), max_tokens=1))
    step(sched)
    # a's and b's blocks are free but cached; c needs 7 blocks: a's (freed first) go before b's.
    sched.add_request(make_request("c", prompt=list(range(100, 124)), max_tokens=1))
    step(sched)
    sched.add_request(make_request("b2", prompt=list(range(50, 62)) + [7], max_tokens=1))
    output, _ = step(sched)
    assert output.scheduled_new_reqs[0].num_computed_tokens == 8  # b's first two blocks survived


@pytest.mark.parametrize("budget", [64, 8])
def test_samples_of_one_request_share_prompt_blocks(budget):
    sched = make_scheduler(block_size=4, budget=budget)
    prompt = list(range(400, 421))
    for i in range(3):
        sched.add_request(make_request(f"{i}_r", prompt=prompt, max_tokens=4, group="r"))
    output, _ = step(sched)
    while "1_r" not in output.num_scheduled_tokens:
        assert list(output.num_scheduled_tokens) == ["0_r"]  # siblings wait while the shared prompt is chunked
        output, _ = step(sched)
    assert output.num_scheduled_tokens["1_r"] == 1 and output.num_scheduled_tokens["2_r"] == 1
    blocks = sched.kv_cache_manager.req_to_blocks
    assert blocks["0_r"][:5] == blocks["1_r"][:5] == blocks["2_r"][:5]
    assert all(b.ref_cnt == 3 for b in blocks["0_r"][:5])


def test_length_and_eos_finish_reasons():
    sched = make_scheduler()
    sched.add_request(make_request("len", prompt_len=3, max_tokens=2))
    reasons = {}
    while sched.has_unfinished_requests():
        _, outputs = step(sched)
        reasons.update({o.request_id: o.finish_reason for o in outputs if o.finished})
    assert reasons == {"len": "length"}


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(10, 40), max_model_len=st.integers(12, 60))
def test_a_step_of_sampled_tokens_alone_ends_requests_as_a_step_with_logprobs_does(seed, num_blocks, max_model_len):
    """Steps whose requests gained only their sampled tokens take a pass of their own; a step with logprobs takes the
    general one. Fed the same tokens, the two give the same outputs, finishes (stop tokens, min_tokens, max_tokens,
    max_model_len) and blocks, preemptions included."""
    rng = random.Random(seed)
    plain, general = (make_scheduler(num_blocks=num_blocks, max_model_len=max_model_len, budget=16, max_num_seqs=6) for _ in range(2))
    for index in range(8):
        params = dict(temperature=0.0, max_tokens=rng.randint(1, 20), min_tokens=rng.randint(0, 2),
                      stop_token_ids=rng.sample(range(40), rng.randint(0, 3)), eos_token_ids=[2], ignore_eos=rng.random() < 0.3)
        params["min_tokens"] = min(params["min_tokens"], params["max_tokens"])
        prompt = [rng.randrange(100, 150) for _ in range(rng.randint(1, 10))]
        for sched in (plain, general):
            sched.add_request(Request(f"r{index}", prompt, SamplingParams(**params)))
    while plain.has_unfinished_requests():
        plain_step, general_step = plain.schedule(), general.schedule()
        assert plain_step.num_scheduled_tokens == general_step.num_scheduled_tokens
        tokens = {request_id: rng.randrange(0, 40) for request_id in plain_step.num_scheduled_tokens
                  if plain.requests[request_id].num_computed_tokens == plain.requests[request_id].num_tokens}
        with_logprobs = {request_id: LogprobsLists([[token]], [[-0.5]], [1]) for request_id, token in tokens.items()}
        plain_outputs = plain.update_from_output(plain_step, ModelRunnerOutput(sampled_token_ids=dict(tokens)))
        general_outputs = general.update_from_output(general_step, ModelRunnerOutput(sampled_token_ids=dict(tokens),
                                                                                     logprobs=with_logprobs))
        assert _news(plain_outputs) == _news(general_outputs)
        assert plain.kv_cache_manager.num_free_blocks == general.kv_cache_manager.num_free_blocks
        check_block_accounting(plain)
    assert not general.has_unfinished_requests()


def _news(outputs) -> list[tuple]:
    return sorted((output.request_id, output.new_token_ids, output.finish_reason, output.stop_reason) for output in outputs)


# ---- randomized: arrivals, lengths, aborts and finishes ------------------------------------------

operations = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    min_size=1,
    max_size=40,
)


SPECULATION = {
    None: None,
    "ngram": SpeculativeConfig(method="ngram", num_speculative_tokens=3),
    "draft_model": SpeculativeConfig(method="draft_model", num_speculative_tokens=4, model="draft"),  # lookahead slots too
}


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, num_blocks=st.integers(12, 40), budget=st.integers(4, 48), caching=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]), seed=st.integers(0, 1000), speculation=st.sampled_from(list(SPECULATION)))
def test_random_workloads_never_leak_or_double_free(ops, num_blocks, budget, caching, policy, seed, speculation):
    """Random arrivals, aborts, finishes and preemptions, with speculation that accepts a random share of its drafts."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_model_len=48, budget=budget, caching=caching, policy=policy,
                           speculative=SPECULATION[speculation])
    added, finish_reasons, counter = [], {}, 0
    shared_prefix = [rng.randrange(60, 90) for _ in range(8)]
    num_lookahead_tokens = sched.drafts.num_lookahead_tokens if sched.drafts else 0

    def run_step():
        decoding = [r.request_id for r in sched.running if r.num_computed_tokens == r.num_tokens - 1]
        preemptions_before = sched.num_preemptions
        output = sched.schedule()
        kv = sched.kv_cache_manager
        for request_id in output.num_scheduled_tokens:  # what the model runs must be running and have its slots
            request = sched.requests[request_id]
            assert request.status == RequestStatus.RUNNING, "a preempted request was left in the batch"
            assert len(kv.req_to_blocks[request_id]) * kv.block_size >= request.num_computed_tokens
        outputs = sched.update_from_output(output, fake_run(output, sched, rng))
        preempted = sched.num_preemptions > preemptions_before
        # A running decode is never starved: it runs unless memory forced a preemption this step.
        for request_id in decoding:
            assert request_id in output.num_scheduled_tokens or preempted, "a running decode was starved"
        assert output.total_num_scheduled_tokens <= budget
        for request in sched.running:  # rejected drafts rolled back: only verified tokens are computed or cached
            assert request.num_computed_tokens <= request.num_tokens
            assert kv.num_cached_blocks.get(request.request_id, 0) * kv.block_size <= request.num_tokens
            assert len(kv.req_to_blocks[request.request_id]) <= -(-(request.num_tokens + num_lookahead_tokens) // kv.block_size)
        finish_reasons.update({o.request_id: o.finish_reason for o in outputs if o.finished})
        check_block_accounting(sched)

    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, priority = op
            prompt = (shared_prefix if rng.random() < 0.5 else []) + [rng.randrange(60, 200) for _ in range(prompt_len)]
            prompt = prompt[:40]
            request = make_request(f"r{counter}", prompt=prompt, max_tokens=min(max_tokens, 48 - len(prompt)) or 1,
                                   priority=priority, eos=True)
            counter += 1
            sched.add_request(request)
            added.append(request)
        elif op[0] == "abort" and added:
            target = added[op[1] % len(added)]
            for r in sched.finish_requests([target.request_id]):
                finish_reasons[r.request_id] = "abort"
            check_block_accounting(sched)
        else:
            for _ in range(op[1]):
                run_step()
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        run_step()
    assert not sched.has_unfinished_requests()
    assert all(r.is_finished and r.status.finish_reason in ("stop", "length", "abort") for r in added)
    assert all(finish_reasons.get(r.request_id) == r.status.finish_reason for r in added)
    assert sched.kv_cache_manager.num_free_blocks == num_blocks


def test_drafts_never_starve_a_decode_and_a_request_that_fills_the_cache_finishes():
    """Drafts take only budget that the decodes after them do not need; and a request whose prompt and output
    fill the whole cache finishes with draft-model speculation, its last steps holding no lookahead slots
    (without that cap it would preempt itself forever)."""
    draft = SpeculativeConfig(method="draft_model", num_speculative_tokens=4, model="draft")
    sched = make_scheduler(num_blocks=64, block_size=4, max_model_len=48, budget=6, speculative=draft)
    for index in range(3):
        sched.add_request(make_request(f"d{index}", prompt_len=2, max_tokens=30))
    step(sched)  # the three prompts; each is drafted for after it
    for _ in range(5):
        decoding = [r.request_id for r in sched.running if r.num_computed_tokens == r.num_tokens - 1]
        output, _ = step(sched)
        assert len(decoding) == 3 and set(decoding) <= set(output.num_scheduled_tokens)
        assert output.drafts_to_verify and output.total_num_scheduled_tokens == 6

    alone = make_scheduler(num_blocks=12, block_size=4, max_model_len=48, budget=4, caching=False, speculative=draft)
    alone.add_request(make_request("r", prompt_len=34, max_tokens=14))
    for _ in range(200):
        if not alone.has_unfinished_requests():
            break
        step(alone)
        check_block_accounting(alone)
    assert not alone.has_unfinished_requests() and alone.num_preemptions == 0


def test_step_time_model_recovers_a_linear_cost_and_forgets_old_costs():
    import random

    from pagedserve.core.step_time import StepShape, StepTimeModel, chunk_attention_pairs

    truth = (0.02, 0.0015, 0.0012, 0.0004)  # overhead, per decode token, per prompt token, per 1000 attention pairs
    rng = random.Random(0)
    model = StepTimeModel()

    def cost(shape, weights):
        return sum(w * f for w, f in zip(weights, shape.features()))

    for _ in range(200):
        decodes, prompts = rng.randint(0, 64), rng.choice([0, 0, rng.randint(16, 512)])
        shape = StepShape(decodes, prompts, decodes * 200 + chunk_attention_pairs(prompts, rng.randint(0, 300)))
        model.observe(shape, cost(shape, truth) * rng.uniform(0.97, 1.03))
    assert model.ready
    assert model.weights == pytest.approx(truth, rel=0.15)
    probe = StepShape(32, 100, 32 * 200 + chunk_attention_pairs(100, 50))
    assert model.predict(probe) == pytest.approx(cost(probe, truth), rel=0.05)
    assert model.prefill_cost(100, 50) == pytest.approx(cost(StepShape(0, 100, chunk_attention_pairs(100, 50)), truth) - truth[0], rel=0.1)
    assert model.prefill_cost(model.max_chunk(0.1, 50, 1000), 50) <= 0.1 < model.prefill_cost(model.max_chunk(0.1, 50, 1000) + 1, 50)
    slower = tuple(2 * w for w in truth)  # the machine slows down: recent steps count most
    for _ in range(300):
        decodes, prompts = rng.randint(1, 64), rng.choice([0, rng.randint(16, 512)])
        shape = StepShape(decodes, prompts, decodes * 200 + chunk_attention_pairs(prompts, 0))
        model.observe(shape, cost(shape, slower))
    assert model.predict(probe) == pytest.approx(cost(probe, slower), rel=0.05)


def test_step_time_fit_stays_non_negative_when_the_features_move_together():
    """A burst of streams: the decode batch, its attention and the prompt tokens beside it all grow together. The
    fit keeps every cost non-negative and still predicts the decode-only step."""
    import random

    from pagedserve.core.step_time import StepShape, StepTimeModel, nonnegative_least_squares

    rng = random.Random(1)
    model = StepTimeModel()
    for batch in range(16, 64):  # steps with prompts, then a few decode-only ones
        prompts = 300 - 3 * batch
        seconds = (0.03 + 0.0017 * batch + 0.0011 * prompts) * rng.uniform(0.9, 1.1)
        model.observe(StepShape(batch, prompts, batch * 150 + prompts * 200), seconds)
    for _ in range(5):
        model.observe(StepShape(64, 0, 64 * 200), 0.03 + 0.0017 * 64)
    assert all(w >= 0 for w in model.weights)
    assert model.predict(StepShape(64, 0, 64 * 200)) == pytest.approx(0.03 + 0.0017 * 64, rel=0.1)
    # The solver against a case worked by hand: y = 1 + x1 exactly, x2 = -x1 tempts a negative weight.
    rows = [(1.0, x, -x) for x in (0.0, 1.0, 2.0, 3.0)]
    gram = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    moment = [sum(r[i] * (1 + r[1]) for r in rows) for i in range(3)]
    assert nonnegative_least_squares(gram, moment) == pytest.approx([1.0, 1.0, 0.0], abs=1e-9)


def test_step_time_model_of_a_mixture_prices_the_experts_a_step_touches():
    """A mixture's step reads every expert its tokens chose: its cost rises steeply over the first tokens and then
    flattens. Fit to the engine's warm-up shapes and a few steps, the model with the experts-touched feature predicts
    decode batches of every size, and a chunk added beside many decodes costs less than beside one (the experts it
    touches are mostly read already)."""
    import random

    from pagedserve.core.step_time import ExpertRouting, StepShape, StepTimeModel, uniform_step_shape

    experts = ExpertRouting(num_experts=32, experts_per_token=4)
    truth = (0.004, 0.0002, 0.0002, 0.0004, 0.0015)  # the four dense costs, then seconds per expert touched

    def cost(shape):
        features = shape.features() + (experts.experts_touched(shape.num_tokens),)
        return sum(w * f for w, f in zip(truth, features))

    assert experts.experts_touched(1) == pytest.approx(4.0)
    assert experts.experts_touched(0) == 0.0 and experts.experts_touched(200) == pytest.approx(32.0, rel=1e-6)
    rng = random.Random(3)
    warm_up = [(1, 1, 0), (8, 1, 64), (32, 1, 64), (1, 64, 0), (8, 1, 1024), (2, 128, 0)]
    shapes = [uniform_step_shape(*s) for s in warm_up] + [
        StepShape(d, 0, d * rng.randint(50, 500)) for d in rng.sample(range(1, 40), 10)]
    with_experts, dense = StepTimeModel(experts=experts), StepTimeModel()
    for shape in shapes:
        seconds = cost(shape) * rng.uniform(0.98, 1.02)
        with_experts.observe(shape, seconds)
        dense.observe(shape, seconds)
    probes = [StepShape(d, 0, d * 300) for d in (1, 2, 3, 5, 12, 24, 48)]
    errors = [abs(with_experts.predict(p) - cost(p)) / cost(p) for p in probes]
    dense_errors = [abs(dense.predict(p) - cost(p)) / cost(p) for p in probes]
    assert max(errors) < 0.05 < max(dense_errors)
    beside_one, beside_many = with_experts.prefill_cost(64, 0, step_tokens=1), with_experts.prefill_cost(64, 0, step_tokens=48)
    assert beside_many < beside_one
    assert beside_one - beside_many == pytest.approx(
        truth[4] * (experts.experts_touched(48) - experts.experts_touched(1) - experts.experts_touched(112) + experts.experts_touched(65)),
        rel=0.2)
    limit = with_experts.max_chunk(0.05, 0, 1000, step_tokens=8)
    assert with_experts.prefill_cost(limit, 0, 8) <= 0.05 < with_experts.prefill_cost(limit + 1, 0, 8)


def test_step_time_model_keeps_what_a_long_run_of_one_shape_does_not_inform():
    """Minutes of one stream decoding refresh the cost of that step shape only: what earlier steps said about
    prompt chunks and bigger batches stays, so a burst after them is priced right."""
    import random

    from pagedserve.core.step_time import StepShape, StepTimeModel

    truth = (0.01, 0.0017, 0.0012, 0.002)
    rng = random.Random(2)
    model = StepTimeModel()

    def cost(shape):
        return sum(w * f for w, f in zip(truth, shape.features()))

    for _ in range(40):
        shape = StepShape(rng.randint(0, 64), rng.choice([0, rng.randint(16, 512)]), rng.uniform(0, 30000))
        model.observe(shape, cost(shape))
    for position in range(3000):
        shape = StepShape(1, 0, 200 + position % 128)
        model.observe(shape, cost(shape))
    for probe in (StepShape(0, 256, 40000), StepShape(16, 0, 16 * 300), StepShape(16, 200, 20000)):
        assert model.predict(probe) == pytest.approx(cost(probe), rel=0.05)


def _stall_scheduler(stall, budget=4096, max_num_seqs=64, **kwargs):
    from pagedserve.core.step_time import StepShape

    kwargs = {"num_blocks": 4096, "block_size": 16, "max_model_len": 2048, "caching": False} | kwargs
    scheduler = make_scheduler(budget=budget, max_num_seqs=max_num_seqs, stall=stall, **kwargs)
    # A model fit to steps of known cost: 10 ms + 1 ms a decode token + 1 ms a prompt token, no attention cost.
    for decodes, prompts in [(1, 0), (8, 0), (32, 0), (0, 64), (0, 256), (16, 100), (4, 300)]:
        scheduler.observe_step(StepShape(decodes, prompts, 0.0), 0.010 + 0.001 * (decodes + prompts))
    return scheduler


def test_prompt_tokens_are_bounded_by_time_while_streams_decode():
    """With a 2x limit, a step that carries prompt tokens while 8 requests decode takes about twice their
    decode-only step, counted for the batch the waiting prompts will join; without decodes, or with the
    limit off, the token budget alone bounds it."""
    from pagedserve.core.step_time import StepShape

    scheduler = _stall_scheduler(DecodeStallLimit(multiple=2.0))
    for index in range(8):
        scheduler.add_request(make_request(f"d{index}", prompt_len=20, max_tokens=100))
    first, _ = step(scheduler)
    assert first.total_num_scheduled_tokens == 160  # nothing decodes yet: no time bound
    step(scheduler)  # the streams flow before the long prompts come
    for index in range(4):
        scheduler.add_request(make_request(f"long{index}", prompt_len=1000, max_tokens=10))
    output, _ = step(scheduler)
    decodes = sum(1 for n in output.num_scheduled_tokens.values() if n == 1)
    prompt_tokens = output.total_num_scheduled_tokens - decodes
    assert decodes == 8
    # Decode-only step of the 12 requests' batch: 10 + 12 = 22 ms, the limit 44 ms, planned at 90% of it
    # (39.6 ms); 8 decodes take 18 ms, which leaves 21 prompt tokens.
    model = scheduler.stall_bound.step_time
    assert model.predict(output.shape) == pytest.approx(0.9 * 0.044, abs=0.002)
    assert prompt_tokens == pytest.approx(21, abs=1) and output.shape == StepShape(8, prompt_tokens, output.shape.attention_pairs)
    off = _stall_scheduler(None)
    for index in range(8):
        off.add_request(make_request(f"d{index}", prompt_len=20, max_tokens=100))
    step(off)
    for index in range(4):
        off.add_request(make_request(f"long{index}", prompt_len=1000, max_tokens=10))
    assert step(off)[0].total_num_scheduled_tokens == 8 + 4 * 1000  # all of every prompt: the budget allowed it


@pytest.mark.parametrize("num_decoding,num_waiting,max_num_seqs,bounded", [
    (2, 14, 64, False),  # a burst: the first prompts decode while the rest arrive
    (4, 4, 64, False),  # as many waiting as decoding
    (5, 4, 64, True),  # fewer waiting than decoding: the streams are kept steady
    (4, 14, 7, True),  # only the 3 seats left count
])
def test_a_burst_of_waiting_requests_is_let_in_without_the_time_bound(num_decoding, num_waiting, max_num_seqs, bounded):
    """While at least as many requests wait to join (and may, within max_num_seqs) as streams decode, a step takes
    their prompts up to the token budget, stalling those few streams once; with fewer, the time bound holds."""
    scheduler = _stall_scheduler(DecodeStallLimit(multiple=2.0), max_num_seqs=max_num_seqs)
    for index in range(num_decoding):
        scheduler.add_request(make_request(f"d{index}", prompt_len=20, max_tokens=100))
    step(scheduler)
    step(scheduler)  # the streams flow: their first tokens are out before the others come
    for index in range(num_waiting):
        scheduler.add_request(make_request(f"w{index}", prompt_len=128, max_tokens=10))
    output, _ = step(scheduler)
    seats = min(num_waiting, max_num_seqs - num_decoding)
    assert (output.stall_limit_s is not None) == bounded
    prompt_tokens = output.total_num_scheduled_tokens - num_decoding
    assert prompt_tokens < 128 if bounded else prompt_tokens == 128 * seats


def test_streams_that_came_in_the_burst_are_not_kept_steady_against_it():
    """A burst's first request starts alone; the rest arrive while it runs and enter as the token budget allows. Once
    more of the burst decode than wait, a step still takes the waiting prompts up to the budget: only streams that
    flowed before the newest waiting request came are kept steady against them, and the first had no token out when
    the rest came. A request that comes once the burst's streams decode meets the time bound again."""
    scheduler = _stall_scheduler(DecodeStallLimit(multiple=2.0), budget=1 + 4 * 128)
    scheduler.add_request(make_request("first", prompt_len=128, max_tokens=100))
    step(scheduler)
    for index in range(8):
        scheduler.add_request(make_request(f"burst{index}", prompt_len=128, max_tokens=100))
    output, _ = step(scheduler)
    assert output.stall_limit_s is None and output.total_num_scheduled_tokens == 1 + 4 * 128
    output, _ = step(scheduler)  # 5 decode, 4 wait: the burst's own streams do not count against it
    assert output.stall_limit_s is None and output.total_num_scheduled_tokens == 1 + 4 * 128  # the whole budget
    scheduler.add_request(make_request("late", prompt_len=128, max_tokens=10))
    output, _ = step(scheduler)
    assert output.stall_limit_s is not None and output.total_num_scheduled_tokens - 9 < 128


def test_streams_whose_prompts_ran_while_the_rest_of_the_burst_came_do_not_bound_it():
    """The engine takes its input between steps: requests that come while a step runs its first prompts join after it.
    Those prompts' streams had no token out when the others came, so the next step takes the late part of the burst
    up to the token budget, although more streams decode than wait; a request that comes after their first tokens
    are out meets the time bound."""
    scheduler = _stall_scheduler(DecodeStallLimit(multiple=2.0), budget=9 * 128)
    for index in range(9):
        scheduler.add_request(make_request(f"early{index}", prompt_len=128, max_tokens=100))
    output, _ = step(scheduler)
    assert output.total_num_scheduled_tokens == 9 * 128
    for index in range(7):
        scheduler.add_request(make_request(f"late{index}", prompt_len=128, max_tokens=100))
    output, _ = step(scheduler)  # 9 decode, 7 wait: every prompt of the burst's late part in this step
    assert output.stall_limit_s is None and output.total_num_scheduled_tokens == 9 + 7 * 128
    scheduler.add_request(make_request("after", prompt_len=128, max_tokens=10))
    output, _ = step(scheduler)  # the 9 early streams flowed before it came
    assert output.stall_limit_s is not None and output.total_num_scheduled_tokens - 16 < 128


def test_prompts_progress_however_tight_the_time_limit():
    scheduler = _stall_scheduler(DecodeStallLimit(seconds=0.001))  # below even the decode-only step
    for index in range(4):
        scheduler.add_request(make_request(f"d{index}", prompt_len=20, max_tokens=100))
    step(scheduler)
    step(scheduler)
    scheduler.add_request(make_request("long", prompt_len=200, max_tokens=5))
    finished, chunks = None, []
    for _ in range(30):
        output, engine_outputs = step(scheduler)
        check_block_accounting(scheduler)
        chunks.append(output.num_scheduled_tokens.get("long", 0))
        finished = finished or next((o for o in engine_outputs if o.request_id == "long" and o.finished), None)
    assert finished is not None  # a block of 16 prompt tokens a step: prefilled in 13 steps, then 5 decodes
    assert max(chunks) == 16 and sum(c for c in chunks if c > 1) == 200


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, num_blocks=st.integers(12, 60), budget=st.integers(4, 64), max_num_seqs=st.integers(1, 8),
       seed=st.integers(0, 1000), speculation=st.sampled_from(list(SPECULATION)))
# Prompts chunked short by the budget, one to a single token; and a step whose drafts spend the budget before the
# prompt's request.
@example(ops=[("step", 1), ("add", 13, 5, 0), ("add", 9, 6, 0), ("step", 3), ("step", 3), ("add", 21, 8, 0), ("step", 2)],
         num_blocks=60, budget=4, max_num_seqs=6, seed=0, speculation="draft_model")
@example(ops=[("add", 9, 8, 0), ("step", 1), ("add", 14, 10, 0), ("step", 1), ("step", 2), ("step", 1), ("step", 3)],
         num_blocks=60, budget=4, max_num_seqs=3, seed=0, speculation="draft_model")
def test_the_time_bound_looks_for_prompt_work_only_where_a_step_can_have_left_some(ops, num_blocks, budget, max_num_seqs,
                                                                                   seed, speculation):
    """The bound skips its scan of the running requests for unfinished prompts after a step that reached them all
    and finished every chunk it took. Against a scheduler that scans before every step, fed the same requests,
    aborts and tokens (preemptions, drafts and budget-cut chunks included), every step is planned alike."""
    rng = random.Random(seed)
    kept, scanning = (_stall_scheduler(DecodeStallLimit(multiple=1.5), budget=budget, max_num_seqs=max_num_seqs,
                                       num_blocks=num_blocks, block_size=4, max_model_len=48, caching=True,
                                       speculative=SPECULATION[speculation]) for _ in range(2))
    counter = 0

    def run_step():
        scanning.stall_bound._prompt_may_be_left = True  # as if nothing were known: the scan runs
        output, reference = kept.schedule(), scanning.schedule()
        assert (output.num_scheduled_tokens, output.stall_limit_s, output.drafts_to_verify) == \
            (reference.num_scheduled_tokens, reference.stall_limit_s, reference.drafts_to_verify)
        runner_output = fake_run(output, kept, rng)
        assert _news(kept.update_from_output(output, runner_output)) == _news(scanning.update_from_output(reference, runner_output))

    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, _ = op
            prompt = [rng.randrange(60, 200) for _ in range(min(prompt_len, 40))]
            for sched in (kept, scanning):
                sched.add_request(make_request(f"r{counter}", prompt=prompt, max_tokens=min(max_tokens, 48 - len(prompt)) or 1))
            counter += 1
        elif op[0] == "abort" and counter:
            for sched in (kept, scanning):
                sched.finish_requests([f"r{op[1] % counter}"])
        else:
            for _ in range(op[1]):
                run_step()
    while kept.has_unfinished_requests():
        run_step()
    assert not scanning.has_unfinished_requests()


def test_a_step_of_decodes_has_the_shape_the_warm_up_fits_the_step_time_model_with():
    """The engine's warm-up steps and the scheduler's steps describe their work through one ShapeTally, so the
    step-time model sees the same features for the same work."""
    from pagedserve.core.step_time import uniform_step_shape

    scheduler = make_scheduler(num_blocks=64, block_size=4, budget=64)
    for index in range(4):
        scheduler.add_request(make_request(f"r{index}", prompt=[100 + index] * 12, max_tokens=8))
    prefill, _ = step(scheduler)
    assert prefill.shape == uniform_step_shape(4, 12, 0)
    decode, _ = step(scheduler)
    assert decode.shape == uniform_step_shape(4, 1, 12)


def test_a_step_names_its_prompt_chunks_and_the_time_it_was_planned_within():
    """What the web console's step timeline shows: each prompt chunk (request, first position, tokens, the request's
    known tokens), contiguous from the prompt's start to its end across steps, and the step's time limit where the
    stall bound planned it (None where nothing bounded it)."""
    scheduler = _stall_scheduler(DecodeStallLimit(multiple=2.0))
    for index in range(8):
        scheduler.add_request(make_request(f"d{index}", prompt_len=20, max_tokens=100))
    first, _ = step(scheduler)
    assert first.stall_limit_s is None  # nothing decoded yet
    assert first.prompt_chunks == [(f"d{index}", 0, 20, 20) for index in range(8)]
    step(scheduler)  # the streams' first tokens are out before the long prompt comes
    scheduler.add_request(make_request("long", prompt_len=300, max_tokens=3))
    covered = 0
    while covered < 300:
        output, _ = step(scheduler)
        assert output.stall_limit_s == pytest.approx(2 * (0.010 + 0.009), rel=0.05)  # 2x the 9-request decode-only step
        [(request_id, start, num_tokens, known)] = output.prompt_chunks
        assert (request_id, start, known) == ("long", covered, 300) and num_tokens == output.num_scheduled_tokens["long"] > 1
        covered += num_tokens
    decode_step, _ = step(scheduler)
    assert decode_step.prompt_chunks == [] and decode_step.stall_limit_s is None  # no prompt work to bound


@pytest.mark.parametrize("budget,threshold,lengths", [(19, 0, [19, 1]), (32, 10, [10, 10, 1])])
def test_a_prompt_chunked_one_token_short_names_its_last_token_as_a_chunk(budget, threshold, lengths):
    """A chunk that stops one token before the prompt's end leaves a token that the next step computes as a decode is
    computed; it is named among that step's prompt chunks all the same, so the chunks cover the prompt, and the step
    that finishes the prompt is known."""
    scheduler = make_scheduler(num_blocks=64, block_size=4, budget=budget, threshold=threshold)
    scheduler.add_request(make_request("p", prompt_len=sum(lengths), max_tokens=4))
    chunks = []
    for _ in lengths:
        output, _ = step(scheduler)
        chunks += output.prompt_chunks
    assert chunks == [("p", sum(lengths[:index]), length, sum(lengths)) for index, length in enumerate(lengths)]
    assert scheduler.requests["p"].prompt_done_step == len(lengths)
    decode, _ = step(scheduler)
    assert decode.prompt_chunks == [] and decode.num_scheduled_tokens == {"p": 1}


class AsyncLoadingConnector:
    """A KV connector's scheduler side as P2pConnector drives the scheduler, with the transfers made up: a request whose
    id starts with "pull" finds its prompt outside and loads it while others run (each load ends after a random number
    of steps, whole or failed); a request whose id starts with "hold" has its blocks held when it finishes normally,
    for a random number of steps."""

    def __init__(self, rng: random.Random, failure_policy: str) -> None:
        from pagedserve.config import KVTransferConfig

        self.transfer = KVTransferConfig("P2pConnector", kv_load_failure_policy=failure_policy)
        self.rng, self.received_tokens, self.sent_tokens = rng, 0, 0
        self.loads: dict[str, int] = {}  # request id -> steps until its load ends
        self.holds: dict[str, int] = {}
        self.gave_up: set[str] = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if not request.request_id.startswith("pull") or request.request_id in self.gave_up:
            return 0, False
        return max(0, request.num_prompt_tokens - num_computed_tokens), True  # as P2pConnector: prompt tokens only

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        if num_external_tokens:
            self.loads[request.request_id] = self.rng.randint(0, 4)

    def build_connector_meta(self, scheduler_output, requests, block_ids_of):
        from pagedserve.core.contracts import KVConnectorMetadata

        return KVConnectorMetadata()

    def step_done(self, metadata) -> None:
        self.loads = {request_id: steps - 1 for request_id, steps in self.loads.items()}
        self.holds = {request_id: steps - 1 for request_id, steps in self.holds.items()}

    def request_finished(self, request, block_ids):
        self.gave_up.discard(request.request_id)
        if request.request_id.startswith("hold") and request.status != RequestStatus.FINISHED_ABORTED:
            self.holds[request.request_id] = self.rng.randint(0, 5)
            return True, {"remote_block_ids": block_ids}
        return False, None

    def has_news(self) -> bool:
        return any(steps <= 0 for steps in (*self.loads.values(), *self.holds.values()))

    def take_finished_loads(self):
        ended = [request_id for request_id, steps in self.loads.items() if steps <= 0]
        results = [(request_id, self.rng.random() < 0.7) for request_id in ended]
        for request_id, ok in results:
            del self.loads[request_id]
            if not ok:
                self.gave_up.add(request_id)
        return results

    def take_released_holds(self):
        released = [request_id for request_id, steps in self.holds.items() if steps <= 0]
        for request_id in released:
            del self.holds[request_id]
        return released

    def stats(self) -> dict:
        return {}


def test_a_request_that_comes_back_with_outputs_loads_its_prompt_and_computes_its_outputs_again():
    """A pulled request preempted after it decoded (it comes back with its output tokens) loads its prompt's KV again:
    once loaded, its output tokens are what it still computes, in blocks it then allocates."""
    from pagedserve.core.remote_kv import RemoteKV

    sched = make_scheduler(num_blocks=32, block_size=4, max_model_len=64, budget=32)
    connector = AsyncLoadingConnector(random.Random(0), "fail")
    sched.kv_connector, sched.remote_kv = connector, RemoteKV(sched.kv_cache_manager, connector, "fail")
    request = make_request("pull0", prompt_len=10, max_tokens=20)
    for token in (61, 62, 63, 64, 65, 66):  # what it decoded before it was preempted
        request.append_output_token(token, 64)
    sched.add_request(request)
    sched.update_from_output(step := sched.schedule(), fake_run(step, sched))
    assert request.request_id in sched.remote_kv.loading and len(sched.kv_cache_manager.req_to_blocks["pull0"]) == 3
    connector.loads["pull0"] = 0  # the load ends, whole
    connector.rng = random.Random(1)  # whose first draw passes the connector's 0.7 bar: the load succeeds
    step = sched.schedule()
    assert step.num_scheduled_tokens == {"pull0": 6}  # its outputs, computed again after the loaded prompt
    sched.update_from_output(step, fake_run(step, sched))
    assert request.num_output_tokens == 7 and len(sched.kv_cache_manager.req_to_blocks["pull0"]) == 4


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, num_blocks=st.integers(12, 40), budget=st.integers(4, 48), caching=st.booleans(),
       seed=st.integers(0, 1000), failure_policy=st.sampled_from(["recompute", "fail"]))
# A loaded request waits at the head of the queue while a longer prompt takes every step's budget, fills the cache
# and is preempted: it must go back behind the loaded request (which holds its blocks), or neither ever runs.
@example(ops=[("add", 15, 1, 0), ("add", 1, 1, 0), ("add", 38, 1, 0)], num_blocks=12, budget=4, caching=False, seed=0,
         failure_policy="recompute")
# Nothing runs, and two loaded requests wait, each holding blocks and needing one the other holds: one of them must give
# its blocks up, or neither ever runs.
@example(ops=[("add", 37, 1, 0), ("add", 40, 1, 0), ("step", 2), ("add", 32, 6, 0), ("add", 17, 5, 0), ("step", 1), ("step", 4),
              ("add", 36, 11, 0), ("add", 38, 4, 0), ("add", 36, 2, 0)], num_blocks=19, budget=37, caching=False, seed=289,
         failure_policy="fail")
def test_loads_while_others_run_and_held_blocks_never_leak(ops, num_blocks, budget, caching, seed, failure_policy):
    """Requests that wait for their KV (admitted with their blocks, then run with their prompt computed, or compute it or
    end when the load fails), requests whose blocks are held after they finish, aborts at any point: the blocks' owners
    always agree with their reference counts, a request runs only with its KV in place, and every block comes back."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, max_model_len=48, budget=budget, caching=caching)
    connector = AsyncLoadingConnector(rng, failure_policy)
    from pagedserve.core.remote_kv import RemoteKV

    sched.kv_connector, sched.remote_kv = connector, RemoteKV(sched.kv_cache_manager, connector, failure_policy)
    added, counter = [], 0

    def run_step():
        output = sched.schedule()
        for request_id in output.num_scheduled_tokens:
            request = sched.requests[request_id]
            assert request.status == RequestStatus.RUNNING and request_id not in sched.remote_kv.loading
        for request in sched.remote_kv.loading.values():
            assert request.request_id not in output.num_scheduled_tokens
        sched.update_from_output(output, fake_run(output, sched, rng))
        check_block_accounting(sched)

    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, priority = op
            prompt = [rng.randrange(60, 200) for _ in range(min(prompt_len, 40))]
            kind = rng.choice(["pull", "hold", "plain"])
            request = make_request(f"{kind}{counter}", prompt=prompt, max_tokens=min(max_tokens, 48 - len(prompt)) or 1, eos=True)
            counter += 1
            sched.add_request(request)
            added.append(request)
        elif op[0] == "abort" and added:
            sched.finish_requests([added[op[1] % len(added)].request_id])
            check_block_accounting(sched)
        else:
            for _ in range(op[1]):
                run_step()
    for _ in range(3000):
        if not (sched.has_unfinished_requests() or sched.remote_kv.loading or sched.remote_kv.held):
            break
        run_step()
    assert not sched.has_unfinished_requests() and not sched.remote_kv.loading and not sched.remote_kv.held
    assert all(r.is_finished for r in added)
    if failure_policy == "recompute":
        assert all(r.status.finish_reason in ("stop", "length", "abort") for r in added)
    assert sched.kv_cache_manager.num_free_blocks == num_blocks
