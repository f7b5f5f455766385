"""Engine configuration: the one home of defaults. CLI flags are derived from these fields."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve.pooling import PoolerConfig, check_pooler_values
from pagedserve.reasoning_format import REASONING_FORMATS
from pagedserve.tasks import runner_for

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# 2 GiB of KV holds ~46k tokens of the default model: plenty of concurrency on a small CPU box.
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3
ATTENTION_BACKENDS = ("auto", "cpu", "torch")
GEMM_BACKENDS = ("auto", "onednn", "torch")
RUNNERS = ("auto", "generate", "pooling")
# 32- and 16-bit caches, and the 8-bit formats of layers/attention/kv_quant.py (fp8 is fp8_e4m3).
# Quantizations applied at load (None: the weights as the checkpoint has them).
QUANTIZATIONS = (None, "int8")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass
class EngineConfig:
    """Every knob of the engine. Field docs double as CLI --help text."""

    model: str = field(default=DEFAULT_MODEL, metadata={"help": "HF-format directory, .gguf file, or the default model's name"})
    tokenizer: str | None = field(default=None, metadata={"help": "tokenizer directory (defaults to the model's)"})
    dtype: str = field(default="auto", metadata={
        "help": "float32, bfloat16, float16, or auto (bfloat16 on accelerators and on CPUs with bfloat16 matrix instructions "
                "whose bfloat16 GEMMs measure at 0.9x float32's rate or more, else float32). On CPU, bfloat16 runs the GEMMs in "
                "bfloat16 between float32 activations; float32 is exact"})
    quantization: str | None = field(default=None, metadata={
        "help": "int8: run the linear layers' GEMMs in int8 on CPU (W8A8: weights per output channel at load, activations per "
                "row at run time; fastest where the CPU has int8 dot products, avx512_vnni or amx_int8); unset: the weights "
                "as loaded"})
    device: str = field(default="auto", metadata={"help": "cpu, cuda, or auto"})
    seed: int = field(default=0, metadata={"help": "seed of the sampler for requests without their own seed"})
    max_model_len: int | None = field(default=None, metadata={"help": "context length (default: the model's, capped by the KV cache)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    kv_cache_memory: int = field(default=DEFAULT_CPU_KV_CACHE_BYTES, metadata={"help": "bytes of KV cache on CPU"})
    kv_cache_dtype: str = field(
        default="auto",
        metadata={"help": "what the KV cache stores: auto (the model's dtype), float32, bfloat16 or float16; a 16-bit cache "
                  "holds twice the tokens and halves the bytes attention reads, at the cost of rounding K/V; or 8 bits with a "
                  "scale per token and head, int8, fp8_e4m3 (or fp8) or fp8_e5m2: 3.8x float32's tokens at head size 64, "
                  "lossy (docs/benchmarks.md)"},
    )
    prefault_kv_cache: bool = field(
        default=True,
        metadata={"help": "on CPU, map the KV cache's pages in a background thread at idle priority, so requests do not pay "
                  "first-touch page faults; off: pages are mapped as K/V are first written"},
    )
    gpu_memory_utilization: float = field(default=0.9, metadata={"help": "fraction of GPU memory the engine may use (CUDA)"})
    num_gpu_blocks_override: int | None = field(default=None, metadata={"help": "force the number of KV blocks (testing)"})
    enable_prefix_caching: bool = field(default=True, metadata={"help": "reuse KV blocks of shared prefixes"})
    # While streams decode the stall bound sizes a step's prompt work in time; the budget bounds the steps it leaves
    # alone (a burst, an idle engine's prompts), and a burst let in in fewer steps stalls its early streams fewer times.
    max_num_batched_tokens: int = field(default=4096, metadata={"help": "token budget of one engine step"})
    max_num_seqs: int = field(default=256, metadata={"help": "most requests running at once"})
    long_prefill_token_threshold: int = field(default=0, metadata={"help": "cap of one prompt's chunk per step (0: no cap)"})
    max_decode_stall: str = field(
        default="2x",
        metadata={"help": "how long a step that carries prompt tokens may make decoding streams wait: Nx (N times the decode-only "
                  "step, predicted by a model of step times fit to the steps run), Ns (N seconds), or off (only the token budget "
                  "bounds it); default 2x"},
    )
    scheduling_policy: str = field(default="fcfs", metadata={"help": "fcfs or priority"})
    gguf_quantized_weights: bool = field(
        default=True,
        metadata={"help": "on CPU in float32, run a GGUF model's GEMMs on its Q4_0/Q4_1/Q8_0 blocks (the same values, "
                  "4-7x fewer bytes per step); off: on the dequantized float32 weights"},
    )
    generation_config: str = field(
        default="auto",
        metadata={"help": "default sampling parameters: auto (the model's generation_config.json, where it has one), vllm "
                  "(pagedserve's own defaults), or a directory holding a generation_config.json; a request's own values win"},
    )
    num_threads: int | None = field(
        default=None, metadata={"help": "torch intra-op threads of the engine, or of each rank (default: the cores, shared among ranks)"})
    pin_threads: bool = field(
        default=True, metadata={"help": "on CPU, for steps of a lone stream's decode, pin each torch thread of the engine's own processes "
                                "to a CPU of its own within those the process may use (taskset, cpusets), where its ranks' threads "
                                "fit them; off: the OS places them in every step"})
    tensor_parallel_size: int = field(
        default=1, metadata={"help": "ranks that split every layer (heads, MLP columns, vocabulary) among them", "aliases": ["-tp"]})
    pipeline_parallel_size: int = field(
        default=1, metadata={"help": "ranks that split the layers into consecutive stages", "aliases": ["-pp"]})
    enable_expert_parallel: bool = field(
        default=False,
        metadata={"help": "a mixture of experts' experts spread over the tensor-parallel ranks, whole (num_experts / "
                  "tensor_parallel_size each), instead of every expert split over them"})
    pp_layer_partition: str | None = field(
        default=None, metadata={"help": "decoder layers per pipeline stage, comma-separated (default: as even as they go)"})
    data_parallel_size: int = field(
        default=1, metadata={"help": "engine cores, each with its own scheduler and KV cache, behind one server", "aliases": ["-dp"]})
    speculative_config: dict | None = field(
        default=None,
        metadata={"help": "speculative decoding, as JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                  "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4} or {\"method\": \"draft_model\", \"model\": DIR, "
                  "\"num_speculative_tokens\": 4}; also disable_by_batch_size, min_acceptance_rate (default: off)"},
    )
    enable_lora: bool = field(default=False, metadata={"help": "serve LoRA adapters (PEFT directories) beside the base model"})
    max_loras: int = field(default=1, metadata={"help": "most distinct LoRA adapters in one step"})
    max_lora_rank: int = field(default=16, metadata={"help": "highest rank of an adapter the engine takes"})
    max_cpu_loras: int | None = field(
        default=None, metadata={"help": "adapters held in memory, least recently used let go first (default: max_loras; at least it)"})
    kv_transfer_config: dict | None = field(
        default=None,
        metadata={"help": "a KV connector, as JSON: {\"kv_connector\": \"SharedStorageConnector\", \"kv_role\": \"kv_both\", "
                  "\"kv_connector_extra_config\": {\"shared_storage_path\": DIR, \"max_bytes\": N}}: full blocks of KV saved "
                  "under DIR by their prefix, loaded by any engine that shares it (default: off)"},
    )
    structured_outputs_compile_timeout: float = field(
        default=10.0,
        metadata={"help": "seconds a request's structure (JSON schema, regex, choice, grammar) may take to compile before the "
                  "request is refused; compiled structures are cached, so a repeat costs nothing"},
    )
    hf_overrides: dict | None = field(
        default=None,
        metadata={"help": "values set over the model's config.json as transformers resolved it, as JSON (vLLM's "
                  "--hf-overrides): {\"max_position_embeddings\": 4096}, {\"is_matryoshka\": true} (default: none)"},
    )
    runner: str = field(
        default="auto",
        metadata={"help": "what the model serves: auto (pooling for a model that only pools, a base model or a "
                  "*ForSequenceClassification; else generate), generate (text: completions, chat, the Responses API) or pooling (an "
                  "embedding model's vectors of prompts: /v1/embeddings, LLM.embed; a classification model's classes: "
                  "/classify, LLM.classify; pair scores of either: /v1/score, /v1/rerank, LLM.score)",
                  "choices": list(RUNNERS)},
    )
    pooler_config: dict | None = field(
        default=None,
        metadata={"help": "with runner pooling, as JSON: {\"pooling_type\": \"LAST\" | \"MEAN\" | \"CLS\", \"normalize\": "
                  "true | false} (default: the model's sentence-transformers pooling, else LAST, normalized)"},
    )
    reasoning_parser: str | None = field(
        default=None,
        metadata={"help": "where a reasoning model's output holds its reasoning: deepseek_r1 (the output begins inside <think>, "
                  "as DeepSeek-R1's template opens it) or qwen3 (reasoning where the output begins with <think>). A "
                  "structured output's structure then holds the answer after </think>, the reasoning being free; the "
                  "server gives the reasoning apart (the chat message's reasoning, the Responses API's reasoning item) "
                  "(default: none)", "choices": sorted(REASONING_FORMATS)},
    )
    distributed_executor_backend: str | None = field(
        default=None,
        metadata={"help": "how ranks run: mp (a process each, the default with more than one rank), ray (Ray actors, on the cluster "
                  "RAY_ADDRESS names or a local one), or uni (one process, one rank)"},
    )
    attention_backend: str = field(
        default="auto",
        metadata={"help": "attention implementation: cpu (C++ kernels on the paged cache; CPU, float32), torch (the plain-torch "
                  "reference, any device), or auto (cpu where it applies, else torch)"},
    )
    cpu_kernels: bool = field(
        default=True,
        metadata={"help": "on CPU in float32, run RMSNorm, rotary, SiLU-and-mul, argmax and GGUF-block GEMMs in the C++ kernels; "
                  "off: their plain-torch paths (attention follows attention_backend)"},
    )
    gemm_backend: str = field(
        default="auto",
        metadata={"help": "dense GEMMs on CPU (float32 or bfloat16 weights): onednn (weights packed at load), torch (torch's "
                  "default BLAS), or auto (bfloat16 GEMMs on the C++ kernels' AMX tiles where the processor has them, else "
                  "onednn where torch has it)"},
    )

    # Set by the data-parallel client on each core's copy when expert parallelism spans the cores; not a user's setting.
    data_parallel_place: DataParallelPlace | None = field(default=None, repr=False, metadata={"internal": True})

    # Parsed from the fields above, once, by validate(): what the engine reads.
    decode_stall: DecodeStallLimit | None = field(init=False, repr=False, default=None)
    speculative: SpeculativeConfig | None = field(init=False, repr=False, default=None)
    kv_transfer: KVTransferConfig | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def held_loras(self) -> int:
        """LoRA adapters a worker holds at once (max_cpu_loras, or max_loras when unset)."""
        return self.max_cpu_loras or self.max_loras

    def validate(self) -> None:
        _require(self.block_size in (8, 16, 32, 64, 128), "block_size", "one of 8, 16, 32, 64, 128", self.block_size)
        _require(self.kv_cache_memory > 0, "kv_cache_memory", "> 0 bytes", self.kv_cache_memory)
        _require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization", "(0, 1]", self.gpu_memory_utilization)
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", ">= 1", self.max_num_batched_tokens)
        _require(self.max_num_seqs >= 1, "max_num_seqs", ">= 1", self.max_num_seqs)
        _require(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold", ">= 0", self.long_prefill_token_threshold)
        _require(self.scheduling_policy in ("fcfs", "priority"), "scheduling_policy", "'fcfs' or 'priority'", self.scheduling_policy)
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", "auto, float32, bfloat16, float16", self.dtype)
        _require(self.quantization in QUANTIZATIONS, "quantization", "int8 or unset", self.quantization)
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", ", ".join(KV_CACHE_DTYPES), self.kv_cache_dtype)
        _require(self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:"), "device", "auto, cpu, cuda", self.device)
        _require(self.attention_backend in ATTENTION_BACKENDS, "attention_backend", ", ".join(ATTENTION_BACKENDS),
                 self.attention_backend)
        _require(self.structured_outputs_compile_timeout > 0, "structured_outputs_compile_timeout", "> 0 seconds",
                 self.structured_outputs_compile_timeout)
        _require(self.reasoning_parser is None or self.reasoning_parser in REASONING_FORMATS, "reasoning_parser",
                 ", ".join(REASONING_FORMATS) + " or unset", self.reasoning_parser)
        _require(self.gemm_backend in GEMM_BACKENDS, "gemm_backend", ", ".join(GEMM_BACKENDS), self.gemm_backend)
        _require(self.max_loras >= 1, "max_loras", ">= 1", self.max_loras)
        _require(self.max_lora_rank >= 1, "max_lora_rank", ">= 1", self.max_lora_rank)
        _require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras, "max_cpu_loras", f">= max_loras ({self.max_loras})",
                 self.max_cpu_loras)
        self.decode_stall = DecodeStallLimit.parse(self.max_decode_stall)
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            _require(isinstance(getattr(self, name), int) and getattr(self, name) >= 1, name, "an integer >= 1", getattr(self, name))
        _require(self.distributed_executor_backend in (None, "mp", "ray", "uni"), "distributed_executor_backend", "mp, ray or uni",
                 self.distributed_executor_backend)
        if self.distributed_executor_backend == "uni":
            _require(self.world_size == 1, "distributed_executor_backend", "mp or ray with more than one rank (uni runs one)",
                     self.distributed_executor_backend)
        _require(self.runner in RUNNERS, "runner", " or ".join(RUNNERS), self.runner)
        if self.runner == "auto":
            self.runner = runner_for(_architectures_of(self.model))
        self.hf_overrides = _json_object(self.hf_overrides, "hf_overrides")
        self._check_pooling()
        self.speculative = SpeculativeConfig.from_dict(self.speculative_config)
        self.kv_transfer = KVTransferConfig.from_dict(self.kv_transfer_config)
        if self.kv_transfer is not None and self.kv_transfer.kv_connector == "P2pConnector" and self.data_parallel_size > 1:
            raise ValueError("kv_transfer_config's P2pConnector serves one engine core's blocks on its ports: with "
                             "data_parallel_size > 1, start one instance per core and put `pagedserve proxy` in front of them")
        if self.speculative is not None and self.world_size > 1:
            raise ValueError("speculative_config runs with one rank (tensor_parallel_size and pipeline_parallel_size 1)")
        if self.enable_expert_parallel and self.data_parallel_size > 1:
            if self.pipeline_parallel_size > 1:
                raise ValueError("enable_expert_parallel with data_parallel_size > 1 spreads the experts over the data-parallel "
                                 "engine cores, which step together; pipeline_parallel_size must then be 1")
            if self.speculative is not None and self.speculative.method == "draft_model":
                raise ValueError("enable_expert_parallel with data_parallel_size > 1 runs with ngram speculation only: a draft "
                                 "model's passes would not step with the other engine cores")
        if self.pp_layer_partition is not None:
            parts = self.pp_layer_partition.split(",")
            _require(len(parts) == self.pipeline_parallel_size and all(p.strip().isdigit() and int(p) > 0 for p in parts),
                     "pp_layer_partition", f"{self.pipeline_parallel_size} positive layer counts, comma-separated", self.pp_layer_partition)
        if self.max_model_len is not None:
            _require(self.max_model_len >= 1, "max_model_len", ">= 1", self.max_model_len)
        if self.num_gpu_blocks_override is not None:
            _require(self.num_gpu_blocks_override >= 1, "num_gpu_blocks_override", ">= 1", self.num_gpu_blocks_override)
        if self.num_threads is not None:
            _require(self.num_threads >= 1, "num_threads", ">= 1", self.num_threads)

    def _check_pooling(self) -> None:
        if self.runner != "pooling":
            if self.pooler_config is not None:
                raise ValueError("pooler_config applies with runner pooling; this engine runs generate")
            return
        self.pooler_config = _json_object(self.pooler_config, "pooler_config", PoolerConfig)
        if self.pooler_config is not None:
            check_pooler_values(self.pooler_config)
        for name in ("speculative_config", "kv_transfer_config", "reasoning_parser"):
            if getattr(self, name) is not None:
                raise ValueError(f"{name} applies to generated text; runner pooling generates none (leave it unset)")

    @property
    def world_size(self) -> int:
        """Ranks of one engine core (data-parallel cores each have this many)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def executor_backend(self) -> str:
        return self.distributed_executor_backend or ("mp" if self.world_size > 1 else "uni")

    @classmethod
    def settings(cls) -> list[dataclasses.Field]:
        """The fields a user sets (the rest are parsed from them, or set by the engine for its own processes)."""
        return [f for f in dataclasses.fields(cls) if f.init and not f.metadata.get("internal")]

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        known = {f.name for f in cls.settings()}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine argument(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)


