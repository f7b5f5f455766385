"""The sampling distribution and the draw rule, defined once: the sampler draws by them (in the C++ kernel on CPU,
in torch elsewhere, token for token the same), speculative decoding verifies and drafts by them, and the tests
hold the kernel to them.

**The distribution** of a row under temperature t, min-p, top-k and top-p (after penalties and min_tokens bans):
weights w = exp((x - max x) / t), so the most likely token weighs 1; min-p keeps w >= min_p and top-k keeps
w >= the k-th heaviest weight (ties at the k-th weight stay); top-p then keeps the smallest set of the heaviest
kept tokens that holds top_p of the kept weight: a kept token belongs to it when the kept tokens strictly heavier
than it weigh less than top_p of the total. The distribution is the set's weights, normalized.

**The draw** of a row is keyed (key, counter): a seeded request's key is its seed and its counter the output
position drawn, so its tokens do not depend on the batch; others take the engine's key and a counter that never
repeats. Try t of a draw takes the uniform number philox_uniform(key, counter, t) (Philox-4x32-10), inverts the
running sum of the kept weights in vocabulary order (block sums of 16 weights in float32, prefixes in float64),
and is accepted when the drawn token is in the top-p set, else try t + 1 follows. Accepted draws follow the
distribution exactly, with no sort of the vocabulary. Other uses of a row's key take streams of their own
(ACCEPT_STREAM, RESIDUAL_STREAM, DRAFT_STREAM), so that no two uses share a number.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.sampling_params import SamplingParams

# Tries of one draw before it falls back to the heaviest token (kMaxTries in csrc/sampling.cpp).
MAX_TRIES = 1000
# Streams of a row's key beyond the draw's tries: a speculative verification's acceptance test and its draw from
# the residual, and a draft model's draw.
ACCEPT_STREAM = 1 << 20
RESIDUAL_STREAM = ACCEPT_STREAM + 1
DRAFT_STREAM = ACCEPT_STREAM + 2
_BLOCK = 16  # weights per block of the inversion (kBlock in csrc/sampling.cpp)
# The temperature column's mark of a greedy row (SamplingParams.is_greedy decides which rows are): sample() and the
# kernel take such a row's argmax.
GREEDY_ROW_TEMPERATURE = 0.0

# ---- Philox-4x32-10 (Salmon et al., SC 2011), as csrc/sampling.cpp computes it ---------------------------

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint64(0x9E3779B9), np.uint64(0xBB67AE85)
_LOW = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)


def philox_uniforms(keys, counters, stream: int) -> np.ndarray:
    """Uniform numbers in [0, 1) of (key, counter, stream) for each row: 53 bits of Philox's output block. Keys
    and counters are 64-bit integers (signed values are taken modulo 2**64)."""
    keys = np.asarray(keys, dtype=np.int64).view(np.uint64)
    counters = np.asarray(counters, dtype=np.int64).view(np.uint64)
    c0, c1 = counters & _LOW, counters >> _32
    c2, c3 = np.full_like(c0, stream), np.zeros_like(c0)
    k0, k1 = keys & _LOW, keys >> _32
    with np.errstate(over="ignore"):
        for _ in range(10):
            p0, p1 = _M0 * c0, _M1 * c2
            c0, c1, c2, c3 = (p1 >> _32) ^ c1 ^ k0, p1 & _LOW, (p0 >> _32) ^ c3 ^ k1, p0 & _LOW
            k0, k1 = (k0 + _W0) & _LOW, (k1 + _W1) & _LOW
    bits = ((c0 << _32) | c1) >> np.uint64(11)
    return bits.astype(np.float64) * 2.0**-53


def philox_uniform(key: int, counter: int, stream: int) -> float:
    return float(philox_uniforms([key], [counter], stream)[0])


# ---- the distribution ----------------------------------------------------------------------------------


@dataclass
class FilterColumns:
    """Each row's filters, one value a row (defaults where a filter is off)."""

    temperature: torch.Tensor  # [R] float32, > 0 for rows that draw
    top_k: torch.Tensor | None = None  # [R] long, 0 = off; None: off for every row
    top_p: torch.Tensor | None = None  # [R] float32, 1 = off
    min_p: torch.Tensor | None = None  # [R] float32, 0 = off

    @classmethod
    def of(cls, params: list[SamplingParams], device: torch.device | None = None) -> FilterColumns:
        """Each request's filters, a row each; a filter no row uses is left off (None)."""
        def column(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=column([GREEDY_ROW_TEMPERATURE if p.is_greedy else p.temperature for p in params]),
            top_k=column([p.top_k for p in params], torch.long) if any(p.top_k for p in params) else None,
            top_p=column([p.top_p for p in params]) if any(p.top_p < 1.0 for p in params) else None,
            min_p=column([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None,
        )

    def filled(self) -> FilterColumns:
        rows, device = self.temperature.shape[0], self.temperature.device
        return FilterColumns(
            self.temperature.float(),
            self.top_k if self.top_k is not None else torch.zeros(rows, dtype=torch.long, device=device),
            self.top_p.float() if self.top_p is not None else torch.ones(rows, device=device),
            self.min_p.float() if self.min_p is not None else torch.zeros(rows, device=device),
        )


def weights_of(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """w = exp((x - max) / t) per row, in the logits' dtype; the scale multiplies by 1/t as the kernel does."""
    top = logits.max(dim=-1, keepdim=True).values
    return torch.exp((logits - top) * torch.reciprocal(temperature.to(logits.dtype)).unsqueeze(-1))


def kept_threshold(weights: torch.Tensor, top_k: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """[R] the least weight a row keeps: min_p, raised to the k-th heaviest weight under top-k."""
    threshold = min_p.to(weights.dtype).clamp(min=0)
    vocab_size = weights.shape[-1]
    limited = (top_k > 0) & (top_k < vocab_size)
    if bool(limited.any()):
        rows = limited.nonzero().squeeze(1)
        k = top_k[rows]
        heaviest = weights[rows].topk(int(k.max()), dim=-1).values
        kth = heaviest.gather(1, (k - 1).unsqueeze(1)).squeeze(1)
        threshold = threshold.clone()
        threshold[rows] = torch.maximum(threshold[rows], kth)
    return threshold


# The heaviest tokens a row's top-p set is first looked for among; doubled until they hold it.
FIRST_HEAVIEST = 64


def top_p_sets(kept: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, V] whether each token is in its row's top-p set (the module doc): a kept token whose strictly heavier kept
    tokens weigh less than top_p of the row's kept weight. That mass falls as the weight does, so a set is every token
    at least as heavy as its lightest member; which is found among each row's heaviest tokens, as many as hold a token
    outside the set (doubled until they do), not by sorting the vocabulary: a set is usually a small part of it."""
    weights = kept.double()
    needed = top_p.double() * weights.sum(dim=-1)
    vocab_size = weights.shape[-1]
    count = min(FIRST_HEAVIEST, vocab_size)
    while True:
        heaviest = weights.topk(count, dim=-1).values  # descending, ties side by side
        heavier = _heavier_in_order(heaviest)
        if count == vocab_size or bool((heavier[:, -1] >= needed).all()):
            break
        count = min(2 * count, vocab_size)
    lightest_member = torch.where(heavier < needed.unsqueeze(1), heaviest, torch.inf).min(dim=-1).values
    return weights >= lightest_member.unsqueeze(1)


def _heavier_in_order(values: torch.Tensor) -> torch.Tensor:
    """[R, n] weights in descending order -> for each, the sum of the weights before it strictly heavier (float64)."""
    before = values.cumsum(dim=-1) - values
    # Ties: a token's strictly heavier tokens are those before the first of its equals.
    first_equal = torch.searchsorted(-values.contiguous(), -values.contiguous(), right=False)
    return before.gather(-1, first_equal)


def kept_weights(logits: torch.Tensor, columns: FilterColumns) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, the weights min-p and top-k keep, zero elsewhere), [R, V] each, in the logits' dtype; columns filled."""
    weights = weights_of(logits, columns.temperature)
    threshold = kept_threshold(weights, columns.top_k, columns.min_p)
    return weights, torch.where(weights >= threshold.unsqueeze(1), weights, 0.0)


def filtered_distribution(logits: torch.Tensor, columns: FilterColumns, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """[R, V] logits -> [R, V] the distribution each row draws from (see the module doc), in dtype. A row with top_p >= 1
    keeps every kept token, as the draw does."""
    columns = columns.filled()
    _, filtered = kept_weights(logits.to(dtype), columns)
    limited = columns.top_p < 1.0
    if bool(limited.any()):
        rows = limited.nonzero().squeeze(1)
        kept = filtered[rows]
        filtered[rows] = torch.where(top_p_sets(kept, columns.top_p[rows]), kept, 0.0)
    return filtered / filtered.sum(dim=-1, keepdim=True)


# ---- the draw ------------------------------------------------------------------------------------------


def sample(logits: torch.Tensor, columns: FilterColumns, keys: torch.Tensor, counters: torch.Tensor, cpu_kernels=None) -> torch.Tensor:
    """[R] one keyed draw per row of [R, V] float32 logits; rows with temperature <= 0 take the argmax. On CPU with
    the C++ kernels in one pass per row, else in torch: the same tokens either way."""
    columns = columns.filled()
    if cpu_kernels is not None and logits.device.type == "cpu":
        return cpu_kernels.sample_rows(logits.contiguous(), columns.temperature, columns.top_k, columns.top_p, columns.min_p,
                                       keys, counters)
    return _sample_in_torch(logits.float(), columns, keys, counters)


def _sample_in_torch(logits: torch.Tensor, columns: FilterColumns, keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    result = logits.argmax(dim=-1)
    top = logits.max(dim=-1).values
    rows = ((columns.temperature > 0) & torch.isfinite(top)).nonzero().squeeze(1)  # the others take the argmax
    if rows.numel() == 0:
        return result
    row_columns = FilterColumns(columns.temperature[rows], columns.top_k[rows], columns.top_p[rows], columns.min_p[rows])
    weights, kept = kept_weights(logits[rows], row_columns)
    inversion = _Inversion(kept)
    needed = columns.top_p[rows].double() * inversion.total
    top_p_off = columns.top_p[rows] >= 1.0
    pending = torch.arange(rows.numel(), device=logits.device)
    keys, counters = keys[rows].cpu().numpy(), counters[rows].cpu().numpy()
    for attempt in range(MAX_TRIES):
        indices = pending.cpu().numpy()
        uniforms = torch.from_numpy(philox_uniforms(keys[indices], counters[indices], attempt)).to(logits.device)
        tokens = inversion.invert(pending, uniforms)
        accepted = top_p_off[pending]
        if not bool(accepted.all()):  # the top-p set: strictly heavier kept tokens weigh less than needed
            row_weights = weights[pending]
            chosen = row_weights.gather(1, tokens.unsqueeze(1))
            heavier = torch.where(row_weights > chosen, row_weights, 0.0).double().sum(dim=-1)
            accepted = accepted | (heavier < needed[pending])
        result[rows[pending[accepted]]] = tokens[accepted]
        pending = pending[~accepted]
        if pending.numel() == 0:
            break
    return result


class _Inversion:
    """The running sum of kept weights in vocabulary order, as the kernel forms it: float32 sums of blocks of 16
    (each summed in order), float64 prefixes of the blocks, float64 running sums inside a block."""

    def __init__(self, kept: torch.Tensor) -> None:
        rows, vocab_size = kept.shape
        self.vocab_size = vocab_size
        num_blocks = -(-vocab_size // _BLOCK)
        self.blocks = torch.nn.functional.pad(kept, (0, num_blocks * _BLOCK - vocab_size)).view(rows, num_blocks, _BLOCK)
        sums = self.blocks[..., 0].clone()
        for column in range(1, _BLOCK):
            sums += self.blocks[..., column]
        self.prefix = sums.double().cumsum(dim=-1)  # sequential, as the kernel's running total
        self.total = self.prefix[:, -1]
        self.kept = kept

    def invert(self, rows: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """[n] the token of each row where the running sum first passes uniform * total."""
        target = uniforms * self.total[rows]
        prefix = self.prefix[rows]
        block = torch.searchsorted(prefix, target.unsqueeze(1), right=True).squeeze(1).clamp(max=prefix.shape[1] - 1)
        before = torch.where(block > 0, prefix.gather(1, (block - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
        weights = self.blocks[rows, block]
        running = torch.cat([before.unsqueeze(1), weights.double()], dim=1).cumsum(dim=1)[:, 1:]
        passed = running > target.unsqueeze(1)
        positions = torch.arange(_BLOCK, device=rows.device)
        first = torch.where(passed, positions, _BLOCK).min(dim=1).values
        last_kept = torch.where(weights > 0, positions, -1).max(dim=1).values  # rounding ran past the block's end
        token = block * _BLOCK + torch.where(first < _BLOCK, first, last_kept)
        missing = (first == _BLOCK) & (last_kept < 0)
        if bool(missing.any()):  # no kept weight in the block at all: the row's last kept token
            indices = torch.arange(self.vocab_size, device=rows.device)
            token[missing] = torch.where(self.kept[rows[missing]] > 0, indices, 0).max(dim=1).values
        return token


def draw(weights: torch.Tensor, uniform: float) -> int:
    """A token in proportion to non-negative weights (not necessarily normalized), by inverting their running sum
    in vocabulary order at one uniform number."""
    cumulative = torch.cumsum(weights.double(), dim=0)
    total = float(cumulative[-1])
    if total <= 0.0:  # the weights vanished to rounding: any kept token will do
        return int(torch.argmax(weights))
    target = torch.tensor([uniform * total], dtype=cumulative.dtype, device=cumulative.device)
    return min(int(torch.searchsorted(cumulative, target, right=True)), len(weights) - 1)


class DrawKeys:
    """(key, counter) of each draw: a seeded request's are (its seed, the output position drawn), the same whatever
    the batch and after a preemption that rebuilds it; the others' are this engine's key and a counter that never
    repeats."""

    # Odd 64-bit constant (golden ratio): spreads engine seeds over keys.
    _SEED_MIX = 0x9E3779B97F4A7C15

    def __init__(self, engine_seed: int) -> None:
        self.engine_key = as_int64(engine_seed * self._SEED_MIX + 1)
        self._next_counter = 0

    def at(self, seed: int | None, position: int) -> tuple[int, int]:
        """The key of one draw at an output position."""
        if seed is None:
            return self.engine_key, self.take_counters(1).start
        return as_int64(seed), position

    def key_of(self, seed: int | None) -> int:
        """The key of every draw of a request with this seed (its counter is at() 's)."""
        return self.engine_key if seed is None else as_int64(seed)

    def take_counters(self, count: int) -> range:
        """The counters of the next count draws of requests without a seed, in order."""
        self._next_counter += count
        return range(self._next_counter - count, self._next_counter)

    def of(self, seed: int | None, position: int, count: int) -> list[tuple[int, int]]:
        """The keys of `count` draws at output positions position, position + 1, ..."""
        return [self.at(seed, position + i) for i in range(count)]


def as_int64(value: int) -> int:
    """value modulo 2**64, as the signed 64-bit integer a torch.long holds."""
    return (value + 2**63) % 2**64 - 2**63
