"""OpenAI-compatible request and response bodies (pydantic).

Requests are checked here, before anything reaches the engine: known fields are strictly typed
("stream": "yes" is an error, not true), numbers are finite and in their ranges (sampling_params.FIELD_BOUNDS),
integers fit 64 bits, strings are valid Unicode, roles and content parts are the API's. A top-level field the
server does not know is refused by name. The schema says what the server accepts: fields it accepts only empty
declare so, and rules between fields are JSON Schema conditions (the server's own limits are added where the app is
built: openapi_schema.py).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, computed_field, field_validator, model_validator

from pagedserve.sampling_params import FIELD_BOUNDS, SamplingParams, StructuredOutputsParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX, json_schema_extra={"x-token-id": True})]  # below the vocabulary's size
Count = Annotated[int, Field(ge=1, le=INT64_MAX)]
# OpenAI's logit_bias: token ids, as decimal strings, each with a bias. The schema bounds the keys by the vocabulary's
# size where the app is built (x-token-id-key); the request's check is the engine's.
TOKEN_ID_KEY = r"^(0|[1-9][0-9]*)$"
LogitBias = dict[Annotated[str, Field(pattern=TOKEN_ID_KEY)], Annotated[float, Field(**FIELD_BOUNDS["logit_bias"].constraints())]]
LOGIT_BIAS_SCHEMA = {"anyOf": [{"type": "object", "propertyNames": {"pattern": TOKEN_ID_KEY, "x-token-id-key": True},
                                "additionalProperties": {"type": "number", "minimum": FIELD_BOUNDS["logit_bias"].ge,
                                                         "maximum": FIELD_BOUNDS["logit_bias"].le}},
                               {"type": "null"}],
                     "description": "token id -> a bias added to its logit before penalties, temperature and the filters"}


class NonEmpty:
    """NonEmpty[T]: a string or list of at least one."""

    def __class_getitem__(cls, kind):
        return Annotated[kind, Field(min_length=1)]


def bounded(name: str, kind=float):
    """A number in FIELD_BOUNDS[name]'s range."""
    return Annotated[kind, Field(**FIELD_BOUNDS[name].constraints())]


def only_empty(schema: dict, why: str) -> dict:
    """A field's schema when the server accepts it only empty (or null): OpenAI has it, this server does not."""
    return {"anyOf": [schema, {"type": "null"}], "description": why}


ROLES = ("system", "developer", "user", "assistant", "tool")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class RequestBody(OpenAIModel):
    """A request's top level: only the fields declared here (a field this server does not know, misspelled or not
    supported, is refused by name rather than ignored), and every string in it valid Unicode."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _strings_are_valid_unicode(cls, data):
        _check_unicode(data, "")
        return data


def _check_unicode(value, path: str) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            where = f"{path}: " if path else ""
            raise ValueError(
                f"{where}the string has a lone UTF-16 surrogate ({value[exc.start]!r} at character {exc.start}), which is not "
                "valid Unicode; send text as UTF-8, escaping characters beyond U+FFFF as surrogate pairs"
            ) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key, path)
            _check_unicode(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_unicode(item, f"{path}.{index}")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(OpenAIModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    include_usage: bool = False


class StrictModel(OpenAIModel):
    """A nested object of the request whose every field the server knows: anything else is refused by name."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, populate_by_name=True)


class JSONSchemaFormat(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None  # what the format is for; not shown to the model
    # The schema the output follows; none: any JSON object. "schema" is BaseModel's own name, hence the alias.
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class TextFormat(StrictModel):
    type: Literal["text"]


class JSONObjectFormat(StrictModel):
    type: Literal["json_object"]


class JSONSchemaResponseFormat(StrictModel):
    type: Literal["json_schema"]
    json_schema: JSONSchemaFormat


def _format_branch(value) -> str | None:
    """The branch of an output format, told by its type (its tag, which error locations leave out)."""
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return f"{kind}-branch" if kind in ("text", "json_object", "json_schema") else None


def output_format(json_schema_format: type, error_type: str):
    """An output format's type: text, any JSON object, or a JSON schema, given as json_schema_format (each API shapes
    that one its own way)."""
    return Annotated[
        Annotated[TextFormat, Tag("text-branch")] | Annotated[JSONObjectFormat, Tag("json_object-branch")]
        | Annotated[json_schema_format, Tag("json_schema-branch")],
        Discriminator(_format_branch, custom_error_type=error_type, custom_error_message="type must be text, json_object or json_schema"),
    ]


ResponseFormat = output_format(JSONSchemaResponseFormat, "response_format_type")


class StructuredOutputsFields(StrictModel):
    """vLLM's structured_outputs: exactly one structure (sampling_params.StructuredOutputsParams)."""

    json_schema: dict[str, Any] | str | None = Field(None, alias="json")
    regex: NonEmpty[str] | None = None
    choice: NonEmpty[list[NonEmpty[str]]] | None = None
    grammar: NonEmpty[str] | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_schema, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=self.json_object, disable_any_whitespace=self.disable_any_whitespace)


