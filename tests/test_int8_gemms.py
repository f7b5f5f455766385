"""quantization int8: the linear layers' GEMMs in int8 (W8A8: weights per output channel, activations per row at run
time, SmoothQuant's smoothing calibrated at start), checked against the same scheme written in torch over
transformers' modules."""

import pytest
import torch
from conftest import greedy, hf_greedy, hf_token_logprobs, worker_of
from torch import nn

from pagedserve import LLM
from pagedserve.config import EngineConfig
from pagedserve.executor import int8_calibration
from pagedserve.executor.worker import int8_gemms_wanted
from pagedserve.layers import cpu_kernels
from pagedserve.layers.gemm import Int8Weight
from pagedserve.layers.linear import Linear


@pytest.fixture(scope="module")
def kernels():
    module = cpu_kernels.load()
    if module is None:
        pytest.skip("the C++ CPU kernels cannot be built here")
    return module


def reference_w8a8(x: torch.Tensor, weight: torch.Tensor, smoothing: torch.Tensor | None = None,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The scheme in torch: weight rows rounded at max|row| / 127, each input row (times 1 / smoothing) at its own
    max / 127, exact integer sums, scaled back by both."""
    x, weight = x.float(), weight.float()
    if smoothing is not None:
        weight = weight * smoothing[None, :]
        x = x * (1.0 / smoothing).float()
    weight_scales = (weight.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    weight_q = torch.round(weight / weight_scales[:, None])
    amax = x.abs().amax(dim=1, keepdim=True)
    x_q = torch.round(x * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax)))
    sums = (x_q.double() @ weight_q.double().T).float()
    out = sums * (amax / 127) * weight_scales
    return out if bias is None else out + bias


@pytest.mark.parametrize("rows", [1, 3, 40])
@pytest.mark.parametrize("smoothed", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear_computes_the_scheme(kernels, rows, smoothed, with_bias):
    torch.manual_seed(rows)
    weight, x = torch.randn(48, 96) * 0.1, torch.randn(rows, 96)
    x[:, 7] *= 30  # an outlier feature, as norms' gains make them
    bias = torch.randn(48) if with_bias else None
    smoothing = torch.rand(96) + 0.5 if smoothed else None
    packed = Int8Weight(weight, kernels, smoothing)
    expected = reference_w8a8(x, weight, smoothing, bias)
    torch.testing.assert_close(packed.linear(x, bias, torch.float32), expected, rtol=1e-5, atol=1e-5)
    # bfloat16 in (a bfloat16 model's activations) and out
    expected_bf16_in = reference_w8a8(x.bfloat16(), weight, smoothing, bias)
    torch.testing.assert_close(packed.linear(x.bfloat16(), bias, torch.float32), expected_bf16_in, rtol=1e-5, atol=1e-5)
    assert packed.linear(x, bias, torch.bfloat16).dtype == torch.bfloat16
    torch.testing.assert_close(packed.linear(x, bias, torch.bfloat16).float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 40])
def test_a_gate_up_product_can_come_out_activated(kernels, rows):
    """silu(gate) * up applied as the sums are scaled: the same values as the float32 SiLU-and-mul of the product."""
    torch.manual_seed(rows)
    weight, x, smoothing = torch.randn(2 * 48, 96) * 0.1, torch.randn(rows, 96), torch.rand(96) + 0.5
    packed = Int8Weight(weight, kernels, smoothing)
    product = packed.linear(x, None, torch.float32)
    assert torch.equal(packed.silu_and_mul(x), kernels.silu_and_mul(product))
    gate, up = reference_w8a8(x, weight, smoothing).chunk(2, dim=-1)
    torch.testing.assert_close(packed.silu_and_mul(x), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_a_row_of_zeros_gives_zeros(kernels):
    packed = Int8Weight(torch.randn(16, 32), kernels)
    out = packed.linear(torch.zeros(2, 32), None, torch.float32)
    assert torch.equal(out, torch.zeros(2, 16))


def test_smoothing_takes_an_outlier_feature_off_the_rows_step(kernels):
    """With one feature 50x the others, rounding rows alone leaves the rest a few levels; smoothed by the features'
    maxima, the product is several times closer to the float one."""
    torch.manual_seed(0)
    weight, x = torch.randn(64, 128) * 0.05, torch.randn(256, 128)
    x[:, 3] *= 50
    exact = x @ weight.T
    plain = Int8Weight(weight, kernels).linear(x, None, torch.float32)
    factors = int8_calibration.smoothing_factors(x.abs().amax(dim=0), weight)
    smoothed = Int8Weight(weight, kernels, factors).linear(x, None, torch.float32)
    assert (smoothed - exact).norm() * 3 < (plain - exact).norm()
    assert (smoothed - exact).norm() < 0.02 * exact.norm()


def test_the_setting_is_checked(kernels):
    with pytest.raises(ValueError, match="quantization must be int8 or unset, got 'fp8'"):
        EngineConfig(quantization="fp8")
    cpu, int8 = torch.device("cpu"), EngineConfig(quantization="int8")
    with pytest.raises(ValueError, match="quantization 'int8' runs on CPU"):
        int8_gemms_wanted(int8, torch.device("cuda"), torch.float32, kernels)
    with pytest.raises(ValueError, match="quantization 'int8' takes dtype float32, bfloat16 or auto; got float16"):
        int8_gemms_wanted(int8, cpu, torch.float16, kernels)
    with pytest.raises(ValueError, match="needs the C\\+\\+ CPU kernels"):
        int8_gemms_wanted(int8, cpu, torch.float32, None)
    assert int8_gemms_wanted(int8, cpu, torch.bfloat16, kernels)
    assert not int8_gemms_wanted(EngineConfig(), cpu, torch.float32, kernels)


@pytest.fixture(scope="module")
def int8_llms(tiny_models, kernels):
    return {arch: LLM(str(tiny_models[arch]), dtype="float32", quantization="int8", kv_cache_memory=16 * 1024**2)
            for arch in ("llama", "qwen2")}


def test_every_linear_layer_but_routers_runs_int8_and_the_logits_stay_float32(int8_llms, tiny_models):
    worker = worker_of(int8_llms["llama"])
    assert worker.dense_gemm_dtype == torch.int8 and worker.gemm_dtype == torch.float32
    linears = [m for m in worker.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.int8_weight is not None and m.int8_weight.input_multipliers is not None for m in linears)
    assert worker.model.packed_lm_head is None or worker.model.packed_lm_head.dtype == torch.float32
    mixture = LLM(str(tiny_models["qwen2_moe"]), dtype="float32", quantization="int8", kv_cache_memory=16 * 1024**2)
    layers = {name: m for name, m in worker_of(mixture).model.named_modules() if isinstance(m, Linear)}
    routers = {name for name, m in layers.items() if m.routes}
    assert routers and all(layers[name].int8_weight is None for name in routers)  # routers pick experts in float
    assert all(m.int8_weight is not None for name, m in layers.items() if name not in routers)
    assert len(mixture.generate({"prompt_token_ids": [1, 2, 3]}, greedy(4), use_tqdm=False)[0].outputs[0].token_ids) == 4


# Our fused layers -> the transformers modules that read the same input.
FUSED_INPUTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",), "gate_up_proj": ("gate_proj", "up_proj"),
                "down_proj": ("down_proj",)}


def transformers_inputs_maxima(hf_model, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' module name -> the largest |x| of each input feature over a forward pass of input_ids."""
    maxima, hooks = {}, []
    for name, module in hf_model.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head":
            def record(module, args, name=name):
                feature_max = args[0].reshape(-1, args[0].shape[-1]).abs().amax(dim=0)
                maxima[name] = feature_max if name not in maxima else torch.maximum(maxima[name], feature_max)
            hooks.append(module.register_forward_pre_hook(record))
    with torch.inference_mode():
        hf_model(input_ids)
    for hook in hooks:
        hook.remove()
    return maxima


def calibration_ids(worker) -> torch.Tensor:
    seqs, tokens = int8_calibration.calibration_shape(worker.max_model_len)
    return worker.model_runner._dummy_inputs(seqs, tokens, 0)[0].view(seqs, tokens)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_layer_is_smoothed_by_the_inputs_transformers_layers_see(arch, int8_llms, tiny_models):
    """The factors each layer was packed with at start are SmoothQuant's for the maxima of its input in transformers'
    float32 forward over the calibration tokens (and the layer's own weight)."""
    from transformers import AutoModelForCausalLM

    worker = worker_of(int8_llms[arch])
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_models[arch], dtype=torch.float32).eval()
    theirs = transformers_inputs_maxima(hf_model, calibration_ids(worker))
    layers = {name: m for name, m in worker.model.named_modules() if isinstance(m, Linear)}
    assert len(layers) == 4 * hf_model.config.num_hidden_layers
    for name, layer in layers.items():
        prefix, _, fused = name.rpartition(".")
        expected = int8_calibration.smoothing_factors(theirs[f"{prefix}.{FUSED_INPUTS[fused][0]}"], layer.weight)
        torch.testing.assert_close(1 / layer.int8_weight.input_multipliers, expected, rtol=1e-3, atol=1e-6)


