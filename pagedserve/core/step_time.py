"""How long an engine step takes, as a function of what it carries: a linear model fit online, by
recursive least squares with forgetting, to the steps the engine times. The scheduler uses it to
bound the prompt tokens it adds to a step while streams decode (stall-free scheduling, after
Sarathi-Serve: the token budget follows a latency target). For a mixture of experts the model has one
more feature, the experts a step's tokens touch: each expert a step touches is read whole, however
few of its tokens chose it, so a mixture's step cost grows with the batch fast and then flattens."""

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

    @property
    def num_tokens(self) -> int:
        return self.decode_tokens + self.prefill_tokens

    def features(self) -> tuple[float, float, float, float]:
        return 1.0, float(self.decode_tokens), float(self.prefill_tokens), self.attention_pairs / _PAIRS_PER_UNIT


@dataclass(frozen=True, slots=True)
class ExpertRouting:
    """A mixture of experts' routing, as the step-time model prices it: experts in each layer, experts each
    token chooses."""

    num_experts: int
    experts_per_token: int

    def experts_touched(self, num_tokens: int) -> float:
        """The experts of a layer that num_tokens tokens choose between them, expected were every token's choice
        uniform and independent. Real routers are skewed (fewer experts touched): the fit's weight on this feature
        absorbs a constant skew."""
        return self.num_experts * (1.0 - (1.0 - self.experts_per_token / self.num_experts) ** num_tokens)


def chunk_attention_pairs(query_len: int, context_len: int) -> float:
    return query_len * (context_len + (query_len + 1) / 2)


class ShapeTally:
    """What a step carries, added up as the step is built: by the scheduler's StepPlan, by the stall bound for the
    decode-only batch it measures against, and by the engine for its warm-up steps. The one place that says what
    a decode and a prompt chunk cost in each feature."""

    __slots__ = ("decode_tokens", "prefill_tokens", "attention_pairs")

    def __init__(self) -> None:
        self.decode_tokens = 0
        self.prefill_tokens = 0
        self.attention_pairs = 0.0

    def add_decode(self, num_tokens: int, context_len: int) -> None:
        """A decode: its last token (and any drafts it verifies) after context_len tokens with K/V."""
        self.decode_tokens += num_tokens
        self.attention_pairs += num_tokens * (context_len + 1)

    def add_decodes(self, num_requests: int, sum_of_context_lens: int) -> None:
        """num_requests decodes of one token each, after contexts that add up to sum_of_context_lens: as many
        add_decode(1, context_len) calls."""
        self.decode_tokens += num_requests
        self.attention_pairs += sum_of_context_lens + num_requests

    def add_chunk(self, num_tokens: int, context_len: int) -> None:
        """A chunk of a prompt after context_len tokens with K/V."""
        self.prefill_tokens += num_tokens
        self.attention_pairs += chunk_attention_pairs(num_tokens, context_len)

    def shape(self) -> StepShape:
        return StepShape(self.decode_tokens, self.prefill_tokens, self.attention_pairs)


def uniform_step_shape(num_seqs: int, seq_len: int, context_len: int) -> StepShape:
    """The shape of a step of num_seqs alike sequences: decodes when seq_len is 1, else prompt chunks."""
    tally = ShapeTally()
    for _ in range(num_seqs):
        if seq_len == 1:
            tally.add_decode(1, context_len)
        else:
            tally.add_chunk(seq_len, context_len)
    return tally.shape()


