"""Decode steps through the decoder layers in one C++ call (models/native_decode.py) give the same bits as the layers'
modules, for Llama's layers and the Gemmas', and only models of the plain form take that path."""

import pytest
import torch
from conftest import draw_norm_weights, greedy, worker_of
from gguf_writer import tiny_llama_config, write_gguf

from pagedserve import LLM
from pagedserve.layers.linear import TILES_MAX_ROWS

KV_CACHE = 4 * 1024**2


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from transformers import LlamaForCausalLM

    config = tiny_llama_config()
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("native") / "tiny-Q4_1.gguf"
    write_gguf(path, LlamaForCausalLM(config).eval().state_dict(), config, "Q4_1")
    return path


def blocks_for_steps_of(monkeypatch, rows: int | None = None) -> None:
    """The GEMMs take their blocks for steps of up to rows rows (None: QUANTIZED_MAX_ROWS), whatever this machine's
    measurement would choose: on some processors the dense weights win from one row on the tiny model's smallest
    shapes, which would leave no steps for the native layers."""
    from pagedserve.executor import gemm_choice

    def fixed_rows(model, dense_dtype):
        for gemm in model.blocks_and_dense_gemms():
            gemm.blocks.max_rows = gemm.blocks.max_rows if rows is None else rows
        return {gemm.shape: gemm.blocks.max_rows for gemm in model.blocks_and_dense_gemms()}

    monkeypatch.setattr(gemm_choice, "choose", fixed_rows)


def modules_only(llm):
    """The engine with its decode steps back on the modules."""
    worker_of(llm).model.model.native_decode = None
    return llm


@pytest.mark.parametrize("settings,block_rows", [
    ({"dtype": "float32"}, None), ({"dtype": "float32", "kv_cache_dtype": "int8"}, None), ({"dtype": "auto"}, None),
    ({"dtype": "auto"}, 2),  # where auto is bfloat16 on AMX tiles, the steps beyond 2 rows on the tiles
], ids=["exact", "int8 cache", "rounded input", "tiles beyond the blocks"])
def test_native_decode_steps_give_the_modules_bits(settings, block_rows, tiny_gguf, monkeypatch):
    if settings["dtype"] == "auto":  # blocks that round their input, whatever this processor's auto is
        monkeypatch.delenv("PAGEDSERVE_CPU_AUTO_DTYPE")
    blocks_for_steps_of(monkeypatch, block_rows)
    native = LLM(str(tiny_gguf), kv_cache_memory=KV_CACHE, **settings)
    layers = worker_of(native).model.model.native_decode
    on_tiles = worker_of(native).cpu_kernels.bf16_matrix_tiles() and worker_of(native).gemm_dtype == torch.bfloat16
    assert layers is not None and layers.max_rows >= (6 if block_rows is None or on_tiles else block_rows)
    modules = modules_only(LLM(str(tiny_gguf), kv_cache_memory=KV_CACHE, **settings))
    assert_same_bits(native, modules)


def assert_same_bits(native, modules) -> None:
    """Greedy tokens and their top logprobs equal, bit for bit, between an engine on the native layers and one on the
    modules, over prompts past the tiny Gemmas' sliding window."""
    prompts = [[1, 40, 50, 60], [7] * 19, list(range(100, 133))]
    params = greedy(12, logprobs=3)
    # Decode steps of one row, of three, and of six (past the rows the integer products take where the blocks round).
    for batch in ([prompts[0]], prompts, prompts * 2):
        ours, theirs = ([{"prompt_token_ids": p} for p in batch] for _ in range(2))
        for got, want in zip(native.generate(ours, params, use_tqdm=False), modules.generate(theirs, params, use_tqdm=False)):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            assert [{t: lp.logprob for t, lp in step.items()} for step in got.outputs[0].logprobs] == \
                   [{t: lp.logprob for t, lp in step.items()} for step in want.outputs[0].logprobs]


