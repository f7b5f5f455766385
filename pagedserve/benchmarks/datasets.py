"""Benchmark prompts: random token ids with a fixed seed, uniform or mixed lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Ids below this are special/control tokens in most vocabularies; random prompts avoid them.
_FIRST_ORDINARY_ID = 100


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(_random_ids(rng, input_len, vocab_size), output_len) for _ in range(num_prompts)]


def mixed_requests(num_prompts: int, vocab_size: int, seed: int = 0, input_range=(16, 512), output_range=(16, 256)) -> list[BenchRequest]:
    """Lengths uniform in the ranges, as real traffic varies."""
    rng = random.Random(seed)
    return [
        BenchRequest(_random_ids(rng, rng.randint(*input_range), vocab_size), rng.randint(*output_range)) for _ in range(num_prompts)
    ]


def _random_ids(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(_FIRST_ORDINARY_ID, vocab_size) for _ in range(length)]
