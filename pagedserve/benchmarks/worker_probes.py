"""What the benchmarks run on every rank of an engine through its collective_rpc utility: functions of a Worker,
defined at module level so that they travel to worker processes by reference."""

from __future__ import annotations


def time_forward_passes(worker, num_seqs: int, seq_len: int, passes: int, context: int = 0) -> list[float]:
    """Seconds of each of `passes` bare forward passes on this rank (ModelRunner.time_forward_passes)."""
    return worker.model_runner.time_forward_passes(num_seqs, seq_len, passes, context)


def answer_steps_with(worker, reply) -> None:
    """Until run_steps_on_the_model: this rank's steps skip the model, and each returns `reply` (what the output rank
    sends back), so that a step's messages are timed alone."""
    worker.execute_model = lambda scheduler_output: reply


def run_steps_on_the_model(worker) -> None:
    worker.__dict__.pop("execute_model", None)


def experts_held(worker) -> dict[str, list[int]]:
    """Each mixture-of-experts layer of this rank -> the experts (global ids) it holds."""
    return {name: list(module.local_experts) for name, module in worker.model.named_modules() if hasattr(module, "local_experts")}


def gemm_work(worker, decode_rows: int, prefill_rows: int) -> dict:
    """What this rank's GEMMs ask of the machine: the multiply-adds (as FLOPs) of one token through every GEMM but the
    lm_head and of one row through the lm_head, each by what it multiplies in at a prefill step's rows and at a decode
    step's ("int8" where it takes its GGUF blocks with the input rounded to 8 bits, else the dtype of its dense product),
    and the bytes of weights a decode step of decode_rows rows reads (each GEMM's GGUF blocks where it takes them for
    that many rows, else its dense weight)."""
    model = worker.model
    dense = str(worker.dense_gemm_dtype).removeprefix("torch.")
    gemms = [(module.in_features * module.out_features, module.quantized, _dense_weight(module), module.weight)
             for module in model.modules() if hasattr(module, "quantized") and hasattr(module, "packed_weight")]
    decode_bytes = sum(_bytes_read(decode_rows, size, blocks, packed, weight) for size, blocks, packed, weight in gemms)
    steps = (("prefill", prefill_rows), ("decode", decode_rows))
    flops = {step: _flops_by_product(((2 * size, blocks) for size, blocks, *_ in gemms), rows, dense) for step, rows in steps}
    lm_head_flops = {"prefill": {}, "decode": {}}
    if model.lm_head is not None:
        vocab = model.lm_head.weight.shape[0] if model.lm_head.weight is not None else model.quantized_lm_head.blocks.shape[0]
        lm_head = [(2 * vocab * model.config.hidden_size, model.quantized_lm_head)]
        # The lm_head's dense product is in the activations' GEMM dtype, whatever the layers' quantization.
        lm_head_dense = str(worker.gemm_dtype).removeprefix("torch.")
        lm_head_flops = {step: _flops_by_product(lm_head, rows, lm_head_dense) for step, rows in steps}
        decode_bytes += _bytes_read(decode_rows, vocab * model.config.hidden_size, model.quantized_lm_head, _dense_lm_head(model),
                                    model.lm_head.weight)
    return {"gemm_dtype": dense, "flops_per_token": flops, "lm_head_flops_per_row": lm_head_flops, "decode_weight_bytes": decode_bytes}


def _flops_by_product(gemms, rows: int, dense: str) -> dict[str, int]:
    """FLOPs of (flops, GGUF blocks or None) GEMMs at a step of `rows` rows, by what they multiply in."""
    by_product: dict[str, int] = {}
    for flops, blocks in gemms:
        product = "int8" if blocks is not None and blocks.rounds_activations and blocks.takes_rows(rows) else dense
        by_product[product] = by_product.get(product, 0) + flops
    return by_product


def _dense_weight(module):
    """What a linear layer's dense product reads: its int8 values, its bfloat16 values' pairs, its packed copy (as many
    bytes as its AMX tiles' copy), or None (the weight itself)."""
    if module.int8_weight is not None:
        return module.int8_weight.values
    return module.bf16_values.packed if module.bf16_values is not None else module.packed


def _dense_lm_head(model):
    """What the lm_head's dense product reads: its bfloat16 pairs, its packed copy, or None (the weight itself)."""
    return model.lm_head_pairs.packed if model.lm_head_pairs is not None else model.packed_lm_head


def _bytes_read(rows: int, size: int, blocks, packed, weight) -> int:
    """Of a GEMM of `size` weights. weight None: a layer on its blocks alone, whose dense steps read its blocks too
    (dequantizing them), or on a packed copy alone (its bfloat16 values' pairs)."""
    if blocks is not None and (blocks.takes_rows(rows) or weight is None):
        return blocks.stored_bytes
    return size * (packed.dtype.itemsize if packed is not None else weight.element_size())
