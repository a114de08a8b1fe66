"""The aiohttp application factory: state, middlewares, routes, engine lifecycle."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator

from aiohttp import web

from pdserve.engine.engine import Engine
from pdserve.server.config import ServerConfig
from pdserve.server.cors import setup_cors
from pdserve.server.errors import APIError, from_http_exception
from pdserve.server.routes import setup_routes
from pdserve.server.sampling_defaults import load_defaults
from pdserve.server.state import ACCESS, STATE, AccessRecord, ServerState

logger = logging.getLogger(__name__)
access_logger = logging.getLogger("pdserve.server.access")


def create_app(config: ServerConfig, engine: Engine | None = None) -> web.Application:
    """An app serving `engine` (loaded from `config.engine` at startup when None).

    The engine is started on app startup and stopped on cleanup; an engine passed in is
    not closed, so it can serve several apps one after another.
    """
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[access_log_middleware, error_middleware, auth_middleware])
    app[STATE] = ServerState(config, engine)
    app.cleanup_ctx.append(engine_lifecycle)
    setup_routes(app)
    if config.cors is not None:
        setup_cors(app, config.cors)
    return app


async def engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    owned = state.engine is None
    engine = state.engine or await asyncio.to_thread(Engine, state.config.engine)
    state.engine = engine
    state.model_names = model_names(state.config, engine)
    _bind_model(state, engine)
    await engine.start()
    logger.info("serving %s as %s (%s mode, context window %d)", engine.model_dir, state.model_names[0],
                engine.mode, engine.max_model_len)
    try:
        yield
    finally:
        await engine.stop()
        if owned:
            engine.close()


def _bind_model(state: ServerState, engine: Engine) -> None:
    """What the server takes from the model: its tokenizer (with --chat-template), sampling defaults, the
    name its vLLM metrics carry."""
    config = state.config
    template = config.chat_template
    state.tokenizer = engine.tokenizer.with_chat_template(template) if template else engine.tokenizer
    state.sampling_defaults = load_defaults(config.generation_config, engine.model_dir,
                                            config.override_generation_config)
    cache = engine.config.cache
    state.metrics.bind_model(state.model_names[0], engine.max_model_len, {
        "block_size": str(cache.block_size), "cache_dtype": "auto",
        "enable_prefix_caching": str(cache.enable_prefix_caching),
        "gpu_memory_utilization": str(cache.gpu_memory_utilization or "")})


def model_names(config: ServerConfig, engine: Engine) -> tuple[str, ...]:
    """Every name a request may use, the reported one first: the --served-model-name values when
    given (as vLLM does), else the model's own name and the --model value."""
    if config.served_model_names:
        return tuple(dict.fromkeys(config.served_model_names))
    return tuple(dict.fromkeys(n for n in (engine.model_name, config.engine.model) if n))


@web.middleware
async def access_log_middleware(request: web.Request, handler) -> web.StreamResponse:
    record = request[ACCESS] = AccessRecord()
    start, status = time.monotonic(), 499                     # 499: the client went away first
    try:
        response = await handler(request)
        status = response.status
        return response
    finally:
        ttft = f"{record.ttft:.3f}s" if record.ttft is not None else "-"
        if request.app[STATE].config.access_log:
            access_logger.info('%s "%s %s" %d id=%s prompt_tokens=%d output_tokens=%d ttft=%s total=%.3fs finish=%s',
                               request.remote, request.method, request.path, status, record.request_id,
                               record.prompt_tokens, record.output_tokens, ttft, time.monotonic() - start,
                               record.finish_reasons)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as e:
        error = e
    except web.HTTPException as e:
        if e.status < 400:
            raise
        error = from_http_exception(e)
    except Exception:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        error = APIError(500, "internal server error", code="internal_error")
    request.app[STATE].metrics.http_errors.labels(str(error.status)).inc()
    return error.response()


@web.middleware
async def auth_middleware(request: web.Request, handler) -> web.StreamResponse:
    key = request.app[STATE].config.api_key
    if key and request.path.startswith("/v1/"):
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "Incorrect API key provided." if token else "Missing API key: send "
                           "'Authorization: Bearer <key>'.", code="invalid_api_key")
    return await handler(request)
