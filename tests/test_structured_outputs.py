"""Structured outputs: outputs that follow a JSON schema, a regular expression, a choice or a grammar; greedy ones token
for token what transformers generates under the same grammar (xgrammar's logits processor), in every engine mode;
masked draws that follow the renormalized distribution; structures that cannot be used refused by name."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch
from conftest import chi_square_p_value, engine_core_of, token_ids_of

from pagedserve import LLM, SamplingParams
from pagedserve.engine.wire import EngineCoreRequest
from pagedserve.layers.sampler import apply_token_bitmask_
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.structured_output.grammar_compiler import StructureError

# One schema for each kind of constraint an agent's schema has.
SCHEMAS = {
    "nested objects": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {"name": {"type": "string"}, "city": {"type": "string"}},
                   "required": ["name", "city"]}}, "required": ["person"]},
    "array of enums": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3}},
        "required": ["colors"]},
    "bounded numbers": {"type": "object", "properties": {
        "age": {"type": "integer", "minimum": 18, "maximum": 99}, "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["age", "score"]},
    "patterned string": {"type": "object", "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "ok": {"type": "boolean"}}, "required": ["code", "ok"]},
}
QUESTION = "Give me an example as JSON."


def chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


def constrained(temperature: float = 0.0, max_tokens: int = 120, **structure) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=7, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**structure))


def assert_follows_schema(output, schema) -> None:
    """A finished output parses and validates; one cut by max_tokens must say so."""
    if output.finish_reason == "length":
        return
    assert output.finish_reason == "stop", output
    jsonschema.validate(json.loads(output.text), schema)


@pytest.mark.parametrize("name", SCHEMAS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_parse_and_validate(default_llm, tokenizer, name, temperature):
    schema = SCHEMAS[name]
    outputs = default_llm.generate([chat(tokenizer, QUESTION)] * 3, constrained(temperature, json=schema), use_tqdm=False)
    for output in outputs:
        assert_follows_schema(output.outputs[0], schema)
    assert any(o.outputs[0].finish_reason == "stop" for o in outputs)


def test_json_object_regex_choice_and_grammar(default_llm, tokenizer):
    prompt = chat(tokenizer, "Answer briefly.")
    structures = [dict(json_object=True), dict(regex=r"[0-9]{3}-[0-9]{4}"), dict(choice=["yes", "no", "maybe so"]),
                  dict(grammar='root ::= "The answer is " ("left" | "right") "."'),
                  dict(json={"type": "object"}, disable_any_whitespace=True)]
    outputs = default_llm.generate([prompt] * len(structures), [constrained(1.0, **s) for s in structures], use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs), texts
    assert isinstance(json.loads(texts[0]), dict)
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", texts[1])
    assert texts[2] in ("yes", "no", "maybe so")
    assert re.fullmatch(r"The answer is (left|right)\.", texts[3])
    assert isinstance(json.loads(texts[4]), dict) and not re.search(r"\s", texts[4].replace('" ', '"').split('"')[0])


def test_each_sample_of_n_follows_the_structure_and_unconstrained_requests_beside_it_are_unchanged(default_llm, tokenizer):
    prompt = chat(tokenizer, QUESTION)
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    alone = default_llm.generate([prompt], plain, use_tqdm=False)[0].outputs[0].token_ids
    schema = SCHEMAS["bounded numbers"]
    mixed = default_llm.generate([prompt, prompt], [SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=80,
                                                                   structured_outputs=StructuredOutputsParams(json=schema)), plain],
                                 use_tqdm=False)
    for sample in mixed[0].outputs:
        assert_follows_schema(sample, schema)
    assert len({sample.text for sample in mixed[0].outputs}) > 1
    assert mixed[1].outputs[0].token_ids == alone


def transformers_under_grammar(model_dir, tokenizer, prompt_ids, spec: StructuredOutputsParams, max_new_tokens: int) -> list[int]:
    """Reference: transformers' greedy generation with xgrammar's own logits processor over the same grammar."""
    import xgrammar as xgr
    import xgrammar.contrib.hf
    from transformers import AutoModelForCausalLM

    from pagedserve.structured_output.grammar_compiler import GrammarCompiler

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    compiler = GrammarCompiler(lambda: tokenizer, model.config.vocab_size, [tokenizer.eos_token_id])
    processor = xgr.contrib.hf.LogitsProcessor(compiler.compile(spec))
    with torch.inference_mode():
        input_ids = torch.tensor([prompt_ids])
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False,
                             logits_processor=[processor], eos_token_id=tokenizer.eos_token_id, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


CASES = [(QUESTION, dict(json=SCHEMAS["nested objects"])), ("What is 12 times 12?", dict(regex=r"[0-9]+")),
         ("Name a fruit.", dict(choice=["apple", "banana", "cherry"]))]


def test_greedy_outputs_equal_transformers_under_the_same_grammar(default_llm, default_hf_dir, tokenizer):
    prompts = [tokenizer(chat(tokenizer, question), add_special_tokens=False).input_ids for question, _ in CASES]
    specs = [StructuredOutputsParams(**structure) for _, structure in CASES]
    ours = default_llm.generate([{"prompt_token_ids": p} for p in prompts],
                                [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=s) for s in specs], use_tqdm=False)
    for output, prompt_ids, spec in zip(ours, prompts, specs):
        expected = transformers_under_grammar(default_hf_dir, tokenizer, prompt_ids, spec, 60)
        assert output.outputs[0].token_ids == expected


def test_constrained_outputs_unchanged_by_preemption_chunking_and_prefix_caching(default_model_dir, default_llm, tokenizer):
    prompts = [chat(tokenizer, f"{QUESTION} Example {i}.") for i in range(6)] * 2  # repeats hit the prefix cache
    params = [constrained(json=SCHEMAS[name]) for name in SCHEMAS] * 3
    expected = token_ids_of(default_llm.generate(prompts, params, use_tqdm=False))
    # 20 blocks of 16 tokens for 12 requests of ~100 tokens, prompts chunked by 32: they preempt each other.
    llm = LLM(str(default_model_dir), max_model_len=256, num_gpu_blocks_override=20, max_num_batched_tokens=64,
              long_prefill_token_threshold=32)
    assert token_ids_of(llm.generate(prompts, params, use_tqdm=False)) == expected
    stats = engine_core_of(llm).get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


def test_speculative_drafts_are_cut_to_the_grammar_and_outputs_are_unchanged(default_model_dir, default_llm):
    """Prompt lookup drafts the copied text, capitals and digits included; a grammar of lower-case words refuses those
    drafts part-way (the grammar steps back over each step's drafts). Greedy outputs equal decoding without drafts."""
    text = "the quick brown fox jumps over the lazy dog. The Quick Brown Fox Jumps Over The Lazy Dog 1 2 3. "
    prompts = [f"Repeat this text: {text * 3}\nRepeated: {text[:30]}", f"{text * 2} Again: the quick"]
    params = constrained(max_tokens=48, regex=r"[a-z .]+")
    expected = token_ids_of(default_llm.generate(prompts, params, use_tqdm=False))
    llm = LLM(str(default_model_dir), max_model_len=1024, kv_cache_memory=128 * 1024**2,
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    manager = engine_core_of(llm).structured_output
    offered, allowed = [], []
    cut = manager.allowed_drafts

    def count(request_id, drafts):
        kept = cut(request_id, drafts)
        offered.append(len(drafts))
        allowed.append(len(kept))
        return kept

    manager.allowed_drafts = count
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids_of(outputs) == expected
    assert all(re.fullmatch(r"[a-z .]+", o.outputs[0].text) for o in outputs)
    assert sum(allowed) > 0, "no draft was verified"
    assert sum(allowed) < sum(offered), "no draft was cut by the grammar"
    assert engine_core_of(llm).get_stats().spec.num_accepted_tokens > 0


@pytest.mark.parametrize("structure,field,message", [
    (dict(json={"type": "objec"}), "structured_outputs.json", "Unsupported type"),
    (dict(regex="(ab"), "structured_outputs.regex", "parenthesis"),
    (dict(grammar="root ::= "), "structured_outputs.grammar", "EBNF"),
])
def test_a_structure_that_does_not_compile_is_refused_by_name_and_others_run(default_llm, structure, field, message):
    with pytest.raises(StructureError, match=message) as raised:
        default_llm.generate(["Hi"], constrained(**structure), use_tqdm=False)
    assert raised.value.field == field
    assert default_llm.generate(["Hi"], constrained(choice=["a", "b"]), use_tqdm=False)[0].outputs[0].text in ("a", "b")


@pytest.mark.parametrize("kwargs,message", [
    (dict(), "exactly one of"), (dict(regex="a", choice=["b"]), "exactly one of"), (dict(choice=[]), "choice must be"),
    (dict(json="{not json"), "not JSON"), (dict(json="[1]"), "a JSON schema"),
])
def test_structure_parameters_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("field,value", [("min_tokens", 3), ("ignore_eos", True)])
def test_settings_that_would_overrule_the_structures_end_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"), **{field: value})


def test_a_structure_the_engine_cannot_compile_ends_its_request_with_a_reason(default_llm):
    """The front end compiles first; a request that reaches the engine core with a bad structure all the same is not
    lost: it ends (abort), and the core goes on with the others."""
    core = engine_core_of(default_llm)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="(ab"), eos_token_ids=[2])
    core.add_request(EngineCoreRequest("bad-structure", [1, 2, 3], params, time.monotonic()))
    core.add_request(EngineCoreRequest("fine", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=2), time.monotonic()))
    finished = {}
    deadline = time.monotonic() + 30
    while len(finished) < 2 and time.monotonic() < deadline:
        finished.update({o.request_id: o.finish_reason for o in core.step() if o.finished})
    assert finished == {"bad-structure": "abort", "fine": "length"}


