"""Shared fixtures: the default model's files, tiny random-weight HF models, HF reference generation."""

from __future__ import annotations

import os
import shutil
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# dtype auto is float32 here on every processor: the transformers references are float32. The bfloat16 mode has
# tests of its own that ask for it.
os.environ.setdefault("PAGEDSERVE_CPU_AUTO_DTYPE", "float32")

import pytest  # noqa: E402
import torch  # noqa: E402

from pagedserve.config import DEFAULT_MODEL  # noqa: E402
from pagedserve.models.location import resolve_model_dir  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")

# Tiny configs, one per supported architecture family. Weights are random but large enough
# (initializer_range) that greedy choices are not near-ties.
TINY_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                       "original_max_position_embeddings": 128}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    # A yarn rotary, and queries scaled by their position past the original length (crossed by the long prompt).
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM", {"sliding_window": None, "pad_token_id": 0, "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.5}}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"use_sliding_window": False, "head_dim": 16}),
    # Multipliers of the embeddings, the attention scores, what each block adds to the residual, and the logits.
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"embedding_multiplier": 6.0, "attention_multiplier": 0.1,
                                                        "residual_multiplier": 0.3, "logits_scaling": 4.0}),
    # Its q/k/v and gate/up saved fused; a longrope scaling (contexts within the original length: the short factors)
    # that turns 12 of each head's 16 dims, as Phi-4-mini's turns 3/4 of them.
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"sliding_window": None, "original_max_position_embeddings": 256,
                                               "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                                                   "partial_rotary_factor": 0.75,
                                                                   "short_factor": [1.0 + i / 16 for i in range(6)],
                                                                   "long_factor": [2.0 + i for i in range(6)],
                                                                   "original_max_position_embeddings": 256}}),
    # Mixtures of experts: top-2 renormalized; a shared expert and a dense first layer; top-4 with per-head q/k norms;
    # q/k norms across the heads, with clipping.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8, "num_experts_per_tok": 2, "sliding_window": None}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                                            "shared_expert_intermediate_size": 64, "mlp_only_layers": [0],
                                                            "use_sliding_window": False}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 4, "moe_intermediate_size": 32,
                                                            "norm_topk_prob": True, "head_dim": 16, "use_sliding_window": False}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 2, "clip_qkv": 3.0}),
    # Norms after attention and the MLP only, q/k norms across the heads; OLMo 3's sliding-window layer and full layer
    # rotating by their own parameters.
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {
        "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0}}}),
    # OLMo 2's layer with q/k norms per head; a sliding-window layer, and a full one without a rotary.
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {"head_dim": 16, "sliding_window": 16, "sliding_window_pattern": 2}),
    # A rotary of adjacent pairs of dims.
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM", {"head_dim": 16, "pad_token_id": 0}),
    # A layer without a rotary (NoPE) after one with it.
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layers": [1, 0], "pad_token_id": 0}),
    # Gemma: its norms' 1 + weight (drawn: transformers starts them at zero), scaled embeddings and GELU (tanh) MLP.
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    # A sliding-window layer and a full one; scores and logits soft-capped at caps the tiny model's values reach.
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
        "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0}),
    # A sliding-window layer and a full one, each rotating by its own parameters (the full one's scaled linearly); scores
    # scaled by query_pre_attn_scalar, not the head size; its norms' weights drawn (transformers starts them at zero).
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}}),
}


@pytest.fixture(scope="session")
def default_model_dir():
    return resolve_model_dir(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def default_hf_dir(default_model_dir, tmp_path_factory):
    """The reference's checkpoint of the default model: the weights of its GGUF file as transformers' own GGUF reading
    gives them, with the converted directory's config and tokenizer (the engine's directory keeps most weights as GGUF
    blocks alone). transformers does not save a model it read from GGUF, so its tensors are written here."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM

    from pagedserve.models.gguf_convert import default_gguf_path

    path = default_gguf_path()
    out = tmp_path_factory.mktemp("default_hf")
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    save_model(model, str(out / "model.safetensors"))
    for file in default_model_dir.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and not file.name.startswith("."):
            shutil.copy(file, out / file.name)
    return out


def make_tiny_model(out_dir, arch: str, tokenizer_dir, tie_word_embeddings: bool = False, max_shard_size: str | None = None,
                    **config_values):
    """config_values: set over the architecture's tiny config (TINY_ARCHS)."""
    import transformers

    config_name, model_name, extra = TINY_ARCHS[arch]
    config = getattr(transformers, config_name)(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.3, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, **(extra | config_values),
    )
    torch.manual_seed(1234)
    model = getattr(transformers, model_name)(config).eval()
    if arch.startswith(("gemma", "olmo2", "olmo3", "exaone4")):
        draw_norm_weights(model)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, **kwargs)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