def transformers_in_w8a8(model_dir, calibration: torch.Tensor):
    """transformers' model with every linear layer but the lm_head replaced by reference_w8a8, smoothed as the engine
    smooths (a fused layer's weight columns are those of all its parts), calibrated on the same token ids in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    maxima = transformers_inputs_maxima(model, calibration)
    modules = dict(model.named_modules())
    for name, module in list(modules.items()):
        prefix, _, part = name.rpartition(".")
        group = next((parts for parts in FUSED_INPUTS.values() if part in parts), None)
        if not isinstance(module, nn.Linear) or group is None:
            continue
        fused_weight = torch.cat([modules[f"{prefix}.{p}"].weight for p in group])
        factors = int8_calibration.smoothing_factors(maxima[name], fused_weight)
        module.forward = lambda x, m=module, s=factors: reference_w8a8(x.reshape(-1, x.shape[-1]), m.weight, s, m.bias).view(
            *x.shape[:-1], m.out_features)
    return model


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: biases on q, k, v
def test_int8_logprobs_are_as_close_to_float32_as_the_scheme_in_transformers(arch, int8_llms, tiny_models):
    """Scored on the tokens float32 picks: the engine's int8 logprobs are off from float32 transformers' by no more, on the
    whole, than the same scheme run in torch over transformers' modules (whose only difference is float32 order)."""
    llm = int8_llms[arch]
    ours_off, theirs_off = distances_from_float32(llm, transformers_in_w8a8(tiny_models[arch], calibration_ids(worker_of(llm))),
                                                  tiny_models[arch])
    assert sum(theirs_off) > 0  # the scheme does round
    assert sum(ours_off) <= 1.25 * sum(theirs_off), (max(ours_off), max(theirs_off))


