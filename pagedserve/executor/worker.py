"""Worker: one rank's device, model and paged KV cache, and the tuning of the host it runs on; it runs steps
through its ModelRunner."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from pagedserve import envs, openmp
from pagedserve.classification import classifier_of
from pagedserve.config import DataParallelPlace, EngineConfig
from pagedserve.core.contracts import ModelRunnerOutput, SchedulerOutput
from pagedserve.cpu_features import cpu_features
from pagedserve.distributed.parallel_state import expert_groups, init_expert_groups, rank_info
from pagedserve.executor import bfloat16_values, cpu_host, gemm_choice, int8_calibration
from pagedserve.executor.auto_dtype import auto_cache_dtype, auto_gemm_dtype
from pagedserve.executor.lora_manager import LoRAManager
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.kv_transfer.factory import worker_connector
from pagedserve.layers import cpu_kernels
from pagedserve.layers.attention import Attention, select_attention_backend
from pagedserve.layers.attention.kv_quant import NO_STATIC_SCALES, KVFormat, kv_format
from pagedserve.layers.fused_moe import FusedMoE
from pagedserve.layers.gemm import onednn_available
from pagedserve.layers.linear import GGUF_KERNEL_TYPES, TILES_MAX_ROWS, Linear, kv_heads_of_rank, row_limit_text
from pagedserve.lora_request import LoRARequest
from pagedserve.matryoshka import matryoshka_dimensions
from pagedserve.model_info import ModelInfo
from pagedserve.models.hf_config import load_hf_config
from pagedserve.models.llama import head_dim_of
from pagedserve.models.loader import (
    eos_token_ids,
    generation_defaults,
    load_model,
    max_position_of,
)
from pagedserve.models.location import resolve_model_dir
from pagedserve.models.moe import moe_shape, parallel_shape_problems
from pagedserve.pooling import resolve_pooler
from pagedserve.processes import is_engine_process
from pagedserve.spec_decode.draft_model import DraftModelProposer
from pagedserve.spec_decode.ngram_proposer import NgramProposer
from pagedserve.spec_decode.proposer import Proposer

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# numpy has no bfloat16: its zeros come as uint16 (same bytes) and are viewed as bfloat16.
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16, torch.uint8: np.uint8}


def resolve_device(config: EngineConfig) -> torch.device:
    device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available() else
                          "cpu" if config.device == "auto" else config.device)
    if device.type == "cuda" and device.index is None and rank_info().world_size > 1:
        return torch.device("cuda", rank_info().rank % torch.cuda.device_count())  # a GPU per rank
    return device


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """What config.dtype names; auto is bfloat16 on accelerators, and on CPUs where it is the faster GEMM
    (auto_dtype.auto_gemm_dtype), else float32 (the environment can fix it: envs.cpu_auto_dtype)."""
    if _auto_measured(config, device):
        return auto_gemm_dtype(cpu_features())
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    return torch.bfloat16 if device.type != "cpu" else _DTYPES[envs.cpu_auto_dtype()]


def cache_dtype_of_model(config: EngineConfig, device: torch.device, gemm_dtype: torch.dtype) -> torch.dtype:
    """What `kv_cache_dtype auto` stores: the GEMMs' dtype, except where `dtype auto` is measured on a CPU
    (auto_dtype.auto_cache_dtype: bfloat16 wherever the processor has bfloat16 instructions, float32 GEMMs or not)."""
    return auto_cache_dtype(cpu_features()) if _auto_measured(config, device) else gemm_dtype


def _auto_measured(config: EngineConfig, device: torch.device) -> bool:
    """Whether auto_dtype decides the dtypes: dtype auto on a CPU, with nothing in the environment fixing it."""
    return config.dtype == "auto" and device.type == "cpu" and not envs.cpu_auto_dtype()


def block_products_round_activations(config: EngineConfig, device: torch.device) -> bool:
    """Whether the GEMMs on GGUF blocks round their input to 8 bits per block of 32 values and multiply integers (as
    llama.cpp's and vLLM's GGUF kernels do): on CPU unless float32, the exact mode, is asked for (by dtype, or for auto
    by the environment: envs.cpu_auto_dtype)."""
    asked = config.dtype if config.dtype != "auto" else envs.cpu_auto_dtype()
    return device.type == "cpu" and asked != "float32"


def activation_and_gemm_dtypes(dtype: torch.dtype, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(what activations are kept in, what GEMM weights are multiplied in). On CPU, bfloat16 means bfloat16 GEMMs
    between float32 activations: the weights and each GEMM's input are rounded to bfloat16 and products accumulate
    in float32, where the matrix units are; norms, attention, the residual stream and sampling keep float32 and
    run on the float32 kernels."""
    if device.type == "cpu" and dtype == torch.bfloat16:
        return torch.float32, torch.bfloat16
    return dtype, dtype


