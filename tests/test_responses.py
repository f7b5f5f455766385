"""The Responses API (/v1/responses) through the official openai client: a response is the chat completion of its
conversation (instructions, input items, and the stored turns its previous_response_id names), streamed as the API's
events that add up to it, with function calls that round-trip as output and input items; stored responses are
retrieved and deleted; bad requests are 4xx naming their field."""

from __future__ import annotations

import json
import time

import jsonschema
import openai
import pytest
from server_utils import RemoteServer, metric_value

from pagedserve.entrypoints.openai.responses_protocol import ResponseObject
from pagedserve.entrypoints.openai.responses_store import ResponseStore

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}


@pytest.fixture(scope="module")
def server():
    remote = RemoteServer("--max-model-len", "1024", "--kv-cache-memory", str(64 * 1024**2))
    yield remote
    remote.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def chat_text(client, messages, max_tokens, **kwargs):
    completion = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=max_tokens, temperature=0,
                                                **kwargs)
    return completion.choices[0], completion.usage


@pytest.mark.slow
def test_a_response_is_the_chat_completion_of_its_conversation(client):
    response = client.responses.create(model=MODEL, instructions="Answer in French.", input="Name a colour.",
                                       max_output_tokens=12, temperature=0)
    conversation = [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Name a colour."}]
    choice, usage = chat_text(client, conversation, 12)
    assert response.output_text == choice.message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert response.usage.total_tokens == usage.total_tokens
    assert response.status == ("incomplete" if choice.finish_reason == "length" else "completed")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == response.status
    assert response.instructions == "Answer in French." and response.model == MODEL and response.max_output_tokens == 12
    assert response.tool_choice == "none" and response.text.format.type == "text"


@pytest.mark.slow
def test_previous_response_id_continues_the_stored_conversation_without_its_instructions(client):
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="Name a fruit.", max_output_tokens=10, temperature=0)
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input=[{"role": "user", "content": "Another one?"}],
                                     max_output_tokens=10, temperature=0)
    # The same conversation sent whole, the first output's items given back as they came.
    resent = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Name a fruit."}, *first.output,
                                                        {"role": "user", "content": "Another one?"}], max_output_tokens=10, temperature=0)
    assert resent.output_text == second.output_text
    choice, usage = chat_text(client, [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": first.output_text},
                                       {"role": "user", "content": "Another one?"}], 10)
    assert second.output_text == choice.message.content and second.usage.input_tokens == usage.prompt_tokens
    assert second.previous_response_id == first.id
    stored = client.responses.retrieve(first.id)
    assert stored.id == first.id and stored.output_text == first.output_text and stored.usage == first.usage
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.create(model=MODEL, previous_response_id=first.id, input="And?", max_output_tokens=4)
    assert gone.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2, include=[], background=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.slow
def test_streamed_events_add_up_to_the_response(client):
    whole = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=200, temperature=0)
    with client.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=200, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text and final.status == whole.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == final.output_text  # a streamed response is stored too
    # Cut by max_output_tokens: the last event says so.
    cut = list(client.responses.create(model=MODEL, input="Count to fifty.", max_output_tokens=3, temperature=0, stream=True))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.incomplete_details.reason == "max_output_tokens"
    assert cut[-1].response.usage.output_tokens == 3


def _assert_same_logprobs(actual, expected) -> None:
    """The same tokens and alternatives; the logprobs close, not equal: a later run of the same prompt reads its prefix
    from the cache, whose sums may differ from a fresh prefill's in the last bits."""
    def tokens(entries):
        return [(e.token, e.bytes, [(t.token, t.bytes) for t in e.top_logprobs]) for e in entries]

    def values(entries):
        return [value for e in entries for value in (e.logprob, *(t.logprob for t in e.top_logprobs))]

    assert tokens(actual) == tokens(expected)
    assert values(actual) == pytest.approx(values(expected), abs=1e-4)