# vLLM's older names of structured_outputs' parts, each a field of its own.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURE_FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS)


def _structure_rules() -> list[dict]:
    """The rules between fields that a structure brings, as JSON Schema conditions: at most one field gives it (a
    text response_format gives none), and nothing then overrules where it ends (min_tokens, ignore_eos). Stated as a
    chain (a field that gives it leaves out those after it), the fewest conditions schema-driven generators can
    follow beside the chat endpoint's own: so the last field, the rarely used guided_grammar, has none, and its
    refusal of min_tokens and ignore_eos is the server's alone."""
    given_as = {"response_format": {"type": "object", "properties": {"type": {"enum": ["json_object", "json_schema"]}}},
                "structured_outputs": {"type": "object"}, "guided_json": {"type": ["object", "string"]},
                "guided_regex": {"type": "string"}, "guided_choice": {"type": "array"}, "guided_grammar": {"type": "string"}}
    absent = {name: {"type": "null"} for name in STRUCTURE_FIELDS}
    return [{"if": {"required": [name], "properties": {name: given_as[name]}},
             "then": {"properties": {**{later: absent[later] for later in STRUCTURE_FIELDS[index + 1:]},
                                     "min_tokens": {"maximum": 0}, "ignore_eos": {"const": False}}}}
            for index, name in enumerate(STRUCTURE_FIELDS[:-1])]


STRUCTURE_RULES = _structure_rules()


