"""Server configuration: the HTTP side, plus the engine's own config."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.engine.config import EngineConfig

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
REASONING_PARSERS = ("deepseek_r1", "qwen3")
METRICS_NAMES = ("both", "vllm", "pdserve")


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may ask for; README.md, "Request limits", documents each."""

    max_n: int = 16
    max_total_tokens: int = 65536             # n x max_tokens over every prompt of one request
    allow_client_priority: bool = False       # False: a request's `priority` is validated, then ignored


@dataclass(frozen=True, slots=True)
class CorsConfig:
    """Cross-origin access for browser apps on other origins (vLLM's --allowed-* options)."""

    allowed_origins: tuple[str, ...]          # "*": any origin
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


@dataclass(frozen=True, slots=True)
class TlsConfig:
    certfile: str
    keyfile: str | None = None                # None: the key is in certfile
    ca_certs: str | None = None               # client certificates are checked against these
    cert_reqs: int = 0                        # ssl.CERT_NONE, CERT_OPTIONAL or CERT_REQUIRED


@dataclass(frozen=True, slots=True)
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()  # the first is reported; (): the model's own name
    api_key: str | None = None
    max_body_bytes: int = 8 * 1024 * 1024
    limits: RequestLimits = field(default_factory=RequestLimits)
    shutdown_timeout: float = 30.0
    retry_after: int = 1                      # seconds, on 429 and 503
    log_level: str = "info"
    tool_call_parser: str | None = None       # hermes | llama3_json; None: chosen from the chat template
    chat_template: str | None = None          # Jinja source that replaces the model's; None: the model's own
    generation_config: str = "auto"           # auto: the model's generation_config.json; vllm: none; or a folder
    override_generation_config: Mapping[str, float] = field(default_factory=dict)
    reasoning_parser: str | None = None       # deepseek_r1 | qwen3: <think> text as reasoning_content
    metrics_names: str = "both"               # both | vllm | pdserve: which names /metrics exports
    cors: CorsConfig | None = None
    tls: TlsConfig | None = None
    access_log: bool = True
    http_log_level: str | None = None         # the HTTP server's and access log's level; None: log_level
