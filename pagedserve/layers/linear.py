"""Linear layers: weights pre-packed for oneDNN on CPU (float32, or bfloat16 where the engine runs its GEMMs in
bfloat16), or GGUF blocks read by our kernel; and their tensor-parallel forms (column-parallel, the head-aware
qkv, row-parallel).

MKL's fp32 GEMM is slow for the small-M shapes of decode steps; oneDNN with a weight reordered once at load time
is faster for M >= 8 and for the wide lm_head. A GGUF model's Q4_0/Q4_1/Q8_0 weights run on their blocks
(csrc/quantized_linear.cpp): the same values, a fraction of the bytes to read per step; so do its Q5_0/Q5_1 and K-quant
(Q4_K/Q5_K/Q6_K) weights where products are integers on input rounded to 8 bits (csrc/quantized_linear_q8.cpp). Which of the two a step
of M rows takes is measured per weight shape on the machine at hand (executor/gemm_choice.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.distributed.parallel_state import tp_all_reduce, tp_rank, tp_size
from pagedserve.layers.gemm import BFloat16ProductsWeight, BFloat16ValuesWeight, Int8Weight, pack_weight, packed_linear, packed_silu_and_mul
from pagedserve.layers.lora import LinearLoRA

# Rows up to which a GEMM runs on the GGUF blocks until measured on the machine (executor/gemm_choice.py): few-row
# steps are bound by reading the weights, 7x the bytes in float32; from 3 rows the kernel runs a broadcast GEMM on an
# interleaved copy of the blocks, which on some processors stays level with oneDNN up to 64 rows and on others falls
# behind from 3.
QUANTIZED_MAX_ROWS = 64
# The row limit of blocks that take every step, whatever its size (as gemm_choice may find for integer products).
EVERY_STEP = sys.maxsize
# Rows up to which a bfloat16 GEMM runs on the C++ kernels' AMX tiles (where pack() gave it them): there they beat
# oneDNN's bfloat16 GEMM and its conversions at every shape measured; from a full prefill step on, oneDNN's blocking
# keeps level or pulls ahead (docs/cpu.md).
TILES_MAX_ROWS = 512
# oneDNN makes a primitive for each row count of each GEMM shape at its first call, and keeps a bounded number: steps
# that reach its bfloat16 GEMMs beyond the tiles' rows run at row counts rounded up to a multiple of this (a few rows of
# padding), so that a handful of primitives serves every step.
ONEDNN_ROW_MULTIPLE = 64


# GGUF types every GEMM on blocks reads, the exact float32 one (csrc/quantized_linear.cpp) and the integer panels: name ->
# GGMLQuantizationType id (fixed by the GGUF format; written here so that loading a model does not import gguf). The AMX
# tiles also read the Q4 ones, dequantizing.
GGUF_KERNEL_TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}
GGUF_Q4_TYPES = (GGUF_KERNEL_TYPES["Q4_0"], GGUF_KERNEL_TYPES["Q4_1"])
# Types only the integer panels read (csrc/gguf_sub_blocks.h): where the products are exact float32, such weights run
# dense.
GGUF_PANEL_TYPES = {"Q5_0": 6, "Q5_1": 7, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
GGUF_BLOCK_TYPES = GGUF_KERNEL_TYPES | GGUF_PANEL_TYPES


def row_limit_text(max_rows: int) -> str:
    """A row limit as the logs say it."""
    return "at any number of rows" if max_rows >= EVERY_STEP else f"up to {max_rows} rows"


class RowLimited:
    """Products on GGUF blocks, which take steps of up to max_rows rows (larger ones take the dense weight)."""

    max_rows = QUANTIZED_MAX_ROWS

    def takes(self, x: torch.Tensor) -> bool:
        return self.takes_rows(x.shape[0])

    def takes_rows(self, rows: int) -> bool:
        return rows <= self.max_rows


class QuantizedWeight(RowLimited):
    """A weight in GGUF blocks ([out_features, bytes per row] uint8) and its gguf type id; it runs steps of up to
    max_rows rows (larger ones take the dense weight). Its products are float32 (exact: the blocks' values times x),
    where steps of 3+ rows read an interleaved copy of the blocks (8 rows side by side, made once) that the kernel's
    broadcast GEMM needs; or, once round_activations() ran, integers on panels of the blocks, every step's input rounded
    to 8 bits."""

    def __init__(self, blocks: torch.Tensor, qtype: int, kernels) -> None:
        self.blocks = blocks.contiguous()
        self.qtype = qtype
        self.panels: torch.Tensor | None = None
        self._interleaved: torch.Tensor | None = None
        self._kernels = kernels

    @property
    def rounds_activations(self) -> bool:
        return self.panels is not None

    @property
    def stored_bytes(self) -> int:
        return self.blocks.numel()

    def panel_parts(self) -> list[tuple[torch.Tensor, int, int]]:
        """(panels, type, output rows) of each part the integer products read: none before round_activations()."""
        return [] if self.panels is None else [(self.panels, self.qtype, self.blocks.shape[0])]

    @property
    def interleaved(self) -> torch.Tensor | None:
        """The float32 kernel's interleaved copy of the blocks, made at its first use: None where the rows are not a
        multiple of 8, or where the products are integers on the panels instead."""
        if self._interleaved is None and self.panels is None and self.blocks.shape[0] % 8 == 0:
            self._interleaved = self._kernels.interleave_gguf_rows(self.blocks, self.qtype)
        return self._interleaved

    def dequantized(self) -> torch.Tensor:
        """The float32 weight the blocks hold ([out_features, in_features], as gguf dequantizes them), made anew."""
        return self._kernels.dequantize_gguf(self.blocks, self.qtype)

    def round_activations(self) -> None:
        """From now on, steps round x to 8 bits per block of 32 values and multiply integers, as llama.cpp's and vLLM's
        GGUF kernels do (csrc/quantized_linear_q8.cpp): fewer instructions per block than widening it to float32. They
        read the blocks' panels (8 or 16 rows side by side, by the build; made here once), which share each block's
        unpacking among a step's rows; the float32 kernel's interleaved copy is let go."""
        self.panels = self._kernels.pack_q8_panels(self.blocks, self.qtype)
        self._interleaved = None

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.panels is not None:
            return self._kernels.quantized_linear_q8(x.contiguous(), self.panels, self.qtype, self.blocks.shape[0], bias)
        return self._kernels.quantized_linear(x.contiguous(), self.blocks, self.qtype, bias, self.interleaved)


class QuantizedParts(RowLimited):
    """A fused layer whose parts (q, k, v; gate, up) come in GGUF blocks of different types, as llama.cpp's mixed files
    (Q4_K_M and the like) give more bits to some of them. Only the integer products read them: each part on its own
    panels, x rounded once for all (csrc/quantized_linear_q8.cpp), their outputs side by side."""

    interleaved = None

    def __init__(self, parts: list[QuantizedWeight], kernels) -> None:
        self.parts = parts
        self.qtype = "+".join(str(part.qtype) for part in parts)  # names the mixture in gemm_choice's keys
        self._kernels = kernels
        # The kernel's arguments (every part's panels, types and output rows), set once the panels are made.
        self._panel_args: tuple[list[torch.Tensor], list[int], list[int]] | None = None

    @property
    def rounds_activations(self) -> bool:
        return self._panel_args is not None

    @property
    def stored_bytes(self) -> int:
        return sum(part.stored_bytes for part in self.parts)

    def panel_parts(self) -> list[tuple[torch.Tensor, int, int]]:
        return [entry for part in self.parts for entry in part.panel_parts()]

    def dequantized(self) -> torch.Tensor:
        return torch.cat([part.dequantized() for part in self.parts])

    def round_activations(self) -> None:
        for part in self.parts:
            part.round_activations()
        panels, types, rows = zip(*self.panel_parts())
        self._panel_args = (list(panels), list(types), list(rows))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self._panel_args is None:
            raise RuntimeError("a layer of mixed GGUF block types multiplies on its panels only (round_activations)")
        return self._kernels.quantized_linear_q8_parts(x.contiguous(), *self._panel_args, bias)


class BlocksOrDense(NamedTuple):
    """A GEMM that can run either on its GGUF blocks or on its dense weight: the name of its shape (GEMMs of one
    shape share a choice), its input width, its blocks and its dense product."""

    shape: str
    in_features: int
    blocks: QuantizedWeight | QuantizedParts
    dense: Callable[[torch.Tensor], torch.Tensor]


class Linear(nn.Linear):
    """nn.Linear that runs small batches on GGUF blocks once given them, and the rest on a oneDNN-packed
    copy of its weight (float32 or bfloat16) once pack() was called. A layer on GGUF blocks holds no dense weight
    (use_blocks): steps its blocks do not take multiply the weight dequantized from them for the step, as vLLM's GGUF
    layers do, so that a GGUF model takes the memory of its file. Replicated: every tensor-parallel rank holds all of
    it. A fused layer (qkv, gate-up) lists its parts' output sizes in shard_sizes."""

    packed_weight: torch.Tensor | None = None
    # A gate-up layer's gate and up packed apart for oneDNN in place of packed_weight (pack, parts_apart): its steps that
    # oneDNN multiplies apply SiLU and the product in the two GEMMs' epilogues (fused_silu_and_mul).
    packed_parts: tuple[torch.Tensor, torch.Tensor] | None = None
    int8_weight: Int8Weight | None = None  # the dense product's weight where GEMMs run in int8 (W8A8)
    bf16_products: BFloat16ProductsWeight | None = None  # where bfloat16 GEMMs run on AMX tiles: the weight for steps of few rows
    bf16_values: BFloat16ValuesWeight | None = None  # a float32 GEMM's weight of bfloat16 values, kept as them (pack)
    # A router's scores pick experts: rounding its input to 8 bits would move tokens between experts, so a router keeps
    # the float GEMM where the other layers run in int8.
    routes = False
    # What the dense product returns: None for its input's dtype. A GEMM whose consumers take bfloat16 (the MLP's
    # gate-up, read by SiLU-and-mul and the down projection) keeps its bfloat16 output rather than widening it.
    output_dtype: torch.dtype | None = None
    quantized: QuantizedWeight | QuantizedParts | None = None
    shard_sizes: tuple[int, ...] | None = None
    lora: LinearLoRA | None = None  # the LoRA adapters' products, where adapters are enabled
    # The checkpoint's sizes, before any tensor-parallel split: each part's output features, and the input features.
    full_part_sizes: tuple[int, ...] | None = None  # None: one part, out_features
    full_in_features: int | None = None  # None: in_features

    def use_blocks(self, blocks: QuantizedWeight | QuantizedParts) -> None:
        """Run on these GGUF blocks (this rank's share of the layer's weight), letting the dense weight go: from now on
        `weight` is None and the checkpoint's float tensors of this layer are not read."""
        self.quantized = blocks
        self.register_parameter("weight", None)

    def pack(self, dtype: torch.dtype = torch.float32, onednn: bool = True, output_dtype: torch.dtype | None = None,
             tile_kernels=None, parts_apart: bool = False, values_kernels=None) -> None:
        """Run the dense product on a copy of the weight in dtype, reordered for oneDNN where onednn, returning
        output_dtype; given tile_kernels (kernels on AMX tiles, with dtype bfloat16), steps of up to TILES_MAX_ROWS rows
        on a second copy for the tiles instead (float32 sums out): the layer's GGUF Q4 blocks where it has them.
        parts_apart, for a gate-up layer: its gate and up packed apart (packed_parts) in place of the whole, so that
        silu(gate) * up comes out of the GEMMs themselves rather than a pass that reads their whole output back. A layer on
        blocks alone has no dense weight to copy: only the tiles' reading of its Q4 blocks. Given values_kernels (the
        kernels that multiply float32 by bfloat16 values), a float32 GEMM whose weight holds bfloat16 values runs on them
        instead of a packed copy (BFloat16ValuesWeight), and the float32 weight is let go: the pairs hold its values."""
        if values_kernels is not None and dtype == torch.float32 and self.weight is not None and BFloat16ValuesWeight.holds(self.weight):
            self.bf16_values, self.packed_weight, self.packed_parts = BFloat16ValuesWeight(self.weight, values_kernels), None, None
            self.register_parameter("weight", None)
            return
        if tile_kernels is not None and (self.weight is not None or self._q4_blocks() is not None):
            self.bf16_products = BFloat16ProductsWeight(self.weight, tile_kernels, self._q4_blocks())
        if self.weight is None:
            return
        if parts_apart:
            gate, up = self.shard_sizes
            self.packed_parts = (pack_weight(self.weight[:gate], dtype, onednn), pack_weight(self.weight[gate : gate + up], dtype, onednn))
            self.packed_weight = None
        else:
            self.packed_weight, self.packed_parts = pack_weight(self.weight, dtype, onednn), None
        self.output_dtype = output_dtype

    @property
    def packed(self) -> torch.Tensor | None:
        """The dense weight's packed copy (its gate half, where the parts were packed apart): what says the dtype and the
        library of the dense product; None where it has none (bf16_values' pairs are the C++ kernels' own)."""
        return self.packed_parts[0] if self.packed_parts is not None else self.packed_weight

    def _q4_blocks(self) -> tuple[torch.Tensor, int] | None:
        """This layer's GGUF blocks and type id where they are Q4_0 / Q4_1, the types the tiles read dequantizing."""
        if self.quantized is None or self.quantized.qtype not in GGUF_Q4_TYPES:
            return None
        return self.quantized.blocks, self.quantized.qtype

    def pack_int8(self, kernels, output_dtype: torch.dtype, smoothing: torch.Tensor | None = None) -> None:
        """Run the dense product in int8 (W8A8, smoothed by the factors given: Int8Weight) from now on, returning
        output_dtype."""
        self.int8_weight = Int8Weight(self.weight, kernels, smoothing)
        self.packed_weight = self.packed_parts = self.bf16_products = self.bf16_values = None
        self.output_dtype = output_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.quantized is not None and self.quantized.takes(x):
            out = self.quantized.linear(x.float(), bias)  # the blocks multiply float32 (x may come bfloat16)
        else:
            out = self.dense_matmul(x, bias)
        if self.lora is not None:  # before a row-parallel layer's all-reduce: each rank adds its share
            self.lora.add_to(out, x)
        return out

    def fused_silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a gate-up layer: silu(gate) * up of its product made by the GEMM itself, where x's rows take such a GEMM
        (the int8 one's single pass, or oneDNN's on the parts packed apart, in their epilogues) and nothing adds to its
        output first (a bias, adapters); else None."""
        if self.bias is not None or self.lora is not None or (self.quantized is not None and self.quantized.takes(x)):
            return None
        if self.int8_weight is not None:
            return self.int8_weight.silu_and_mul(x)
        if self.packed_parts is not None and not self.on_tiles(x.shape[0]):
            return packed_silu_and_mul(x, *self.packed_parts)
        return None

    def dense_matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The product on the dense weight (packed where pack() or pack_int8() ran), whatever the blocks would take."""
        if self.int8_weight is not None:
            return self.int8_weight.linear(x, bias, self.output_dtype or x.dtype)
        pairs = self.bf16_products if self.on_tiles(x.shape[0]) else self.bf16_values  # float32 sums out, either way
        if pairs is not None:
            out = pairs.linear(x)
            return out if bias is None else out + bias
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, bias, self.output_dtype)
        if self.packed_parts is not None:
            biases = bias.split(self.shard_sizes) if bias is not None else (None, None)
            return torch.cat([packed_linear(x, part, part_bias, self.output_dtype)
                              for part, part_bias in zip(self.packed_parts, biases, strict=True)], dim=-1)
        if self.weight is None:  # on blocks alone: in float32, as the blocks' own products
            return F.linear(x.float(), self.quantized.dequantized(), bias)
        return F.linear(x, self.weight, bias)

    def input_dtype(self, rows: int) -> torch.dtype | None:
        """bfloat16 where a step of `rows` rows multiplies its input rounded to bfloat16 and reads it for nothing else (not
        the GGUF blocks, int8 or adapters): an input that comes in bfloat16 gives the same product, without the pass
        that rounds it. None: the input's own dtype."""
        if self.lora is not None or self.int8_weight is not None or (self.quantized is not None and self.quantized.takes_rows(rows)):
            return None
        packed_bfloat16 = self.packed is not None and self.packed.dtype == torch.bfloat16
        return torch.bfloat16 if self.on_tiles(rows) or packed_bfloat16 else None

    def on_tiles(self, rows: int) -> bool:
        """Whether the dense product of a step of `rows` rows runs on the AMX tiles' copy of the weight."""
        return self.bf16_products is not None and rows <= TILES_MAX_ROWS

    def rank_slice(self, tensor: torch.Tensor, shard: int | None, is_bias: bool) -> torch.Tensor:
        """The part of a full checkpoint tensor (part `shard` of a fused layer) this rank holds."""
        return tensor

    def rank_blocks(self, blocks: torch.Tensor, shard: int | None, block_shape: tuple[int, int]) -> torch.Tensor | None:
        """The part of a part's GGUF blocks ([out rows, bytes]; block_shape: (values, bytes) of one block) this rank
        holds; None where it cannot be cut."""
        return self.rank_slice(blocks, shard, is_bias=False)


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """tensor with zero rows after its own, to `rows` rows (tensor itself where it has as many)."""
    if tensor.shape[0] == rows:
        return tensor
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    return padded


