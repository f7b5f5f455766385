"""GGUF files: every supported tensor type dequantizes to what gguf's reference gives, and F32 is token-exact."""

import copy
import statistics
from functools import partial

import gguf_writer
import numpy as np
import pytest
import torch
from conftest import draw_norm_weights, greedy, worker_of
from gguf_writer import QUANT_TYPES, quantized_round_trip, tiny_llama_config, write_gguf

from pagedserve import LLM


@pytest.fixture(scope="module")
def tiny_hf_llama():
    from transformers import LlamaForCausalLM

    config = tiny_llama_config()
    torch.manual_seed(0)
    return config, LlamaForCausalLM(config).eval()


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))


def tiny_gguf(tmp_path, tiny_hf_llama, type_name: str):
    """The tiny model written as a GGUF file of type_name."""
    config, hf_model = tiny_hf_llama
    path = tmp_path / f"tiny-{type_name}.gguf"
    write_gguf(path, hf_model.state_dict(), config, type_name)
    return path


@pytest.mark.parametrize("type_name", sorted(QUANT_TYPES))
def test_gguf_weights_load_as_their_dequantized_values(type_name, tiny_hf_llama, tmp_path):
    """Off their blocks, every layer holds the file's values: those the converted checkpoint keeps only as blocks are
    dequantized at load. (oneDNN's float32 copies keep the loaded weights to read back: a BF16 file's would otherwise
    be kept as bfloat16 values alone.)"""
    config, hf_model = tiny_hf_llama
    llm = LLM(str(tiny_gguf(tmp_path, tiny_hf_llama, type_name)), kv_cache_memory=4 * 1024**2, gguf_quantized_weights=False,
              gemm_backend="onednn")
    ours = worker_of(llm).model
    layer, hf_layer = ours.model.layers[1], hf_model.model.layers[1]
    q_size = layer.self_attn.q_size
    pairs = [
        (layer.self_attn.qkv_proj.weight[:q_size], hf_layer.self_attn.q_proj.weight),  # q rows un-permuted
        (layer.mlp.gate_up_proj.weight[config.intermediate_size:], hf_layer.mlp.up_proj.weight),
        (ours.lm_head.weight, hf_model.lm_head.weight),
    ]
    for loaded, original in pairs:
        expected = quantized_round_trip(original.detach().numpy(), type_name)
        if type_name == "BF16":
            expected = original.detach().to(torch.bfloat16).float().numpy()
        np.testing.assert_allclose(loaded.detach().numpy(), expected, rtol=0, atol=1e-6)
    out = llm.generate("hello world", greedy(8), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 8
    assert llm.get_tokenizer().chat_template  # carried over from the GGUF metadata


def test_f32_gguf_generates_exactly_like_the_original_model(tiny_hf_llama, tmp_path):
    _, hf_model = tiny_hf_llama
    llm = LLM(str(tiny_gguf(tmp_path, tiny_hf_llama, "F32")), kv_cache_memory=4 * 1024**2)
    out = llm.generate(["hello world", "or"], greedy(12), use_tqdm=False)
    for output in out:
        ids = torch.tensor([output.prompt_token_ids])
        with torch.inference_mode():
            reference = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)
        assert output.outputs[0].token_ids == reference[0, ids.shape[1]:].tolist()


def test_converted_gguf_is_cached(tiny_hf_llama, tmp_path):
    from pagedserve.models import gguf_convert

    path = tiny_gguf(tmp_path, tiny_hf_llama, "Q8_0")
    first = gguf_convert.ensure_converted(path)
    marker_time = (first / ".pagedserve-complete").stat().st_mtime_ns
    assert gguf_convert.ensure_converted(path) == first
    assert (first / ".pagedserve-complete").stat().st_mtime_ns == marker_time
    assert any(first.glob(f"{gguf_convert.FLOAT_FILE_STEM}-*.safetensors")) and (first / "tokenizer.json").is_file()
    # Keyed by content: a copy elsewhere (another environment's site-packages, say) reuses the conversion.
    copy = tmp_path / "elsewhere" / path.name
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    assert gguf_convert.ensure_converted(copy) == first
    assert (first / ".pagedserve-complete").stat().st_mtime_ns == marker_time


