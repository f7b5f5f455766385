"""LoRA products added to a linear layer's output, each row with its own adapter.

A step's flat batch holds its decodes first (one row each, of many requests and adapters), then each prompt chunk's
rows together (one request, one adapter). Where the engine runs the C++ kernels, one call per layer adds every
adapted row's product (csrc/lora.cpp): the rows grouped by adapter, each group through its own adapter's A and B.
Elsewhere torch computes them: a chunk's rows take their adapter's product on a slice of the batch (x·Aᵀ, then one
GEMM with the adapter's B laid out over the layer's output, each part of a fused layer in its own columns); the decode
rows, few and mixed, take the product of every adapter among them in two GEMMs: the adapters' A stacked, each row
keeping only its own adapter's columns (a mask), then their B side by side. The scheduler bounds a step's adapters by
max_loras, which bounds the stack. Base-model rows get nothing; a step without adapters costs nothing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import torch

from pagedserve.layers.gemm import pack_weight, packed_linear


@dataclass(frozen=True)
class StepAdapters:
    """Which rows of a step run with which adapter. What each way of computing the products reads is derived once a
    step, on first use (the kernel's row groups, or the torch path's decode slots), and shared by every layer."""

    # The adapters of the step, sorted: the decode rows' product stacks them all, so that the stack changes only when
    # an adapter's first request joins or its last one leaves, not with each step's mix of decodes and chunks.
    adapter_ids: tuple[int, ...]
    decode_ids: tuple[int, ...]  # each decode row's adapter (0: the base model), in row order
    # (first row, end row, adapter id) of the prompt chunks with an adapter, one span for chunks side by side of one adapter
    chunks: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, segments: list[tuple[int, int]]) -> StepAdapters | None:
        """From the flat batch's segments in order, (adapter id, 0 for the base model; rows): the decodes (one row
        each) lead, prompt chunks (two rows or more) follow. None when no row runs with an adapter."""
        num_decodes = 0
        while num_decodes < len(segments) and segments[num_decodes][1] == 1:
            num_decodes += 1
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
        return cls(adapter_ids, tuple(adapter_id for adapter_id, _ in segments[:num_decodes]), tuple(chunks))

    @cached_property
    def num_decode_rows(self) -> int:
        """The decode rows the torch path multiplies: 0 when none runs with an adapter."""
        return len(self.decode_ids) if any(self.decode_ids) else 0

    @cached_property
    def decode_slots(self) -> torch.Tensor | None:
        """Each decode row's index in adapter_ids (-1: the base model), [rows, 1]; None when every decode row runs with
        the one adapter."""
        if len(self.adapter_ids) == 1 and 0 not in self.decode_ids:
            return None
        slot = {adapter_id: index for index, adapter_id in enumerate(self.adapter_ids)}
        return torch.tensor([slot.get(adapter_id, -1) for adapter_id in self.decode_ids], dtype=torch.long).unsqueeze(1)

    @cached_property
    def row_groups(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The kernel's rows and groups: every adapted row (int32), the decode rows of each adapter together, then
        each chunk span; and per group (first index into rows, end index, the adapter's index in adapter_ids), [groups,
        3] int32."""
        slot = {adapter_id: index for index, adapter_id in enumerate(self.adapter_ids)}
        by_adapter: dict[int, list[int]] = {}
        for row, adapter_id in enumerate(self.decode_ids):
            if adapter_id:
                by_adapter.setdefault(adapter_id, []).append(row)
        pieces: list[torch.Tensor] = []
        groups: list[tuple[int, int, int]] = []
        count = 0
        for adapter_id, adapter_rows in by_adapter.items():
            pieces.append(torch.tensor(adapter_rows, dtype=torch.int32))
            groups.append((count, count + len(adapter_rows), slot[adapter_id]))
            count += len(adapter_rows)
        for start, end, adapter_id in self.chunks:
            pieces.append(torch.arange(start, end, dtype=torch.int32))
            groups.append((count, count + end - start, slot[adapter_id]))
            count += end - start
        return torch.cat(pieces), torch.tensor(groups, dtype=torch.int32)


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


# The activations the kernel takes (and the outputs it adds to).
KERNEL_DTYPES = (torch.float32, torch.bfloat16)
# The kernel reads an adapter's Aᵀ in whole vectors of its widest build (16 floats): its columns are padded to this.
_KERNEL_COLUMNS = 16


