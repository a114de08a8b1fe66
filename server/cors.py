"""CORS for browser apps on other origins (--allowed-origins), as Starlette's middleware answers them in vLLM."""
from __future__ import annotations

from aiohttp import web

from pdserve.server.config import CorsConfig

ALL_METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
PREFLIGHT_MAX_AGE = "600"               # seconds a browser may reuse a preflight answer (Starlette's default)


def setup_cors(app: web.Application, cors: CorsConfig) -> None:
    """Answer preflight requests and add the CORS headers to every response to an allowed origin (streams and
    errors included: the headers go on as a response is prepared)."""
    app.middlewares.insert(0, _preflight_middleware(cors))

    async def add_headers(request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        if origin and _allowed(cors, origin):
            response.headers.update(_origin_headers(cors, origin))
    app.on_response_prepare.append(add_headers)


def _preflight_middleware(cors: CorsConfig):
    @web.middleware
    async def preflight(request: web.Request, handler) -> web.StreamResponse:
        origin, method = request.headers.get("Origin"), request.headers.get("Access-Control-Request-Method")
        if request.method != "OPTIONS" or not origin or not method:
            return await handler(request)
        wanted = [h.strip() for h in request.headers.get("Access-Control-Request-Headers", "").split(",") if h.strip()]
        refused = _refusal(cors, origin, method, wanted)
        if refused:
            return web.Response(status=400, text=refused)
        headers = {"Access-Control-Allow-Methods": ALL_METHODS if "*" in cors.allowed_methods
                   else ", ".join(cors.allowed_methods),
                   "Access-Control-Max-Age": PREFLIGHT_MAX_AGE}
        allowed_headers = wanted if "*" in cors.allowed_headers else cors.allowed_headers
        if allowed_headers:
            headers["Access-Control-Allow-Headers"] = ", ".join(allowed_headers)
        return web.Response(status=200, text="OK", headers=headers)
    return preflight


def _refusal(cors: CorsConfig, origin: str, method: str, headers: list[str]) -> str | None:
    if not _allowed(cors, origin):
        return "Disallowed CORS origin"
    if "*" not in cors.allowed_methods and method.upper() not in {m.upper() for m in cors.allowed_methods}:
        return "Disallowed CORS method"
    allowed = {h.lower() for h in cors.allowed_headers}
    if "*" not in allowed and any(h.lower() not in allowed for h in headers):
        return "Disallowed CORS headers"
    return None


def _allowed(cors: CorsConfig, origin: str) -> bool:
    return "*" in cors.allowed_origins or origin in cors.allowed_origins


def _origin_headers(cors: CorsConfig, origin: str) -> dict[str, str]:
    """Any origin gets `*` unless credentials are allowed, which need the origin itself (and Vary: Origin)."""
    if "*" in cors.allowed_origins and not cors.allow_credentials:
        return {"Access-Control-Allow-Origin": "*"}
    headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
    if cors.allow_credentials:
        headers["Access-Control-Allow-Credentials"] = "true"
    return headers
