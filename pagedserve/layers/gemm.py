"""Dense GEMMs on CPU: a weight packed once (reordered for oneDNN, in float32 or in bfloat16 where the processor
multiplies bfloat16, in bfloat16 pairs for the C++ kernels, or rounded to int8 for W8A8 GEMMs), and the product of an
activation with it. Shared by the linear layers, the experts of a mixture and the LoRA adapters' products."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.host_memory import FRESH_PAGES_ABOVE_BYTES

# Batch size oneDNN's weight layout is tuned for: a typical decode batch.
_PACKING_BATCH_HINT = 32


def onednn_available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies weights of dtype here: float32 always, bfloat16 where the processor has the
    instructions its bfloat16 kernels need (elsewhere such weights run through torch's own GEMM)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor, dtype: torch.dtype = torch.float32, onednn: bool = True) -> torch.Tensor:
    """weight in dtype, reordered for oneDNN where it multiplies that dtype (and onednn is asked for), else as a
    plain tensor for torch's own GEMM."""
    weight = weight.detach().to(dtype)
    return torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_BATCH_HINT) if onednn and onednn_packs(dtype) else weight.contiguous()


class Int8Weight:
    """A weight rounded to int8 with a scale per output feature (max |row| / 127), multiplied by activations rounded to
    int8 per row at run time, with int32 sums (csrc/int8_gemm.cpp): the integer kernels run about twice the bfloat16
    rate where the processor has int8 dot products (AVX-512 VNNI, AMX), at the accuracy of 8-bit activations.

    smoothing (SmoothQuant's s, one factor per input feature) moves the range of activations' outlier features into the
    weight: the weight's columns are multiplied by s before rounding and each input by 1 / s, so the product is the
    same while an outlier feature no longer sets its whole row's int8 step."""

    def __init__(self, weight: torch.Tensor, kernels, smoothing: torch.Tensor | None = None) -> None:
        weight = weight.detach().float()
        self.input_multipliers = None
        if smoothing is not None:
            weight = weight * smoothing[None, :]
            self.input_multipliers = (1.0 / smoothing).float().contiguous()
        self.scales = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        self.values = torch.round(weight / self.scales[:, None]).to(torch.int8).contiguous()
        self._kernel = kernels.int8_linear  # looked up once, not per call
        self._silu_kernel = kernels.int8_linear_silu_and_mul

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        return self._kernel(x, self.values, self.scales, bias, out_dtype, self.input_multipliers)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up (float32) of the product with a gate-up weight, applied as the sums are scaled: the widest
        activation of an MLP is never written out."""
        return self._silu_kernel(x, self.values, self.scales, self.input_multipliers)


class BFloat16ProductsWeight:
    """A weight for a GEMM that multiplies in bfloat16 and returns float32 sums as they are (csrc/bf16_gemm.cpp): the
    lm_head's where the other GEMMs multiply in bfloat16, and every linear layer's on AMX tiles (`bf16_matrix_tiles`). oneDNN's
    bfloat16 GEMMs return bfloat16, which would round the logits to steps of 1/8 at their usual size and tie tokens that
    are not tied, and costs a pass to widen each layer's output. Only where the kernels' build has bfloat16 dot products
    (`offered`): elsewhere the loop that stands in for them is slower than float32 GEMMs. On AMX tiles the kernel takes
    its input as it comes (float32, or the bfloat16 SiLU-and-mul output), and beat oneDNN's bfloat16 GEMM with its
    conversions at every row count measured (docs/cpu.md); on AVX-512 BF16 dot products alone it beats it for the
    lm_head only."""

    def __init__(self, weight: torch.Tensor | None, kernels, q4_blocks: tuple[torch.Tensor, int] | None = None) -> None:
        """Given q4_blocks (weight's GGUF Q4_0 / Q4_1 blocks and their type id), the kernel reads those instead,
        dequantizing them as it goes into the same bfloat16 values (csrc/tile_blocks.h): the same products from 0.31 of
        the bytes, for steps of the few tens of rows that wait on reading their weights; weight may then be None (a
        layer on blocks alone)."""
        self.out_features = q4_blocks[0].shape[0] if q4_blocks is not None else weight.shape[0]
        self.packed = kernels.pack_tile_blocks(*q4_blocks) if q4_blocks is not None else kernels.pack_bf16_pairs(weight)
        self._kernel = kernels.bf16_pairs_linear  # looked up once, not per call

    @staticmethod
    def offered(kernels) -> bool:
        return kernels is not None and kernels.bf16_dot_products()

    def linear(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T in float32, into out where given."""
        return self._kernel(x, self.packed, self.out_features, out)


class BFloat16ValuesWeight:
    """A float32 GEMM's weight whose values are all bfloat16 values (a checkpoint stored in bfloat16), kept as them:
    packed in pairs (as BFloat16ProductsWeight's), each value widened as it is read and multiplied by the float32 input in
    float32 (csrc/bf16_gemm.cpp, bf16_weights_linear). The products are the float32 weight's, from half its bytes, which
    steps of few rows wait on reading. Where the kernels widen on vectors and keep pace with float32 GEMMs
    (executor/bfloat16_values.py chooses)."""

    def __init__(self, weight: torch.Tensor, kernels) -> None:
        self.out_features = weight.shape[0]
        self.packed = kernels.pack_bf16_pairs(weight)
        self._kernel = kernels.bf16_weights_linear  # looked up once, not per call

    @staticmethod
    def holds(weight: torch.Tensor) -> bool:
        """Whether every value of a float32 weight is a bfloat16 value, so that keeping it in bfloat16 changes none."""
        return weight.dtype == torch.float32 and torch.equal(weight, weight.to(torch.bfloat16).float())

    def linear(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T in float32, into out where given."""
        return self._kernel(x, self.packed, self.out_features, out)


def linear_into(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = product(x) for a product that allocates its output, made over parts of x's rows whose outputs each stay
    within FRESH_PAGES_ABOVE_BYTES (memory the allocator keeps), then copied into out."""
    rows_per_part = max(1, FRESH_PAGES_ABOVE_BYTES // (out.shape[-1] * out.element_size()))
    for start in range(0, x.shape[0], rows_per_part):
        out[start : start + rows_per_part] = product(x[start : start + rows_per_part])
    return out


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x @ packed_weight.T (+ bias) in out_dtype (default: x's). A weight in a narrower dtype (bfloat16) multiplies x
    rounded to it, with float32 accumulation inside the GEMM; its output is widened to out_dtype and the bias added
    in it."""
    out_dtype = out_dtype or x.dtype
    low = x if packed_weight.dtype == x.dtype else x.to(packed_weight.dtype)
    fused_bias = bias if out_dtype == packed_weight.dtype else None
    if packed_weight.is_mkldnn:
        out = torch.ops.mkldnn._linear_pointwise(low, packed_weight, fused_bias, "none", [], "")
    else:
        out = F.linear(low, packed_weight, fused_bias)
    if out.dtype == out_dtype:
        return out
    out = out.to(out_dtype)
    return out if bias is None else out + bias


def packed_silu_and_mul(x: torch.Tensor, packed_gate: torch.Tensor, packed_up: torch.Tensor) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) in the packed weights' dtype, from two oneDNN GEMMs that apply SiLU and the product
    as they store their sums (post-ops): the gate-up product is never written out whole and read back."""
    low = x if x.dtype == packed_gate.dtype else x.to(packed_gate.dtype)
    activated_gate = torch.ops.mkldnn._linear_pointwise(low, packed_gate, None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(low, activated_gate, packed_up, None, "mul")