class _KernelWeights:
    """Every held adapter's weights for one layer as the kernel reads them: each adapter's Aᵀ ([in_features, its
    columns padded], float32) and each part's B ([its columns, its outputs], float32) in two flat tensors; per
    adapter its entry of the kernel's adapter table, (offset of its Aᵀ, padded columns, first part, end part); and the
    part table, (first column, end column, first output, end output, offset of its B) per part."""

    def __init__(self, products: dict[int, AdapterProduct]) -> None:
        a_blocks, b_blocks, parts = [], [], []
        self.entries: dict[int, tuple[int, int, int, int]] = {}
        a_offset = b_offset = 0
        for adapter_id, product in products.items():
            columns, in_features = product.a.shape
            padded = -(-columns // _KERNEL_COLUMNS) * _KERNEL_COLUMNS
            a_t = torch.zeros(in_features, padded)
            a_t[:, :columns] = product.a.t()
            a_blocks.append(a_t.flatten())
            self.entries[adapter_id] = (a_offset, padded, len(parts), len(parts) + len(product.parts))
            a_offset += a_t.numel()
            for part in product.parts:
                b_t = part.b.t().contiguous()  # [its columns, its outputs]
                b_blocks.append(b_t.flatten())
                parts.append((part.rank_start, part.rank_start + part.rank_len, part.out_start, part.out_start + part.out_len, b_offset))
                b_offset += b_t.numel()
        self.a = torch.cat(a_blocks) if a_blocks else torch.zeros(0)
        self.b = torch.cat(b_blocks) if b_blocks else torch.zeros(0)
        self.parts = torch.tensor(parts, dtype=torch.int32).view(-1, 5)

    def table(self, adapter_ids: tuple[int, ...]) -> torch.Tensor:
        """The adapter table of a step's adapters, in their order ([adapters, 4] int32; zero columns for an adapter
        that leaves this layer as it is)."""
        return torch.tensor([self.entries.get(adapter_id, (0, 0, 0, 0)) for adapter_id in adapter_ids], dtype=torch.int32)


class LinearLoRA:
    """The products of the adapters a worker holds, for one linear layer (this rank's share of them): through the C++
    kernel where given one, else multiplied in the dtype and through the GEMM the layer's own weight is (bfloat16
    GEMMs where the engine runs them)."""

    def __init__(self, out_features: int, gemm_dtype: torch.dtype = torch.float32, onednn: bool = False, kernels=None) -> None:
        self.out_features = out_features
        self.gemm_dtype = gemm_dtype
        self.onednn = onednn
        self.kernels = kernels
        self._products: dict[int, AdapterProduct] = {}
        self._weights: dict[int, _Packed] = {}  # each adapter's A and B over the layer's output, float32, to stack
        self._packed: dict[int, _Packed] = {}  # and packed for the GEMM
        self._stack_key: tuple[int, ...] | None = None  # the adapters _stack was built for (a step's set repeats)
        self._stack: tuple[_Packed, torch.Tensor] | None = None  # and, per column, the index of its adapter among them
        self._kernel_weights: _KernelWeights | None = None  # built when a step first needs it after a change
        self._kernel_table: torch.Tensor | None = None  # for the adapters of _stack_key

    def set_adapter(self, adapter_id: int, product: AdapterProduct) -> None:
        self._products[adapter_id] = product
        if self.kernels is None:
            weights = self._weights[adapter_id] = _Packed(product.a, self._b_over_output(product))
            self._packed[adapter_id] = self._pack(weights.a, weights.b)
        self._changed()

    def remove_adapter(self, adapter_id: int) -> None:
        del self._products[adapter_id]
        self._weights.pop(adapter_id, None)
        self._packed.pop(adapter_id, None)
        self._changed()

    def _changed(self) -> None:
        self._stack_key = None
        self._kernel_weights = None

    def add_to(self, out: torch.Tensor, x: torch.Tensor) -> None:
        step = _step
        if step is None:
            return
        if self.kernels is not None:
            self._add_by_kernel(out, x, step)
            return
        if step.num_decode_rows:
            self._add_decodes(out, x, step)
        for start, end, adapter_id in step.chunks:
            packed = self._packed.get(adapter_id)
            if packed is not None:  # else this adapter leaves the layer as it is
                out[start:end] += packed_linear(packed_linear(x[start:end], packed.a, None), packed.b, None, out.dtype)

    def _add_by_kernel(self, out: torch.Tensor, x: torch.Tensor, step: StepAdapters) -> None:
        if self._kernel_weights is None:
            self._kernel_weights = _KernelWeights(self._products)
        weights = self._kernel_weights
        if self._stack_key != step.adapter_ids:
            self._kernel_table, self._stack_key = weights.table(step.adapter_ids), step.adapter_ids
        rows, groups = step.row_groups
        self.kernels.lora_add_(out, x, rows, groups, weights.a, weights.b, self._kernel_table, weights.parts)

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
