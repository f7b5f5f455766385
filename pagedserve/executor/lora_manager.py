"""The LoRA adapters a worker holds: read from their PEFT directories, checked against the model, cut to this rank's
share as their base layers are (column-parallel: B's rows; row-parallel: A's columns), and attached to the linear
layers they adapt. At most max_cpu_loras are held, the least recently used let go first; an adapter let go while a
request still runs with it is read again from its directory when its next step comes."""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from torch import nn

from pagedserve.layers.linear import Linear, RowParallelLinear
from pagedserve.layers.lora import KERNEL_DTYPES, AdapterProduct, LinearLoRA, PartProduct
from pagedserve.lora_request import LoRARequest
from pagedserve.models.llama import STACKED_PARAMS, MissingLayer
from pagedserve.models.lora_checkpoint import ModuleLoRA, read_peft_adapter

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, max_lora_rank: int, max_cpu_loras: int, kernels=None) -> None:
        self.model = model
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.linears: dict[str, Linear] = {name: module for name, module in model.named_modules() if isinstance(module, Linear)}
        for linear in self.linears.values():
            # A layer on GGUF blocks alone multiplies float32, as its blocks do.
            weight_dtype = linear.weight.dtype if linear.weight is not None else torch.float32
            kernel = kernels if weight_dtype in KERNEL_DTYPES else None
            linear.lora = LinearLoRA(linear.out_features, *_gemm_of(linear), kernels=kernel)
        self.held: OrderedDict[int, LoRARequest] = OrderedDict()  # least recently used first
        self._attached: dict[int, list[LinearLoRA]] = {}

    def add(self, lora: LoRARequest, keep: frozenset[int] = frozenset()) -> bool:
        """Hold the adapter (ValueError naming the problem if it cannot run on this model); returns whether it was read
        now. keep: adapters not to let go to make room (those of the step about to run)."""
        if lora.lora_int_id in self.held:
            self.held.move_to_end(lora.lora_int_id)
            return False
        adapter = read_peft_adapter(lora.lora_path, self.max_lora_rank)
        products = self._products(adapter.modules, lora)  # every check before any layer changes
        while len(self.held) >= self.max_cpu_loras:
            victim = next((adapter_id for adapter_id in self.held if adapter_id not in keep), None)
            if victim is None:
                raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) adapters are in use; LoRA adapter {lora.lora_name!r} "
                                 "cannot be held beside them")
            self.remove(victim)
        for linear_name, product in products.items():
            self.linears[linear_name].lora.set_adapter(lora.lora_int_id, product)
        self._attached[lora.lora_int_id] = [self.linears[name].lora for name in products]
        self.held[lora.lora_int_id] = lora
        logger.info("LoRA adapter %s (id %d, rank %d) read from %s", lora.lora_name, lora.lora_int_id, adapter.rank, lora.lora_path)
        return True

    def remove(self, adapter_id: int) -> bool:
        if self.held.pop(adapter_id, None) is None:
            return False
        for layer_lora in self._attached.pop(adapter_id):
            layer_lora.remove_adapter(adapter_id)
        return True

    def prepare_step(self, adapters: dict[int, LoRARequest]) -> None:
        """Hold every adapter the step runs with (read again those let go since), marking them recently used."""
        keep = frozenset(adapters)
        for lora in adapters.values():
            self.add(lora, keep)

    def _products(self, modules: dict[str, ModuleLoRA], lora: LoRARequest) -> dict[str, AdapterProduct]:
        parts_of: dict[str, dict[int | None, ModuleLoRA]] = {}
        for module_name, module in modules.items():
            parent, _, leaf = module_name.rpartition(".")
            fused, part = STACKED_PARAMS.get(leaf, (leaf, None))
            linear_name = f"{parent}.{fused}"
            if linear_name not in self.linears:
                if self._on_another_stage(module_name):
                    continue
                raise ValueError(f"LoRA adapter {lora.lora_name!r} adapts {module_name}, which is not a linear layer of this "
                                 "model that adapters can adapt (attention q/k/v/o and the MLP's gate/up/down projections)")
            parts_of.setdefault(linear_name, {})[part] = module
        return {name: self._product(self.linears[name], parts, lora) for name, parts in parts_of.items()}

    def _on_another_stage(self, module_name: str) -> bool:
        """Whether the module is in a decoder layer that pipeline parallelism gave to another stage."""
        pieces = module_name.split(".")
        if len(pieces) < 3 or pieces[:2] != ["model", "layers"] or not pieces[2].isdigit():
            return False
        layers = self.model.model.layers
        index = int(pieces[2])
        return index < len(layers) and isinstance(layers[index], MissingLayer)

    def _product(self, linear: Linear, parts: dict[int | None, ModuleLoRA], lora: LoRARequest) -> AdapterProduct:
        """This rank's share of the adapter's product for one layer, after checking the shapes against the layer's."""
        row_parallel = isinstance(linear, RowParallelLinear)
        full_sizes = linear.full_part_sizes or (linear.out_features,)
        local_sizes = linear.shard_sizes or (linear.out_features,)
        in_features = linear.full_in_features or linear.in_features
        stacked_a, products, rank_start = [], [], 0
        for part in sorted(parts, key=lambda p: p or 0):
            module, index = parts[part], part or 0
            expected = (in_features, full_sizes[index])
            if (module.a.shape[1], module.b.shape[0]) != expected:
                raise ValueError(f"LoRA adapter {lora.lora_name!r}: its weights for a layer of {expected[0]} inputs and "
                                 f"{expected[1]} outputs are shaped A {tuple(module.a.shape)} and B {tuple(module.b.shape)}")
            a = linear.rank_slice(module.a, None, is_bias=False) if row_parallel else module.a
            b = module.b if row_parallel else linear.rank_slice(module.b, part, is_bias=True)
            stacked_a.append(a)
            products.append(PartProduct(sum(local_sizes[:index]), local_sizes[index], rank_start, module.rank, b.contiguous()))
            rank_start += module.rank
        return AdapterProduct(torch.cat(stacked_a).contiguous(), products)


def _gemm_of(linear: Linear) -> tuple[torch.dtype, bool]:
    """(dtype, through oneDNN) of the layer's own dense GEMM, which its adapters' products follow."""
    if linear.bf16_values is not None:  # float32 products: the adapters' run as a float32 layer's do
        return torch.float32, True
    packed = linear.packed
    return (packed.dtype, packed.is_mkldnn) if packed is not None else (torch.float32, False)
