"""LoRA products added to a linear layer's output, each row with its own adapter: a step's flat batch is segmented by
adapter (the scheduler bounds the adapters of a step by max_loras), and each adapter's rows take one x·Aᵀ for all the
layer's adapted parts and one ·Bᵀ per part, added in place into the part's columns. Rows of the base model cost
nothing, and a layer no adapter of the step adapts costs a dictionary lookup per adapter."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

# The step's rows by adapter while the model runner's forward pass runs: (adapter id, row indices, or None when every
# row runs with it). None between passes, and in passes without adapters (warm-up, draft models).
_step_groups: list[tuple[int, torch.Tensor | None]] | None = None


@contextmanager
def adapters_for_step(groups: list[tuple[int, torch.Tensor | None]] | None) -> Iterator[None]:
    global _step_groups
    _step_groups = groups
    try:
        yield
    finally:
        _step_groups = None


def row_groups(segments: list[tuple[int, int]]) -> list[tuple[int, torch.Tensor | None]] | None:
    """The groups adapters_for_step takes, from the flat batch's segments in order (adapter id, 0 for the base model;
    rows). None when no row runs with an adapter."""
    rows_of: dict[int, list[int]] = {}
    row = 0
    for adapter_id, num_rows in segments:
        if adapter_id:
            rows_of.setdefault(adapter_id, []).extend(range(row, row + num_rows))
        row += num_rows
    if not rows_of:
        return None
    if len(rows_of) == 1 and len(next(iter(rows_of.values()))) == row:
        return [(next(iter(rows_of)), None)]
    return [(adapter_id, torch.tensor(rows, dtype=torch.long)) for adapter_id, rows in rows_of.items()]


@dataclass
class PartProduct:
    """One adapted part of a layer (q, k or v of a fused qkv; the whole of an unfused layer): its columns of the
    layer's output and its rows of the layer's stacked A."""

    out_start: int
    out_len: int
    rank_start: int
    rank_len: int
    b: torch.Tensor  # [out_len, rank_len], scaled


@dataclass
class AdapterProduct:
    a: torch.Tensor  # [sum of the parts' ranks, in_features]: the parts' A stacked
    parts: list[PartProduct]


class LinearLoRA:
    """The products of the adapters a worker holds, for one linear layer (this rank's share of them)."""

    def __init__(self) -> None:
        self.adapters: dict[int, AdapterProduct] = {}

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> None:
        groups = _step_groups
        if groups is None:
            return
        for adapter_id, rows in groups:
            product = self.adapters.get(adapter_id)
            if product is None:  # this adapter leaves the layer as it is
                continue
            rows_in = x if rows is None else x.index_select(0, rows)
            down = torch.matmul(rows_in.float(), product.a.t())
            for part in product.parts:
                delta = torch.matmul(down[:, part.rank_start:part.rank_start + part.rank_len], part.b.t()).to(out.dtype)
                columns = out.narrow(1, part.out_start, part.out_len)
                if rows is None:
                    columns += delta
                else:
                    columns.index_add_(0, rows, delta)
