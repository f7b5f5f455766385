"""Structured outputs: a request's structure (JSON schema, regex, choice, grammar) compiled with xgrammar against the
model's vocabulary, and a grammar state per constrained request that says, each step, which tokens may come next."""