# ---- the masks -------------------------------------------------------------------------------------------------


def random_bitmask(rows: int, vocab: int, allowed_share: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bitmask [rows, ceil(vocab / 32)] int32, allowed [rows, vocab] bool), with a run of whole words all allowed and
    one all forbidden (the kernel's shortcuts)."""
    generator = torch.Generator().manual_seed(seed)
    allowed = torch.rand(rows, vocab, generator=generator) < allowed_share
    allowed[:, 64:96], allowed[:, 96:128] = True, False
    words = -(-vocab // 32)
    padded = torch.zeros(rows, words * 32, dtype=torch.int64)
    padded[:, :vocab] = allowed.long()
    packed = (padded.view(rows, words, 32) << torch.arange(32)).sum(-1)
    return (packed - (packed >= 2**31).long() * 2**32).to(torch.int32), allowed


@pytest.mark.parametrize("vocab", [200, 49152, 1000 + 7])
def test_bitmask_kernel_equals_the_torch_path(vocab):
    from pagedserve.layers import cpu_kernels

    bitmask, allowed = random_bitmask(3, vocab, 0.3, seed=vocab)
    rows = torch.tensor([4, 0, 2])
    logits = torch.randn(5, vocab)
    by_kernel, by_torch = logits.clone(), logits.clone()
    apply_token_bitmask_(by_kernel, bitmask, rows, cpu_kernels.load())
    apply_token_bitmask_(by_torch, bitmask, rows)
    assert torch.equal(by_kernel, by_torch)
    expected = logits.clone()
    expected[rows] = torch.where(allowed, logits[rows], float("-inf"))
    assert torch.equal(by_kernel, expected)  # untouched rows (1, 3) stay as they were


def test_masked_draws_follow_the_renormalized_distribution():
    """Many draws from one masked row: only allowed tokens, in the proportions of the model's distribution renormalized
    over them (chi-square at a fixed seed); the same test rejects draws held to a distribution a little off."""
    from pagedserve.layers import cpu_kernels

    kernels = cpu_kernels.load()
    vocab, draws = 3000, 40_000
    torch.manual_seed(0)
    logits = torch.randn(vocab) * 3.0
    bitmask, allowed = random_bitmask(1, vocab, 0.05, seed=1)
    rows = logits.expand(draws, vocab).contiguous()
    apply_token_bitmask_(rows, bitmask.expand(draws, -1).contiguous(), torch.arange(draws), kernels)
    column = lambda value, dtype=torch.float32: torch.full((draws,), value, dtype=dtype)  # noqa: E731
    tokens = kernels.sample_rows(rows, column(1.0), column(0, torch.long), column(1.0), column(0.0), column(99, torch.long),
                                 torch.arange(draws))
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[~allowed[0]].sum() == 0, "drew a token the mask forbids"
    renormalized = torch.where(allowed[0], torch.softmax(logits.double(), 0), 0.0)
    assert chi_square_p_value(counts, renormalized / renormalized.sum()) > 1e-4
    off = torch.where(allowed[0], torch.softmax(logits.double() / 1.1, 0), 0.0)
    assert chi_square_p_value(counts, off / off.sum()) < 1e-4


def test_a_repetition_penalty_below_float32s_range_keeps_forbidden_tokens_forbidden(default_llm):
    """A penalty that is 0 in float32 would turn a forbidden token's -inf into NaN, which greedy picks."""
    params = SamplingParams(temperature=0.0, max_tokens=6, repetition_penalty=5e-324,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    output = default_llm.generate(["0 0 0"], params, use_tqdm=False)[0].outputs[0]
    assert re.fullmatch("[a-z]+", output.text) and output.finish_reason in ("stop", "length"), output


def test_a_structure_that_compiles_too_slowly_is_refused_and_still_lands_in_the_cache(default_llm):
    """The time limit refuses without waiting for the compile, which goes on and is cached for the next request."""
    compiler = default_llm.llm_engine.front_end.grammars
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i}}}$"} for i in range(1, 40)}}
    spec = StructuredOutputsParams(json=schema)
    with pytest.raises(StructureError, match="did not compile within"):
        compiler.compile_within(spec, time_limit_s=1e-6)
    assert compiler.compile_within(spec, time_limit_s=30) is not None
