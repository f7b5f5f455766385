"""The names a request's `model` may give: the base model's served names and the LoRA adapters the server holds
(those of --lora-modules, and those loaded at run time), each adapter under the id the engine knows it by."""

from __future__ import annotations

import itertools

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.entrypoints.openai.errors import APIError
from pagedserve.entrypoints.openai.protocol import ModelCard
from pagedserve.entrypoints.openai.settings import LoRAModule
from pagedserve.lora_request import LoRARequest


class ServingModels:
    def __init__(self, engine: AsyncLLM, base_names: list[str], lora_modules: list[LoRAModule] = ()) -> None:
        self.engine = engine
        self.base_names = base_names
        self.lora_modules = list(lora_modules)
        self.adapters: dict[str, LoRARequest] = {}
        self._next_id = itertools.count(1)  # never reused: the prefix cache keys blocks by adapter id
        if self.lora_modules and not engine.config.enable_lora:
            raise ValueError("lora_modules needs LoRA adapters enabled (--enable-lora)")

    async def load_lora_modules(self) -> None:
        """The adapters named at start; ValueError naming the one that cannot be served."""
        for module in self.lora_modules:
            try:
                await self.load_lora_adapter(module.name, module.path)
            except APIError as exc:
                raise ValueError(f"LoRA module {module.name!r} ({module.path}): {exc.message}") from exc

    async def load_lora_adapter(self, name: str, path: str) -> LoRARequest:
        if name in self.adapters or name in self.base_names:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        lora = LoRARequest(name, next(self._next_id), path)
        try:
            await self.engine.add_lora(lora)
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_path") from exc
        self.adapters[name] = lora
        return lora

    async def unload_lora_adapter(self, name: str) -> None:
        lora = self.adapters.pop(name, None)
        if lora is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="not_found")
        await self.engine.remove_lora(lora.lora_int_id)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's model names (None: the base model); 404 for a name the server does not serve."""
        if model is None or model in self.base_names:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")
        return lora

    def response_name(self, model: str | None) -> str:
        """The model a response names: the one the request gave, else the base model's first name."""
        return model if model is not None else self.base_names[0]

    def cards(self) -> list[ModelCard]:
        root, max_model_len = self.engine.model_info.model_dir, self.engine.max_model_len
        base = [ModelCard(id=name, root=root, max_model_len=max_model_len) for name in self.base_names]
        return base + [ModelCard(id=lora.lora_name, root=lora.lora_path, parent=self.base_names[0], max_model_len=max_model_len)
                       for lora in self.adapters.values()]
