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


def gemm_work(worker, decode_rows: int) -> dict:
    """What this rank's GEMMs ask of the machine: the dtype they multiply in, the multiply-adds (as FLOPs) of one token
    through every GEMM but the lm_head and of one row through the lm_head, and the bytes of weights a decode step of
    decode_rows rows reads (each GEMM's GGUF blocks where it takes them for that many rows, else its dense weight)."""
    model = worker.model
    gemms = [(module.in_features * module.out_features, module.quantized, _dense_weight(module), module.weight)
             for module in model.modules() if hasattr(module, "quantized") and hasattr(module, "packed_weight")]
    decode_bytes = sum(_bytes_read(decode_rows, blocks, packed, weight) for _, blocks, packed, weight in gemms)
    lm_head_flops = 0
    if model.lm_head is not None:
        lm_head_flops = 2 * model.lm_head.weight.numel()
        decode_bytes += _bytes_read(decode_rows, model.quantized_lm_head, _dense_lm_head(model), model.lm_head.weight)
    return {"gemm_dtype": str(worker.dense_gemm_dtype).removeprefix("torch."), "flops_per_token": 2 * sum(size for size, *_ in gemms),
            "lm_head_flops_per_row": lm_head_flops, "decode_weight_bytes": decode_bytes}


def _dense_weight(module):
    """What a linear layer's dense product reads: its int8 values, its packed copy (as many bytes as its AMX tiles'
    copy), or None (the weight itself)."""
    return module.int8_weight.values if module.int8_weight is not None else module.packed


def _dense_lm_head(model):
    """What the lm_head's dense product reads: its bfloat16 pairs, its packed copy, or None (the weight itself)."""
    return model.bfloat16_lm_head.packed if model.bfloat16_lm_head is not None else model.packed_lm_head


def _bytes_read(rows: int, blocks, packed, weight) -> int:
    if blocks is not None and blocks.takes_rows(rows):
        return blocks.blocks.numel()
    return weight.numel() * (packed.dtype.itemsize if packed is not None else weight.element_size())