def split_evenly(size: int, name: str) -> tuple[int, int]:
    """(start, length) of this rank's share of size, which the tensor-parallel ranks must divide."""
    ranks, rank = tp_size(), tp_rank()
    if size % ranks:
        raise ValueError(f"{name} ({size}) is not divisible by tensor_parallel_size ({ranks})")
    return rank * (size // ranks), size // ranks


class ColumnParallelLinear(Linear):
    """Output features split among the tensor-parallel ranks, each part of a fused layer evenly: each rank
    computes its slice of the outputs, with no communication."""

    def __init__(self, in_features: int, part_sizes: tuple[int, ...], bias: bool, name: str) -> None:
        self.part_ranges = [split_evenly(size, f"{name} output part {i}") for i, size in enumerate(part_sizes)]
        super().__init__(in_features, sum(length for _, length in self.part_ranges), bias=bias)
        self.full_part_sizes = part_sizes
        self.shard_sizes = tuple(length for _, length in self.part_ranges) if len(part_sizes) > 1 else None

    def rank_slice(self, tensor, shard, is_bias):
        start, length = self.part_ranges[shard or 0]
        return tensor.narrow(0, start, length)


class QKVParallelLinear(ColumnParallelLinear):
    """The fused q, k, v projection split by heads: each rank takes num_heads / tp query heads and its KV
    heads, num_kv_heads / tp of them, or, with more ranks than KV heads, the one its query heads read."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool) -> None:
        ranks, rank = tp_size(), tp_rank()
        self.num_local_heads = heads_per_rank(num_heads, ranks, "num_attention_heads")
        self.num_local_kv_heads, first_kv = kv_heads_of_rank(num_kv_heads, ranks, rank)
        q_range = (rank * self.num_local_heads * head_dim, self.num_local_heads * head_dim)
        kv_range = (first_kv * head_dim, self.num_local_kv_heads * head_dim)
        Linear.__init__(self, hidden_size, q_range[1] + 2 * kv_range[1], bias=bias)
        self.part_ranges = [q_range, kv_range, kv_range]
        self.shard_sizes = (q_range[1], kv_range[1], kv_range[1])
        self.full_part_sizes = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)


def heads_per_rank(num_heads: int, ranks: int, name: str) -> int:
    if num_heads % ranks:
        raise ValueError(f"{name} ({num_heads}) is not divisible by tensor_parallel_size ({ranks})")
    return num_heads // ranks


def kv_heads_of_rank(num_kv_heads: int, ranks: int, rank: int) -> tuple[int, int]:
    """(how many KV heads, the first one) this rank holds: a share, or one replicated head."""
    if num_kv_heads >= ranks:
        count = heads_per_rank(num_kv_heads, ranks, "num_key_value_heads")
        return count, rank * count
    if ranks % num_kv_heads:
        raise ValueError(f"tensor_parallel_size ({ranks}) above num_key_value_heads ({num_kv_heads}) must be a multiple of it")
    return 1, rank * num_kv_heads // ranks


class RowParallelLinear(Linear):
    """Input features split among the tensor-parallel ranks: each rank multiplies its slice of the input (the
    output of a column-parallel layer) by its slice of the weight, and the partial sums are all-reduced; the
    bias is added once, after."""

    def __init__(self, in_features: int, out_features: int, bias: bool, name: str) -> None:
        self.in_range = split_evenly(in_features, f"{name} input features")
        super().__init__(self.in_range[1], out_features, bias=bias)
        self.full_in_features = in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = tp_all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias

    def rank_slice(self, tensor, shard, is_bias):
        return tensor if is_bias else tensor.narrow(1, *self.in_range)

    def rank_blocks(self, blocks, shard, block_shape):
        columns = block_columns(self.in_range, block_shape)
        return None if columns is None else blocks.narrow(1, *columns)


def block_columns(value_range: tuple[int, int], block_shape: tuple[int, int]) -> tuple[int, int] | None:
    """(start, length) in bytes of a row of GGUF blocks that hold values (start, length) of it, given (values, bytes) of
    one block; None where the range cuts a block (that rank runs on dense weights)."""
    (start, length), (values, block_bytes) = value_range, block_shape
    if start % values or length % values:
        return None
    return start // values * block_bytes, length // values * block_bytes
