"""Mixtures of experts: the fused layer against a token-by-token reference, routing as each model defines it, the
models' layers built as their configs say, and the checks at load and at start. (The four architectures against
transformers: test_models_vs_hf.py; split over ranks: test_parallel.py.)"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from conftest import engine_core_of, greedy, worker_of

from pagedserve import LLM, SamplingParams
from pagedserve.layers.activation import SiluAndMul
from pagedserve.layers.fused_moe import fused_experts, select_experts


def reference_experts(x, w13, w2, weights, ids):
    """Token by token, expert by expert: what a mixture computes, written plainly."""
    out = torch.zeros_like(x)
    intermediate = w2.shape[2]
    for token in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            expert = int(ids[token, slot])
            gate_up = w13[expert] @ x[token]
            hidden = F.silu(gate_up[:intermediate]) * gate_up[intermediate:]
            out[token] += weights[token, slot] * (w2[expert] @ hidden)
    return out


def _experts(num_experts: int, hidden: int = 24, intermediate: int = 40, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) * 0.2
    w2 = torch.randn(num_experts, hidden, intermediate, generator=generator) * 0.2
    return w13, w2, generator


@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (37, 1), (37, 2), (5, 8), (64, 8)])
def test_fused_experts_equal_the_token_by_token_reference(num_tokens, top_k):
    w13, w2, generator = _experts(8)
    x = torch.randn(num_tokens, 24, generator=generator)
    weights, ids = select_experts(torch.randn(num_tokens, 8, generator=generator), top_k, renormalize=top_k > 1)
    ours = fused_experts(x, w13, w2, weights, ids, SiluAndMul())
    torch.testing.assert_close(ours, reference_experts(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_experts_that_get_no_token_and_one_expert_that_gets_them_all():
    w13, w2, generator = _experts(6)
    x = torch.randn(9, 24, generator=generator)
    logits = torch.full((9, 6), -5.0)
    logits[:, 4] = 5.0  # every token's first choice
    logits[:, 1] = 3.0  # and second
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert set(ids.flatten().tolist()) == {1, 4}
    ours = fused_experts(x, w13, w2, weights, ids, SiluAndMul())
    torch.testing.assert_close(ours, reference_experts(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    no_tokens = fused_experts(x[:0], w13, w2, weights[:0], ids[:0], SiluAndMul())
    assert no_tokens.shape == (0, 24)


def test_routing_is_a_float32_softmax_then_top_k_renormalized_only_where_the_model_says():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], dtype=torch.bfloat16)
    probabilities = torch.softmax(logits.float(), dim=-1)
    weights, ids = select_experts(logits, 2, renormalize=False)
    assert weights.dtype == torch.float32 and ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, probabilities[:, :2])
    renormalized, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(renormalized, probabilities[:, :2] / probabilities[:, :2].sum())


def test_each_layer_is_built_as_the_config_says(tiny_models):
    """Qwen2-MoE's first layer keeps its dense MLP (mlp_only_layers); the second is a mixture with a gated shared
    expert; Mixtral's mixtures have none."""
    from pagedserve.core.step_time import ExpertRouting
    from pagedserve.layers.fused_moe import FusedMoE
    from pagedserve.models.mlp import GatedMLP
    from pagedserve.models.moe import MoEBlock

    qwen_llm = LLM(str(tiny_models["qwen2_moe"]), kv_cache_memory=2**22)
    qwen = worker_of(qwen_llm).model
    # The scheduler's step-time models price the experts a step touches, as the model routes its tokens.
    stall_bound = engine_core_of(qwen_llm).scheduler.stall_bound
    assert stall_bound.step_time.experts == stall_bound.decode_step_time.experts == ExpertRouting(8, 2)
    dense, sparse = (layer.mlp for layer in qwen.model.layers)
    assert isinstance(dense, GatedMLP) and isinstance(sparse, MoEBlock)
    assert sparse.shared_expert is not None and sparse.experts.top_k == 2
    assert list(sparse.experts.local_experts) == list(range(8)) and sparse.experts.intermediate_range == (0, 32)
    assert [len(part) for part in sparse.experts.packed] == [8, 8]  # each expert packed for the engine's GEMMs
    mixtral = worker_of(LLM(str(tiny_models["mixtral"]), kv_cache_memory=2**22)).model
    assert all(isinstance(layer.mlp, MoEBlock) and layer.mlp.shared_expert is None for layer in mixtral.model.layers)
    assert all(layer.mlp.experts.renormalize for layer in mixtral.model.layers)
    assert engine_core_of(LLM(str(tiny_models["llama"]), kv_cache_memory=2**22)).scheduler.stall_bound.step_time.experts is None
    assert sum(isinstance(module, FusedMoE) for module in mixtral.modules()) == 2


