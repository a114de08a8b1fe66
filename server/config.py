"""Server configuration: the HTTP side, plus the engine's own config."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.config import EngineConfig


@dataclass(frozen=True, slots=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()  # the first is reported; (): the model's own name
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    max_n: int = 16
    shutdown_timeout: float = 30.0
    retry_after: int = 1                      # seconds, on 429 and 503
    log_level: str = "info"