def test_a_gguf_files_digest_is_read_once_per_version_of_the_file(tiny_hf_llama, tmp_path):
    """A later start finds the conversion without reading the whole file again; a file that changed is read anew."""
    import os
    import subprocess
    import sys

    path = tiny_gguf(tmp_path, tiny_hf_llama, "Q8_0")
    probe = ("import sys; from pathlib import Path; from pagedserve.models import gguf_convert; "
             "print(gguf_convert.converted_dir_for(Path(sys.argv[1])))")

    def converted_dir() -> str:  # in a new process, as a start asks
        return subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, check=True).stdout

    first = converted_dir()
    original = path.read_bytes()
    stat = path.stat()
    path.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # same size; its modification time put back below
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert converted_dir() == first  # the digest kept for this size and time: the file was not read
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert converted_dir() != first  # a new version of the file: read, and its own digest


def test_missing_gguf_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        LLM(str(tmp_path / "absent.gguf"))


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_gguf_runs_on_its_blocks_with_the_same_values(type_name, tiny_hf_llama, tmp_path):
    from pagedserve.layers import cpu_kernels
    from pagedserve.layers.linear import QUANTIZED_MAX_ROWS, Linear

    config, _ = tiny_hf_llama
    path = tiny_gguf(tmp_path, tiny_hf_llama, type_name)
    on_blocks = LLM(str(path), kv_cache_memory=4 * 1024**2)
    model = worker_of(on_blocks).model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * config.num_hidden_layers and all(m.quantized is not None for m in linears)
    assert model.quantized_lm_head is not None
    assert {m.quantized.qtype for m in linears} == {int(QUANT_TYPES[type_name])}  # our type ids are gguf's
    assert all(m.weight is None for m in linears) and model.lm_head.weight is None  # no dense copy beside the blocks
    kernels = cpu_kernels.load()
    on_floats = LLM(str(path), kv_cache_memory=4 * 1024**2, gguf_quantized_weights=False)
    dense = [m for m in worker_of(on_floats).model.modules() if isinstance(m, Linear)]
    assert all(m.quantized is None for m in dense)
    for module, reference in zip(linears, dense):  # the blocks hold the dense weights' values, rows in the same order
        assert torch.equal(kernels.dequantize_gguf(module.quantized.blocks, module.quantized.qtype), reference.weight)
        assert module.quantized.interleaved is not None  # steps of 3+ rows take the broadcast GEMM
    for blocks in [m.quantized for m in linears] + [model.quantized_lm_head]:  # both block kernels (1-2 rows, 3+) run below,
        blocks.max_rows = QUANTIZED_MAX_ROWS  # whatever this machine measured
    # A prompt longer than QUANTIZED_MAX_ROWS runs its prefill on the weights dequantized for the step, its decodes on
    # the blocks.
    prompts = ["hello world", "or", "hello world or hello " * (QUANTIZED_MAX_ROWS // 4)]
    params = greedy(10)
    params.logprobs = 3
    for ours, reference in zip(on_blocks.generate(prompts, params, use_tqdm=False), on_floats.generate(prompts, params, use_tqdm=False)):
        assert ours.outputs[0].token_ids == reference.outputs[0].token_ids
        for got, want in zip(ours.outputs[0].logprobs, reference.outputs[0].logprobs):
            for token_id, logprob in want.items():
                assert got[token_id].logprob == pytest.approx(logprob.logprob, abs=1e-4)



def test_the_converted_directory_keeps_blocks_alone_and_export_writes_transformers_checkpoint(tiny_hf_llama, tmp_path, monkeypatch):
    """A converted GGUF model keeps the tensors the kernels read as GGUF blocks alone (no float32 copy: about the file's
    size, and no file transformers would read as the whole checkpoint), the others in shards; it generates as
    transformers does. `pagedserve export` writes the whole checkpoint, in shards, with the values transformers' own
    reading of the GGUF file gives."""
    from transformers import AutoModelForCausalLM

    from pagedserve.entrypoints import cli
    from pagedserve.models import hf_export, safetensors_shards
    from pagedserve.models.gguf_blocks import load_quantized_blocks
    from pagedserve.models.gguf_convert import ensure_converted
    from pagedserve.models.loader import stored_tensor_names

    path = tiny_gguf(tmp_path, tiny_hf_llama, "Q4_1")
    monkeypatch.setattr(safetensors_shards, "SHARD_BYTES", 64 * 1024)  # the conversion's float tensors and the export in shards
    converted = ensure_converted(path)
    assert len(list(converted.glob("*.safetensors"))) > 1
    blocks, stored = load_quantized_blocks(converted), stored_tensor_names(converted)
    assert "lm_head.weight" in blocks and "model.layers.0.self_attn.q_proj.weight" in blocks
    assert set(blocks) & stored == {"model.embed_tokens.weight"}  # looked up by rows: float32 too
    assert not (converted / "model.safetensors").exists()
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name)
    output = LLM(str(path), kv_cache_memory=4 * 1024**2, dtype="float32").generate("hello world", greedy(12), use_tqdm=False)[0]
    ids = torch.tensor([output.prompt_token_ids])
    with torch.inference_mode():
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)
    assert output.outputs[0].token_ids == expected[0, ids.shape[1]:].tolist()
    out = tmp_path / "exported"
    assert cli.main(["export", str(path), str(out)]) == 0
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    ours, theirs = AutoModelForCausalLM.from_pretrained(out).state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)
    assert cli.main(["export", str(path), str(out)]) == 2  # not over what is there
    cached = hf_export.transformers_checkpoint(converted)  # what the HF baseline of bench throughput reads
    assert cached != converted and hf_export.transformers_checkpoint(converted) == cached
    assert all(torch.equal(tensor, theirs[name]) for name, tensor in AutoModelForCausalLM.from_pretrained(cached).state_dict().items())


