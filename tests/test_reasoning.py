"""Reasoning parsers: a reasoning model's output as its reasoning and its answer, and a stream's deltas that add up
to the same parts however the text is cut."""

import random

import numpy as np
import openai
import pytest

from pagedserve.entrypoints.openai.reasoning import END, REASONING_PARSERS, START

CASES = [
    # (parser, output, reasoning, answer)
    ("deepseek_r1", "Let me see.\n</think>\n\nIt is 4.", "Let me see.\n", "\n\nIt is 4."),
    ("deepseek_r1", "<think>Hm.</think>Yes.", "Hm.", "Yes."),
    ("deepseek_r1", "Still thinking when cut off", "Still thinking when cut off", None),
    ("deepseek_r1", "</think>", None, ""),
    ("deepseek_r1", "", None, None),
    ("deepseek_r1", "a </thin b</think>c </think> d", "a </thin b", "c </think> d"),
    ("qwen3", "<think>\nPlan.\n</think>\n\nDone.", "\nPlan.\n", "\n\nDone."),
    ("qwen3", "No thinking here.", None, "No thinking here."),
    ("qwen3", "<think>cut off", "cut off", None),
    ("qwen3", "<thin", None, "<thin"),
    ("qwen3", "", None, ""),
    ("qwen3", " <think>x</think>y", None, " <think>x</think>y"),
]


@pytest.mark.parametrize("parser,output,reasoning,answer", CASES)
def test_an_output_splits_into_its_reasoning_and_its_answer(parser, output, reasoning, answer):
    assert REASONING_PARSERS[parser].split(output) == (reasoning, answer)


@pytest.mark.parametrize("parser", sorted(REASONING_PARSERS))
def test_streamed_deltas_add_up_to_the_whole_outputs_parts_however_it_is_cut(parser):
    rng = random.Random(0)
    pieces = ["<think>", "</think>", "<", "</", "think", ">", "a", " b", "\n", "<thi", "nk>", "</th", "ink>"]
    for _ in range(2000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 10)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        deltas = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]
        stream = REASONING_PARSERS[parser].stream()
        reasoning, answer = "", ""
        for delta in deltas:
            new_reasoning, new_answer = stream.feed(delta)
            reasoning, answer = reasoning + new_reasoning, answer + new_answer
        last_reasoning, last_answer = stream.finish()
        assert stream.parts(reasoning + last_reasoning, answer + last_answer) == REASONING_PARSERS[parser].split(text), (text, deltas)
        # Nothing is lost or made up: the parts and the markers that split them are the text.
        reasoning, answer = REASONING_PARSERS[parser].split(text)
        body = (reasoning or "") + ("" if answer is None else END + answer)
        assert text in (answer, body, START + body), (text, reasoning, answer)


@pytest.mark.parametrize("parser", sorted(REASONING_PARSERS))
def test_the_reasoning_tokens_are_those_up_to_the_end_of_the_reasoning(parser):
    """Against every prefix of the tokens tried in turn: the fewest whose text holds the </think> after the reasoning's
    start; all of them where it never comes; none where there is no reasoning."""
    rng = random.Random(1)
    pieces = ["<think>", "</think>", "<", "</", "think", ">", "a", " b", "<thi", "nk>", "</th", "ink>"]
    for _ in range(1000):
        token_ids = [rng.randrange(len(pieces)) for _ in range(rng.randint(0, 12))]

        def decode(ids):
            return "".join(pieces[index] for index in ids)

        text = decode(token_ids)
        skip = len(START) if text.startswith(START) else 0
        if not (skip or REASONING_PARSERS[parser].starts_inside):
            expected = 0
        else:
            expected = next((k for k in range(len(token_ids) + 1) if END in decode(token_ids[:k])[skip:]), len(token_ids))
        assert REASONING_PARSERS[parser].reasoning_tokens(token_ids, decode) == expected, text


# ---- a server with --reasoning-parser, over a model that writes one known output ------------------------------------

REASONING, ANSWER = "Let me add these numbers.", " It is four!"


