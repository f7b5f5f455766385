"""Float32 GEMMs on weights of bfloat16 values (a checkpoint stored in bfloat16): kept as bfloat16 pairs and read by the C++
kernels into float32 products (layers/gemm.BFloat16ValuesWeight), where measured to keep pace with float32 GEMMs
(executor/bfloat16_values.py): the exact mode's output, from half the weights' bytes."""

import pytest
import torch
from conftest import greedy, hf_greedy, hf_token_logprobs, worker_of

from pagedserve import LLM
from pagedserve.benchmarks.worker_probes import gemm_work
from pagedserve.executor import bfloat16_values
from pagedserve.layers.gemm import BFloat16ValuesWeight
from pagedserve.layers.linear import Linear

PROMPTS = [[1, 400, 500, 600, 700], list(range(100, 170)), [5] * 3]


def test_a_bfloat16_checkpoint_in_float32_keeps_its_weights_as_bfloat16_and_gives_transformers_float32_output(
        bfloat16_checkpoint, values_kernels_anywhere):
    llm = LLM(str(bfloat16_checkpoint), dtype="float32", kv_cache_memory=8 * 1024**2)
    worker = worker_of(llm)
    linears = [m for m in worker.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.bf16_values is not None and m.packed is None and m.weight is None for m in linears)
    assert isinstance(worker.model.lm_head_pairs, BFloat16ValuesWeight) and worker.model.packed_lm_head is None
    # The ceiling's decode reads two bytes a weight: the pairs, not a float32 copy.
    config = worker.model.config
    weights = sum(m.in_features * m.out_features for m in linears) + config.vocab_size * config.hidden_size
    assert gemm_work(worker, decode_rows=1, prefill_rows=64)["decode_weight_bytes"] == 2 * weights
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(12, logprobs=0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(bfloat16_checkpoint, PROMPTS, 12)
    for prompt, output in zip(PROMPTS, outputs):
        reference, _ = hf_token_logprobs(bfloat16_checkpoint, prompt, output.outputs[0].token_ids)
        ours = [step[token].logprob for step, token in zip(output.outputs[0].logprobs, output.outputs[0].token_ids)]
        assert ours == pytest.approx(reference, abs=1e-4)
    batched = llm.generate([{"prompt_token_ids": p} for p in PROMPTS * 3], greedy(12), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == [o.outputs[0].token_ids for o in outputs] * 3


def test_float32_weights_keep_their_float32_copies(tiny_models, values_kernels_anywhere):
    """Rounding a float32 checkpoint's weights to bfloat16 would change the exact mode's products: they stay float32."""
    worker = worker_of(LLM(str(tiny_models["llama"]), dtype="float32", kv_cache_memory=8 * 1024**2))
    assert all(m.bf16_values is None and m.packed.dtype == torch.float32 for m in worker.model.modules() if isinstance(m, Linear))
    assert worker.model.lm_head_pairs is None


def test_gemm_backend_onednn_keeps_float32_copies(bfloat16_checkpoint, values_kernels_anywhere):
    worker = worker_of(LLM(str(bfloat16_checkpoint), dtype="float32", gemm_backend="onednn", kv_cache_memory=8 * 1024**2))
    assert all(m.bf16_values is None and m.packed.is_mkldnn for m in worker.model.modules() if isinstance(m, Linear))


class FakeKernels:
    def __init__(self, vector: bool) -> None:
        self.vector = vector

    def bf16_weights_vector(self) -> bool:
        return self.vector


@pytest.mark.parametrize("vector,share,taken", [(True, 0.95, True), (True, 0.5, False), (False, 0.95, False)])
def test_the_kernels_take_bfloat16_values_where_they_widen_on_vectors_and_keep_pace(vector, share, taken, monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    measured = []
    monkeypatch.setattr(bfloat16_values, "_kernel_rate", lambda kernels: measured.append(share) or share * 100.0)
    monkeypatch.setattr(bfloat16_values, "matmul_rate_at", lambda dtype, size, repeats: 100.0)
    bfloat16_values.measured_share.cache_clear()
    kernels = FakeKernels(vector)
    assert (bfloat16_values.values_kernels(kernels) is kernels) == taken
    assert measured == ([share] if vector else [])  # nothing to measure where the kernels have no vector path
    bfloat16_values.measured_share.cache_clear()  # a later start reads the measurement back instead of measuring again
    assert (bfloat16_values.values_kernels(kernels) is kernels) == taken and len(measured) == (1 if vector else 0)
    bfloat16_values.measured_share.cache_clear()


def test_the_measured_share_is_this_machines():
    from pagedserve.layers import cpu_kernels

    kernels = cpu_kernels.load()
    assert bfloat16_values._kernel_rate(kernels) > 1.0


def test_an_adapter_over_bfloat16_values_equals_peft(bfloat16_checkpoint, values_kernels_anywhere, tmp_path):
    """The adapters' products add to the layers' float32 products as on float32 copies."""
    from test_lora import ALL_TARGETS, make_adapter

    from pagedserve import LoRARequest

    adapter = make_adapter(bfloat16_checkpoint, tmp_path / "adapter", 8, ALL_TARGETS, 5)
    llm = LLM(str(bfloat16_checkpoint), dtype="float32", enable_lora=True, max_lora_rank=8, kv_cache_memory=8 * 1024**2)
    assert all(m.bf16_values is not None for m in worker_of(llm).model.modules() if isinstance(m, Linear))
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(10), lora_request=LoRARequest("a", 1, str(adapter)),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(bfloat16_checkpoint, PROMPTS, 10, adapter_dir=adapter)