def test_a_checkpoint_without_one_of_its_experts_is_refused_naming_it(tiny_models, tmp_path):
    from safetensors.torch import load_file, save_file

    source = tiny_models["mixtral"]
    broken = tmp_path / "mixtral"
    shutil.copytree(source, broken)
    [weights_file] = broken.glob("*.safetensors")
    tensors = load_file(weights_file)
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, weights_file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors for: .*model\.layers\.1\.mlp\.experts#5\.up"):
        LLM(str(broken), kv_cache_memory=2**22)


def test_a_split_the_mixture_cannot_take_is_refused_at_start(tiny_models, tmp_path):
    with pytest.raises(ValueError, match=r"OLMoE normalizes k across all KV heads, which tensor_parallel_size \(4\) above"):
        LLM(str(tiny_models["olmoe"]), tensor_parallel_size=4, kv_cache_memory=2**22)
    odd = tmp_path / "qwen3_moe"
    shutil.copytree(tiny_models["qwen3_moe"], odd)
    config = json.loads((odd / "config.json").read_text())
    config["moe_intermediate_size"] = 33
    (odd / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"the experts' intermediate size \(33\) is not divisible by tensor_parallel_size \(2\)"):
        LLM(str(odd), tensor_parallel_size=2, kv_cache_memory=2**22)
    with pytest.raises(ValueError, match=r"num_experts \(8\) is not divisible by tensor_parallel_size \(3\): expert parallelism"):
        LLM(str(tiny_models["qwen2_moe"]), tensor_parallel_size=3, enable_expert_parallel=True, kv_cache_memory=2**22)


def test_experts_stacked_as_transformers_holds_them_load_as_the_per_expert_tensors(tiny_models, tmp_path):
    """gate_up_proj [E, 2I, H] and down_proj [E, H, I] per layer (transformers' layout, and what its GGUF reader gives):
    the same model, the same greedy tokens."""
    import re

    from conftest import greedy, token_ids_of
    from safetensors.torch import load_file, save_file

    stacked_dir = tmp_path / "qwen3_moe"
    shutil.copytree(tiny_models["qwen3_moe"], stacked_dir)
    [weights_file] = stacked_dir.glob("*.safetensors")
    tensors = load_file(weights_file)
    per_expert = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    parts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name in [name for name in tensors if per_expert.match(name)]:
        module, expert, part = per_expert.match(name).groups()
        parts.setdefault(module, {}).setdefault(part, {})[int(expert)] = tensors.pop(name)
    for module, by_part in parts.items():
        experts = range(len(by_part["gate_proj"]))
        tensors[f"{module}.gate_up_proj"] = torch.stack([torch.cat([by_part["gate_proj"][e], by_part["up_proj"][e]]) for e in experts])
        tensors[f"{module}.down_proj"] = torch.stack([by_part["down_proj"][e] for e in experts])
    save_file(tensors, weights_file, metadata={"format": "pt"})
    prompts = [{"prompt_token_ids": [1, 400, 500, 600, 700]}, {"prompt_token_ids": list(range(100, 140))}]
    stacked = LLM(str(stacked_dir), kv_cache_memory=2**22).generate(prompts, greedy(16), use_tqdm=False)
    original = LLM(str(tiny_models["qwen3_moe"]), kv_cache_memory=2**22).generate(prompts, greedy(16), use_tqdm=False)
    assert token_ids_of(stacked) == token_ids_of(original)