@pytest.fixture(scope="module")
def tiny_ggufs_beyond_llama(tmp_path_factory):
    """A Gemma 2 (soft caps, norms around attention and the MLP, GELU, a sliding-window layer), a Gemma 3 (per-head
    q/k norms too, a rotary table per layer type) and a Qwen3 (per-head q/k norms) in Q4_1, their norms' weights drawn."""
    import gguf_writer
    from transformers import Gemma2ForCausalLM, Gemma3ForCausalLM, Qwen3ForCausalLM

    paths = {}
    for arch, config, model_class, write in (
        ("gemma2", gguf_writer.tiny_gemma2_config(), Gemma2ForCausalLM, gguf_writer.write_gemma2_gguf),
        ("gemma3", gguf_writer.tiny_gemma3_config(), Gemma3ForCausalLM, gguf_writer.write_gemma3_gguf),
        ("qwen3", gguf_writer.tiny_qwen3_config(), Qwen3ForCausalLM, gguf_writer.write_qwen3_gguf),
    ):
        torch.manual_seed(0)
        model = model_class(config).eval()
        draw_norm_weights(model)
        paths[arch] = tmp_path_factory.mktemp("native") / f"tiny-{arch}-Q4_1.gguf"
        write(paths[arch], model.state_dict(), config, "Q4_1")
    return paths


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_native_decode_steps_of_layers_beyond_llamas_give_the_modules_bits(arch, dtype, tiny_ggufs_beyond_llama, monkeypatch):
    if dtype == "auto":
        monkeypatch.delenv("PAGEDSERVE_CPU_AUTO_DTYPE")
    blocks_for_steps_of(monkeypatch)
    path = str(tiny_ggufs_beyond_llama[arch])
    native = LLM(path, kv_cache_memory=KV_CACHE, dtype=dtype)
    layers = worker_of(native).model.model.native_decode
    assert layers is not None and layers.max_rows >= 6
    assert_same_bits(native, modules_only(LLM(path, kv_cache_memory=KV_CACHE, dtype=dtype)))


def test_native_decode_steps_on_bfloat16_values_give_the_modules_bits(bfloat16_checkpoint, values_kernels_anywhere):
    """A dense checkpoint of bfloat16 values, its float32 GEMMs on the values (Linear.bf16_values): its decode steps take
    the native layers too."""
    native = LLM(str(bfloat16_checkpoint), dtype="float32", kv_cache_memory=KV_CACHE)
    assert worker_of(native).model.model.native_decode.max_rows == TILES_MAX_ROWS
    assert_same_bits(native, modules_only(LLM(str(bfloat16_checkpoint), dtype="float32", kv_cache_memory=KV_CACHE)))


def test_native_decode_steps_run_the_kernels(tiny_gguf, monkeypatch):
    """The engine's decode steps go through the native layers (a step they did not take would leave this unseen)."""
    blocks_for_steps_of(monkeypatch)
    llm = LLM(str(tiny_gguf), dtype="float32", kv_cache_memory=KV_CACHE)
    layers = worker_of(llm).model.model.native_decode
    calls = []
    monkeypatch.setattr(layers, "native", _Counting(layers.native, calls))
    llm.generate({"prompt_token_ids": [1, 2, 3]}, greedy(5), use_tqdm=False)
    assert len(calls) == 4  # the prefill ran on the modules, then one call per decode step


class _Counting:
    def __init__(self, native, calls: list) -> None:
        self._native, self._calls = native, calls

    def forward(self, *args):
        self._calls.append(args[0].shape[0])
        return self._native.forward(*args)


def test_only_plain_models_on_blocks_take_the_native_layers(tiny_gguf, tiny_models):
    no_blocks = LLM(str(tiny_models["llama"]), dtype="float32", kv_cache_memory=KV_CACHE)
    assert worker_of(no_blocks).model.model.native_decode is None
    with_adapters = LLM(str(tiny_gguf), dtype="float32", kv_cache_memory=KV_CACHE, enable_lora=True, max_lora_rank=8)
    assert worker_of(with_adapters).model.model.native_decode is None
    without_kernels = LLM(str(tiny_gguf), dtype="float32", kv_cache_memory=KV_CACHE, cpu_kernels=False)
    assert worker_of(without_kernels).model.model.native_decode is None
