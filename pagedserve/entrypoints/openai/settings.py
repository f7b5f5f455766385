"""The server's own settings (the engine's are EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: list[str] = field(default_factory=list)
    max_waiting_requests: int | None = None
    log_level: str = "info"