class StepTimeModel:
    """seconds ~ overhead + per decode token + per prompt token + per attention unit (+ per expert touched, for a
    mixture of experts), every weight >= 0.

    The fit is least squares over all observed steps, older ones weighted down by `forgetting` per step in the
    direction each new step informs, constrained to non-negative weights: the features move together (a
    bigger batch has more decode tokens and more attention), and an unconstrained fit trades a negative
    overhead for inflated per-token costs, which over-predicts exactly the decode-only steps the stall limit
    is measured against."""

    def __init__(self, forgetting: float = 0.98, min_observations: int = 5, experts: ExpertRouting | None = None) -> None:
        self.forgetting = forgetting
        self.min_observations = min_observations
        self.experts = experts
        n = self._num_features = 5 if experts else 4
        self._gram = [[0.0] * n for _ in range(n)]  # sum of x x^T, old steps weighted down (_forget_along)
        self._moment = [0.0] * n  # sum of x * seconds, likewise
        self._weights = [0.0] * n
        self._stale = False  # refit lazily: observing is every step, predicting only when prompts wait
        self.num_observations = 0
        self._saw_prefill = self._saw_decode_only = False

    @property
    def ready(self) -> bool:
        """Fit to enough steps, decode-only and with prompt tokens, to tell their costs apart."""
        return self.num_observations >= self.min_observations and self._saw_prefill and self._saw_decode_only

    @property
    def weights(self) -> list[float]:
        if self._stale:
            self._weights = nonnegative_least_squares(self._gram, self._moment)
            self._stale = False
        return self._weights

    def features(self, shape: StepShape) -> tuple[float, ...]:
        if self.experts is None:
            return shape.features()
        return shape.features() + (self.experts.experts_touched(shape.num_tokens),)

    def observe(self, shape: StepShape, seconds: float) -> None:
        x = self.features(shape)
        self._forget_along(x)
        n = self._num_features
        for i in range(n):
            self._moment[i] += x[i] * seconds
            row = self._gram[i]
            for j in range(n):
                row[j] += x[i] * x[j]
        self._stale = True
        self.num_observations += 1
        self._saw_prefill |= shape.prefill_tokens > 0
        self._saw_decode_only |= shape.prefill_tokens == 0 and shape.decode_tokens > 0

    def _forget_along(self, x: tuple[float, ...]) -> None:
        """Weight the old steps down only in the direction the new step informs (directional forgetting): a long
        run of one step shape (one stream decoding for minutes) then refreshes what it measures and keeps what
        earlier steps said about the others, which uniform forgetting would erase. Keeps G^-1 m where it was."""
        gram, moment, n = self._gram, self._moment, self._num_features
        gx = [sum(gram[i][j] * x[j] for j in range(n)) for i in range(n)]
        information = sum(x[i] * gx[i] for i in range(n))
        if information <= 1e-12:
            return
        lose = (1.0 - self.forgetting) / information
        xm = sum(x[i] * moment[i] for i in range(n))
        for i in range(n):
            moment[i] -= lose * gx[i] * xm
            row = gram[i]
            for j in range(n):
                row[j] -= lose * gx[i] * gx[j]

    def predict(self, shape: StepShape) -> float:
        return sum(w * v for w, v in zip(self.weights, self.features(shape)))

    def prefill_cost(self, query_len: int, context_len: int, step_tokens: int = 0) -> float:
        """Seconds a chunk adds to a step that carries step_tokens tokens without it (the experts the step touches
        already are not read twice)."""
        weights = self.weights
        _, _, per_token, per_unit = weights[:4]
        seconds = per_token * query_len + per_unit * chunk_attention_pairs(query_len, context_len) / _PAIRS_PER_UNIT
        if self.experts is not None:
            touched = self.experts.experts_touched
            seconds += weights[4] * (touched(step_tokens + query_len) - touched(step_tokens))
        return seconds

    def max_chunk(self, seconds: float, context_len: int, limit: int, step_tokens: int = 0) -> int:
        """The longest chunk (at most limit tokens) after context_len tokens that fits in seconds, in a step that
        carries step_tokens tokens without it."""
        if self.prefill_cost(limit, context_len, step_tokens) <= seconds:
            return limit
        low, high = 0, limit  # prefill_cost grows with the chunk: bisect
        while low < high:
            middle = (low + high + 1) // 2
            if self.prefill_cost(middle, context_len, step_tokens) <= seconds:
                low = middle
            else:
                high = middle - 1
        return low


def nonnegative_least_squares(gram: list[list[float]], moment: list[float]) -> list[float]:
    """argmin over w >= 0 of w^T G w - 2 m^T w, given the normal equations G = X^T X, m = X^T y. With four or
    five unknowns every support is tried: the optimum is the unconstrained solution on its own support, and
    no feasible candidate beats it (31 supports for the five of a mixture of experts)."""
    n = len(moment)
    best, best_objective = [0.0] * n, 0.0
    for mask in range(1, 1 << n):
        support = [i for i in range(n) if mask >> i & 1]
        solution = _solve([[gram[i][j] for j in support] for i in support], [moment[i] for i in support])
        if solution is None or min(solution) < 0.0:
            continue
        weights = [0.0] * n
        for i, value in zip(support, solution):
            weights[i] = value
        objective = sum(weights[i] * gram[i][j] * weights[j] for i in support for j in support) - 2.0 * sum(
            weights[i] * moment[i] for i in support)
        if objective < best_objective:
            best, best_objective = weights, objective
    return best


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when the system is (nearly) singular, as it is for a
    feature the steps have not varied yet."""
    n = len(rhs)
    rows = [matrix[i][:] + [rhs[i]] for i in range(n)]
    scale = max(abs(rows[i][i]) for i in range(n)) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        if abs(rows[pivot][col]) <= 1e-12 * scale:
            return None
        rows[col], rows[pivot] = rows[pivot], rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / rows[col][col]
            if factor:
                for c in range(col, n + 1):
                    rows[r][c] -= factor * rows[col][c]
    solution = [0.0] * n
    for i in reversed(range(n)):
        solution[i] = (rows[i][n] - sum(rows[i][j] * solution[j] for j in range(i + 1, n))) / rows[i][i]
    return solution