def int8_gemms_wanted(config: EngineConfig, device: torch.device, dtype: torch.dtype, kernels) -> bool:
    """Whether the linear layers run W8A8 int8 GEMMs (quantization int8): on CPU, between float32 or bfloat16
    activations, through the C++ kernels. A processor without int8 dot products runs them, but slower than float32:
    the log says so."""
    if config.quantization != "int8":
        return False
    if device.type != "cpu":
        raise ValueError(f"quantization 'int8' runs on CPU; the device is {device.type}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"quantization 'int8' takes dtype float32, bfloat16 or auto; got {_name(dtype)}")
    if kernels is None:
        raise ValueError("quantization 'int8' needs the C++ CPU kernels (cpu_kernels on, and a compiler to build them)")
    if not cpu_features().has_int8_matrix:
        logger.warning("quantization int8: this CPU has no int8 dot products (avx512_vnni, avx_vnni or amx_int8), so its int8 "
                       "GEMMs run slower than float32 ones")
    return True


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_cache_element(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' element type for a kv_cache_dtype setting: the model's, the one named, or bytes for an 8-bit
    format (kv_quant.py)."""
    if kv_format(kv_cache_dtype) is not None:
        return torch.uint8
    return model_dtype if kv_cache_dtype == "auto" else _DTYPES[kv_cache_dtype]


def settle_static_kv_scales(model: torch.nn.Module, fmt: KVFormat | None, model_name: str) -> None:
    """Keep the static k_scale / v_scale a checkpoint ships where the cache is FP8, the format they are calibrated
    for; any other cache scales each row itself, and the log says which."""
    layers = [module for module in model.modules() if isinstance(module, Attention) and module.kv_scales]
    if not layers:
        return
    if fmt is not None and fmt.takes_static_scales:
        logger.info("%s: the %s KV cache quantizes %d layers with the checkpoint's static k_scale / v_scale", model_name, fmt.name,
                    len(layers))
        return
    for layer in layers:
        layer.kv_scales = NO_STATIC_SCALES
    logger.info("%s: the checkpoint's k_scale / v_scale are for an FP8 KV cache; this %s cache does not use them", model_name,
                fmt.name if fmt is not None else "16- or 32-bit")


def kv_cache_row_width(hf_config, kv_cache_dtype: str) -> int:
    """Elements of one (token, KV head) row of a model's cache: the head's values, and an 8-bit format's scale."""
    fmt = kv_format(kv_cache_dtype)
    return fmt.row_bytes(head_dim_of(hf_config)) if fmt is not None else head_dim_of(hf_config)


def kv_cache_blocks(model: str, kv_cache_dtype: str, kv_cache_memory: int, block_size: int) -> int:
    """Blocks a model's cache (every layer and KV head, on one rank) of this dtype holds in kv_cache_memory bytes. auto
    is not a size: name the dtype."""
    hf_config = load_hf_config(resolve_model_dir(model))
    row_bytes = kv_cache_row_width(hf_config, kv_cache_dtype) * kv_cache_element(kv_cache_dtype, None).itemsize
    return kv_cache_memory // (2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * row_bytes * block_size)


class Worker:
    """One rank's share of the model (all of it in a single process; see distributed/parallel_state.py).
    Loads it at construction; determine_num_blocks() then initialize_cache() make it ready."""

    def __init__(self, config: EngineConfig) -> None:
        threads = cpu_host.threads_per_rank(config)
        if threads is not None:
            torch.set_num_threads(threads)
        self.config = config
        self.device = resolve_device(config)
        self.on_cpu = self.device.type == "cpu"
        if self.on_cpu:
            cpu_host.keep_freed_memory()
            features = cpu_features()
            logger.info("CPU %s: %s; torch's CPU kernels use %s", features.model_name, " ".join(features.isa) or "no AVX2",
                        torch.backends.cpu.get_cpu_capability())
        self.dtype, self.gemm_dtype = activation_and_gemm_dtypes(resolve_dtype(config, self.device), self.device)
        self.kv_cache_dtype = kv_cache_element(config.kv_cache_dtype, cache_dtype_of_model(config, self.device, self.gemm_dtype))
        self.kv_format = kv_format(config.kv_cache_dtype)
        self.model_dir = resolve_model_dir(config.model)
        self.hf_config = load_hf_config(self.model_dir, config.hf_overrides)
        self.classifier = classifier_of(self.hf_config) if config.runner == "pooling" else None
        self.pooler = None
        if config.runner == "pooling":
            self.pooler = resolve_pooler(config.pooler_config, self.model_dir, classifier=self.classifier is not None)
        self.model_max_len = max_position_of(self.hf_config)
        if config.max_model_len is not None and config.max_model_len > self.model_max_len:
            raise ValueError(f"max_model_len must be <= {self.model_max_len} (the model's context length), got {config.max_model_len}")
        self.eos_token_ids = eos_token_ids(self.model_dir, self.hf_config)
        self.generation_defaults = generation_defaults_of(config, self.model_dir)
        # Compiled now (the first time on a machine), not during the first request.
        self.cpu_kernels = cpu_kernels.load() if config.cpu_kernels and self.device.type == "cpu" else None
        if self.cpu_kernels is not None:
            openmp.calibrate_spin(self.cpu_kernels.spin_pause_seconds)
            logger.info("OpenMP threads wait with %s", openmp.spin_setting())
        self.thread_pinning = None
        if self.on_cpu:
            self.thread_pinning = cpu_host.thread_pinning(config, rank_info().rank, self.cpu_kernels, is_engine_process())
        if self.thread_pinning is not None:
            logger.info("torch threads pinned one to a CPU each (CPUs %s) for steps of up to %d token(s)",
                        ",".join(map(str, self.thread_pinning.cpus)), cpu_host.PINNED_MAX_TOKENS)
        self.int8_gemms = int8_gemms_wanted(config, self.device, self.dtype, self.cpu_kernels)
        self.attn_backend = select_attention_backend(config.attention_backend, self.device, self.dtype, self.cpu_kernels, self.kv_format,
                                                     self.bfloat16_on_tiles, bfloat16_gemms=self.gemm_dtype == torch.bfloat16)
        if config.data_parallel_place is not None:
            self._join_expert_groups(config.data_parallel_place)
        on_blocks = config.gguf_quantized_weights and self.cpu_kernels is not None and self.dtype == torch.float32
        self.model = load_model(self.hf_config, self.model_dir, self.dtype, self.device, self.model_max_len, self.attn_backend,
                                pooling=config.runner == "pooling", place_blocks=self._place_gguf_blocks if on_blocks else None,
                                kernels=self.cpu_kernels)
        settle_static_kv_scales(self.model, self.kv_format, self.model_dir.name)
        cpu_kernels.attach(self.model, self.cpu_kernels)
        # A partial rotary, or one of adjacent pairs, reorders q's and k's rows at load (layers/rotary.rotary_order): an
        # adapter's rows would be in the checkpoint's order (GGUF blocks are reordered as the rows are).
        if self.model.rotary_order is not None and config.enable_lora:
            raise ValueError("enable_lora is not supported with a rotary that reorders q and k at load (the model's "
                             "partial_rotary_factor, or ERNIE 4.5's adjacent pairs)")
        self._pack_gemm_weights(self.model)
        if not self.int8_gemms:  # else once the int8 GEMMs exist (initialize_cache)
            self._choose_gemm_paths()
        self.draft_model, self.draft_config = self._load_draft_model() if config.speculative else (None, None)
        self.num_blocks = 0
        self.max_model_len = 0
        self.kv_caches: list[torch.Tensor] = []
        self.draft_kv_caches: list[torch.Tensor] = []
        self.model_runner: ModelRunner | None = None
        self.kv_prefault: cpu_host.KVCachePrefault | None = None  # maps the KV cache's pages while the engine is idle
        gemms = self.dense_gemm_dtype
        dtypes = _name(self.dtype) if gemms == self.dtype else f"{_name(self.dtype)} activations, {_name(gemms)} GEMMs"
        logger.info("model %s on %s (%s), attention backend %s", self.model_dir.name, self.device, dtypes, self.attn_backend.name)
        self._log_matrix_tiles()

    @property
    def bfloat16_on_tiles(self) -> bool:
        """Whether the GEMMs multiply in bfloat16 where the kernels run AMX tiles (the build has them, the OS granted them)."""
        return self.gemm_dtype == torch.bfloat16 and self.cpu_kernels is not None and self.cpu_kernels.bf16_matrix_tiles()

    def _log_matrix_tiles(self) -> None:
        """Say what runs on AMX tiles, where anything does."""
        if not self.bfloat16_on_tiles:
            return
        layers = sum(1 for module in self.model.modules() if isinstance(module, Linear) and module.bf16_products is not None)
        logger.info("AMX tiles, granted by the OS: the lm_head, %d linear layers' steps of up to %d rows%s", layers,
                    TILES_MAX_ROWS, ", prompts' first chunks' attention" if self.attn_backend.takes_bfloat16 else "")

    @property
    def dense_gemm_dtype(self) -> torch.dtype:
        """What the linear layers' dense products multiply in: int8 under quantization int8, else gemm_dtype (the lm_head,
        LoRA adapters and experts of a mixture stay in gemm_dtype)."""
        return torch.int8 if self.int8_gemms else self.gemm_dtype

    def _pack_gemm_weights(self, model: torch.nn.Module) -> None:
        onednn = self._packs_for_onednn()
        if onednn or self.gemm_dtype != self.dtype:
            tiles = self.bfloat16_on_tiles and self.config.gemm_backend == "auto"
            model.pack_gemm_weights(self.gemm_dtype, onednn, self.dtype, self.cpu_kernels, tiles=tiles,
                                    values_kernels=self._values_kernels(model))
            kept = sum(1 for module in model.modules() if isinstance(module, Linear) and module.bf16_values is not None)
            if kept:
                logger.info("%d linear layers%s hold bfloat16 values: kept as them, multiplied in float32", kept,
                            " and the lm_head" if model.lm_head_pairs is not None else "")

    def _values_kernels(self, model: torch.nn.Module):
        """The kernels that read float32 GEMMs' weights of bfloat16 values (executor/bfloat16_values.py), where the
        model's GEMMs may run on them: float32 GEMMs on dense weights under gemm_backend auto, not int8 ones (which round
        the float32 weights later: int8_calibration). Nothing is measured for a model whose layers all run on GGUF blocks."""
        dense = any(isinstance(module, Linear) and module.weight is not None for module in model.modules())
        wanted = dense and self.gemm_dtype == torch.float32 and self.config.gemm_backend == "auto" and not self.int8_gemms
        return bfloat16_values.values_kernels(self.cpu_kernels) if wanted else None

    def _choose_gemm_paths(self) -> None:
        rows = gemm_choice.choose(self.model, self.dense_gemm_dtype)
        if rows:
            logger.info("GEMMs on the GGUF blocks (measured on this machine; %s weights for larger steps): %s",
                        _name(self.dense_gemm_dtype), ", ".join(f"{shape} {row_limit_text(count)}" for shape, count in rows.items()))

    def _packs_for_onednn(self) -> bool:
        available = onednn_available(self.device, self.dtype)
        if self.config.gemm_backend == "onednn" and not available:
            raise ValueError(f"gemm_backend 'onednn' needs a CPU device, float32 and a torch built with oneDNN; got device "
                             f"{self.device.type}, dtype {_name(self.dtype)}")
        return available and self.config.gemm_backend != "torch"

    def _load_draft_model(self) -> tuple[torch.nn.Module | None, object]:
        """The draft model of speculative_config method draft_model, run like the target (same dtype, device,
        attention backend and kernels)."""
        spec = self.config.speculative
        if spec.method != "draft_model":
            return None, None
        draft_dir = resolve_model_dir(spec.model)
        draft_config = load_hf_config(draft_dir)
        if draft_config.vocab_size != self.hf_config.vocab_size:
            raise ValueError(f"speculative_config.model must share the target's vocabulary ({self.hf_config.vocab_size} tokens); "
                             f"{draft_dir.name} has {draft_config.vocab_size}")
        # Drafts run up to num_speculative_tokens positions past the verified tokens.
        max_position = max(max_position_of(draft_config), self.model_max_len) + spec.num_speculative_tokens
        draft = load_model(draft_config, draft_dir, self.dtype, self.device, max_position, self.attn_backend, kernels=self.cpu_kernels)
        settle_static_kv_scales(draft, self.kv_format, draft_dir.name)
        cpu_kernels.attach(draft, self.cpu_kernels)
        self._pack_gemm_weights(draft)
        logger.info("draft model %s (%d layers) for speculative decoding", draft_dir.name, draft_config.num_hidden_layers)
        return draft, draft_config

    def _make_proposer(self) -> Proposer | None:
        spec = self.config.speculative
        if spec is None:
            return None
        if spec.method == "ngram":
            return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        return DraftModelProposer(self.draft_model, self.draft_kv_caches, self.config.block_size, self.attn_backend, self.device,
                                  spec.num_speculative_tokens, self.cpu_kernels)

    def _place_gguf_blocks(self, model: torch.nn.Module, blocks: dict[str, tuple[torch.Tensor, int]]) -> set[str]:
        """Put the model's layers onto the GGUF blocks their products read in this mode (load_model's place_blocks);
        returns the names of the blocks taken."""
        rounding = block_products_round_activations(self.config, self.device)
        if not rounding:
            blocks = self._blocks_of_exact_types(blocks)
        if not blocks:
            return set()
        taken = model.use_quantized_weights(blocks, self.cpu_kernels, integer_products=rounding)
        if rounding:
            for products in model.block_products():
                products.round_activations()
        logger.info("%d GGUF tensors run on their blocks (%.0f MB), their layers without dense weights%s", len(taken),
                    sum(blocks[name][0].numel() for name in taken) / 1e6,
                    ", multiplying their input rounded to 8 bits per 32 values (dtype float32 multiplies it exactly)" if rounding else "")
        return taken

    @staticmethod
    def _blocks_of_exact_types(blocks: dict[str, tuple[torch.Tensor, int]]) -> dict[str, tuple[torch.Tensor, int]]:
        """The blocks the exact float32 products read; the others (Q5 and K-quants, read only by the integer products)
        run dense, and the log says so."""
        exact = {name: entry for name, entry in blocks.items() if entry[1] in GGUF_KERNEL_TYPES.values()}
        if len(exact) < len(blocks):
            logger.info("%d GGUF tensors in Q5_0/Q5_1/K-quant blocks run on float32 weights: only the integer products read "
                        "those blocks (any dtype but float32)", len(blocks) - len(exact))
        return exact

    # ---- KV cache ---------------------------------------------------------------------------------

    @property
    def num_local_layers(self) -> int:
        return len(rank_info().stage_layers(self.hf_config.num_hidden_layers))

    @property
    def num_local_kv_heads(self) -> int:
        info = rank_info()
        return kv_heads_of_rank(self.hf_config.num_key_value_heads, info.tp_size, info.tp_rank)[0]

    def kv_bytes_per_block(self) -> int:
        """Bytes of one block in every cache this rank keeps (the target's, and a draft model's in the same layout)."""
        per_token = 2 * self.num_local_layers * self.num_local_kv_heads * self._row_width(self.hf_config)
        if self.draft_config is not None:
            draft = self.draft_config
            per_token += 2 * draft.num_hidden_layers * draft.num_key_value_heads * self._row_width(draft)
        return per_token * self.kv_cache_dtype.itemsize * self.config.block_size

    def _row_width(self, hf_config) -> int:  # of this engine's kv_cache_dtype
        return kv_cache_row_width(hf_config, self.config.kv_cache_dtype)

    def _join_expert_groups(self, place: DataParallelPlace) -> None:
        """Expert parallelism over the data-parallel cores: check the mixture divides over their ranks, then form the
        groups with the other cores' ranks (a dense model has no experts to spread: nothing to form)."""
        if moe_shape(self.hf_config) is None:
            logger.warning("enable_expert_parallel changes nothing: the model has no experts")
            return
        problems = parallel_shape_problems(self.hf_config, self.config.tensor_parallel_size, True, place.size)
        if problems:
            raise ValueError("; ".join(problems))
        init_expert_groups(place)
        logger.info("expert parallelism over %d data-parallel engine cores: this rank holds %d of the %d experts", place.size,
                    moe_shape(self.hf_config).num_experts // expert_groups().size, moe_shape(self.hf_config).num_experts)

    def determine_num_blocks(self) -> int:
        if self.config.num_gpu_blocks_override is not None:
            return self.config.num_gpu_blocks_override
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1 - self.config.gpu_memory_utilization)
        else:
            budget = self.config.kv_cache_memory
        num_blocks = int(budget // self.kv_bytes_per_block())
        if num_blocks < 1:
            raise ValueError(f"the KV cache budget ({int(budget)} bytes) holds no block; raise kv_cache_memory")
        return num_blocks

    def initialize_cache(self, num_blocks: int) -> None:
        config = self.config
        self.num_blocks = num_blocks
        self.max_model_len = self._max_model_len(num_blocks)
        shape = (2, num_blocks, config.block_size, self.num_local_kv_heads, self._row_width(self.hf_config))
        self.kv_caches = [zeroed(shape, self.kv_cache_dtype, self.device) for _ in range(self.num_local_layers)]
        if self.draft_config is not None:
            draft_shape = (2, num_blocks, config.block_size, self.draft_config.num_key_value_heads, self._row_width(self.draft_config))
            num_draft_layers = self.draft_config.num_hidden_layers
            self.draft_kv_caches = [zeroed(draft_shape, self.kv_cache_dtype, self.device) for _ in range(num_draft_layers)]
        self.model_runner = ModelRunner(self.model, self.kv_caches, config.block_size, self.device, config.seed, self.attn_backend,
                                        self.cpu_kernels, self._make_proposer(), self.pooler)
        if expert_groups() is not None:
            self.model_runner.steps_with_other_cores = list(self._mixtures().values())
        if config.enable_lora:
            self.model_runner.lora_manager = LoRAManager(self.model, config.max_lora_rank, config.held_loras, self.cpu_kernels)
        connector = worker_connector(config, rank_info().tp_rank, rank_info().pp_rank)
        if connector is not None:
            connector.register_kv_caches(self.kv_caches)
            self.model_runner.kv_connector = connector
        if self.int8_gemms:
            layers = int8_calibration.pack_int8_gemms(self.model, self.model_runner, self.cpu_kernels, self.dtype, self.max_model_len)
            logger.info("quantization int8: %d linear layers run smoothed int8 GEMMs (calibrated on this model now)", layers)
            self._choose_gemm_paths()
        # After the row counts are chosen and the adapters' layers known: the native layers read both once.
        if not config.enable_lora and self.model.use_native_decode(self.cpu_kernels):
            logger.info("decode steps %s run the decoder layers in one C++ call", row_limit_text(self.model.model.native_decode.max_rows))
        if self.on_cpu and config.prefault_kv_cache:
            self.kv_prefault = cpu_host.KVCachePrefault(self.kv_caches + self.draft_kv_caches)
        logger.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %s); max concurrency at max_model_len=%d: %.2fx",
            num_blocks, config.block_size, num_blocks * config.block_size,
            self.kv_format.name if self.kv_format is not None else _name(self.kv_cache_dtype),
            self.max_model_len, num_blocks * config.block_size / self.max_model_len,
        )

    def _max_model_len(self, num_blocks: int) -> int:
        capacity = num_blocks * self.config.block_size
        requested = self.config.max_model_len
        if requested is None:
            return min(self.model_max_len, capacity)
        if requested > capacity:
            raise ValueError(
                f"max_model_len {requested} does not fit in the KV cache ({capacity} tokens); "
                "raise kv_cache_memory or lower max_model_len"
            )
        return requested

    # ---- steps --------------------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.thread_pinning is not None:
            self.thread_pinning.for_step(scheduler_output.total_num_scheduled_tokens)
        if self.kv_prefault is None:
            return self.model_runner.execute_model(scheduler_output)
        self.kv_prefault.step_started()
        try:
            return self.model_runner.execute_model(scheduler_output)
        finally:
            self.kv_prefault.step_ended()

    def wait_for_kv_cache_mapping(self, timeout_s: float | None = None) -> None:
        """Return once the KV cache's pages are mapped in and gathered into 2 MB pages (at once without the prefault)."""
        if self.kv_prefault is not None:
            self.kv_prefault.wait(timeout_s)

    def model_info(self) -> ModelInfo:
        shape = moe_shape(self.hf_config)
        return ModelInfo(model_dir=str(self.model_dir), max_model_len=self.max_model_len, vocab_size=self.hf_config.vocab_size,
                         eos_token_ids=list(self.eos_token_ids), num_blocks=self.num_blocks,
                         generation_defaults=dict(self.generation_defaults), num_experts=shape.num_experts if shape else 0,
                         experts_per_token=shape.top_k if shape else 0, pooler=self.pooler, classifier=self.classifier,
                         matryoshka_dimensions=matryoshka_dimensions(self.hf_config))

    @property
    def is_output_rank(self) -> bool:
        """Whether this rank's step output goes back to the engine core (the last stage's first tensor-parallel rank)."""
        return rank_info().is_output_rank

    def close(self) -> None:
        """Stop what runs beside the steps (a KV connector's serving and pulling)."""
        if self.model_runner is not None and self.model_runner.kv_connector is not None:
            self.model_runner.kv_connector.close()

    def warm_up(self, timed: bool = True) -> list[tuple[int, int, int, float]]:
        timings = self.model_runner.warm_up(self.max_model_len, timed)
        for experts in self._mixtures().values():  # the warm-up's tokens are nobody's
            experts.routed.zero_()
        return timings

    def add_lora(self, lora: LoRARequest) -> str | None:
        """Hold an adapter: None, or what keeps this model from running it (an answer, not an exception, so that every
        rank replies to the call)."""
        try:
            self._lora_manager().add(lora)
        except ValueError as exc:
            return str(exc)
        return None

    def remove_lora(self, adapter_id: int) -> bool:
        return self._lora_manager().remove(adapter_id)

    def list_loras(self) -> list[int]:
        """The ids of the adapters held, least recently used first."""
        return list(self._lora_manager().held)

    def _lora_manager(self) -> LoRAManager:
        if self.model_runner.lora_manager is None:
            raise ValueError("LoRA adapters are not enabled (enable_lora)")
        return self.model_runner.lora_manager

    def expert_token_counts(self) -> dict[int, list[int]]:
        """This rank's mixture-of-experts layers (by index) -> tokens routed to each of their experts since start."""
        return {layer: experts.routed.tolist() for layer, experts in self._mixtures().items()}

    def _mixtures(self) -> dict[int, FusedMoE]:
        return {int(name.split(".")[2]): module for name, module in self.model.named_modules() if isinstance(module, FusedMoE)}


def generation_defaults_of(config: EngineConfig, model_dir: Path) -> dict[str, float | int]:
    """Default sampling parameters by the generation_config setting (auto: the model's own; vllm: none; or a directory)."""
    if config.generation_config == "vllm":
        return {}
    source = model_dir if config.generation_config == "auto" else Path(config.generation_config)
    if config.generation_config != "auto" and not (source / "generation_config.json").is_file():
        raise FileNotFoundError(f"generation_config: no generation_config.json in {source}")
    return generation_defaults(source)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros. On CPU they come from calloc: the OS hands out zero pages when first touched, so a
    cache of gigabytes costs nothing at start-up (torch.zeros would write every byte); in 4 KB pages (the KV cache's
    prefault gathers them into 2 MB pages once mapped: cpu_host)."""
    if device.type == "cpu" and dtype in _NUMPY_DTYPES:
        tensor = torch.from_numpy(np.zeros(shape, dtype=_NUMPY_DTYPES[dtype])).view(dtype)
        cpu_host.use_small_pages(tensor)
        return tensor
    return torch.zeros(shape, dtype=dtype, device=device)