class ExtraSamplingFields(RequestBody):
    """Sampling fields shared by both endpoints, including the engine's extras beyond OpenAI's."""

    model_config = ConfigDict(json_schema_extra={"allOf": STRUCTURE_RULES})

    n: Count = 1
    temperature: bounded("temperature") | None = None
    top_p: bounded("top_p") | None = None
    presence_penalty: bounded("presence_penalty") = 0.0
    frequency_penalty: bounded("frequency_penalty") = 0.0
    seed: Int64 | None = None
    stop: NonEmpty[str] | list[NonEmpty[str]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: LogitBias | None = Field(None, json_schema_extra=LOGIT_BIAS_SCHEMA)
    # engine extras
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: bounded("min_p") | None = None
    repetition_penalty: bounded("repetition_penalty") | None = None
    min_tokens: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: NonEmpty[list[TokenId]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int64 = 0
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, or one of its older guided_* names.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: NonEmpty[str] | None = None
    guided_choice: NonEmpty[list[NonEmpty[str]]] | None = None
    guided_grammar: NonEmpty[str] | None = None
    # Disaggregated prefill and decode (vLLM's field): what this request's KV transfer asks of a P2pConnector engine.
    kv_transfer_params: dict[str, Any] | None = None

    def structure_field(self) -> str | None:
        """The request field that gives the output's structure, if any; more than one is a ValueError."""
        given = [name for name in STRUCTURE_FIELDS if getattr(self, name) is not None]
        if isinstance(self.response_format, TextFormat):
            given.remove("response_format")
        if len(given) > 1:
            raise ValueError(f"{given[1]} must be left out: the output's structure is given once, and {given[0]} gives it")
        return given[0] if given else None

    def structure(self) -> StructuredOutputsParams | None:
        """The output's structure, from whichever field gives it."""
        field = self.structure_field()
        if field is None:
            return None
        if field == "structured_outputs":
            return self.structured_outputs.params()
        if field == "response_format":
            schema = getattr(self.response_format, "json_schema", None)
            if schema is None or schema.json_schema is None:
                return StructuredOutputsParams(json_object=True)
            return StructuredOutputsParams(json=schema.json_schema)
        part = GUIDED_FIELDS[field]
        try:
            return StructuredOutputsParams(**{part: getattr(self, field)})
        except ValueError as exc:  # it names structured_outputs' part: the request gave it under its older name
            raise ValueError(str(exc).replace(f"structured_outputs.{part}", field, 1)) from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: SamplingParams) -> SamplingParams:
        """The request's sampling parameters; what it leaves out comes from defaults (the model's generation config)."""

        def given(value, default):
            return default if value is None else value

        return SamplingParams(
            n=self.n,
            temperature=given(self.temperature, defaults.temperature),
            top_p=given(self.top_p, defaults.top_p),
            top_k=given(self.top_k, defaults.top_k),
            min_p=given(self.min_p, defaults.min_p),
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=given(self.repetition_penalty, defaults.repetition_penalty),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            allowed_token_ids=self.allowed_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=given(max_tokens, defaults.max_tokens),
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structure(),
            logit_bias={int(token_id): bias for token_id, bias in self.logit_bias.items()} if self.logit_bias else None,
            kv_transfer_params=self.kv_transfer_params,
        )


def _prompt_shape(prompt) -> str:
    """Which form of prompt this is, told by its first item: the errors then speak of that form alone."""
    if isinstance(prompt, list) and prompt:
        return "texts-branch" if isinstance(prompt[0], str) else "id-lists-branch" if isinstance(prompt[0], list) else "ids-branch"
    return "text-branch" if isinstance(prompt, str) else "ids-branch"


# A text, texts, token ids, or lists of token ids; none of them empty.
Prompt = Annotated[
    Annotated[NonEmpty[str], Tag("text-branch")] | Annotated[NonEmpty[list[NonEmpty[str]]], Tag("texts-branch")]
    | Annotated[NonEmpty[list[TokenId]], Tag("ids-branch")] | Annotated[NonEmpty[list[NonEmpty[list[TokenId]]]], Tag("id-lists-branch")],
    Discriminator(_prompt_shape),
]


class CompletionRequest(ExtraSamplingFields):
    model: str | None = None
    prompt: Prompt
    max_tokens: Count | None = 16
    echo: bool = False
    logprobs: bounded("logprobs", int) | None = None
    # Only the prompt's last this many tokens (-1: max_model_len of them); its bound is added where the app is built.
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | Literal[-1] | None = None
    # Accepted by OpenAI but not by this server: rejected with a 400 when set.
    suffix: str | None = Field(None, json_schema_extra={"anyOf": [{"type": "null"}], "description": "not supported"})
    best_of: Int64 | None = Field(None, json_schema_extra=only_empty({"type": "integer", "minimum": 1, "maximum": 1},
                                                                    "not supported: when given, it must equal n"))

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: SamplingParams) -> SamplingParams:
        params = super().sampling_params(max_tokens, logprobs, defaults)
        return dataclasses.replace(params, truncate_prompt_tokens=self.truncate_prompt_tokens)


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextContentPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    @field_validator("content", mode="before")
    @classmethod
    def _only_text_parts(cls, content):
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"content parts of type {kind!r} are not supported; only 'text'")
        return content

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments; none: any object
    strict: bool | None = None  # a forced call always follows its parameters, strict or not


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str = Field(min_length=1)


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatTemplateFields(RequestBody):
    """How a conversation is rendered: shared by chat completions and /tokenize."""

    add_generation_prompt: bool = True
    # A Jinja template of the request's own: refused unless the server trusts request templates.
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class ChatCompletionRequest(ExtraSamplingFields, ChatTemplateFields):
    # Rules between fields, as the server applies them: top_logprobs needs logprobs; max_tokens or its newer name,
    # not both.
    model_config = ConfigDict(json_schema_extra={"allOf": [
        *STRUCTURE_RULES,
        {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
         "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
        {"if": {"required": ["max_tokens"], "properties": {"max_tokens": {"type": "integer"}}},
         "then": {"properties": {"max_completion_tokens": {"type": "null"}}}},
    ]})

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: bounded("logprobs", int) | None = None  # with logprobs true
    tools: list[ChatTool] | None = None
    # Default with tools: auto (which needs a server started with --enable-auto-tool-choice).
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # With a reasoning parser: how many of the completion tokens were reasoning.
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's: where the decode instance finds the KV


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # A reasoning model's reasoning, on a server with --reasoning-parser (reasoning_content: its older name, the same).
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @computed_field
    @property
    def reasoning_content(self) -> str | None:
        return self.reasoning


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed call: its first delta has id, type and the function's name; the next ones add to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatCompletionChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's: where the decode instance finds the KV


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @computed_field
    @property
    def reasoning_content(self) -> str | None:
        return self.reasoning


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionResponse(BaseModel):
    version: str


class TokenizePromptRequest(RequestBody):
    model: str | None = None
    prompt: str = Field(min_length=1)
    add_special_tokens: bool = True


class TokenizeChatRequest(ChatTemplateFields):
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)