@pytest.mark.slow
def test_included_logprobs_are_the_chat_completions_whole_or_streamed(client):
    asked = {"model": MODEL, "input": "Name a color.", "max_output_tokens": 8, "temperature": 0,
             "include": ["message.output_text.logprobs"], "top_logprobs": 3}
    response = client.responses.create(**asked)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a color."}], max_completion_tokens=8,
                                          temperature=0, logprobs=True, top_logprobs=3)
    [text] = response.output[0].content
    expected = chat.choices[0].logprobs.content
    _assert_same_logprobs(text.logprobs, expected)
    assert len(expected) == response.usage.output_tokens and response.top_logprobs == 3
    assert all(len(entry.top_logprobs) == 3 for entry in expected)
    # Streamed: each text delta carries the logprobs of the tokens whose text it brings; the text's done event all of them.
    with client.responses.stream(**asked) as stream:
        events = list(stream)
    in_deltas = [entry for event in events if event.type == "response.output_text.delta" for entry in event.logprobs]
    [done] = [event for event in events if event.type == "response.output_text.done"]
    _assert_same_logprobs(done.logprobs, expected)
    assert in_deltas and [e.token for e in in_deltas] == [e.token for e in done.logprobs][: len(in_deltas)]
    # Not included: none, whatever top_logprobs says (as the API has it).
    plain = client.responses.create(model=MODEL, input="Name a color.", max_output_tokens=4, top_logprobs=3)
    assert plain.output[0].content[0].logprobs == []


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_calls_round_trip_as_output_and_input_items(client, tool_choice):
    ask = "What is the weather in Paris?"
    response = client.responses.create(model=MODEL, input=ask, tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False,
                                       max_output_tokens=60, temperature=0)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id and response.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert response.tools[0].name == "get_weather"
    assert response.tool_choice == "required" if tool_choice == "required" else response.tool_choice.name == "get_weather"
    with client.responses.stream(model=MODEL, input=ask, tools=[WEATHER], tool_choice=tool_choice, parallel_tool_calls=False,
                                 max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
        [streamed] = stream.get_final_response().output
    assert (streamed.name, streamed.arguments) == (call.name, call.arguments)
    assert "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta") == call.arguments
    # The call and its output go back as input items: the conversation the chat endpoint runs.
    answer = client.responses.create(model=MODEL, input=[{"role": "user", "content": ask}, *response.output,
                                                        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
                                     tools=[WEATHER], tool_choice="none", max_output_tokens=12, temperature=0)
    choice, _ = chat_text(client, [{"role": "user", "content": ask},
                                   {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                                                         "function": {"name": call.name, "arguments": call.arguments}}]},
                                   {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}], 12,
                          tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], tool_choice="none")
    assert answer.output_text == choice.message.content
    # As an agent loop sends it: only the call's output, after the stored response that made the call.
    continued = client.responses.create(model=MODEL, previous_response_id=response.id, tools=[WEATHER], tool_choice="none",
                                        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
                                        max_output_tokens=12, temperature=0)
    assert continued.output_text == answer.output_text
    # What went into it, as items: the stored turn's input and its call (the same item), then the call's output.
    listed = list(client.responses.input_items.list(continued.id, order="asc"))
    assert [item.type for item in listed] == ["message", "function_call", "function_call_output"]
    assert listed[1].id == call.id and (listed[1].call_id, listed[1].arguments) == (call.call_id, call.arguments)
    assert (listed[2].call_id, listed[2].output) == (call.call_id, "Sunny, 21 C") and listed[2].id


