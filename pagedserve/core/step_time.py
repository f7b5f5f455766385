"""How long an engine step takes, as a function of what it carries: a linear model fit online, by
recursive least squares with forgetting, to the steps the engine times. The scheduler uses it to
bound the prompt tokens it adds to a step while streams decode (stall-free scheduling, after
Sarathi-Serve: the token budget follows a latency target)."""

from __future__ import annotations

from dataclasses import dataclass

# Attention work is counted in thousands of (query token, key token) pairs, so that its weight is of
# the same order as the others'.
_PAIRS_PER_UNIT = 1000.0


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step carries: decode tokens (one per decoding request), prompt tokens, and the attention
    work of both (query-key pairs: a decode attends its context, a chunk of q tokens after L its context
    and, causally, itself)."""

    decode_tokens: int = 0
    prefill_tokens: int = 0
    attention_pairs: float = 0.0

    def features(self) -> tuple[float, float, float, float]:
        return 1.0, float(self.decode_tokens), float(self.prefill_tokens), self.attention_pairs / _PAIRS_PER_UNIT


def chunk_attention_pairs(query_len: int, context_len: int) -> float:
    return query_len * (context_len + (query_len + 1) / 2)


class StepTimeModel:
    """seconds ~ overhead + per decode token + per prompt token + per attention unit."""

    def __init__(self, forgetting: float = 0.98, min_observations: int = 5) -> None:
        self.forgetting = forgetting
        self.min_observations = min_observations
        self.weights = [0.0, 0.0, 0.0, 0.0]
        self._inverse = [[1e3 if i == j else 0.0 for j in range(4)] for i in range(4)]  # P = (X^T X)^-1, a weak prior
        self.num_observations = 0
        self._saw_prefill = self._saw_decode_only = False

    @property
    def ready(self) -> bool:
        """Fit to enough steps, decode-only and with prompt tokens, to tell their costs apart."""
        return self.num_observations >= self.min_observations and self._saw_prefill and self._saw_decode_only

    def observe(self, shape: StepShape, seconds: float) -> None:
        x = shape.features()
        p = self._inverse
        px = [sum(p[i][j] * x[j] for j in range(4)) for i in range(4)]
        denominator = self.forgetting + sum(x[i] * px[i] for i in range(4))
        gain = [v / denominator for v in px]
        error = seconds - sum(w * v for w, v in zip(self.weights, x))
        self.weights = [w + g * error for w, g in zip(self.weights, gain)]
        self._inverse = [[(p[i][j] - gain[i] * px[j]) / self.forgetting for j in range(4)] for i in range(4)]
        self.num_observations += 1
        self._saw_prefill |= shape.prefill_tokens > 0
        self._saw_decode_only |= shape.prefill_tokens == 0 and shape.decode_tokens > 0

    def predict(self, shape: StepShape) -> float:
        return sum(max(w, 0.0) * v for w, v in zip(self.weights, shape.features()))

    def prefill_cost(self, query_len: int, context_len: int) -> float:
        """Seconds a chunk adds to a step."""
        _, _, per_token, per_unit = (max(w, 0.0) for w in self.weights)
        return per_token * query_len + per_unit * chunk_attention_pairs(query_len, context_len) / _PAIRS_PER_UNIT

    def max_chunk(self, seconds: float, context_len: int, limit: int) -> int:
        """The longest chunk (at most limit tokens) after context_len tokens that fits in seconds."""
        if self.prefill_cost(limit, context_len) <= seconds:
            return limit
        low, high = 0, limit  # prefill_cost grows with the chunk: bisect
        while low < high:
            middle = (low + high + 1) // 2
            if self.prefill_cost(middle, context_len) <= seconds:
                low = middle
            else:
                high = middle - 1
        return low