def test_export_of_a_sharded_checkpoint_writes_its_own_index(tiny_models, tmp_path):
    """An HF directory in shards with an index exports to a checkpoint of the same tensors, indexed by its own shards."""
    from transformers import AutoModelForCausalLM

    from pagedserve.entrypoints import cli

    source = tiny_models["mistral"]
    assert (source / "model.safetensors.index.json").is_file()
    assert cli.main(["export", str(source), str(tmp_path / "out")]) == 0
    ours, theirs = (AutoModelForCausalLM.from_pretrained(d).state_dict() for d in (tmp_path / "out", source))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[name], theirs[name]) for name in ours)


def test_blocks_are_matched_to_their_converted_tensor_only_exactly():
    from pagedserve.models.gguf_blocks import _row_order

    rng = np.random.default_rng(0)
    converted = rng.standard_normal((6, 32)).astype(np.float32)
    converted[4] = converted[1]  # repeated rows (as in embeddings) are fine in the original order
    assert _row_order(converted.copy(), converted).tolist() == list(range(6))
    assert _row_order(converted[[1, 0, 3, 2, 5, 4]], converted) is None  # a repeated row cannot be placed once each
    distinct = rng.standard_normal((6, 32)).astype(np.float32)
    permuted = distinct[[1, 0, 3, 2, 5, 4]]  # llama.cpp's q/k layout is a row permutation
    assert np.array_equal(distinct[_row_order(permuted, distinct)], permuted)
    assert _row_order(distinct[:, ::-1].copy(), distinct) is None  # values that match nothing
    off_by_one_ulp = permuted.copy()
    off_by_one_ulp[2, 7] = np.nextafter(off_by_one_ulp[2, 7], np.float32(np.inf))
    assert _row_order(off_by_one_ulp, distinct) is None
    assert _row_order(distinct[:5], distinct) is None  # another shape


def file_values(hf_model, type_name: str, stored_as_is=lambda name: False):
    """A copy of hf_model holding the values a GGUF file of type_name holds: its matrices quantized and back (but for
    those stored_as_is names)."""
    reference = copy.deepcopy(hf_model)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if param.dim() >= 2 and not stored_as_is(name):
                param.copy_(torch.from_numpy(quantized_round_trip(param.numpy(), type_name)))
    return reference