@pytest.mark.slow
def test_input_items_are_what_went_into_a_response_page_by_page(server, client):
    """GET /v1/responses/{id}/input_items: the stored turns' items and the request's own, each with an id (an earlier
    output's own), the latest first unless asked otherwise, a page at a time; logprobs only where included."""
    first = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Name a fruit."}], max_output_tokens=6,
                                    temperature=0, include=["message.output_text.logprobs"])
    second = client.responses.create(model=MODEL, previous_response_id=first.id, max_output_tokens=4,
                                     input=[{"role": "user", "content": [{"type": "input_text", "text": "Another one?"}]}])
    # One item a page: the client follows each page's last id to the next.
    listed = list(client.responses.input_items.list(second.id, limit=1, order="asc"))
    assert [(item.type, item.role) for item in listed] == [("message", "user"), ("message", "assistant"), ("message", "user")]
    assert [part.text for item in listed for part in item.content] == ["Name a fruit.", first.output_text, "Another one?"]
    assert [part.type for item in listed for part in item.content] == ["input_text", "output_text", "input_text"]
    assert listed[1].id == first.output[0].id and listed[1].content[0].logprobs == []
    assert len({item.id for item in listed}) == 3
    latest_first = client.responses.input_items.list(second.id)
    assert [item.id for item in latest_first.data] == [item.id for item in reversed(listed)] and not latest_first.has_more
    page = client.responses.input_items.list(second.id, limit=2, order="asc")
    assert (page.first_id, page.last_id, page.has_more) == (listed[0].id, listed[1].id, True)
    with_logprobs = client.responses.input_items.list(second.id, order="asc", include=["message.output_text.logprobs"]).data
    assert with_logprobs[1].content[0].logprobs == first.output[0].content[0].logprobs != []
    assert [item.id for item in client.responses.input_items.list(first.id).data] == [listed[0].id]
    for query, status, param in [(f"after={first.id}", 404, "after"), ("limit=0", 400, "limit"), ("limit=101", 400, "limit"),
                                 ("order=up", 400, "order"), ("include=reasoning.encrypted_content", 400, "include"),
                                 ("include%5B%5D=reasoning.encrypted_content", 400, "include")]:
        answer = server.get(f"/v1/responses/{second.id}/input_items?{query}")
        assert (answer.status_code, answer.json()["error"]["param"]) == (status, param), answer.text
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp-unknown")


@pytest.mark.slow
def test_a_json_schema_text_format_holds_the_output(client):
    response = client.responses.create(model=MODEL, input="Describe a person.", max_output_tokens=150, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.text.format.type == "json_schema"


@pytest.mark.slow
@pytest.mark.parametrize("fields,status,param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]}, 400, "input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, 400, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, 400, "input"),  # no message to answer: reasoning is left out
    ({"input": []}, 400, "input"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, 400, "tools"),
    ({"input": "Hi", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "Hi", "tools": [WEATHER]}, 400, "tool_choice"),  # auto: this server reads no calls from text
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, 400, "tool_choice"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, 400, "text.format"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, 400, "text.format"),
    ({"input": "Hi", "reasoning": {"effort": "low"}}, 400, "reasoning"),
    ({"input": "Hi", "truncation": "middle"}, 400, "truncation"),
    ({"input": "Hi", "include": ["reasoning.encrypted_content"]}, 400, "include"),
    ({"input": "Hi", "include": ["message.output_text.logprobs"], "tools": [WEATHER], "tool_choice": "required"}, 400, "include"),
    ({"input": "Hi", "top_logprobs": 21}, 400, "top_logprobs"),
    ({"input": "Hi", "background": True, "store": False}, 400, "background"),
    ({"input": "Hi", "metadata": {str(index): "v" for index in range(17)}}, 400, "metadata"),
    ({"input": "Hi", "temperature": -1}, 400, "temperature"),
    ({"input": "Hi", "previous_response_id": "resp-unknown"}, 404, "previous_response_id"),
    ({"input": "Hi", "model": "not-served"}, 404, "model"),
])
def test_bad_requests_are_4xx_naming_the_field_and_the_server_goes_on(server, client, fields, status, param):
    answer = server.post("/v1/responses", json={"model": MODEL, **fields})
    assert answer.status_code == status and answer.json()["error"]["param"] == param, answer.text
    assert client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).status == "incomplete"


