"""Where a reasoning model's output holds its reasoning (reasoning_parser, --reasoning-parser): between <think> and
</think>, and the answer after. The front end splits the output's text by it (entrypoints/openai/reasoning.py); the
engine core lets a constrained request reason freely and holds only its answer to the structure
(structured_output/reasoning_gate.py), reading the same rule off the two markers' token ids.

- deepseek_r1: the output begins inside the reasoning (these models' templates open <think> in the prompt).
- qwen3: the output has reasoning only where it begins with <think>.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_inside: bool  # whether the output begins inside the reasoning without a <think> of its own

    def marker_ids(self, tokenizer) -> tuple[int, int]:
        """The token ids of <think> and </think> in an HF tokenizer's vocabulary, where each is one token (reasoning
        models have them so); ValueError naming reasoning_parser otherwise."""
        vocabulary = tokenizer.get_vocab()
        missing = [marker for marker in (START, END) if marker not in vocabulary]
        if missing:
            raise ValueError(f"reasoning_parser {self.name} needs {' and '.join(missing)} as one token of the model's "
                             "vocabulary (a structured output begins after </think>), and this tokenizer has no such token")
        return vocabulary[START], vocabulary[END]


REASONING_FORMATS = {"deepseek_r1": ReasoningFormat("deepseek_r1", starts_inside=True),
                     "qwen3": ReasoningFormat("qwen3", starts_inside=False)}