def assert_generates_like(llm, reference) -> None:
    """Greedy tokens, and their logprobs, equal transformers' on the reference model: for a short prompt and a long
    one. The logprobs too, because greedy picks alone barely depend on attention in so small a model."""
    for prompt in ([5, 6, 7, 8, 9, 10], list(range(40, 90))):
        ours = llm.generate({"prompt_token_ids": prompt}, greedy(10, logprobs=1), use_tqdm=False)[0].outputs[0]
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
            logits = reference(torch.tensor([prompt + expected])).logits[0, len(prompt) - 1:-1]
        assert list(ours.token_ids) == expected
        reference_logprobs = torch.log_softmax(logits.double(), dim=-1)[range(len(expected)), expected].tolist()
        ours_logprobs = [position[token].logprob for token, position in zip(ours.token_ids, ours.logprobs)]
        assert ours_logprobs == pytest.approx(reference_logprobs, abs=1e-3)


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral", "olmoe"])
@pytest.mark.parametrize("type_name", ["F32", "Q8_0", "Q4_0"])
def test_a_mixture_of_experts_gguf_generates_like_its_weights_in_transformers(arch, type_name, tmp_path):
    """llama.cpp's layouts: a Qwen2-MoE (each layer's experts stacked, the expert widths in the metadata, the shared
    expert's gate a vector), a Mixtral (architecture llama with experts, q and k permuted) and an OLMoE (an
    architecture transformers' GGUF reading does not know, read by ours; q and k norms over all heads): greedy tokens and
    their logprobs equal transformers' on the values the file holds (quantized and back), the quantized experts
    multiplying on their GGUF blocks."""
    from transformers import MixtralForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM

    from pagedserve.layers.fused_moe import FusedMoE
    from pagedserve.layers.linear import QuantizedWeight

    if arch == "mixtral":
        config, model_class, write = gguf_writer.tiny_mixtral_config(), MixtralForCausalLM, gguf_writer.write_mixtral_gguf
    elif arch == "olmoe":
        config, model_class, write = gguf_writer.tiny_olmoe_config(), OlmoeForCausalLM, gguf_writer.write_olmoe_gguf
    else:
        config, model_class, write = gguf_writer.tiny_qwen2_moe_config(), Qwen2MoeForCausalLM, gguf_writer.write_qwen2_moe_gguf
    torch.manual_seed(0)
    hf_model = model_class(config).eval()
    path = tmp_path / f"tiny-{arch}-{type_name}.gguf"
    write(path, hf_model.state_dict(), config, type_name)
    reference = file_values(hf_model, type_name, stored_as_is=lambda name: "shared_expert_gate" in name)
    llm = LLM(str(path), kv_cache_memory=4 * 1024**2)
    mixtures = [module for module in worker_of(llm).model.modules() if isinstance(module, FusedMoE)]
    on_blocks = [isinstance(weight, QuantizedWeight) for module in mixtures for part in module.packed for weight in part]
    assert len(mixtures) == 2 and all(on_blocks) == (type_name != "F32") and len(on_blocks) == 2 * 2 * 8
    assert_generates_like(llm, reference)


@pytest.mark.parametrize("arch,type_name", [("gemma3", "F32"), ("gemma3", "Q8_0"), ("gemma3", "Q4_0"),
                                            ("gemma2", "F32"), ("gemma2", "Q8_0"), ("qwen3", "F32"), ("qwen3", "Q4_0"),
                                            ("olmo2", "F32"), ("olmo2", "Q4_0"), ("smollm3", "F32"), ("smollm3", "Q8_0"),
                                            ("ernie4_5", "F32"), ("ernie4_5", "Q8_0"), ("exaone4", "F32"), ("exaone4", "Q4_1")])
def test_a_dense_gguf_of_another_architecture_generates_like_its_weights_in_transformers(arch, type_name, tmp_path):
    """llama.cpp's Gemma 2, Gemma 3, Qwen3, OLMo 2, SmolLM3 and ERNIE 4.5 layouts (the Gemmas' norms stored plus one,
    their sliding and full attention layers in llama.cpp's pattern, Gemma 3's full layers' rope scaling, Gemma 2's soft
    caps; Qwen3's per-head q/k norms and its head size, which the file states; tied embeddings; read by ours, as
    transformers' GGUF reading does not know them: OLMo 2's norms after attention and the MLP only and its q/k norms
    across the heads, SmolLM3's q and k in llama.cpp's rotary layout and its fourth layer without a rotary, which the
    file does not state, ERNIE 4.5's q and k as its checkpoint holds them for its rotary of adjacent pairs, its head
    size and its tied embeddings, EXAONE 4's sliding-window pattern beside a full layer without a rotary and its llama3
    rope scaling read back from the file's factors): greedy tokens and their logprobs equal transformers' on the values
    the file holds, past the sliding window, the quantized layers multiplying on their GGUF blocks."""
    from transformers import (
        Ernie4_5ForCausalLM,
        Exaone4ForCausalLM,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Olmo2ForCausalLM,
        Qwen3ForCausalLM,
        SmolLM3ForCausalLM,
    )

    from pagedserve.layers.linear import Linear

    config, model_class, write = {
        "gemma2": (gguf_writer.tiny_gemma2_config(), Gemma2ForCausalLM, gguf_writer.write_gemma2_gguf),
        "gemma3": (gguf_writer.tiny_gemma3_config(), Gemma3ForCausalLM, gguf_writer.write_gemma3_gguf),
        "qwen3": (gguf_writer.tiny_qwen3_config(), Qwen3ForCausalLM, gguf_writer.write_qwen3_gguf),
        "olmo2": (gguf_writer.tiny_olmo2_config(), Olmo2ForCausalLM, gguf_writer.write_olmo2_gguf),
        "smollm3": (gguf_writer.tiny_smollm3_config(), SmolLM3ForCausalLM, gguf_writer.write_smollm3_gguf),
        "ernie4_5": (gguf_writer.tiny_ernie4_5_config(), Ernie4_5ForCausalLM, gguf_writer.write_ernie4_5_gguf),
        "exaone4": (gguf_writer.tiny_exaone4_config(), Exaone4ForCausalLM, gguf_writer.write_exaone4_gguf),
    }[arch]
    torch.manual_seed(0)
    hf_model = model_class(config).eval()
    draw_norm_weights(hf_model)
    path = tmp_path / f"tiny-{arch}-{type_name}.gguf"
    write(path, hf_model.state_dict(), config, type_name)
    reference = file_values(hf_model, type_name)
    llm = LLM(str(path), kv_cache_memory=4 * 1024**2)
    linears = [module for module in worker_of(llm).model.modules() if isinstance(module, Linear)]
    assert len(linears) == 4 * config.num_hidden_layers and all((m.quantized is not None) == (type_name != "F32") for m in linears)
    assert_generates_like(llm, reference)