def test_a_request_past_the_context_length_is_a_400_in_words_that_fit_this_api(server):
    answer = server.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 5000})
    message = answer.json()["error"]["message"]
    assert answer.status_code == 400 and "maximum context length is 1024 tokens" in message, answer.text
    assert "max_tokens" not in message


@pytest.mark.slow
def test_truncation_auto_drops_the_earliest_turns_as_many_as_the_context_needs(server, client):
    """A conversation longer than the model's context (1024 tokens here): refused as it is, and with truncation auto run
    as the chat completion of its longest tail of whole turns that leaves max_output_tokens of room."""
    turns = []
    for index in range(6):
        turns += [{"role": "user", "content": f"Note {index}: " + "the river runs past the old mill " * 25},
                  {"role": "assistant", "content": f"Noted {index}."}]
    turns.append({"role": "user", "content": "Which note came last?"})
    asked = {"model": MODEL, "input": turns, "instructions": "Be brief.", "max_output_tokens": 16, "temperature": 0}
    with pytest.raises(openai.BadRequestError, match="max_model_len 1024|maximum context length is 1024"):
        client.responses.create(**asked)
    response = client.responses.create(**asked, truncation="auto")

    def prompt_length(start: int) -> int:
        messages = [{"role": "system", "content": "Be brief."}, *turns[start:]]
        return server.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["count"]

    user_starts = [index for index, turn in enumerate(turns) if turn["role"] == "user"]
    kept = next(start for start in user_starts if prompt_length(start) + 16 <= 1024)
    assert kept > 0 and prompt_length(user_starts[user_starts.index(kept) - 1]) + 16 > 1024
    choice, usage = chat_text(client, [{"role": "system", "content": "Be brief."}, *turns[kept:]], 16)
    assert response.output_text == choice.message.content and response.usage.input_tokens == usage.prompt_tokens
    assert response.truncation == "auto" and response.status in ("completed", "incomplete")


def test_the_longest_tail_that_fits_begins_at_a_turn():
    """fitting_turns against every start tried in turn: the first user message (or the start) from which the tail fits,
    and the last turn where none does; never a tool's answer or an assistant message."""
    import asyncio
    import random

    from pagedserve.entrypoints.openai.responses_protocol import fitting_turns

    rng = random.Random(0)
    for _ in range(300):
        messages = [{"role": rng.choice(["user", "assistant", "tool"]), "length": rng.randint(1, 50)} for _ in range(rng.randint(1, 12))]
        limit = rng.randint(0, 300)
        tried = []

        async def fits(start: int, messages=messages, limit=limit, tried=tried) -> bool:
            tried.append(start)
            return sum(message["length"] for message in messages[start:]) <= limit

        starts = [0] + [index for index, message in enumerate(messages) if index and message["role"] == "user"]
        expected = next((start for start in starts if asyncio.run(fits(start))), starts[-1])
        tried.clear()
        assert asyncio.run(fitting_turns(messages, fits)) == expected
        assert set(tried) <= set(starts) and len(tried) <= len(starts).bit_length()