def _json_object(values: dict | str | None, name: str, fields_of=None) -> dict | None:
    """A setting given as a JSON object (a dict, or its text on the command line), with only the fields of the
    dataclass fields_of (any, without one); ValueError naming the setting otherwise."""
    if values is None:
        return None
    if isinstance(values, str):
        try:
            values = json.loads(values)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} must be a JSON object, got {values!r}: {exc}") from exc
    if not isinstance(values, dict):
        raise ValueError(f"{name} must be a JSON object, got {values!r}")
    if fields_of is None:
        return values
    known = {f.name for f in dataclasses.fields(fields_of)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{name} has unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    return values


def _require(ok: bool, name: str, allowed: str, value) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True)
class DecodeStallLimit:
    """How long a step that carries prompt tokens may make decoding streams wait (max_decode_stall): a multiple of
    the decode-only step ('2x'), or seconds ('0.5s')."""

    multiple: float | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str) -> DecodeStallLimit | None:
        """'2x' -> a multiple, '0.5s' -> seconds, 'off' -> None; anything else is refused, naming the setting."""
        text = text.strip().lower()
        if text == "off":
            return None
        try:
            value = float(text[:-1]) if len(text) >= 2 else float("nan")
        except ValueError:
            value = float("nan")
        finite = math.isfinite(value)
        if finite and text.endswith("x") and value > 1:
            return cls(multiple=value)
        if finite and text.endswith("s") and value > 0:
            return cls(seconds=value)
        raise ValueError(f"max_decode_stall must be off, a multiple such as 2x (> 1), or seconds such as 0.5s (> 0), got {text!r}")

    def limit(self, decode_only_seconds: float) -> float:
        """The limit in seconds, given the decode-only step of the batch that the prompts are joining."""
        return self.seconds if self.multiple is None else self.multiple * decode_only_seconds


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's field names): a proposer drafts num_speculative_tokens tokens per running
    request after each step, and the next step verifies them all in one pass."""

    method: str  # ngram: prompt lookup; draft_model: a smaller model with the same vocabulary
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    # No drafts while this many requests run (0: never off for the batch's sake).
    disable_by_batch_size: int = 0
    # A request whose drafts are accepted less often than this stops drafting for a while.
    min_acceptance_rate: float = 0.1

    @classmethod
    def from_dict(cls, values: dict | str | None) -> SpeculativeConfig | None:
        values = _json_object(values, "speculative_config", cls)
        if values is None:
            return None
        if "method" not in values or "num_speculative_tokens" not in values:
            raise ValueError("speculative_config needs method (ngram or draft_model) and num_speculative_tokens")
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        name = "speculative_config."
        _require(self.method in ("ngram", "draft_model"), name + "method", "ngram or draft_model", self.method)
        _require(isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 16,
                 name + "num_speculative_tokens", "an integer in [1, 16]", self.num_speculative_tokens)
        _require(isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1, name + "prompt_lookup_min", ">= 1",
                 self.prompt_lookup_min)
        _require(isinstance(self.prompt_lookup_max, int) and self.prompt_lookup_max >= self.prompt_lookup_min,
                 name + "prompt_lookup_max", f">= prompt_lookup_min ({self.prompt_lookup_min})", self.prompt_lookup_max)
        _require(isinstance(self.disable_by_batch_size, int) and self.disable_by_batch_size >= 0, name + "disable_by_batch_size",
                 ">= 0", self.disable_by_batch_size)
        _require(isinstance(self.min_acceptance_rate, (int, float)) and 0 <= self.min_acceptance_rate <= 1,
                 name + "min_acceptance_rate", "in [0, 1]", self.min_acceptance_rate)
        if self.method == "draft_model":
            _require(isinstance(self.model, str) and bool(self.model), name + "model", "the draft model's directory or .gguf file",
                     self.model)
        else:
            _require(self.model is None, name + "model", "unset for method ngram", self.model)


KV_CONNECTORS = ("SharedStorageConnector", "P2pConnector")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
# P2pConnector's kv_connector_extra_config where a field is not given.
P2P_DEFAULTS = {"kv_host": "127.0.0.1", "kv_port": 14579, "kv_lease_seconds": 120.0, "trusted_producers": None}
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class DataParallelPlace:
    """An engine core's place among data-parallel cores whose ranks share a mixture's experts (expert parallelism over
    data parallelism): its index, the number of cores, and the address of the store (host:port) where their processes
    meet to form the groups they step together in."""

    rank: int
    size: int
    store_address: str

    @property
    def store_host_port(self) -> tuple[str, int]:
        host, _, port = self.store_address.rpartition(":")
        return host, int(port)


@dataclass(frozen=True)
class KVTransferConfig:
    """A KV connector (vLLM's field names): how this engine saves the KV it computes and loads KV computed elsewhere.
    SharedStorageConnector: kv_connector_extra_config {"shared_storage_path": DIR, "max_bytes": N (default: no bound)}.
    P2pConnector: kv_connector_extra_config {"kv_host": the address its transfer sockets listen on (default 127.0.0.1),
    "kv_port": the first of its ports (the engine's, then one per rank), "kv_lease_seconds": how long a finished
    request's blocks wait for a decode instance to pull them, "trusted_producers": ["host:port", ...] the prefill
    instances a decode instance pulls from (default: those on this machine's loopback)}. kv_load_failure_policy: what a
    decode instance does when KV cannot be loaded: compute the prompt itself (recompute) or end the request (fail)."""

    kv_connector: str
    kv_role: str = "kv_both"  # kv_producer: saves; kv_consumer: loads; kv_both: both
    kv_connector_extra_config: dict = field(default_factory=dict)
    engine_id: str | None = None
    kv_load_failure_policy: str = "recompute"

    @classmethod
    def from_dict(cls, values: dict | str | None) -> KVTransferConfig | None:
        values = _json_object(values, "kv_transfer_config", cls)
        if values is None:
            return None
        if "kv_connector" not in values:
            raise ValueError(f"kv_transfer_config needs kv_connector ({', '.join(KV_CONNECTORS)})")
        config = cls(**values)
        name = "kv_transfer_config."
        _require(config.kv_connector in KV_CONNECTORS, name + "kv_connector", ", ".join(KV_CONNECTORS), config.kv_connector)
        _require(config.kv_role in KV_ROLES, name + "kv_role", ", ".join(KV_ROLES), config.kv_role)
        _require(config.kv_load_failure_policy in KV_LOAD_FAILURE_POLICIES, name + "kv_load_failure_policy",
                 ", ".join(KV_LOAD_FAILURE_POLICIES), config.kv_load_failure_policy)
        _require(config.engine_id is None or isinstance(config.engine_id, str) and config.engine_id != "", name + "engine_id",
                 "a non-empty string", config.engine_id)
        _require(isinstance(config.kv_connector_extra_config, dict), name + "kv_connector_extra_config", "a JSON object",
                 config.kv_connector_extra_config)
        if config.kv_connector == "SharedStorageConnector":
            _check_shared_storage(config.kv_connector_extra_config, name + "kv_connector_extra_config.")
        else:
            _check_p2p(config.kv_connector_extra_config, name + "kv_connector_extra_config.")
        return config

    def p2p_setting(self, name: str):
        """P2pConnector's kv_connector_extra_config field, or its default."""
        return self.kv_connector_extra_config.get(name, P2P_DEFAULTS[name])

    @property
    def saves(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def loads(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


def _check_shared_storage(extra: dict, name: str) -> None:
    _known(extra, name, ("shared_storage_path", "max_bytes"))
    _require(isinstance(extra.get("shared_storage_path"), str) and extra["shared_storage_path"] != "", name + "shared_storage_path",
             "a directory", extra.get("shared_storage_path"))
    max_bytes = extra.get("max_bytes")
    _require(max_bytes is None or isinstance(max_bytes, int) and max_bytes > 0, name + "max_bytes", "an integer > 0 (bytes)", max_bytes)


def _check_p2p(extra: dict, name: str) -> None:
    _known(extra, name, tuple(P2P_DEFAULTS))
    extra = P2P_DEFAULTS | extra
    host = extra["kv_host"]
    _require(isinstance(host, str) and host != "", name + "kv_host", "an address to listen on", host)
    port = extra["kv_port"]
    _require(isinstance(port, int) and 1024 <= port <= 65000, name + "kv_port", "an integer in [1024, 65000]", port)
    lease = extra["kv_lease_seconds"]
    _require(isinstance(lease, (int, float)) and lease > 0, name + "kv_lease_seconds", "a number > 0 (seconds)", lease)
    trusted = extra["trusted_producers"]
    _require(trusted is None or isinstance(trusted, list) and all(isinstance(t, str) and ":" in t for t in trusted),
             name + "trusted_producers", 'a list of "host:port"', trusted)


def _known(values: dict, name: str, known: tuple[str, ...]) -> None:
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise ValueError(f"{name.rstrip('.')} has unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}")


def _architectures_of(model: str) -> list[str]:
    """The architectures a model directory's config.json names; none for the default model and GGUF files (text
    models), or where there is no readable config.json (loading the model says why)."""
    try:
        architectures = json.loads((Path(model).expanduser() / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return []
    return [str(name) for name in architectures] if isinstance(architectures, list) else []
