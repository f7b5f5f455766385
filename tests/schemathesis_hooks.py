"""Schemathesis hooks for the coverage-phase test. One rule between fields cannot be stated in JSON Schema: min_tokens
<= max_tokens. The coverage phase takes each field to its bounds with the others at their defaults, so in the tester's
copy of the schema the completions endpoint's min_tokens stops at max_tokens' default."""

import schemathesis

COMPLETIONS_DEFAULT_MAX_TOKENS = 16


@schemathesis.hook
def before_load_schema(ctx, raw_schema: dict) -> None:
    min_tokens = raw_schema["components"]["schemas"]["CompletionRequest"]["properties"]["min_tokens"]
    min_tokens["maximum"] = COMPLETIONS_DEFAULT_MAX_TOKENS
