"""A reasoning model's output as its reasoning and its answer (--reasoning-parser): the text between <think> and
</think> is the reasoning (chat's message.reasoning, the Responses API's reasoning item), the rest the answer, whole
or streamed; a stream's deltas add up to the whole output's parts however the text is cut into deltas.

Where each parser takes the reasoning to be is pagedserve/reasoning_format.py's rule: deepseek_r1's output begins inside
it (a <think> the model writes itself is left out), and one cut off before </think> is reasoning alone, with no answer;
qwen3's has reasoning only where it begins with <think> (with chat_template_kwargs enable_thinking false, whose template
closes an empty block in the prompt, the whole output is the answer).
"""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.reasoning_format import END, REASONING_FORMATS, START, ReasoningFormat


class ReasoningParser(ReasoningFormat):
    """A reasoning format's reading of an output's text."""

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, answer) of a whole output; None for a part it does not have."""
        stream = self.stream()
        reasoning, answer = stream.feed(text)
        last_reasoning, last_answer = stream.finish()
        return stream.parts(reasoning + last_reasoning, answer + last_answer)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.starts_inside)

    def reasoning_tokens(self, token_ids: list[int], decode: Callable[[list[int]], str]) -> int:
        """How many of an output's tokens are its reasoning, its markers included: none where it has none, all where it
        never leaves it, else the fewest whose text holds the </think> that ends it (found by bisection: the text of
        the first tokens is the beginning of the whole text, and </think> is whole characters)."""
        text = decode(token_ids)
        opened = text.startswith(START)
        if not (opened or self.starts_inside):
            return 0
        skip = len(START) if opened else 0
        if END not in text[skip:]:
            return len(token_ids)
        low, high = 0, len(token_ids)  # the end is in the text of token_ids[:high], not in that of token_ids[:low]
        while high - low > 1:
            middle = (low + high) // 2
            if END in decode(token_ids[:middle])[skip:]:
                high = middle
            else:
                low = middle
        return high


class ReasoningStream:
    """One output's text deltas in, each as (reasoning, answer) deltas out. Text that may be the beginning of a <think>
    or a </think> is held back until the next delta tells."""

    def __init__(self, starts_inside: bool) -> None:
        self.starts_inside = starts_inside
        self.phase = "start"  # then "reasoning" or "answer"; "answer" once </think> came
        self.held = ""
        self.had_reasoning = False

    def feed(self, delta: str) -> tuple[str, str]:
        held = self.held + delta
        reasoning, answer = "", ""
        if self.phase == "start":
            if START.startswith(held) and len(held) < len(START):
                self.held = held
                return "", ""
            opened = held.startswith(START)
            if opened:
                held = held[len(START):]
            self._enter("reasoning" if opened or self.starts_inside else "answer")
        if self.phase == "reasoning":
            end = held.find(END)
            if end < 0:
                kept = _undecided_tail(held)
                reasoning, held = held[:len(held) - kept], held[len(held) - kept:]
            else:
                reasoning, held = held[:end], held[end + len(END):]
                self.phase = "answer"
        if self.phase == "answer":
            answer, held = held, ""
        self.held = held
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What was held back, once the output is whole: where it was undecided, as the text it is."""
        held, self.held = self.held, ""
        if self.phase == "start":
            self._enter("reasoning" if self.starts_inside else "answer")
        return (held, "") if self.phase == "reasoning" else ("", held)

    def parts(self, reasoning: str, answer: str) -> tuple[str | None, str | None]:
        """The whole output's (reasoning, answer) from its deltas: None for a part it never reached, and for reasoning
        with no text."""
        return (reasoning if self.had_reasoning and reasoning else None), (answer if self.reached_answer else None)

    @property
    def reached_answer(self) -> bool:
        return self.phase == "answer"

    def _enter(self, phase: str) -> None:
        self.phase = phase
        self.had_reasoning = phase == "reasoning"


def _undecided_tail(text: str) -> int:
    """How many characters at the end of text could begin a </think> still to come."""
    for length in range(min(len(text), len(END) - 1), 0, -1):
        if END.startswith(text[-length:]):
            return length
    return 0


REASONING_PARSERS = {name: ReasoningParser(form.name, form.starts_inside) for name, form in REASONING_FORMATS.items()}
