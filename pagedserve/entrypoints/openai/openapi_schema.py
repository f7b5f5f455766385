"""The server's /openapi.json: FastAPI's schema of the routes, made to say what this server accepts, so that a
client (or a schema-driven tester) that sends a schema-valid request is served:

- its bad bodies get a 400 (errors.py), not FastAPI's 422;
- integer bounds are exact: FastAPI's OpenAPI model holds them as floats, and 2**63 - 1 as a float is 2**63, which
  the server refuses;
- the server's own limits: token ids (and logit_bias's keys) below the vocabulary's size, at most max_n samples, generated tokens within
  the context, a request's own chat template only where the server trusts them (else null), an embedding's dimensions
  only where the model's embeddings may be shortened, to the sizes they may be (else null)."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pagedserve.entrypoints.openai.protocol import INT64_MAX, INT64_MIN


@dataclass(frozen=True)
class ServedLimits:
    vocab_size: int
    max_n: int
    max_model_len: int
    trust_request_chat_template: bool
    matryoshka_dimensions: list[int] | None = None  # the sizes an embedding may be shortened to (None: none)


def served_schema(app: FastAPI, limits: ServedLimits) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _drop_422(schema)
        _each_schema(schema, _exact_integer_bounds)
        _apply_limits(schema["components"]["schemas"], limits)
        app.openapi_schema = schema
    return app.openapi_schema


def _drop_422(schema: dict) -> None:
    for path in schema["paths"].values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    for name in ("HTTPValidationError", "ValidationError"):
        schema.get("components", {}).get("schemas", {}).pop(name, None)


def _each_schema(node, visit) -> None:
    """visit(schema) for every object in the document, depth first."""
    if isinstance(node, dict):
        visit(node)
        for value in node.values():
            _each_schema(value, visit)
    elif isinstance(node, list):
        for value in node:
            _each_schema(value, visit)


def _exact_integer_bounds(node: dict) -> None:
    if node.get("type") == "integer":
        for key in ("minimum", "maximum"):
            if isinstance(node.get(key), float):
                node[key] = min(max(int(node[key]), INT64_MIN), INT64_MAX)


def _apply_limits(bodies: dict, limits: ServedLimits) -> None:
    """The server's limits in its bodies' schemas (the bodies of the routes it serves: generation, or its pooling model's)."""
    _each_schema(bodies, _bound_token_ids(limits.vocab_size - 1))

    def properties(name: str) -> dict:
        return bodies.get(name, {}).get("properties", {})

    for name in ("CompletionRequest", "ChatCompletionRequest"):
        if "n" in properties(name):
            properties(name)["n"]["maximum"] = limits.max_n
    properties("DetokenizeRequest")["tokens"]["maxItems"] = limits.max_model_len
    # Generated tokens follow at least one prompt token in the context.
    for name, field in (("CompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_tokens"),
                        ("ChatCompletionRequest", "max_completion_tokens"), ("CompletionRequest", "min_tokens"),
                        ("ChatCompletionRequest", "min_tokens"), ("ResponsesRequest", "max_output_tokens")):
        if field in properties(name):
            _integer_branch(properties(name)[field])["maximum"] = limits.max_model_len - 1
    for name in ("CompletionRequest", "EmbeddingRequest", "ClassificationRequest", "ScoreRequest", "RerankRequest"):
        if "truncate_prompt_tokens" in properties(name):
            _integer_branch(properties(name)["truncate_prompt_tokens"])["maximum"] = limits.max_model_len
    if "dimensions" in properties("EmbeddingRequest"):
        properties("EmbeddingRequest")["dimensions"] = _dimensions_schema(limits.matryoshka_dimensions)
    if not limits.trust_request_chat_template:
        for name in ("ChatCompletionRequest", "TokenizeChatRequest"):
            if name in bodies:
                bodies[name]["properties"]["chat_template"] = {
                    "type": "null", "description": "a request's own template: this server does not accept them"}


def _dimensions_schema(allowed: list[int] | None) -> dict:
    if allowed is None:
        return {"type": "null", "description": "this model's embeddings are not shortened (not a matryoshka model)"}
    contiguous = allowed == list(range(1, allowed[-1] + 1))
    sizes = {"type": "integer", "minimum": 1, "maximum": allowed[-1]} if contiguous else {"type": "integer", "enum": allowed}
    return {"anyOf": [sizes, {"type": "null"}], "description": "the embedding's first this many values, normalized again"}


def _integer_branch(field: dict) -> dict:
    """The integer range of an optional integer field (its first integer branch: a constant, such as -1, comes after)."""
    return next(branch for branch in field.get("anyOf", [field]) if branch.get("type") == "integer")


def _bound_token_ids(largest: int):
    key_pattern = decimal_pattern_up_to(largest)

    def visit(node: dict) -> None:
        if node.pop("x-token-id", False):
            node["maximum"] = largest
        if node.pop("x-token-id-key", False):
            node["pattern"] = key_pattern
    return visit


def decimal_pattern_up_to(largest: int) -> str:
    """A regular expression of the numbers 0 to largest in decimal, without leading zeros: the numbers of fewer
    digits, then those of as many, by the first digit where they fall below largest."""
    digits = str(largest)
    alternatives = ["0"] + ["[1-9]" + (f"[0-9]{{{length - 1}}}" if length > 1 else "") for length in range(1, len(digits))]
    for i, digit in enumerate(digits):
        low, rest = (1 if i == 0 else 0), len(digits) - i - 1
        if int(digit) > low:
            alternatives.append(digits[:i] + f"[{low}-{int(digit) - 1}]" + (f"[0-9]{{{rest}}}" if rest else ""))
    if largest:
        alternatives.append(digits)
    return "^(" + "|".join(alternatives) + ")$"