def test_rope_factors_are_refused_where_the_architecture_does_not_read_them(tmp_path):
    """llama.cpp writes a scaled rotary as factors of its frequencies (rope_freqs); a file of an architecture read here
    that has them, but whose reading does not take them, is refused rather than served without the scaling."""
    from transformers import Ernie4_5ForCausalLM

    config = gguf_writer.tiny_ernie4_5_config()
    path = tmp_path / "tiny-ernie-scaled.gguf"
    factors = np.full(config.head_dim // 2, 2.0, dtype=np.float32)
    gguf_writer.write_ernie4_5_gguf(path, Ernie4_5ForCausalLM(config).state_dict(), config, "F32", rope_factors=factors)
    with pytest.raises(ValueError, match=r"ernie4_5 GGUF file has rope factors \(rope_freqs.weight\).*HF checkpoint"):
        LLM(str(path), kv_cache_memory=4 * 1024**2)


def test_an_olmo3_gguf_is_refused_rather_than_read_without_its_sliding_window_layers(tmp_path):
    from transformers import Olmo2ForCausalLM

    config = gguf_writer.tiny_olmo2_config()
    path = tmp_path / "tiny-olmo3.gguf"
    gguf_writer.write_olmo2_gguf(path, Olmo2ForCausalLM(config).state_dict(), config, "F32", sliding_window=16)
    with pytest.raises(ValueError, match=r"sliding-window layers \(an OLMo 3\).*HF checkpoint"):
        LLM(str(path), kv_cache_memory=4 * 1024**2)


def test_a_gguf_mixture_of_an_architecture_whose_experts_are_not_read_is_refused(tiny_hf_llama, tmp_path, monkeypatch):
    """A llama file that says it has experts but holds none stacked (as llama.cpp's older Mixtral files held one
    tensor per expert) would otherwise load without them."""
    import gguf

    config, hf_model = tiny_hf_llama
    path = tmp_path / "llama-with-experts.gguf"
    add_metadata = gguf.GGUFWriter.add_name

    def with_experts(writer, name):
        add_metadata(writer, name)
        writer.add_expert_count(8)

    monkeypatch.setattr(gguf.GGUFWriter, "add_name", with_experts)
    write_gguf(path, hf_model.state_dict(), config, "F32")
    with pytest.raises(ValueError, match="mixture of experts of architecture 'llama'; GGUF mixtures are read for qwen2moe"):
        LLM(str(path), kv_cache_memory=4 * 1024**2)


@pytest.mark.parametrize("dtype,auto_in_environment,rounds", [
    ("auto", None, True), ("auto", "float32", False), ("auto", "bfloat16", True), ("float32", None, False), ("bfloat16", None, True),
])
def test_block_products_round_their_input_unless_float32_is_asked_for(dtype, auto_in_environment, rounds, monkeypatch):
    from pagedserve.config import EngineConfig
    from pagedserve.executor.worker import block_products_round_activations

    monkeypatch.delenv("PAGEDSERVE_CPU_AUTO_DTYPE", raising=False)
    if auto_in_environment:
        monkeypatch.setenv("PAGEDSERVE_CPU_AUTO_DTYPE", auto_in_environment)
    assert block_products_round_activations(EngineConfig(dtype=dtype), torch.device("cpu")) == rounds
    assert not block_products_round_activations(EngineConfig(dtype=dtype), torch.device("cuda"))


def transformers_on_rounded_input(tiny_hf_llama, type_name: str):
    """The tiny model in transformers with its weights as the GGUF file holds them, and the input of every linear layer
    (the lm_head's too) rounded as llama.cpp rounds activations."""
    from torch import nn

    config, hf_model = tiny_hf_llama
    model = copy.deepcopy(hf_model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.copy_(torch.from_numpy(quantized_round_trip(module.weight.numpy(), type_name)))
        embedding = model.get_input_embeddings().weight
        embedding.copy_(torch.from_numpy(quantized_round_trip(embedding.numpy(), type_name)))
    return with_rounded_linear_inputs(model)


def with_rounded_linear_inputs(model, unrounded: str = "shared_expert_gate"):
    """model (changed in place) with the input of every linear layer but those named unrounded (a vector in GGUF files,
    so never on blocks), and of each expert's products, rounded as llama.cpp rounds activations: to
    nearbyint(x * 127 / max|x|) per 32 values."""
    from unittest import mock

    import torch.nn.functional as F
    from torch import nn

    def rounded(x):
        blocks = x.reshape(*x.shape[:-1], -1, 32)
        amax = blocks.abs().amax(-1, keepdim=True)
        return (torch.round(blocks * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))) * (amax / 127)).reshape(x.shape)

    linear = F.linear

    def experts_forward(*args, original, **kwargs):  # transformers' experts multiply with F.linear on stacked weights
        with mock.patch.object(F, "linear", lambda x, weight, bias=None: linear(rounded(x), weight, bias)):
            return original(*args, **kwargs)

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and not name.endswith(unrounded):
            module.forward = lambda x, m=module: linear(rounded(x), m.weight, m.bias)
        elif getattr(module, "gate_up_proj", None) is not None and module.gate_up_proj.dim() == 3:
            module.config._experts_implementation = "eager"  # the loop of F.linear calls, not a grouped GEMM
            module.forward = partial(experts_forward, original=module.forward)
    return model.eval()


