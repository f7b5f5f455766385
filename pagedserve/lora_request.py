"""LoRARequest: the adapter a request runs with. No torch: the front end, the wire and the scheduler carry it."""

from __future__ import annotations

from dataclasses import dataclass

# A PEFT adapter directory's files.
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, id and PEFT directory (adapter_config.json + adapter_model.safetensors).

    lora_int_id (>= 1) is the adapter's identity inside the engine: the workers hold its weights under it and the
    prefix cache keys its blocks by it, so one id must always mean the same weights."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