def _when_ended(client, response_id: str, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, "the background response did not end"
        time.sleep(0.05)
    return response


@pytest.mark.slow
def test_a_background_response_runs_on_and_reads_back_as_the_same_response_would(client):
    asked = {"model": MODEL, "input": "Name a fruit.", "max_output_tokens": 12, "temperature": 0}
    started = client.responses.create(**asked, background=True)
    assert started.background and started.status in ("queued", "in_progress") and started.output == []
    done = _when_ended(client, started.id)
    whole = client.responses.create(**asked)
    assert (done.status, done.output_text, done.usage.output_tokens) == (whole.status, whole.output_text, whole.usage.output_tokens)
    assert client.responses.cancel(done.id).status == done.status  # ended: cancelling changes nothing
    after = client.responses.create(model=MODEL, previous_response_id=done.id, input="Another one?", max_output_tokens=4)
    assert after.status in ("completed", "incomplete")


@pytest.mark.slow
def test_a_streamed_background_response_runs_on_without_its_client_and_streams_again_from_any_event(server, client):
    asked = {"model": MODEL, "input": "Count from 1 to 20.", "max_output_tokens": 40, "temperature": 0}
    first_part = []
    with client.responses.create(**asked, background=True, stream=True) as stream:
        for event in stream:  # the client reads up to its first text, then goes away
            first_part.append(event)
            if event.type == "response.output_text.delta":
                break
    response_id = first_part[0].response.id
    assert first_part[0].response.background and [event.sequence_number for event in first_part] == list(range(len(first_part)))
    resumed = list(client.responses.retrieve(response_id, stream=True, starting_after=first_part[-1].sequence_number))
    events = first_part + resumed
    assert [event.sequence_number for event in events] == list(range(len(events)))
    whole = client.responses.create(**asked)
    assert events[-1].type == f"response.{whole.status}" and events[-1].response.output_text == whole.output_text
    assert "".join(event.delta for event in events if event.type == "response.output_text.delta") == whole.output_text
    assert _when_ended(client, response_id).output_text == whole.output_text
    # Read again from the start, after it ended: the same events.
    again = list(client.responses.retrieve(response_id, stream=True))
    assert [(event.type, event.sequence_number) for event in again] == [(event.type, event.sequence_number) for event in events]
    # Only a streamed background response has events to give again; starting_after belongs to a stream.
    with pytest.raises(openai.ConflictError) as not_streamed:
        list(client.responses.retrieve(whole.id, stream=True))
    assert not_streamed.value.body["param"] == "stream"
    answer = server.get(f"/v1/responses/{response_id}?starting_after=3")
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, "starting_after"), answer.text
    # Cancelled while it streams: its stream ends, with no completed event, and the engine is freed.
    long = client.responses.create(model=MODEL, input="Count from 1 to 1000, separated by commas.", max_output_tokens=900,
                                   temperature=0, background=True, stream=True)
    started = next(iter(long))
    long.close()
    assert client.responses.cancel(started.response.id).status == "cancelled"
    kinds = [event.type for event in client.responses.retrieve(started.response.id, stream=True)]
    assert kinds[0] == "response.created" and not any(kind in ("response.completed", "response.incomplete") for kind in kinds)
    deadline = time.monotonic() + 30
    while metric_value(server.get("/metrics").text, "pagedserve:num_requests_running") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.slow
def test_cancelling_a_background_response_stops_it_and_frees_what_it_held(server, client):
    generated_before = metric_value(server.get("/metrics").text, "pagedserve:generation_tokens_total")
    started = client.responses.create(model=MODEL, input="Count from 1 to 1000, separated by commas.", max_output_tokens=900,
                                      temperature=0, background=True)
    [asked] = client.responses.input_items.list(started.id).data  # known while it runs
    assert asked.content[0].text == "Count from 1 to 1000, separated by commas."
    with pytest.raises(openai.ConflictError) as unfinished:  # nothing to continue from yet
        client.responses.create(model=MODEL, previous_response_id=started.id, input="And then?")
    assert unfinished.value.body["param"] == "previous_response_id"
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(started.id).status == "cancelled"
    deadline = time.monotonic() + 30
    while metric_value(metrics := server.get("/metrics").text, "pagedserve:num_requests_running") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert metric_value(metrics, "pagedserve:kv_cache_usage_perc") == 0
    assert metric_value(metrics, "pagedserve:generation_tokens_total") - generated_before < 900  # stopped, not run out
    with pytest.raises(openai.ConflictError) as plain:  # only a background response can be cancelled
        client.responses.cancel(client.responses.create(model=MODEL, input="Hi", max_output_tokens=2).id)
    assert plain.value.body["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp-unknown")