def rounding_llm(path, monkeypatch):
    """An LLM on the file with dtype auto on a processor without bfloat16 matrix units: float32 everywhere but the
    products on GGUF blocks, whose input is rounded to 8 bits per 32 values; every step on the blocks, whatever this
    machine measured."""
    from pagedserve.cpu_features import CPUFeatures
    from pagedserve.executor import worker as worker_module
    from pagedserve.layers.linear import QUANTIZED_MAX_ROWS

    monkeypatch.delenv("PAGEDSERVE_CPU_AUTO_DTYPE")
    monkeypatch.setattr(worker_module, "cpu_features", lambda: CPUFeatures("test CPU", frozenset({"avx2", "fma"})))
    llm = LLM(str(path), kv_cache_memory=4 * 1024**2)
    worker = worker_of(llm)
    assert worker.dtype == worker.gemm_dtype == torch.float32
    for gemm in worker.model.blocks_and_dense_gemms():
        gemm.blocks.max_rows = QUANTIZED_MAX_ROWS
    return llm


def assert_rounding_departs_like_transformers(rounding, exact, reference, statistic=sum) -> None:
    """Scored on the tokens the exact mode picks, the rounding engine's logprobs are off from the exact mode's (which are
    transformers') by no more, on the whole (the statistic over the positions), than the reference's (transformers
    rounding each linear layer's input)."""
    scoring = greedy(1, prompt_logprobs=0)
    ours_off, theirs_off = [], []
    for seed in range(3):
        prompt = torch.randint(10, 250, (24,), generator=torch.Generator().manual_seed(seed)).tolist()
        ids = prompt + exact.generate({"prompt_token_ids": prompt}, greedy(8), use_tqdm=False)[0].outputs[0].token_ids
        ours, exact_logprobs = (llm.generate({"prompt_token_ids": ids}, scoring, use_tqdm=False)[0].prompt_logprobs
                                for llm in (rounding, exact))
        with torch.inference_mode():
            theirs = reference(torch.tensor([ids])).logits[0].float().log_softmax(-1)
        for i in range(len(prompt), len(ids)):
            ours_off.append(abs(ours[i][ids[i]].logprob - exact_logprobs[i][ids[i]].logprob))
            theirs_off.append(abs(theirs[i - 1, ids[i]].item() - exact_logprobs[i][ids[i]].logprob))
    assert sum(theirs_off) > 0 and sum(ours_off) > 0  # both do round
    assert statistic(ours_off) <= 1.25 * statistic(theirs_off), (ours_off, theirs_off)


