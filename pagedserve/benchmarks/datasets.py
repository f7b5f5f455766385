"""Benchmark requests from a fixed seed: random token ids of uniform or mixed lengths, and multi-turn
chat conversations built from the English passages in data/passages.txt (written for this project)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# Ids below this are special/control tokens in most vocabularies; random prompts avoid them.
_FIRST_ORDINARY_ID = 100
PASSAGES_FILE = Path(__file__).with_name("data") / "passages.txt"
# The `mixed` lengths: as real traffic varies.
MIXED_INPUT_RANGE, MIXED_OUTPUT_RANGE = (16, 512), (16, 256)


@dataclass
class BenchRequest:
    prompt_token_ids: list[int] | None  # a completion prompt as token ids...
    output_len: int
    messages: list[dict] | None = None  # ...or a conversation, for the chat endpoint
    ignore_eos: bool = True  # False: the answer ends where the model ends it (max output_len)

    def as_messages(self, rng: random.Random) -> list[dict]:
        """The request as a conversation: its own, or a user message of passage text about as long as its prompt."""
        if self.messages is not None:
            return self.messages
        # About 4 words to 3 tokens in English.
        return [{"role": "user", "content": passage_text(rng, round(len(self.prompt_token_ids) * 0.75))}]

    def as_prompt(self):
        """The request as a completion prompt: its token ids, or its conversation as plain text."""
        if self.prompt_token_ids is not None:
            return self.prompt_token_ids
        return "\n".join(f"{m['role']}: {m['content']}" for m in self.messages) + "\nassistant:"


def random_requests(num_prompts: int, input_len: int, output_len: int, vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    return [BenchRequest(_random_ids(rng, input_len, vocab_size), output_len) for _ in range(num_prompts)]


def mixed_requests(num_prompts: int, vocab_size: int, seed: int = 0, input_range=MIXED_INPUT_RANGE,
                   output_range=MIXED_OUTPUT_RANGE) -> list[BenchRequest]:
    """Lengths uniform in the ranges, as real traffic varies."""
    rng = random.Random(seed)
    return [
        BenchRequest(_random_ids(rng, rng.randint(*input_range), vocab_size), rng.randint(*output_range)) for _ in range(num_prompts)
    ]


def chat_requests(num_prompts: int, seed: int = 0, output_range=(32, 256), max_turns: int = 4) -> list[BenchRequest]:
    """Multi-turn conversations over the passages: a user shares a passage and asks about it, the assistant
    answers (with text from the passages standing in for earlier answers), and so on for 1 to max_turns turns;
    each request asks for the next answer."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        messages = [{"role": "system", "content": "You are a helpful assistant who answers questions about texts."}]
        for turn in range(rng.randint(1, max_turns)):
            if turn:
                messages.append({"role": "assistant", "content": passage_text(rng, rng.randint(20, 80))})
            question = rng.choice(_QUESTIONS)
            messages.append({"role": "user", "content": f"{question}\n\n{rng.choice(passages())}" if turn == 0 else question})
        requests.append(BenchRequest(None, rng.randint(*output_range), messages))
    return requests


def copy_requests(num_prompts: int, seed: int = 0, max_output_len: int = 256) -> list[BenchRequest]:
    """Conversations asking the model to repeat, or lightly edit, about 160 words of passage text: answers that
    copy their prompt, where prompt-lookup speculation pays. They end where the model ends them."""
    rng = random.Random(seed)
    texts = passages()
    requests = []
    for _ in range(num_prompts):
        first = rng.randrange(len(texts))
        text = f"{texts[first]}\n\n{texts[(first + 1) % len(texts)]}"
        old_word, new_word = rng.choice(_EDITS)
        instruction = rng.choice((
            "Repeat the following text exactly, word for word.",
            "Copy out the following text without changing anything.",
            f"Rewrite the following text, replacing the word '{old_word}' with '{new_word}' and changing nothing else.",
            "Rewrite the following text with British spelling, changing nothing else.",
        ))
        requests.append(BenchRequest(None, max_output_len, [{"role": "user", "content": f"{instruction}\n\n{text}"}], ignore_eos=False))
    return requests


_EDITS = (("the", "this"), ("and", "plus"), ("was", "seemed"), ("of", "from"), ("a", "one"))

_QUESTIONS = (
    "Summarize this passage in two sentences.", "What is the main idea here?", "Rewrite the passage for a ten-year-old.",
    "Which details in the text surprised you, and why?", "Give the passage a title and explain your choice.",
    "What would happen next if the story continued?", "List three facts the passage states.",
)


@lru_cache(maxsize=1)
def passages() -> tuple[str, ...]:
    return tuple(p.strip() for p in PASSAGES_FILE.read_text().split("\n\n") if p.strip())


def passage_text(rng: random.Random, num_words: int) -> str:
    """About num_words words of running passage text, from a random place."""
    words = " ".join(passages()).split()
    start = rng.randrange(len(words))
    return " ".join(words[(start + i) % len(words)] for i in range(max(1, num_words)))


def _random_ids(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(_FIRST_ORDINARY_ID, vocab_size) for _ in range(length)]
