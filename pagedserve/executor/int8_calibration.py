"""The int8 GEMMs of quantization int8, set up once the KV cache exists: one bare forward pass in the float GEMMs
records the largest magnitude each linear layer's input features reach, and each layer is then rounded to int8 with
SmoothQuant's smoothing (Int8Weight) by those maxima.

Rounded per row alone, a row's int8 step is set by its few outlier features (the features that the norms' gains
and the residual stream make large in every token), and the rest of the row keeps a handful of levels. Smoothing
divides each feature by s = max|x|^alpha / max|w|^(1 - alpha) and multiplies the weight's column by it, which
balances the two operands' ranges. The features that are outliers are the same whatever the text, so the pass runs
on the same fixed pseudo-random token ids on every start and every rank (ModelRunner.time_forward_passes), and
smoothing never depends on anything a request sent.
"""

from __future__ import annotations

import torch

from pagedserve.layers.linear import Linear

# SmoothQuant's migration strength: 0.5 splits the range evenly between activations and weights.
SMOOTHING_ALPHA = 0.5
# Calibration pass: sequences x tokens, enough rows for every feature's maximum to show.
CALIBRATION_SEQS = 4
CALIBRATION_TOKENS = 256
# Floor of the maxima: a feature that stayed zero (or a weight column of zeros) keeps a finite factor.
_MIN_MAGNITUDE = 1e-5


def pack_int8_gemms(model: torch.nn.Module, runner, kernels, output_dtype: torch.dtype, max_tokens: int) -> int:
    """Calibrate and round every linear layer but routers (and the lm_head, not a Linear) to smoothed int8 GEMMs that
    return output_dtype; returns how many. max_tokens bounds the calibration pass (the KV cache's tokens and the
    context length). A layer on GGUF blocks alone (no dense weight) keeps its blocks."""
    maxima = {layer: maximum for layer, maximum in input_maxima(model, runner, max_tokens).items() if layer.weight is not None}
    for layer, maximum in maxima.items():
        layer.pack_int8(kernels, output_dtype, smoothing_factors(maximum, layer.weight))
    return len(maxima)


@torch.inference_mode()
def input_maxima(model: torch.nn.Module, runner, max_tokens: int) -> dict[Linear, torch.Tensor]:
    """Per linear layer that runs in the calibration pass (not routers), the largest |x| of each of its input features."""
    maxima: dict[Linear, torch.Tensor] = {}

    def record(layer: Linear, args) -> None:
        x = args[0]
        feature_max = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
        seen = maxima.get(layer)
        maxima[layer] = feature_max if seen is None else torch.maximum(seen, feature_max)

    hooks = [module.register_forward_pre_hook(record) for module in model.modules() if isinstance(module, Linear) and not module.routes]
    try:
        runner.time_forward_passes(*calibration_shape(max_tokens), 1)
    finally:
        for hook in hooks:
            hook.remove()
    return maxima


def calibration_shape(max_tokens: int) -> tuple[int, int]:
    """(sequences, tokens each) of the calibration pass, within max_tokens in all."""
    tokens = min(CALIBRATION_TOKENS, max_tokens)
    return max(1, min(CALIBRATION_SEQS, max_tokens // tokens)), tokens


def smoothing_factors(input_max: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTHING_ALPHA) -> torch.Tensor:
    """SmoothQuant's s per input feature: max|x|^alpha / max|w|^(1 - alpha)."""
    weight_max = weight.detach().float().abs().amax(dim=0).clamp_min(_MIN_MAGNITUDE)
    return input_max.clamp_min(_MIN_MAGNITUDE).pow(alpha) / weight_max.pow(1 - alpha)