def test_auto_runs_the_blocks_on_input_rounded_to_8_bits(tiny_hf_llama, tmp_path, monkeypatch):
    """dtype auto on a processor without bfloat16 matrix units: float32 everywhere but the products on GGUF blocks of
    few rows, whose input is rounded to 8 bits per 32 values; off from the exact mode no more than rounding each linear
    layer's input in transformers."""
    path = tiny_gguf(tmp_path, tiny_hf_llama, "Q4_1")
    exact = LLM(str(path), dtype="float32", kv_cache_memory=4 * 1024**2)
    rounding = rounding_llm(path, monkeypatch)
    blocks = [gemm.blocks for gemm in worker_of(rounding).model.blocks_and_dense_gemms()]
    assert blocks and all(b.rounds_activations and b.interleaved is None for b in blocks)
    assert not any(gemm.blocks.rounds_activations for gemm in worker_of(exact).model.blocks_and_dense_gemms())
    assert_rounding_departs_like_transformers(rounding, exact, transformers_on_rounded_input(tiny_hf_llama, "Q4_1"))


# Types of a mixed file as llama.cpp's Q4_K_M mixes them (v and down in more bits), and every other type only the
# integer products read: layer 0's q/k/v and gate/up each mix two types, layer 1's are of one.
_MIXED_TYPES = {"token_embd": "Q4_K", "output": "Q6_K", "attn_q": ("Q4_K", "Q6_K"), "attn_k": ("Q4_K", "Q6_K"),
                "attn_v": ("Q6_K", "Q6_K"), "attn_output": ("Q5_K", "Q5_0"), "ffn_gate": ("Q4_K", "Q5_1"),
                "ffn_up": ("Q5_0", "Q5_1"), "ffn_down": ("Q6_K", "Q4_K")}
# A mixture in Q4_K_M's mix: the experts' gate and up in Q4_K, their down in Q6_K, the router as llama.cpp keeps it.
_MIXTURE_TYPES = {"token_embd": "Q4_K", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K",
                  "attn_output": "Q4_K", "ffn_gate_inp": "F32", "ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K",
                  "ffn_down_exps": "Q6_K", "ffn_gate_shexp": "Q4_K", "ffn_up_shexp": "Q4_K", "ffn_down_shexp": "Q6_K"}


def types_of(table: dict):
    """The type of each GGUF tensor by its name (blk.N.part.weight: the part's type, or its type in layer N)."""
    def type_of(name: str) -> str:
        parts = name.split(".")
        chosen = table[parts[0] if len(parts) == 2 else parts[2]]
        return chosen if isinstance(chosen, str) else chosen[int(parts[1])]

    return type_of


def test_k_quant_and_q5_files_run_their_blocks_where_products_are_integers(tmp_path, monkeypatch):
    """A file mixing Q4_K, Q5_K, Q6_K, Q5_0 and Q5_1 matrices, as llama.cpp's K-quant files do, fused layers of two types
    included. In float32 (exact) it generates as transformers does on the values the file holds, on dense weights; where
    products are integers every linear layer and the lm_head run on their blocks, off from the exact mode no more than
    transformers rounding each linear layer's input, and decode steps in one C++ call give the modules' bits."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from pagedserve.layers.linear import GGUF_PANEL_TYPES, Linear, QuantizedParts

    config = gguf_writer.tiny_k_quant_llama_config()
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(config)
    draw_norm_weights(hf_model)
    path = tmp_path / "tiny-mixed-k-quants.gguf"
    write_gguf(path, hf_model.state_dict(), config, types_of(_MIXED_TYPES))
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, torch_dtype=torch.float32).eval()

    exact = LLM(str(path), dtype="float32", kv_cache_memory=4 * 1024**2)
    assert not worker_of(exact).model.blocks_and_dense_gemms()
    assert_generates_like(exact, reference)

    rounding = rounding_llm(path, monkeypatch)
    model = worker_of(rounding).model
    linears = [module for module in model.modules() if isinstance(module, Linear)]
    assert len(linears) == 4 * config.num_hidden_layers and all(m.quantized is not None for m in linears)
    first = model.model.layers[0]
    assert isinstance(first.self_attn.qkv_proj.quantized, QuantizedParts) and isinstance(first.mlp.gate_up_proj.quantized, QuantizedParts)
    blocks = [gemm.blocks for gemm in model.blocks_and_dense_gemms()]
    assert len(blocks) == len(linears) + 1 and all(b.rounds_activations for b in blocks)  # the lm_head too
    assert {part.qtype for b in blocks for part in getattr(b, "parts", [b])} == set(GGUF_PANEL_TYPES.values())
    assert_rounding_departs_like_transformers(rounding, exact, with_rounded_linear_inputs(copy.deepcopy(reference)))
    assert model.model.native_decode is not None
    prompts = [{"prompt_token_ids": [1, 40, 50, 60]}, {"prompt_token_ids": list(range(100, 133))}]
    native = rounding.generate(prompts, greedy(8, logprobs=3), use_tqdm=False)
    model.model.native_decode = None
    for got, want in zip(native, rounding.generate(prompts, greedy(8, logprobs=3), use_tqdm=False)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert [{t: lp.logprob for t, lp in step.items()} for step in got.outputs[0].logprobs] == \
               [{t: lp.logprob for t, lp in step.items()} for step in want.outputs[0].logprobs]


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_linear_layer_on_the_tiles_reads_its_q4_blocks_for_the_dense_weights_products(type_name):
    """Given the tiles' kernels, a layer on Q4 blocks packs them for the tiles (dequantized as a step goes) rather than
    its dense weight in bfloat16: the same products, bit for bit; a Q8_0 layer keeps the bfloat16 pairs."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from pagedserve.layers import cpu_kernels
    from pagedserve.layers.gemm import BFloat16ProductsWeight
    from pagedserve.layers.linear import Linear, QuantizedWeight

    kernels = cpu_kernels.load()
    qtype = GGMLQuantizationType[type_name]
    blocks = quantize(np.random.default_rng(0).standard_normal((96, 160)).astype(np.float32) * 0.05, qtype)
    linear = Linear(160, 96, bias=False)
    linear.weight.data = torch.from_numpy(dequantize(blocks, qtype))
    linear.quantized = QuantizedWeight(torch.from_numpy(blocks.copy()), int(qtype), kernels)
    linear.pack(torch.bfloat16, onednn=False, tile_kernels=kernels)
    assert (linear.bf16_products.packed.dtype == torch.uint8) == (type_name != "Q8_0")
    x = torch.randn(20, 160)
    assert torch.equal(linear.dense_matmul(x, None), BFloat16ProductsWeight(linear.weight, kernels).linear(x))