def draw_norm_weights(model) -> None:
    """Every norm's weight drawn at random: the Gemmas' start at zero (they scale by 1 + weight), which would leave a
    norm that went to the wrong place, or lost its + 1, unseen."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)


def make_tiny_classifier(out_dir, tokenizer_dir, architecture: str, id2label: dict[int, str]):
    """A tiny random-weight sequence classification model (LlamaForSequenceClassification or
    Qwen2ForSequenceClassification) of len(id2label) labels, saved in HF format."""
    import transformers

    config_class = {"LlamaForSequenceClassification": transformers.LlamaConfig,
                    "Qwen2ForSequenceClassification": transformers.Qwen2Config}[architecture]
    config = config_class(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.3, bos_token_id=1,
                          eos_token_id=2, num_labels=len(id2label), id2label=id2label,
                          label2id={name: index for index, name in id2label.items()})
    torch.manual_seed(11)
    getattr(transformers, architecture)(config).eval().save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, default_model_dir):
    """arch -> directory of a tiny random-weight model saved in HF format."""
    root = tmp_path_factory.mktemp("tiny_models")
    dirs = {}
    for arch in TINY_ARCHS:
        # Exercise the loader's variants: Qwen2 tied embeddings, Mistral sharded with an index file.
        dirs[arch] = make_tiny_model(
            root / arch, arch, default_model_dir,
            tie_word_embeddings=(arch == "qwen2"), max_shard_size="1MB" if arch == "mistral" else None,
        )
    return dirs


@pytest.fixture(scope="session")
def bfloat16_checkpoint(tiny_models, tmp_path_factory):
    """The tiny Llama saved in bfloat16, as most checkpoints are (its lm_head apart from the embedding)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("bfloat16_checkpoint")
    AutoModelForCausalLM.from_pretrained(tiny_models["llama"], dtype=torch.bfloat16).save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tiny_models["llama"] / name).exists():
            shutil.copy(tiny_models["llama"] / name, out / name)
    return out


@pytest.fixture
def values_kernels_anywhere(monkeypatch):
    """Float32 GEMMs read weights of bfloat16 values on the kernels (executor/bfloat16_values.py) whatever this processor
    measures: a processor without AVX-512 runs their scalar loop, the same products, slower."""
    from pagedserve.executor import bfloat16_values

    monkeypatch.setattr(bfloat16_values, "values_kernels", lambda kernels: kernels)


def hf_model(model_dir, dtype=torch.float32, adapter_dir=None, model_class=None):
    """transformers' model of model_dir in dtype (model_class's, default AutoModelForCausalLM's); with adapter_dir,
    through peft with that LoRA adapter."""
    from transformers import AutoModelForCausalLM

    model = (model_class or AutoModelForCausalLM).from_pretrained(model_dir, dtype=dtype).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    return model


def hf_greedy(model_dir, prompt_ids_list, max_new_tokens, dtype=torch.float32, adapter_dir=None, model_class=None,
              **generate_options):
    """Reference: transformers greedy generation in dtype, one prompt at a time (no padding effects), of hf_model's
    model; generate_options go to generate (its logits processors' settings)."""
    model = hf_model(model_dir, dtype, adapter_dir, model_class)
    results = []
    with torch.inference_mode():
        for prompt_ids in prompt_ids_list:
            input_ids = torch.tensor([prompt_ids])
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, **generate_options)
            results.append(out[0, len(prompt_ids):].tolist())
    return results


