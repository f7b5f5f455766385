"""Schemathesis hooks for the coverage-phase test: rules between fields and values that JSON Schema cannot state.

- min_tokens <= max_tokens: the coverage phase takes each field to its bounds with the others at their defaults, so
  in the tester's copy of the schema the completions endpoint's min_tokens stops at max_tokens' default.
- A structure must compile: in the tester's copy, the grammars and the schemas given as text that it may send are
  ones that do.
- A named tool_choice must name one of the request's tools, and "required" and a named function compile the tools'
  parameters: in the tester's copy, tool_choice is "none" or "auto" (the server runs with --enable-auto-tool-choice).
- A stored response's starting_after picks up a stream, so it needs stream true: the coverage phase takes one query
  field at a time, so the tester's copy leaves starting_after out (test_responses.py reads streams with it).
- On a pooling model's server, a score request's text_1 holds one text or as many as text_2: in the tester's copy,
  one."""

import schemathesis

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# What JSON Schema cannot say of a structure, that it compiles, said of the strings that are not compiled by any
# rule of their own: a grammar and a schema given as text, each as a pattern of ones that do (a string outside it is
# refused, as the schema then says).
GRAMMAR = {"type": "string", "pattern": '^root ::= "[a-z]"$'}
SCHEMA_TEXT = {"type": "string", "pattern": "^[{][}]$"}


@schemathesis.hook
def before_load_schema(ctx, raw_schema: dict) -> None:
    bodies = raw_schema["components"]["schemas"]
    if "ScoreRequest" in bodies:  # a pooling model's server
        _pair_scores(bodies)
        return
    bodies["CompletionRequest"]["properties"]["min_tokens"]["maximum"] = COMPLETIONS_DEFAULT_MAX_TOKENS
    for body in ("CompletionRequest", "ChatCompletionRequest"):
        fields = bodies[body]["properties"]
        fields["guided_grammar"] = {"anyOf": [GRAMMAR, {"type": "null"}]}
        fields["guided_json"] = {"anyOf": [{"type": "object"}, SCHEMA_TEXT, {"type": "null"}]}
    bodies["ChatCompletionRequest"]["properties"]["tool_choice"] = {"anyOf": [{"enum": ["none", "auto"]}, {"type": "null"}]}
    structured = bodies["StructuredOutputsFields"]["properties"]
    structured["grammar"] = {"anyOf": [GRAMMAR, {"type": "null"}]}
    structured["json"] = {"anyOf": [{"type": "object"}, SCHEMA_TEXT, {"type": "null"}]}
    retrieve = raw_schema["paths"]["/v1/responses/{response_id}"]["get"]
    retrieve["parameters"] = [parameter for parameter in retrieve["parameters"] if parameter["name"] != "starting_after"]


def _pair_scores(bodies: dict) -> None:
    """The score endpoint pairs text_1 with text_2 (one against each, or as many as it): text_1 one text."""
    bodies["ScoreRequest"]["properties"]["text_1"] = {"type": "string", "minLength": 1}