def test_the_engine_counts_the_tokens_routed_to_each_expert(tiny_models):
    """Every position the model computes is routed to top_k experts of each mixture layer (the warm-up's are not
    counted): a request of P prompt tokens and G generated ones computes P + G - 1 positions."""
    llm = LLM(str(tiny_models["qwen2_moe"]), kv_cache_memory=2**22)
    [before] = llm.llm_engine.call_utility("collective_rpc", "expert_token_counts")
    assert set(before) == {1} and sum(before[1]) == 0  # layer 0 is dense
    prompts = [{"prompt_token_ids": list(range(100, 100 + length))} for length in (5, 23)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True), use_tqdm=False)
    [after] = llm.llm_engine.call_utility("collective_rpc", "expert_token_counts")
    assert len(after[1]) == 8 and sum(after[1]) == 2 * ((5 + 7 - 1) + (23 + 7 - 1))


@pytest.mark.slow
def test_metrics_report_the_tokens_routed_to_each_expert(tiny_models):
    import re

    from server_utils import RemoteServer

    server = RemoteServer("--model", str(tiny_models["qwen2_moe"]), "--served-model-name", "tiny", "--kv-cache-memory", str(2**22))
    try:
        response = server.post("/v1/completions", json={"model": "tiny", "prompt": [100, 101, 102, 103, 104, 105], "max_tokens": 9,
                                                         "ignore_eos": True})
        assert response.status_code == 200
        text = server.get("/metrics").text
        log = server.log_text()
    finally:
        assert server.stop() == 0
    assert "experts' token counts were not read" not in log, log[-3000:]
    counts = {}
    for labels, value in re.findall(r"^pagedserve:moe_expert_tokens_total\{(.*)\} (\S+)$", text, re.MULTILINE):
        named = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        counts[named["layer"], int(named["expert"])] = float(value)
    assert {layer for layer, _ in counts} == {"1"} and sum(counts.values()) == 2 * (6 + 9 - 1)


def _routed_tokens(metrics_text: str) -> dict[str, float]:
    """engine -> tokens routed to any expert of any layer, from /metrics."""
    import re

    routed: dict[str, float] = {}
    for labels, value in re.findall(r"^pagedserve:moe_expert_tokens_total\{(.*)\} (\S+)$", metrics_text, re.MULTILINE):
        engine = dict(re.findall(r'(\w+)="([^"]*)"', labels))["engine"]
        routed[engine] = routed.get(engine, 0.0) + float(value)
    return routed


