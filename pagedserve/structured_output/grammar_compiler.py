"""A request's structure compiled by xgrammar against the model's vocabulary. xgrammar caches compiled grammars by
their text, so a structure that many requests share compiles once. The front end compiles within a time limit to
refuse a bad or too costly structure with a message naming it; the engine core compiles off its step loop. xgrammar
(and the transformers it imports) loads with the first compile: an engine that is never asked for a structure does
not pay for it at start."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING

from pagedserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr

# xgrammar's messages start with a time and a C++ source location: "[16:26:18] /project/cpp/x.cc:83: Regex ...".
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")
# Compiled grammars kept, in bytes: a JSON schema's is tens of kilobytes, any JSON's a few hundred.
_CACHE_LIMIT_BYTES = 256 << 20


_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regular expression", "choice": "choice",
               "grammar": "grammar"}


class StructureError(ValueError):
    """A structure that does not compile (or not in time). field: the SamplingParams field at fault (a server names the
    request field the structure came from instead)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(f"the {_KIND_NAMES[kind]} cannot be used: {message}")
        self.field = f"structured_outputs.{kind}"


class GrammarCompiler:
    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, stop_token_ids: list[int]) -> None:
        """load_tokenizer: the model's HF tokenizer, loaded at the first compile (most engines never compile one).
        vocab_size: the width of the model's logits, which the masks cover. stop_token_ids: the tokens a finished
        structure allows (the model's EOS)."""
        self._load_tokenizer = load_tokenizer
        self._tokenizer = None
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: xgr.GrammarCompiler | None = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def compile(self, spec: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The spec's grammar, compiled (or from the cache). Raises StructureError naming the field at fault."""
        compiler = self._xgrammar_compiler()
        kind = spec.kind
        try:
            if kind == "json":
                return compiler.compile_json_schema(spec.json, any_whitespace=not spec.disable_any_whitespace)
            if kind == "json_object":  # an object, as OpenAI's json_object promises (not any JSON value)
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=not spec.disable_any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_grammar(spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError) as exc:  # xgrammar's errors for a structure it cannot read
            raise StructureError(kind, _SOURCE_PREFIX.sub("", str(exc)).strip()) from None

    def compile_within(self, spec: StructuredOutputsParams, time_limit_s: float) -> xgr.CompiledGrammar:
        """compile(), refused with a StructureError when it takes longer than time_limit_s. The compile goes on in its
        thread (xgrammar cannot be interrupted) and lands in the cache; this thread does not wait for it."""
        future = self._compile_pool().submit(self.compile, spec)
        try:
            return future.result(timeout=time_limit_s)
        except FutureTimeout:
            raise StructureError(spec.kind, f"it did not compile within {time_limit_s:g} s; simplify it") from None

    def _compile_pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
            return self._pool

    def _xgrammar_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer_locked(), vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                # One thread: compiling shares the machine with the model's steps.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=_CACHE_LIMIT_BYTES)
            return self._compiler

    def tokenizer(self):
        """The model's HF tokenizer, loaded once."""
        with self._lock:
            return self._tokenizer_locked()

    def _tokenizer_locked(self):
        if self._tokenizer is None:
            self._tokenizer = self._load_tokenizer()
        return self._tokenizer


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose sentences are exactly the given strings (a JSON string literal is an EBNF one)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