def hf_token_logprobs(model_dir, prompt_ids, output_ids, dtype=torch.float32, adapter_dir=None, model_class=None):
    """Reference log-probabilities of output_ids after prompt_ids, from one forward pass of hf_model's model."""
    model = hf_model(model_dir, dtype, adapter_dir, model_class)
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids + output_ids])
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    start = len(prompt_ids) - 1
    return [logprobs[start + i, token].item() for i, token in enumerate(output_ids)], logprobs


def hf_greedy_picks(model_dir, prompt_ids, output_ids, **model_options):
    """transformers' most likely token after the prompt and after each longer prefix of output_ids, from one forward
    pass: where output_ids equal them, they are what transformers' greedy generation gives (without its decode steps)."""
    _, logprobs = hf_token_logprobs(model_dir, prompt_ids, output_ids, **model_options)
    return most_likely_after(logprobs, len(prompt_ids), len(output_ids))


def most_likely_after(logprobs, prompt_len, count):
    """From hf_token_logprobs' log-probabilities of every position: the most likely token at each of the count
    positions after a prompt of prompt_len tokens."""
    return logprobs[prompt_len - 1:prompt_len - 1 + count].argmax(dim=-1).tolist()


@pytest.fixture(scope="session")
def default_llm():
    """The default model, shared by the tests that only read from it."""
    from pagedserve import LLM

    return LLM(max_model_len=2048, kv_cache_memory=512 * 1024**2)


@pytest.fixture(scope="session")
def tokenizer(default_llm):
    return default_llm.get_tokenizer()


PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Here is a short story about a robot who learns to paint:",
    "def fibonacci(n):",
]


def engine_core_of(llm):
    """The EngineCore an offline LLM runs in its own process (for tests that inspect its state)."""
    return llm.llm_engine.client.engine_core


def worker_of(llm):
    return engine_core_of(llm).executor.worker


def greedy(max_tokens: int, **kwargs):
    from pagedserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def assert_matches(outputs: list, reference: list) -> None:
    """Token for token, or diverging only where the reference's top two tokens are a near-tie (a parallel engine sums
    in another order); logprobs within 1e-3 where the tokens agree. The outputs need logprobs."""
    for ours, theirs in zip(outputs, reference):
        for mine, expected in zip(ours.outputs, theirs.outputs):
            for position, (token, want) in enumerate(zip(mine.token_ids, expected.token_ids)):
                if token == want:
                    if mine.logprobs is not None:
                        assert mine.logprobs[position][token].logprob == pytest.approx(expected.logprobs[position][want].logprob, abs=1e-3)
                    continue
                top = sorted(lp.logprob for lp in expected.logprobs[position].values())[-2:]
                assert top[1] - top[0] < 0.01, f"diverged at position {position} without a near-tie: {top}"
                break  # after a near-tie divergence the continuations differ


def token_ids_of(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def chi_square_p_value(counts: torch.Tensor, probabilities: torch.Tensor) -> float:
    """Pearson's test of counts against probabilities, tokens expected fewer than 5 times pooled."""
    total = counts.sum().item()
    expected = probabilities * total
    big = expected >= 5
    observed = [*counts[big].tolist(), counts[~big].sum().item()]
    expected_list = [*expected[big].tolist(), expected[~big].sum().item()]
    if expected_list[-1] < 5:  # nothing worth a bin of its own: fold it in, it must then be (nearly) empty
        assert observed[-1] <= 2
        observed, expected_list = observed[:-1], expected_list[:-1]
    scale = sum(observed) / sum(expected_list)
    statistic = sum((o - e * scale) ** 2 / (e * scale) for o, e in zip(observed, expected_list))
    degrees = len(observed) - 1
    # The chi-square distribution's survival function: the regularized upper incomplete gamma function.
    return torch.special.gammaincc(torch.tensor(degrees / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)).item()


def pytest_unconfigure(config):
    """After the summary: triton (which torch._dynamo loads where it is installed, and xgrammar's dependencies install
    it) reports its bindings as leaked when the interpreter exits, lines that would follow the summary. Nothing is
    said on stderr after this point but those."""
    sys.stderr.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