def make_scripted_model(out_dir, tokenizer_dir, prompt_last_token: str, script: list[int]):
    """A Llama whose layers add nothing (their output projections are zero), so each next token follows from the current
    token alone: after the chat prompt's last token, greedy decoding writes the script, token by token."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_tokens(["<think>", "</think>"])
    sources = [tokenizer.convert_tokens_to_ids(prompt_last_token), *script[:-1]]
    assert len(set(sources)) == len(sources), "each token of the script must come after a different token"
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for index, (source, target) in enumerate(zip(sources, script)):
            direction = torch.zeros(64)
            direction[index] = 1.0
            model.model.embed_tokens.weight[source] = direction
            model.lm_head.weight[target] = 10.0 * direction
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def scripted_models(tmp_path_factory, default_model_dir):
    """Two scripted models over a tokenizer with <think> and </think> added: deepseek_r1's writes REASONING</think>ANSWER
    (its reasoning opened by the prompt), qwen3's <think>REASONING</think>ANSWER."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    tokenizer.add_tokens([START, END])
    script = [*tokenizer.encode(REASONING), tokenizer.convert_tokens_to_ids(END), *tokenizer.encode(ANSWER), tokenizer.eos_token_id]
    last = tokenizer.convert_ids_to_tokens(prompt_ids[-1])
    return {"deepseek_r1": make_scripted_model(tmp_path_factory.mktemp("r1"), default_model_dir, last, script),
            "qwen3": make_scripted_model(tmp_path_factory.mktemp("qwen3"), default_model_dir, last,
                                         [tokenizer.convert_tokens_to_ids(START), *script])}


@pytest.fixture(scope="module")
def reasoning_server(scripted_models):
    from server_utils import RemoteServer

    server = RemoteServer("--model", str(scripted_models["deepseek_r1"]), "--served-model-name", "thinker",
                          "--reasoning-parser", "deepseek_r1", "--kv-cache-memory", str(16 * 1024**2), "--max-model-len", "256")
    yield server
    assert server.stop() == 0, server.log_text()[-3000:]


ASK = [{"role": "user", "content": "What is two and two?"}]
CHOICES = ["yes", "no"]


