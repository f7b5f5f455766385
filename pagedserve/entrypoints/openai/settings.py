"""The server's own settings (the engine's are EngineConfig); `pagedserve serve` flags of the same names."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

DEFAULT_MAX_N = 128
# Tokens a chat request without max_tokens may generate (OpenAI's models cap their output too); a request that wants
# more says so. None: up to the context, as vLLM does.
DEFAULT_MAX_TOKENS = 4096


@dataclass(frozen=True)
class LoRAModule:
    name: str
    path: str

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        """'name=path', or vLLM's JSON form '{"name": ..., "path": ...}'; ValueError naming the bad value."""
        if text.lstrip().startswith("{"):
            try:
                fields = json.loads(text)
                return cls(str(fields["name"]), str(fields["path"]))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"lora_modules entry {text!r} must be name=path or JSON with name and path") from exc
        name, separator, path = text.partition("=")
        if not separator or not name or not path:
            raise ValueError(f"lora_modules entry {text!r} must be name=path or JSON with name and path")
        return cls(name, path)


@dataclass
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: list[str] = field(default_factory=list)
    max_waiting_requests: int | None = None
    log_level: str = "info"
    # Most samples one request may ask for (n); None: DEFAULT_MAX_N, never more than the engine's max_num_seqs.
    max_n: int | None = None
    max_request_bytes: int = 16 * 1024**2
    metrics_require_api_key: bool = False
    trust_request_chat_template: bool = False
    chat_template: str | None = None  # the server's template, used instead of the model's (load_chat_template's text)
    chat_template_timeout: float = 5.0  # seconds a request's own chat template may take to render
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    # Seconds a client may take to send a request's line and headers, and then its body (else 408, and the connection
    # closes); and an idle connection's life between requests.
    request_read_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    # Open client connections; one beyond gets 503 and is closed.
    max_connections: int = 4096
    # A request's max_tokens when it gives none (the model's generation_config max_new_tokens, where it has one, wins).
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS
    # tool_choice "auto": the model's calls read in the format of tool_call_parser (tool_parsers.py); off: refused.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # The web console at / (its page, and its stream of engine stats); the stream names requests by id, and carries
    # their prompts' text only with web_console_show_prompts.
    web_console: bool = True
    web_console_show_prompts: bool = False
    web_console_interval: float = 0.5  # seconds between the stats stream's samples
    # LoRA adapters served from the start, by the names requests give as their model; and whether
    # /v1/load_lora_adapter and /v1/unload_lora_adapter may change them while the server runs.
    lora_modules: list[LoRAModule] = field(default_factory=list)
    allow_runtime_lora_updating: bool = False
    # Responses kept for GET /v1/responses/{id} and previous_response_id (store: true), the oldest dropped beyond.
    max_stored_responses: int = 1000

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser: the format the model writes its calls in")

    @property
    def auto_tool_call_parser(self) -> str | None:
        """The format tool_choice "auto" reads calls in; None where "auto" is off."""
        return self.tool_call_parser if self.enable_auto_tool_choice else None

    def effective_max_n(self, max_num_seqs: int) -> int:
        limits = [self.max_n or DEFAULT_MAX_N, max_num_seqs]
        if self.max_waiting_requests:
            limits.append(self.max_waiting_requests)
        return min(limits)