def test_a_k_quant_mixture_runs_its_experts_on_their_blocks_where_products_are_integers(tmp_path, monkeypatch):
    """A Qwen2-MoE file in llama.cpp's Q4_K_M mix, its experts' down in another type than their gate and up. In float32
    (exact) it generates as transformers does on the values the file holds, the experts on dense weights; where products
    are integers every expert runs on its blocks, off from the exact mode no more than transformers rounding the input
    of every linear layer and expert product."""
    from transformers import AutoModelForCausalLM, Qwen2MoeForCausalLM

    from pagedserve.layers.fused_moe import FusedMoE
    from pagedserve.layers.linear import GGUF_PANEL_TYPES, QuantizedWeight

    config = gguf_writer.tiny_qwen2_moe_config()
    config.hidden_size, config.intermediate_size, config.head_dim = 256, 512, 64
    config.moe_intermediate_size = config.shared_expert_intermediate_size = 256
    torch.manual_seed(0)
    path = tmp_path / "tiny-qwen2-moe-q4_k_m.gguf"
    gguf_writer.write_qwen2_moe_gguf(path, Qwen2MoeForCausalLM(config).state_dict(), config, types_of(_MIXTURE_TYPES))
    # transformers' reading of a qwen2moe file leaves the expert widths at its defaults: the config gives them.
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, config=config, torch_dtype=torch.float32).eval()

    def experts(llm):
        """Each expert's gate-up and down weights, over the mixtures."""
        packed = [module.packed for module in worker_of(llm).model.modules() if isinstance(module, FusedMoE)]
        return [w for gate_up, _ in packed for w in gate_up], [w for _, down in packed for w in down]

    exact = LLM(str(path), dtype="float32", kv_cache_memory=4 * 1024**2)
    assert not any(isinstance(weight, QuantizedWeight) for weights in experts(exact) for weight in weights)
    assert_generates_like(exact, reference)

    rounding = rounding_llm(path, monkeypatch)
    gate_up, down = experts(rounding)
    assert len(gate_up) == len(down) == 2 * config.num_experts
    assert all(isinstance(w, QuantizedWeight) and w.rounds_activations for w in gate_up + down)
    assert {w.qtype for w in gate_up} == {GGUF_PANEL_TYPES["Q4_K"]} and {w.qtype for w in down} == {GGUF_PANEL_TYPES["Q6_K"]}
    # Rounding can move a token to another expert where the router's scores nearly tie: a jump either engine may take at
    # a position the other does not, so the typical departure (the median) is compared.
    assert_rounding_departs_like_transformers(rounding, exact, with_rounded_linear_inputs(copy.deepcopy(reference)),
                                              statistic=statistics.median)