@pytest.mark.parametrize("flags", [["-dp", "2"], ["-dp", "2", "-tp", "2"]], ids=["dp2", "dp2-tp2"])
def test_expert_parallelism_over_data_parallel_cores_equals_one_engine(tiny_models, flags):
    """The experts spread over every rank of two engine cores (4 or 2 of 8 each): greedy outputs as one engine gives
    them, whether both cores have requests or one runs alone while the other joins its steps without tokens; each
    core counts the tokens it routed, and joining another's step routes none."""
    import asyncio

    from server_utils import RemoteServer

    model = str(tiny_models["qwen2_moe"])
    prompts = [[5 + index, 6, 7, 8, 9] for index in range(6)]
    expected = [output.outputs[0].text for output in LLM(model, kv_cache_memory=2**22, dtype="float32").generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(12), use_tqdm=False)]
    server = RemoteServer("--model", model, "--served-model-name", "tiny", "--kv-cache-memory", str(2**22), "--dtype", "float32",
                          "--enable-expert-parallel", *flags)
    try:
        async def main():
            client = server.async_openai()

            async def complete(prompt):
                answer = await client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0.0,
                                                         extra_body={"ignore_eos": True})
                return answer.choices[0].text

            together = await asyncio.gather(*(complete(p) for p in prompts))
            alone = [await complete(p) for p in prompts[:2]]
            return together, alone

        together, alone = asyncio.run(main())
        routed = _routed_tokens(server.get("/metrics").text)
        log = server.log_text()
    finally:
        assert server.stop() == 0
    assert together == expected and alone == expected[:2]
    experts_each = 4 if "-tp" not in flags else 2
    assert f"expert parallelism over 2 data-parallel engine cores: this rank holds {experts_each} of the 8 experts" in log
    # One mixture layer, top-2: (prompt + generated - 1) tokens of each request through it, on its own core only.
    assert set(routed) == {"0", "1"} and all(count > 0 for count in routed.values())
    assert sum(routed.values()) == 2 * (5 + 12 - 1) * (len(prompts) + 2)


def test_expert_parallelism_over_cores_refuses_what_would_not_step_with_the_other_cores():
    from pagedserve.config import EngineConfig

    with pytest.raises(ValueError, match="pipeline_parallel_size must then be 1"):
        EngineConfig(enable_expert_parallel=True, data_parallel_size=2, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="runs with ngram speculation only"):
        EngineConfig(enable_expert_parallel=True, data_parallel_size=2,
                     speculative_config={"method": "draft_model", "model": "draft", "num_speculative_tokens": 2})
    EngineConfig(enable_expert_parallel=True, data_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2})


def test_expert_parallelism_over_cores_the_experts_do_not_divide_is_refused_naming_the_numbers(tiny_models):
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "pagedserve.entrypoints.cli", "serve", "--model", str(tiny_models["qwen2_moe"]),
                             "--kv-cache-memory", str(2**22), "--enable-expert-parallel", "-dp", "3"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "num_experts (8) is not divisible by tensor_parallel_size (1) x data_parallel_size (3)" in result.stderr


def test_speculation_over_a_mixture_equals_decoding_without_it(tiny_models):
    """Verifying drafts runs several positions of a request through the experts in one step (as for any proposer's
    drafts): with the mixture drafting for itself every draft is accepted, and the greedy tokens stay those of plain
    decoding."""
    from conftest import engine_core_of, greedy, token_ids_of

    model = str(tiny_models["mixtral"])
    prompts = [{"prompt_token_ids": [10, 11, 12, 13] * 8}, {"prompt_token_ids": list(range(200, 230))}]
    drafting = {"method": "draft_model", "model": model, "num_speculative_tokens": 3}
    speculative = LLM(model, kv_cache_memory=2**22, speculative_config=drafting)
    plain = LLM(model, kv_cache_memory=2**22)
    assert token_ids_of(speculative.generate(prompts, greedy(24), use_tqdm=False)) == token_ids_of(
        plain.generate(prompts, greedy(24), use_tqdm=False))
    stats = engine_core_of(speculative).get_stats().spec
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_a_mixture_runs_in_half_precision_close_to_float32(tiny_models):
    """float16 activations and experts (the routing weights stay float32, as transformers keeps them): the tokens
    chosen stay likely under float32."""
    from conftest import greedy, hf_token_logprobs

    model_dir = tiny_models["qwen3_moe"]
    prompt = [1, 400, 500, 600, 700]
    half = LLM(str(model_dir), dtype="float16", kv_cache_memory=2**22)
    out = half.generate({"prompt_token_ids": prompt}, greedy(8, logprobs=0), use_tqdm=False)[0].outputs[0]
    reference, _ = hf_token_logprobs(model_dir, prompt, list(out.token_ids))
    assert [position[token].logprob for token, position in zip(out.token_ids, out.logprobs)] == pytest.approx(reference, abs=0.15)