def test_the_store_drops_the_oldest_beyond_its_limit():
    store = ResponseStore(max_responses=2)
    responses = [ResponseObject(model=MODEL) for _ in range(3)]
    for response in responses:
        store.put(response, [], [{"role": "user", "content": response.id}])
    assert store.get(responses[0].id) is None
    kept = responses[1:]
    assert [store.get(response.id).conversation for response in kept] == [[{"role": "user", "content": r.id}] for r in kept]
    assert store.delete(responses[1].id) and not store.delete(responses[1].id)


def test_a_stream_that_fails_ends_with_the_apis_error_event_and_aborts_its_request():
    """Past its created event, a response whose engine goes away ends with an error event (no [DONE]: the API's
    streams end with their last event), and its sub-request is aborted."""
    import asyncio
    from types import SimpleNamespace

    from pagedserve.engine.core_client import EngineDeadError
    from pagedserve.entrypoints.openai.serving_base import ServingBase
    from pagedserve.entrypoints.openai.serving_responses import _ResponseEvents, _Run
    from pagedserve.entrypoints.openai.tool_calls import ToolPlan

    aborted = []

    async def abort(sub_id):
        aborted.append(sub_id)

    serving = SimpleNamespace(engine=SimpleNamespace(abort=abort))
    events = _ResponseEvents(None, _Run(ResponseObject(model=MODEL), [("resp-1-0", None)], ToolPlan("none"), [], [], chat_request=None))

    async def failing():
        yield events.event("response.created", response={})
        raise EngineDeadError("the engine core died")

    async def read():
        stream = ServingBase.sse_stream(serving, [("resp-1-0", None)], failing(), SimpleNamespace(state=SimpleNamespace()),
                                        error_event=events.error)
        return [chunk async for chunk in stream]

    created, failed = asyncio.run(read())
    assert created.startswith("event: response.created\n")
    assert failed.startswith("event: error\n")
    error = json.loads(failed.split("data: ", 1)[1])
    assert error == {"type": "error", "sequence_number": 1, "code": "503", "message": "the engine core died", "param": None}
    assert aborted == ["resp-1-0"]


def test_a_server_that_keeps_no_responses_refuses_store_true():
    """--max-stored-responses 0: a request that asks for its response to be kept (store true, the API's default) is a 400
    naming store, before anything runs."""
    import asyncio

    from pagedserve.entrypoints.openai.errors import APIError
    from pagedserve.entrypoints.openai.responses_protocol import ResponsesRequest
    from pagedserve.entrypoints.openai.serving_responses import OpenAIServingResponses

    serving = OpenAIServingResponses(chat=None, store=ResponseStore(max_responses=0))
    with pytest.raises(APIError) as refused:
        asyncio.run(serving.create_response(ResponsesRequest(input="Hi"), raw_request=None))
    assert refused.value.status == 400 and refused.value.param == "store"


def test_output_items_carried_to_a_later_turn_are_the_conversation_the_same_items_sent_back_make():
    """A stored response's output goes into its conversation as the same items sent back as input would: its text and
    its calls one assistant message, as a chat completion's message holds them."""
    from pagedserve.entrypoints.openai.responses_protocol import (
        FunctionCallOutput,
        OutputMessage,
        OutputText,
        ResponsesRequest,
        conversation_of,
    )

    output = [OutputMessage(content=[OutputText(text="Let me look.")]),
              FunctionCallOutput(call_id="call_1", name="get_weather", arguments='{"city": "Paris"}'),
              FunctionCallOutput(call_id="call_2", name="get_weather", arguments='{"city": "Rome"}')]
    sent_back = ResponsesRequest.model_validate({"input": [item.model_dump(mode="json") for item in output]}).input_items()
    calls = [{"id": f"call_{index}", "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{city}"}}'}}
             for index, city in ((1, "Paris"), (2, "Rome"))]
    expected = [{"role": "assistant", "content": "Let me look.", "tool_calls": calls}]
    assert conversation_of([item.as_input() for item in output]) == conversation_of(sent_back) == expected