def test_lora_adapters_add_their_float_products_to_the_int8_layers(tiny_models, tmp_path):
    """An adapter over every projection on an int8 engine: its logprobs are off from peft's float32 by no more, on the
    whole, than peft's adapter over the scheme in transformers (the adapter's products stay float in both)."""
    from peft import PeftModel
    from test_lora import ALL_TARGETS, make_adapter

    from pagedserve import LoRARequest

    model_dir = tiny_models["llama"]
    adapter_dir = make_adapter(model_dir, tmp_path / "adapter", 8, ALL_TARGETS, seed=1)
    llm = LLM(str(model_dir), dtype="float32", quantization="int8", enable_lora=True, max_lora_rank=8, kv_cache_memory=16 * 1024**2)
    reference = PeftModel.from_pretrained(transformers_in_w8a8(model_dir, calibration_ids(worker_of(llm))), str(adapter_dir)).eval()
    ours_off, theirs_off = distances_from_float32(llm, reference, model_dir, adapter_dir, LoRARequest("adapter", 1, str(adapter_dir)))
    assert sum(theirs_off) > 0
    assert sum(ours_off) <= 1.25 * sum(theirs_off), (max(ours_off), max(theirs_off))


def distances_from_float32(llm, reference, model_dir, adapter_dir=None, lora_request=None) -> tuple[list[float], list[float]]:
    """How far the engine's logprobs and the reference model's are from float32 transformers' (with the adapter, peft's),
    each token's, scored on the tokens float32 picks after four random prompts."""
    ours_off, theirs_off = [], []
    for seed in range(4):
        prompt = torch.randint(100, 40000, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
        tokens = hf_greedy(model_dir, [prompt], 10, adapter_dir=adapter_dir)[0]
        exact, _ = hf_token_logprobs(model_dir, prompt, tokens, adapter_dir=adapter_dir)
        with torch.inference_mode():
            logits = reference(torch.tensor([prompt + tokens])).logits[0].float().log_softmax(-1)
        theirs = [logits[len(prompt) + i - 1, token].item() for i, token in enumerate(tokens)]
        scored = llm.generate({"prompt_token_ids": prompt + tokens}, greedy(1, prompt_logprobs=0), lora_request=lora_request,
                              use_tqdm=False)[0]
        ours = [scored.prompt_logprobs[len(prompt) + i][token].logprob for i, token in enumerate(tokens)]
        ours_off += [abs(a - b) for a, b in zip(ours, exact)]
        theirs_off += [abs(a - b) for a, b in zip(theirs, exact)]
    return ours_off, theirs_off


def test_int8_greedy_output_does_not_depend_on_the_batch(int8_llms):
    """Each row is rounded at its own scale and the sums are exact integers: a request's output is the same alone and
    among others."""
    llm = int8_llms["llama"]
    prompts = [[1, 400, 500, 600, 700], list(range(100, 170)), [5] * 3, list(range(3000, 3040, 3))]
    alone = [llm.generate({"prompt_token_ids": p}, greedy(12), use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts * 3], greedy(12), use_tqdm=False)]
    assert together == alone * 3