@pytest.mark.slow
def test_chat_gives_the_reasoning_and_the_answer_apart_whole_or_streamed(reasoning_server):
    client = reasoning_server.openai()
    completion = client.chat.completions.create(model="thinker", messages=ASK, temperature=0)
    message = completion.choices[0].message
    assert (message.reasoning, message.reasoning_content, message.content) == (REASONING, REASONING, ANSWER)
    # Its reasoning tokens: the script's reasoning and the </think>.
    reasoning_count = reasoning_server.post("/tokenize", json={"model": "thinker", "prompt": REASONING}).json()["count"]
    assert completion.usage.completion_tokens_details.reasoning_tokens == reasoning_count + 1
    chunks = list(client.chat.completions.create(model="thinker", messages=ASK, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert "".join(getattr(delta, "reasoning", None) or "" for delta in deltas) == REASONING
    assert "".join(delta.content or "" for delta in deltas) == ANSWER
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == reasoning_count + 1
    # Cut off while reasoning: reasoning alone, no answer.
    cut = client.chat.completions.create(model="thinker", messages=ASK, temperature=0, max_tokens=3).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None and REASONING.startswith(cut.message.reasoning)
    # Held to a structure, the reasoning is free and the structure holds the answer after it (the script's answer is
    # not among the choices), whole or streamed.
    structure = {"structured_outputs": {"choice": CHOICES}}
    held = client.chat.completions.create(model="thinker", messages=ASK, temperature=0, max_tokens=40, extra_body=structure)
    message = held.choices[0].message
    assert message.reasoning == REASONING and message.content in CHOICES
    assert held.usage.completion_tokens_details.reasoning_tokens == reasoning_count + 1
    deltas = [chunk.choices[0].delta for chunk in client.chat.completions.create(
        model="thinker", messages=ASK, temperature=0, max_tokens=40, extra_body=structure, stream=True) if chunk.choices]
    assert "".join(getattr(delta, "reasoning", None) or "" for delta in deltas) == REASONING
    assert "".join(delta.content or "" for delta in deltas) == message.content


@pytest.mark.slow
def test_a_response_has_a_reasoning_item_before_its_message_whole_or_streamed(reasoning_server):
    client = reasoning_server.openai()
    response = client.responses.create(model="thinker", input="What is two and two?", temperature=0)
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and [part.text for part in reasoning.content] == [REASONING]
    assert message.type == "message" and response.output_text == ANSWER and reasoning.status == message.status == "completed"
    # Its tokens up to and with </think>: the script's reasoning and the marker.
    reasoning_count = reasoning_server.post("/tokenize", json={"model": "thinker", "prompt": REASONING}).json()["count"]
    assert response.usage.output_tokens_details.reasoning_tokens == reasoning_count + 1
    with client.responses.stream(model="thinker", input="What is two and two?", temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(event.delta for event in events if event.type == "response.reasoning_text.delta") == REASONING
    [done] = [event for event in events if event.type == "response.reasoning_text.done"]
    assert done.text == REASONING and [item.type for item in final.output] == ["reasoning", "message"]
    assert final.usage.output_tokens_details.reasoning_tokens == reasoning_count + 1
    assert final.output_text == ANSWER
    # The reasoning item given back as input is accepted and left out of the conversation, as a later turn by
    # previous_response_id leaves it out.
    given_back = client.responses.create(model="thinker", input=[{"role": "user", "content": "What is two and two?"}, *response.output,
                                                                 {"role": "user", "content": "And three?"}], temperature=0)
    continued = client.responses.create(model="thinker", previous_response_id=response.id, input="And three?", temperature=0)
    assert given_back.output_text == continued.output_text == ANSWER
    assert given_back.usage.input_tokens == continued.usage.input_tokens
    with pytest.raises(openai.BadRequestError) as refused:  # a token's logprob is the output text's only without reasoning
        client.responses.create(model="thinker", input="Hi", include=["message.output_text.logprobs"])
    assert refused.value.body["param"] == "include"
    listed = list(client.responses.input_items.list(continued.id, order="asc"))
    assert [item.type for item in listed] == ["message", "reasoning", "message", "message"] and listed[1].id == reasoning.id


# ---- the engine: a structure holds the answer after the reasoning ----------------------------------------------------


def test_the_gate_reads_the_reasoning_off_the_marker_tokens():
    from pagedserve.reasoning_format import REASONING_FORMATS
    from pagedserve.structured_output.reasoning_gate import OPENING, REASONING, ReasoningGate

    class Vocabulary:
        def get_vocab(self):
            return {START: 31, END: 8}

    assert ReasoningGate(REASONING_FORMATS["deepseek_r1"], Vocabulary).first_phase == REASONING
    gate = ReasoningGate(REASONING_FORMATS["qwen3"], Vocabulary)
    assert gate.first_phase == OPENING
    assert gate.advance(OPENING, [5, 6]) == (None, [5, 6])  # any first token but <think> is the answer's
    assert gate.advance(OPENING, [31, 1, 2]) == (REASONING, [])
    assert gate.advance(REASONING, [1, 2]) == (REASONING, [])
    assert gate.advance(REASONING, [1, 8, 3, 4]) == (None, [3, 4])
    assert gate.drafts_to_verify(REASONING, [1, 2, 8, 3]) == [1, 2] and gate.drafts_to_verify(REASONING, [1, 2]) == [1, 2]
    assert gate.drafts_to_verify(OPENING, [31, 1]) == []
    rows = np.zeros((2, 3), dtype=np.int32)
    rows[1, 0] = 5
    gate.allow_opening(rows, 1)  # token 31: the top bit of word 0
    assert rows[0].tolist() == [0, 0, 0] and rows[1].view(np.uint32).tolist() == [5 | 1 << 31, 0, 0]


def test_a_parser_needs_its_markers_as_single_tokens(default_model_dir):
    from pagedserve import LLM

    with pytest.raises(ValueError, match="reasoning_parser deepseek_r1 needs <think> and </think> as one token"):
        LLM(str(default_model_dir), reasoning_parser="deepseek_r1", kv_cache_memory=16 * 1024**2, max_model_len=256)


def scripted_outputs(model_dir, parser: str, prompts: list, params: list, **engine_args) -> list:
    from pagedserve import LLM

    llm = LLM(str(model_dir), reasoning_parser=parser, kv_cache_memory=16 * 1024**2, max_model_len=256, **engine_args)
    try:
        return [output.outputs[0] for output in llm.chat(prompts, params, use_tqdm=False)]
    finally:
        llm.llm_engine.client.shutdown()


@pytest.mark.slow
def test_the_engine_holds_only_the_answer_to_a_structure_after_free_reasoning(scripted_models):
    from pagedserve import SamplingParams
    from pagedserve.sampling_params import StructuredOutputsParams

    free = SamplingParams(temperature=0, max_tokens=40)
    held = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(choice=CHOICES))
    answers = {REASONING + END + choice for choice in CHOICES}
    # deepseek_r1: the output begins inside the reasoning. With n-gram drafts from a prompt that holds the reasoning,
    # drafts run across </think> too; they are verified only up to it.
    echo = [{"role": "user", "content": REASONING + END + " Then?"}]
    plain, plain_held, echoed, echoed_held = scripted_outputs(
        scripted_models["deepseek_r1"], "deepseek_r1", [ASK, ASK, echo, echo], [free, held, free, held],
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    assert plain.text == echoed.text == REASONING + END + ANSWER
    assert plain_held.text in answers and echoed_held.text == plain_held.text
    # qwen3: reasoning where the output begins with <think>; else the structure holds it from its first token.
    opened, opened_held = scripted_outputs(scripted_models["qwen3"], "qwen3", [ASK, ASK], [free, held])
    assert opened.text == START + REASONING + END + ANSWER and opened_held.text in {START + answer for answer in answers}
    [unopened_held] = scripted_outputs(scripted_models["deepseek_r1"], "qwen3", [ASK], [held])
    assert unopened_held.text in CHOICES