def _tokenize_input(body) -> str | None:
    """The branch a /tokenize body takes (its tag, which error locations leave out), None when it gives both or neither."""
    if not isinstance(body, dict) or ("prompt" in body) == ("messages" in body):
        return None
    return "prompt-branch" if "prompt" in body else "messages-branch"


# A text or a conversation: the schema says exactly one, as the server does.
TokenizeRequest = Annotated[
    Annotated[TokenizePromptRequest, Tag("prompt-branch")] | Annotated[TokenizeChatRequest, Tag("messages-branch")],
    Discriminator(_tokenize_input, custom_error_type="tokenize_input", custom_error_message="give exactly one of prompt or messages"),
]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class EmbeddingRequest(RequestBody):
    """POST /v1/embeddings (a server with runner pooling)."""

    model: str | None = None
    input: Prompt
    encoding_format: Literal["float", "base64"] = "float"
    # A matryoshka model's embeddings shortened to their first this many values (a 400 for another model).
    dimensions: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    user: str | None = None  # the end user, for the client's own records (OpenAI's abuse monitoring); not used
    # vLLM's extras: only each prompt's last this many tokens (-1: max_model_len of them); the scheduling priority.
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | Literal[-1] | None = None
    priority: Int64 = 0


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a str: base64 of the float32 values, little-endian


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class PooledList(BaseModel):
    """What the embeddings, classify and score endpoints answer: a list of results for the request's inputs."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: EmbeddingUsage


class EmbeddingResponse(PooledList):
    data: list[EmbeddingData]


class ClassificationRequest(RequestBody):
    """POST /classify (vLLM's; a server with runner pooling over a classification model): each input's classes."""

    model: str | None = None
    input: Prompt
    user: str | None = None  # the end user, for the client's own records; not used
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | Literal[-1] | None = None
    priority: Int64 = 0
    # False: each label's logit instead of its probability.
    use_activation: bool = True


class ClassificationData(BaseModel):
    index: int
    label: str  # the most probable label's name
    probs: list[float]
    num_classes: int


class ClassificationResponse(PooledList):
    data: list[ClassificationData]
    usage: UsageInfo  # vLLM's: with completion_tokens, 0


class ScoreRequest(RequestBody):
    """POST /v1/score (vLLM's; a server with runner pooling over an embedding model or a cross-encoder): text_1's one
    text against each of text_2, or the two lists pair by pair."""

    model: str | None = None
    text_1: NonEmpty[str] | NonEmpty[list[NonEmpty[str]]]
    text_2: NonEmpty[str] | NonEmpty[list[NonEmpty[str]]]
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | Literal[-1] | None = None
    priority: Int64 = 0


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(PooledList):
    data: list[ScoreData]


class RerankRequest(RequestBody):
    """POST /v1/rerank (vLLM's, in Jina's and Cohere's shape; a server with runner pooling over an embedding model or
    a cross-encoder): documents ordered by their score against the query."""

    model: str | None = None
    query: NonEmpty[str]
    documents: NonEmpty[list[NonEmpty[str]]]
    top_n: Annotated[int, Field(ge=0, le=INT64_MAX)] = 0  # the best this many (0: all)
    return_documents: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | Literal[-1] | None = None
    priority: Int64 = 0


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class LoadLoRAAdapterRequest(RequestBody):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(RequestBody):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # accepted for vLLM's clients; the name alone says which
