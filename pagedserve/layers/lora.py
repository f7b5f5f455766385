"""LoRA products added to a linear layer's output, each row with its own adapter.

A step's flat batch holds its decodes first (one row each, of many requests and adapters), then each prompt chunk's
rows together (one request, one adapter). A chunk's rows take their adapter's product on a slice of the batch: x·Aᵀ,
then one GEMM with the adapter's B laid out over the layer's output (each part of a fused layer in its own columns).
The decode rows, few and mixed, take the product of every adapter among them in two GEMMs: the adapters' A stacked,
each row keeping only its own adapter's columns (a mask), then their B side by side; the scheduler bounds a step's
adapters by max_loras, which bounds the stack. Base-model rows get nothing; a step without adapters costs nothing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from pagedserve.layers.gemm import pack_weight, packed_linear


@dataclass(frozen=True)
class StepAdapters:
    """Which rows of a step run with which adapter."""

    # The adapters of the step, sorted: the decode rows' product stacks them all, so that the stack changes only when
    # an adapter's first request joins or its last one leaves, not with each step's mix of decodes and chunks.
    adapter_ids: tuple[int, ...]
    num_decode_rows: int  # 0 when no decode row runs with an adapter
    # Each decode row's index in adapter_ids (-1: the base model); None when every decode row runs with the one adapter.
    decode_slots: torch.Tensor | None
    # (first row, end row, adapter id) of the prompt chunks with an adapter, one span for chunks side by side of one adapter
    chunks: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, segments: list[tuple[int, int]]) -> StepAdapters | None:
        """From the flat batch's segments in order, (adapter id, 0 for the base model; rows): the decodes (one row
        each) lead, prompt chunks (two rows or more) follow. None when no row runs with an adapter."""
        num_decodes = 0
        while num_decodes < len(segments) and segments[num_decodes][1] == 1:
            num_decodes += 1
        decode_ids = [adapter_id for adapter_id, _ in segments[:num_decodes]]
        chunks, row = [], num_decodes
        for adapter_id, num_rows in segments[num_decodes:]:
            if adapter_id and chunks and chunks[-1][1] == row and chunks[-1][2] == adapter_id:
                chunks[-1] = (chunks[-1][0], row + num_rows, adapter_id)  # the same adapter's chunks, side by side
            elif adapter_id:
                chunks.append((row, row + num_rows, adapter_id))
            row += num_rows
        adapter_ids = tuple(sorted({adapter_id for adapter_id, _ in segments} - {0}))
        if not adapter_ids:
            return None
        if not any(decode_ids):
            return cls(adapter_ids, 0, None, tuple(chunks))
        slots = None
        if len(adapter_ids) > 1 or 0 in decode_ids:
            slot = {adapter_id: index for index, adapter_id in enumerate(adapter_ids)}
            slots = torch.tensor([slot.get(adapter_id, -1) for adapter_id in decode_ids], dtype=torch.long).unsqueeze(1)
        return cls(adapter_ids, num_decodes, slots, tuple(chunks))


# The step's adapters while the model runner's forward pass runs; None between passes and in passes without adapters
# (warm-up, draft models).
_step: StepAdapters | None = None


@contextmanager
def adapters_for_step(step: StepAdapters | None) -> Iterator[None]:
    global _step
    _step = step
    try:
        yield
    finally:
        _step = None


@dataclass
class PartProduct:
    """One adapted part of a layer (q, k or v of a fused qkv; the whole of an unfused layer): its columns of the
    layer's output and its rows of the adapter's stacked A."""

    out_start: int
    out_len: int
    rank_start: int
    rank_len: int
    b: torch.Tensor  # [out_len, rank_len], scaled


@dataclass
class AdapterProduct:
    a: torch.Tensor  # [sum of the parts' ranks, in_features]: the parts' A stacked
    parts: list[PartProduct]


@dataclass
class _Packed:
    """A product: A, and B over the layer's output (each part's B in its rows and columns)."""

    a: torch.Tensor  # [columns, in_features]
    b: torch.Tensor  # [out_features, columns]


class LinearLoRA:
    """The products of the adapters a worker holds, for one linear layer (this rank's share of them), multiplied in
    the dtype and through the GEMM the layer's own weight is (bfloat16 GEMMs where the engine runs them)."""

    def __init__(self, out_features: int, gemm_dtype: torch.dtype = torch.float32, onednn: bool = False) -> None:
        self.out_features = out_features
        self.gemm_dtype = gemm_dtype
        self.onednn = onednn
        self._weights: dict[int, _Packed] = {}  # each adapter's A and B over the layer's output, float32, to stack
        self._packed: dict[int, _Packed] = {}  # and packed for the GEMM
        self._stack_key: tuple[int, ...] | None = None  # the adapters _stack was built for (a step's set repeats)
        self._stack: tuple[_Packed, torch.Tensor] | None = None  # and, per column, the index of its adapter among them

    def set_adapter(self, adapter_id: int, product: AdapterProduct) -> None:
        weights = self._weights[adapter_id] = _Packed(product.a, self._b_over_output(product))
        self._packed[adapter_id] = self._pack(weights.a, weights.b)
        self._stack_key = None

    def remove_adapter(self, adapter_id: int) -> None:
        del self._weights[adapter_id]
        del self._packed[adapter_id]
        self._stack_key = None

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> None:
        step = _step
        if step is None:
            return
        if step.num_decode_rows:
            self._add_decodes(out, x, step)
        for start, end, adapter_id in step.chunks:
            packed = self._packed.get(adapter_id)
            if packed is not None:  # else this adapter leaves the layer as it is
                out[start:end] += packed_linear(packed_linear(x[start:end], packed.a, None), packed.b, None, out.dtype)

    def _add_decodes(self, out: torch.Tensor, x: torch.Tensor, step: StepAdapters) -> None:
        if self._stack_key != step.adapter_ids:
            self._stack, self._stack_key = self._build_stack(step.adapter_ids), step.adapter_ids
        if self._stack is None:  # no adapter among the decodes changes this layer
            return
        packed, column_slots = self._stack
        rows = step.num_decode_rows
        down = packed_linear(x[:rows], packed.a, None, torch.float32)
        if step.decode_slots is not None:  # each row keeps its own adapter's columns
            down.mul_(step.decode_slots == column_slots)
        out[:rows] += packed_linear(down, packed.b, None, out.dtype)

    def _build_stack(self, adapter_ids: tuple[int, ...]) -> tuple[_Packed, torch.Tensor] | None:
        present = [(slot, self._weights[adapter_id]) for slot, adapter_id in enumerate(adapter_ids) if adapter_id in self._weights]
        if not present:
            return None
        slots = [slot for slot, weights in present for _ in range(weights.a.shape[0])]
        a = torch.cat([weights.a for _, weights in present])
        b = torch.cat([weights.b for _, weights in present], dim=1)
        return self._pack(a, b), torch.tensor(slots, dtype=torch.long).unsqueeze(0)

    def _b_over_output(self, product: AdapterProduct) -> torch.Tensor:
        """[out_features, the adapter's columns]: each part's B in its rows and columns, zeros elsewhere."""
        b = torch.zeros(self.out_features, product.a.shape[0])
        for part in product.parts:
            b[part.out_start:part.out_start + part.out_len, part.rank_start:part.rank_start + part.rank_len] = part.b
        return b

    def _pack(self, a: torch.Tensor, b: torch.Tensor) -> _Packed:
        return _Packed(pack_weight(a, self.gemm_dtype, self.onednn), pack_weight(b, self.gemm_dtype, self.onednn))
